"""The VNN-COMP route (``abcrown_plugin/vnncomp.py``): its choice of α,β-CROWN config, read from the
user's own ``vnncomp_main.py`` with a fallback table for the 2021/2022 names (pure: α,β-CROWN is read,
not imported), and ``run_instance.sh`` through the plugin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from plugin_support import LIMIT_S, VENDOR, instance, needs_abcrown, plugin_env

from complete_verifier_ext.abcrown_plugin import vnncomp
from complete_verifier_ext.abcrown_plugin.locate import PluginError

pytestmark = pytest.mark.skipif(
    not VENDOR.is_dir(), reason=f"{VENDOR} not found (the vendored alpha-beta-CROWN)"
)

# the 16 VNN-COMP 2025 scored categories and the config α,β-CROWN's vnncomp_main.py picks for each
SCORED_2025 = {
    "acasxu_2023": "vnncomp21/acasxu.yaml",
    "cersyve": "vnncomp25/cersyve.yaml",
    "cgan_2023": "vnncomp23/cgan.yaml",
    "cifar100_2024": "vnncomp25/cifar100.yaml",
    "collins_rul_cnn_2022": "vnncomp23/collins-rul-cnn.yaml",
    "cora_2024": "vnncomp25/cora.yaml",
    "dist_shift_2023": "vnncomp23/dist-shift.yaml",
    "linearizenn_2024": "vnncomp24/linearizenn.yaml",
    "malbeware": "vnncomp25/malbeware.yaml",
    "metaroom_2023": "vnncomp23/metaroom.yaml",
    "nn4sys": "vnncomp23/nn4sys.yaml",
    "safenlp_2024": "vnncomp24/safenlp.yaml",
    "sat_relu": "vnncomp25/sat_relu.yaml",
    "tinyimagenet_2024": "vnncomp25/tinyimagenet.yaml",
    "tllverifybench_2023": "vnncomp23/tllVerifyBench.yaml",
    "vggnet16_2022": "vnncomp23/vggnet16.yaml",
}


def config_of(category: str, onnx: str = "net.onnx", vnnlib: str = "prop.vnnlib") -> str:
    path = vnncomp.abcrown_config(VENDOR, category, onnx, vnnlib)
    return str(path.relative_to(VENDOR / "complete_verifier" / "exp_configs"))


@pytest.mark.parametrize(("category", "config"), sorted(SCORED_2025.items()))
def test_every_2025_category_resolves_to_abcrowns_choice(category, config):
    assert config_of(category) == config


def test_every_name_of_the_checkouts_vnncomp_main_resolves():
    choices = vnncomp.checkout_choices(VENDOR / "complete_verifier")
    assert len(choices) >= 25
    for category, rel in choices.items():
        assert config_of(category) == rel


@pytest.mark.parametrize(
    ("category", "onnx", "config"),
    [
        ("acasxu", "n.onnx", "vnncomp21/acasxu.yaml"),  # 2021/2022 names: commented out in vnncomp_main
        ("rl_benchmarks", "a/cartpole.onnx", "vnncomp22/cartpole.yaml"),  # picked by the ONNX file
        ("rl_benchmarks", "a/dubinsrejoin.onnx", "vnncomp22/dubins-rejoin.yaml"),
        ("reach_prob_density", "a/gcas.onnx", "vnncomp22/reach_probability_gcas.yaml"),
        ("mnist_fc", "mnist-net_256x2.onnx", "vnncomp22/mnistfc_small.yaml"),
        ("mnistfc", "mnist-net_256x6.onnx", "vnncomp22/mnistfc.yaml"),
        ("oval21", "n.onnx", "vnncomp22/oval22.yaml"),
        ("nn4sys_2023", "n.onnx", "vnncomp23/nn4sys.yaml"),  # a year suffix the checkout does not use
        ("cifar100", "n.onnx", "vnncomp24/cifar100.yaml"),  # VNN-COMP 2024's, commented out now
        ("cifar100_2024", "n.onnx", "vnncomp25/cifar100.yaml"),  # 2025's name for it
        ("lsnc", "n.onnx", "vnncomp24/lsnc.yaml"),  # commented out in vnncomp_main.py
        ("safenlp_medical", "n.onnx", "vnncomp24/safenlp.yaml"),  # its startswith("safenlp")
        ("collins-rul-cnn", "n.onnx", "vnncomp23/collins-rul-cnn.yaml"),
    ],
)
def test_older_and_year_suffixed_names(category, onnx, config):
    assert config_of(category, onnx) == config


def test_vnncomps_test_instances_take_the_test_configs():
    assert config_of("cifar100_2024", vnnlib="x/test_nano.vnnlib") == "vnncomp21/test.yaml"
    assert config_of("oval21", vnnlib="x/test_prop.vnnlib") == "vnncomp21/acasxu.yaml"


def test_every_commented_out_name_and_every_config_file_resolves():
    """The names vnncomp_main.py keeps commented out (earlier years' categories) resolve to the config
    it names, unless a live name of the same spelling overrides it; every config under
    ``exp_configs/vnncomp2*/`` is found by its own name (the latest year's; where that name is a
    category's, as ``oval21``'s, the config that category runs)."""
    cv = VENDOR / "complete_verifier"
    live, old = vnncomp.checkout_choices(cv), vnncomp.checkout_choices(cv, commented=True)
    assert {"lsnc", "cifar100", "tinyimagenet", "ml4acopf_2023", "nn4sys_2023"} <= set(old)
    for category, rel in old.items():  # (a callable picks by the ONNX file: the file of one of its picks)
        want = live.get(category, rel)
        assert config_of(category, "net.onnx") == (want("net.onnx") if callable(want) else want)
    root = cv / "exp_configs"
    named = {**old, **live, **vnncomp.CONFIGS}
    for path in root.glob("vnncomp2*/*.yaml"):  # its name's latest year, or the config its category runs
        assert Path(config_of(path.stem)).name == path.name or path.stem in named, path


def test_an_unknown_category_is_one_line_naming_the_nearest_known_ones():
    with pytest.raises(PluginError, match="no alpha-beta-CROWN config known for category 'lsn'") as e:
        config_of("lsn")
    assert "\n" not in str(e.value) and "nearest known: lsnc" in str(e.value)


@needs_abcrown
def test_vnncomp_route_runs_abcrowns_config_sharded(tmp_path):
    """``run_instance.sh`` with ``ABCROWN_PATH`` set runs α,β-CROWN's own mnist_fc config (its
    ``mnistfc_small.yaml`` for 256x2) through the plugin, here at P = 2 (``ABCROWN_EXTRA_ARGS``); the
    sat result carries a counterexample that onnxruntime confirms."""
    import re

    import numpy as np
    import onnxruntime as ort

    from complete_verifier_ext.attack import clause_margins
    from complete_verifier_ext.spec import load_vnnlib

    onnx, spec = instance("mnist-net_256x2", "prop_1_0.03.vnnlib")[1::2]
    results = tmp_path / "results.txt"
    script = Path(__file__).resolve().parents[1] / "vnncomp_scripts" / "run_instance.sh"
    # mnistfc_small.yaml asks for MIP, which is refused under P > 1: the attack alone decides here
    extra = "--parallel.mode fsdp --parallel.world_size 2 --complete_verifier skip"
    env = plugin_env(ABCROWN_EXTRA_ARGS=extra, PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(script), "v1", "mnist_fc", onnx, spec, str(results), "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = results.read_text()
    assert text.startswith("sat\n")
    x = np.array([float(v) for v in re.findall(r"\(X_\d+\s+(\S+)\)", text)], dtype=np.float32)
    region = load_vnnlib(spec).regions[0]
    assert x.shape == region.lower.shape and np.all(region.lower <= x) and np.all(x <= region.upper)
    sess = ort.InferenceSession(onnx)
    feed = sess.get_inputs()[0]
    shape = [1 if not isinstance(d, int) or d <= 0 else d for d in feed.shape]
    y = sess.run(None, {feed.name: x.reshape(shape)})[0].reshape(-1)
    assert clause_margins(y, region.clauses).min() <= 0


@needs_abcrown
def test_vnncomp_route_unknown_category_is_an_error(tmp_path):
    onnx, spec = instance("mnist-net_256x2", "prop_1_0.03.vnnlib")[1::2]
    results = tmp_path / "results.txt"
    script = Path(__file__).resolve().parents[1] / "vnncomp_scripts" / "run_instance.sh"
    out = subprocess.run(
        ["bash", str(script), "v1", "no_such_category", onnx, spec, str(results), "60"],
        env=plugin_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and results.read_text() == "error\n"
    assert "no alpha-beta-CROWN config known for category 'no_such_category'" in out.stderr


def test_vnncomp_route_picks_abcrowns_config_and_our_parallel_section(tmp_path, monkeypatch):
    from complete_verifier_ext.abcrown_plugin import vnncomp

    monkeypatch.setenv("ABCROWN_PATH", str(VENDOR))
    ours = tmp_path / "mnist_fc.yaml"
    ours.write_text("parallel:\n  mode: fsdp\n  world_size: 3\n")
    small = vnncomp.command("mnist_fc", "a/mnist-net_256x2.onnx", "p.vnnlib", "r.txt", "60", str(ours))
    large = vnncomp.command("mnistfc", "a/mnist-net_256x6.onnx", "p.vnnlib", "r.txt", "60", None)
    assert small[1].endswith("exp_configs/vnncomp22/mnistfc_small.yaml")
    assert large[1].endswith("exp_configs/vnncomp22/mnistfc.yaml")
    assert small[-4:] == ["--parallel.mode", "fsdp", "--parallel.world_size", "3"]
    assert "--parallel.mode" not in large
