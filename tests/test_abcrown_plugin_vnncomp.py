"""The VNN-COMP route's choice of α,β-CROWN config (``abcrown_plugin/vnncomp.py``): read from the user's
own ``vnncomp_main.py``, with a fallback table for the 2021/2022 names. Pure: α,β-CROWN is read, not
imported."""

from __future__ import annotations

from pathlib import Path

import pytest

from complete_verifier_ext.abcrown_plugin import vnncomp
from complete_verifier_ext.abcrown_plugin.locate import PluginError

VENDOR = Path(__file__).resolve().parents[1].parent / "shared" / "vendor" / "alpha-beta-CROWN"

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
        ("acasxu", "n.onnx", "vnncomp21/acasxu.yaml"),  # 2021/2022 names: the fallback table
        ("mnist_fc", "mnist-net_256x2.onnx", "vnncomp22/mnistfc_small.yaml"),
        ("mnistfc", "mnist-net_256x6.onnx", "vnncomp22/mnistfc.yaml"),
        ("oval21", "n.onnx", "vnncomp22/oval22.yaml"),
        ("nn4sys_2023", "n.onnx", "vnncomp23/nn4sys.yaml"),  # a year suffix the checkout does not use
        ("cifar100", "n.onnx", "vnncomp25/cifar100.yaml"),  # one it does, left out
    ],
)
def test_older_and_year_suffixed_names(category, onnx, config):
    assert config_of(category, onnx) == config


def test_vnncomps_test_instances_take_the_test_configs():
    assert config_of("cifar100_2024", vnnlib="x/test_nano.vnnlib") == "vnncomp21/test.yaml"
    assert config_of("oval21", vnnlib="x/test_prop.vnnlib") == "vnncomp21/acasxu.yaml"


def test_an_unknown_category_is_one_line_naming_the_known_ones():
    with pytest.raises(PluginError, match="no alpha-beta-CROWN config known for category 'no_such'") as e:
        config_of("no_such")
    assert "\n" not in str(e.value) and "cersyve" in str(e.value)
