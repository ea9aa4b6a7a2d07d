"""``general.engine: abcrown``: the real α,β-CROWN (``../shared/vendor``) run through our launcher with the
sharding patched in. Every run is an ``abcrown`` subprocess under a hard time limit (a hang fails the
test), on real gloo ranks. Skipped with the reason when ``../shared`` or the α,β-CROWN dependencies are
absent."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import rank_processes
from support import relative_error as rel

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
VENDOR = SHARED / "vendor" / "alpha-beta-CROWN"
BENCH = SHARED / "benchmarks"
MNIST = BENCH / "mnist_fc"
DEPS = (
    "onnxoptimizer",
    "skl2onnx",
    "gurobipy",
    "psutil",
    "sortedcontainers",
    "pandas",
    "termcolor",
    "appdirs",
)

pytestmark = [
    pytest.mark.skipif(not VENDOR.is_dir(), reason=f"{VENDOR} not found (the vendored alpha-beta-CROWN)"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in DEPS),
        reason="alpha-beta-CROWN's PyPI dependencies are missing: pip install -e '.[abcrown]'",
    ),
]

LIMIT_S = 150


def _env(**extra: str) -> dict:
    env = {**os.environ, "ABCROWN_PATH": str(VENDOR), "OMP_NUM_THREADS": "1", **extra}
    return env


def _config(tmp: Path, text: str) -> str:
    path = tmp / "exp.yaml"
    path.write_text(text)
    return str(path)


BOUNDS_YAML = """general:
  device: cpu
  complete_verifier: skip
solver:
  crown:
    batch_size: {chunk}
  alpha-crown:
    iteration: 10
attack:
  pgd_order: skip
"""


def run(tmp: Path, config: str, *args: str, P: int = 1, env: dict | None = None, name="run", mode="fsdp"):
    """One ``abcrown --general.engine abcrown`` process; returns (process, summary dict or None, results)."""
    out = tmp / name
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "complete_verifier_ext.cli",
        "--config",
        config,
        "--general.engine",
        "abcrown",
        "--summary",
        str(out / "s.json"),
        "--results_file",
        str(out / "out.txt"),
        *args,
    ]
    if P > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(P)]
    proc = subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp)
    summary = json.loads((out / "s.json").read_text()) if (out / "s.json").exists() else None
    results = (out / "out.txt").read_text() if (out / "out.txt").exists() else None
    return proc, summary, results


def instance(net: str, prop: str) -> list[str]:
    return ["--onnx_path", str(MNIST / "onnx" / f"{net}.onnx"), "--vnnlib_path", str(MNIST / "vnnlib" / prop)]


CHUNK = 32  # rows a CROWN pass on 256x2: its largest start node has 140 unstable rows, 5 passes


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    """α,β-CROWN alone (P = 1) on mnist 256x2 prop_0_0.05 (CROWN and α-CROWN do not verify it), with
    ``CHUNK`` rows per CROWN pass so that the ranks split the rows."""
    tmp = tmp_path_factory.mktemp("abcrown_p1")
    cfg = _config(tmp, BOUNDS_YAML.format(chunk=CHUNK))
    proc, summary, results = run(tmp, cfg, *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp, cfg, summary


@pytest.mark.parametrize(("P", "mode"), [(3, "fsdp"), (3, "tp")])  # P = 2: test_tp_conv…, test_bab…
def test_bounds_equal_unpatched_with_split_rows(unpatched, P, mode):
    """FSDP (weights gathered per call) and TP (never a whole weight: column-parallel forward and IBP,
    ``A @ W`` around a ring of shards), rows and α split: the bounds are unpatched α,β-CROWN's."""
    tmp, cfg, ref = unpatched
    proc, got, results = run(
        tmp,
        cfg,
        *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"),
        P=P,
        name=f"p{P}{mode}",
        env=_env(CVE_ABCROWN_AUDIT="1"),
        mode=mode,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert got["engine"] == "abcrown" and got["verdict"] == ref["verdict"]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-6
    # the passes are dealt whole and the gradients summed only where split: α-CROWN is one process's
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-6
    assert len(got["peak_mb"]) == P and got["crown_batch_size"] == CHUNK
    assert results.strip() == "timeout"
    # rank 0 alone prints: α,β-CROWN's "Result:" line appears once
    assert proc.stdout.count("Result: ") == 1
    # α is kept by row: 256x2 has 6972 α elements, 4200 of them one start node's 140 rows; each rank
    # holds its block of passes of those (+1 default slot) and the replicated rest
    assert ref["alpha_elements"] == [6972]
    assert max(got["alpha_elements"]) <= 2772 + 30 * (140 // P + CHUNK + 1)  # + one pass, slot 0
    # no rank holds a whole weight (nor a copy, nor a transposed copy) at the start and end of the build
    assert got["full_weights_live"] == [[[], []]] * P


def test_a_rank_that_owns_no_row_of_a_layer(tmp_path):
    """171 rows a pass at P = 3 on 256x6: a layer bounded for all its 256 neurons has two passes, so
    rank 2 owns none of its rows. Its α keeps only the default slot (it once kept zero rows and
    crashed in α-CROWN) and it runs dummy passes; the bounds are one process's."""
    cfg = _config(tmp_path, BOUNDS_YAML.format(chunk=171).replace("iteration: 10", "iteration: 3"))
    args = instance("mnist-net_256x6", "prop_0_0.05.vnnlib")
    p1, ref, _ = run(tmp_path, cfg, *args, name="p1")
    p3, got, _ = run(tmp_path, cfg, *args, P=3, name="p3")
    assert p1.returncode == 0 and p3.returncode == 0, p3.stderr[-2000:]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-6
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-5


def test_bounds_bitwise_when_rows_are_not_split(tmp_path):
    """CROWN verifies 256x2 prop_0_0.03; no layer has more unstable neurons than a pass holds, so FSDP
    alone is active and the bounds are bitwise α,β-CROWN's."""
    cfg = _config(tmp_path, BOUNDS_YAML.format(chunk=512))
    args = instance("mnist-net_256x2", "prop_0_0.03.vnnlib")
    p1, s1, r1 = run(tmp_path, cfg, *args, name="p1")
    p2, s2, r2 = run(tmp_path, cfg, *args, P=2, name="p2")
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-2000:]
    assert s1["bounds"]["crown"] == s2["bounds"]["crown"]
    assert s1["verdict"] == s2["verdict"] == "unsat" and r1.strip() == r2.strip() == "unsat"


def test_pgd_counterexample_with_tp_weights(tmp_path):
    """256x2 prop_1_0.03 is falsified by PGD: α,β-CROWN's attack runs on the sharded ``model_ori``,
    column-parallel under tp (under fsdp, gathered per call: ``test_vnncomp_route_runs_abcrowns_config…``)."""
    cfg = _config(tmp_path, "general:\n  device: cpu\n  complete_verifier: skip\n")  # no BaB under tp
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"), P=2, mode="tp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert s["verdict"] == "sat" and results.startswith("sat\n((X_0 ")  # with its counterexample


def test_config_keys_registered_and_dumped(tmp_path):
    code = f"""
import sys
from complete_verifier_ext.abcrown_plugin import locate, runner
arguments = runner._import_abcrown(locate.find({str(VENDOR)!r}))
open({str(tmp_path / "c.yaml")!r}, "w").write("parallel:\\n  mode: fsdp\\n  world_size: 4\\n")
args = ["--config", {str(tmp_path / "c.yaml")!r}, "--parallel_world_size", "3"]
arguments.Config.parse_config(args, verbose=False)
print(arguments.Config.dump_config(arguments.Config.all_args))
"""
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    dumped = out.stdout[out.stdout.index("parallel:") :]
    assert "mode: fsdp" in dumped and "world_size: 3" in dumped  # the command line beats the YAML
    assert "engine: abcrown" in out.stdout


def test_typo_key_is_abcrowns_own_error(tmp_path):
    cfg = _config(tmp_path, "general:\n  device: cpu\nsolver:\n  bogus_key: 1\n")
    proc, _, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_0_0.03.vnnlib"))
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "bogus_key" in lines[0] and "not found" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert results.strip() == "error"


def test_missing_checkout_is_one_line(tmp_path):
    cfg = _config(tmp_path, "general:\n  device: cpu\n")
    env = _env(ABCROWN_PATH=str(tmp_path / "nowhere"))
    proc, _, results = run(tmp_path, cfg, env=env)
    assert proc.returncode == 1 and "not an alpha-beta-CROWN checkout" in proc.stderr
    assert "Traceback" not in proc.stderr and results.strip() == "error"


def test_the_patch_table_is_every_change_and_undo_restores_all(tmp_path):
    """Snapshot every attribute of every α,β-CROWN and auto_LiRPA module and of their classes (and the
    plugin's own modules) before installing, for one process, fsdp and tp: exactly the attributes of
    ``table.TABLE``'s rows that apply change (a patch left out of the table fails here), and after
    ``undo`` every attribute is the same object as before."""
    code = f"""
import sys, inspect
from pathlib import Path
from complete_verifier_ext.abcrown_plugin import locate, patches, runner, table
from complete_verifier_ext.config import ParallelConfig
checkout = locate.find({str(VENDOR)!r})
runner._import_abcrown(checkout)
import abcrown
roots = [str(checkout.root.resolve()), str(Path(patches.__file__).parent)]
def ours(mod):
    f = getattr(mod, "__file__", None) or ""
    return any(str(Path(f).resolve()).startswith(r) for r in roots)
def snapshot():
    out = {{}}
    for name, mod in list(sys.modules.items()):
        if mod is None or not ours(mod):
            continue
        for attr, value in list(vars(mod).items()):
            out[f"{{name}}.{{attr}}"] = value
            if inspect.isclass(value) and value.__module__ == name:
                for a, v in list(vars(value).items()):
                    out[f"{{name}}.{{attr}}.{{a}}"] = v
    return out
def canonical(target):  # the snapshot's key of a table target: the class by its defining module
    owner, name = patches.resolve(target)
    where = f"{{owner.__module__}}.{{owner.__qualname__}}" if inspect.isclass(owner) else owner.__name__
    return f"{{where}}.{{name}}"
before = snapshot()
counts = []
for mode, world in (("none", 1), ("fsdp", 2), ("tp", 2)):
    setup = table.Setup(ParallelConfig(mode=mode, world_size=world), world, patches.Probe(),
                        {str(tmp_path / "cache")!r}, 0.0)
    p = patches.Patcher()
    table.install(p, setup)
    during = snapshot()
    missing = object()  # a key on one side only: a method set on a class that inherited it
    changed = {{k for k in set(before) | set(during) if before.get(k, missing) is not during.get(k, missing)}}
    expected = {{canonical(t) for t in table.targets(setup)}}
    assert changed == expected, (sorted(changed - expected), sorted(expected - changed))
    p.undo()
    after = snapshot()
    left = [k for k in before if after.get(k) is not before[k]]
    assert not left and set(after) == set(before), left
    counts.append(len(changed))
print(*counts)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    always, fsdp, tp = map(int, out.stdout.split()[-3:])
    assert always < tp < fsdp  # fsdp also wraps MatMul


def _kill_rank1_when(tmp_path: Path, cfg: str, args: list[str], ready) -> None:
    """Start a P = 2 run, SIGKILL rank 1 once ``ready(scratch)`` holds (``scratch``: the run's scratch
    folder, with rank 1's log), then expect ``error`` and exit 1 within 30 s, and no process left."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "kill"
    (out / "tmp").mkdir(parents=True)
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", cfg, "--general.engine", "abcrown"]
    cmd += ["--results_file", str(out / "out.txt"), "--parallel.mode", "fsdp", "--parallel.world_size", "2"]
    env = _env(TMPDIR=str(out / "tmp"))
    proc = subprocess.Popen(
        [*cmd, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        parent = psutil.Process(proc.pid)
        ranks: list = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (len(ranks) == 2 and ready(out / "tmp")):
            time.sleep(0.5)
            ranks = [psutil.Process(pid) for pid in rank_processes(parent.pid)]
        assert len(ranks) == 2 and ready(out / "tmp"), "the ranks did not get there"
        assert proc.poll() is None
        ranks[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "rank 1 died" in err, err[-2000:]
    assert (out / "out.txt").read_text().strip() == "error"
    time.sleep(1)
    assert not [r for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_rank_is_an_error_within_30s(tmp_path):
    """A rank killed with SIGKILL mid-α-CROWN: ``error`` in the results file and exit 1 within 30 s, and
    no process left behind."""
    cfg = _config(tmp_path, BOUNDS_YAML.format(chunk=4).replace("iteration: 10", "iteration: 2000"))
    t0 = time.monotonic()
    # ten seconds after the start: well inside α-CROWN's 2000 iterations
    _kill_rank1_when(
        tmp_path, cfg, instance("mnist-net_256x2", "prop_0_0.05.vnnlib"), lambda _: time.monotonic() - t0 > 10
    )


def _in_bab_round(scratch: Path, n: int = 2) -> bool:
    logs = list(scratch.glob("cve_abcrown_*/rank1.log"))
    return bool(logs) and f"BaB round {n}" in logs[0].read_text(errors="replace")


def test_a_rank_killed_mid_bab_is_an_error_within_30s(tmp_path):
    """The same in the middle of BaB (256x6 prop_2_0.05 stays open for minutes), while rank 1 bounds its
    share of the domains, with the weights kept sharded: rank 0 is waiting in a weight request or
    serving rank 1 when it dies."""
    cfg = _config(tmp_path, BAB_YAML.replace("batch_size: 8", "batch_size: 64"))
    args = [*instance("mnist-net_256x6", "prop_2_0.05.vnnlib"), "--parallel.bab_weights", "sharded"]
    _kill_rank1_when(tmp_path, cfg, args, _in_bab_round)


SKEW = """
import time, sys
_real, _t0 = time.time, time.monotonic()
def _skewed():
    dist = sys.modules.get("torch.distributed")
    late = time.monotonic() - _t0 > {after}
    if dist is not None and dist.is_initialized() and dist.get_rank() == 1 and late:
        return _real() + 1000.0
    return _real()
time.time = _skewed
"""


def test_clock_skew_on_one_rank_keeps_lockstep(tmp_path, unpatched):
    """Rank 1's clock jumps 1000 s ahead mid-run: every time-limit decision uses the ranks' maximum, so
    both ranks stop together (no collective mismatch) and the verdict is α,β-CROWN's."""
    _, _, ref = unpatched
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW.format(after=5.0))
    cfg = _config(tmp_path, BOUNDS_YAML.format(chunk=CHUNK).replace("iteration: 10", "iteration: 200"))
    env = _env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc, got, results = run(
        tmp_path, cfg, *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"), "--timeout", "500", P=2, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert got["verdict"] == ref["verdict"] == "timeout" and results.strip() == "timeout"


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
    env = _env(ABCROWN_EXTRA_ARGS=extra, PYTHON=sys.executable)
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


def test_vnncomp_route_unknown_category_is_an_error(tmp_path):
    onnx, spec = instance("mnist-net_256x2", "prop_1_0.03.vnnlib")[1::2]
    results = tmp_path / "results.txt"
    script = Path(__file__).resolve().parents[1] / "vnncomp_scripts" / "run_instance.sh"
    out = subprocess.run(
        ["bash", str(script), "v1", "no_such_category", onnx, spec, str(results), "60"],
        env=_env(PYTHON=sys.executable),
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


def test_a_sat_that_does_not_check_becomes_unknown(tmp_path):
    """Rank 0 re-checks α,β-CROWN's counterexample with onnxruntime before a ``sat`` stands: the centre
    of prop_1_0.03's box is classified correctly, so a results file claiming it is turned into
    ``unknown``; a real counterexample nudged just outside the box (float32 rounding) is rounded
    back in and kept."""
    import numpy as np

    from complete_verifier_ext.abcrown_plugin import witness
    from complete_verifier_ext.attack import format_counterexample
    from complete_verifier_ext.spec import load_vnnlib

    onnx, spec = instance("mnist-net_256x2", "prop_1_0.03.vnnlib")[1::2]
    region = load_vnnlib(spec).regions[0]
    results = tmp_path / "results.txt"
    centre = (region.lower + region.upper) / 2
    results.write_text(f"sat\n{format_counterexample(centre, np.zeros(10))}\n")
    assert "does not check" in witness.recheck(str(results), onnx, spec)
    assert results.read_text() == "unknown\n"

    # the plugin's own sat on this instance (test_vnncomp_route_runs_abcrowns_config_sharded) is a real one
    proc, s, text = run(
        tmp_path,
        _config(tmp_path, "general:\n  device: cpu\n  save_adv_example: true\n"),
        *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"),
    )
    assert proc.returncode == 0 and text.startswith("sat\n")
    x = witness.read_inputs(text)
    at_upper = np.isclose(x, region.upper, rtol=0, atol=1e-6)
    assert at_upper.any()
    outside = np.where(at_upper, region.upper + 1e-9, x)  # a bound rounded outward
    results.write_text(f"sat\n{format_counterexample(outside, np.zeros(10))}\n")
    assert witness.recheck(str(results), onnx, spec) is None
    kept = witness.read_inputs(results.read_text())
    assert results.read_text().startswith("sat\n") and np.all(kept <= region.upper)


BAB_YAML = """general:
  device: cpu
  complete_verifier: bab
solver:
  batch_size: 8
  alpha-crown:
    iteration: 20
  beta-crown:
    iteration: 10
bab:
  timeout: 120
attack:
  pgd_order: skip
"""


def _visited(stdout: str) -> int:
    lines = [ln for ln in stdout.splitlines() if ln.endswith(" domains visited")]
    return int(lines[-1].split()[0]) if lines else 0


# what unpatched α,β-CROWN (P = 1) gives on 256x2 prop_9_0.05 with BAB_YAML (kFSB, 8 domains a round):
# unsat after 16 domains
BAB_P1 = ("unsat", 16)


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_bab_with_domains_split_over_ranks(tmp_path, mode):
    """256x2 prop_9_0.05 needs BaB: every rank keeps its own share of the domain list and bounds up to
    ⌈8 / P⌉ of them a round, rebalanced when the queues drift. Same verdict and (this tree is small
    enough that every round takes all its domains) the same domain count as unpatched P = 1, at P = 3
    (uneven shares; P = 2 runs in the kill test and the benchmark), with the weights replicated for the
    search (``fsdp``, the default) or kept sharded (``tp``: each rank fetches single shards on request,
    ``parallel.serve``, with its own number of bound passes; never a whole weight, none left alive).
    ``fsdp`` with ``bab_weights: sharded`` runs in the kill test and ``test_parallel_serve``."""
    cfg = _config(tmp_path, BAB_YAML)
    args = instance("mnist-net_256x2", "prop_9_0.05.vnnlib")
    env = _env(CVE_ABCROWN_AUDIT="1") if mode == "tp" else None
    proc, s, results = run(tmp_path, cfg, *args, P=3, mode=mode, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (results.strip(), _visited(proc.stdout)) == BAB_P1
    whole, shards = zip(*s["bab_weight_fetches"], strict=True)
    if mode == "tp":
        assert s["parallel"]["bab_weights"] == "sharded"
        assert sum(whole) == 0 and min(shards) > 0
        assert s["full_weights_live"] == [[[], []]] * 3
    else:
        assert s["parallel"]["bab_weights"] == "replicated" and sum(whole) + sum(shards) == 0


MOVE = """
import sys, types
import torch
from complete_verifier_ext.abcrown_plugin import bab_split, locate, runner
runner._import_abcrown(locate.find({vendor!r}))
import arguments
sys.argv = ["abcrown"]
arguments.Config.parse_config()
from tensor_storage import get_tensor_storage as S

def domains(n, first, unstable=True):
    v = lambda *shape: torch.arange(first, first + n * int(torch.Size(shape).numel())).float().view(n, *shape)
    a = torch.arange(first, first + 2 * n * 4).float().view(2, 1, n, 4)  # alpha: the batch in dim 2
    return types.SimpleNamespace(
        final_name="out", num_domains=n, all_lAs={{"relu": S(v(3))}}, all_global_lbs=S(v(2)),
        all_global_ubs=S(v(2) + 1), all_thresholds=S(v(2) * 0), Cs=S(v(2, 10)),
        all_lb_alls={{"out": S(v(2)), "x": S(torch.zeros(1, 7))}},
        all_ub_alls={{"out": S(v(2) + 2), "x": S(torch.ones(1, 7))}},
        all_x_Ls=None, all_x_Us=None, all_input_split_idx=None,
        all_alphas={{"relu": {{"out": S(a, concat_dim=2)}}}},
        unstable_interm_bounds={{"l": [S(v(5)), S(v(5) + 1)]}} if unstable else None,
        all_betas=[f"b{{first + i}}" for i in range(n)], all_intermediate_betas=[None] * n,
        histories=[{{"h": first + i}} for i in range(n)], split_histories=[[]] * n, depths=list(range(n)),
    )

a, b = domains(5, 0), domains(0, 100, unstable=False)  # b: a rank that never added children
whole = {{k: s.tensor().clone() for k, s in bab_split._storages(a).items()}}
moved = bab_split.take(a, 2)  # the top of the stack, as pick_out takes it
assert a.num_domains == 3 and [h["h"] for h in a.histories] == [0, 1, 2]
bab_split.put(b, moved)
assert b.num_domains == 2 and [h["h"] for h in b.histories] == [3, 4] and b.all_betas == ["b3", "b4"]
for key, s in bab_split._storages(b).items():
    dim = 2 if key[0] == "alpha" else 0
    assert torch.equal(s.tensor(), whole[key].narrow(dim, 3, 2)), key
for key, s in bab_split._storages(a).items():
    dim = 2 if key[0] == "alpha" else 0
    assert torch.equal(s.tensor(), whole[key].narrow(dim, 0, 3)), key
bab_split.put(a, bab_split.take(b, 2))  # and back: the list as it was
for key, s in bab_split._storages(a).items():
    assert torch.equal(s.tensor(), whole[key]), key
assert [h["h"] for h in a.histories] == [0, 1, 2, 3, 4] and a.num_domains == 5
try:
    bab_split.take(a, 6)
except RuntimeError as e:
    print("refused:", e)
"""


def test_domains_move_between_lists_whole_and_in_order(tmp_path):
    """The rebalancer's take/put on α,β-CROWN's own TensorStorages: every per-domain tensor and list
    moves (the α with the batch in dim 2, the intermediate bounds created on a rank that had none),
    in order, and a round trip restores the list; asking for more domains than held is an error."""
    code = MOVE.format(vendor=str(VENDOR))
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: asked for 6 of 5 domains" in out.stdout


@pytest.mark.parametrize(
    ("change", "mode", "named"),
    [
        (("complete_verifier: bab", "complete_verifier: mip"), "fsdp", "general.complete_verifier: mip"),
        (("  timeout: 120", "  timeout: 120\n  attack:\n    enabled: true"), "tp", "bab.attack.enabled"),
    ],
)
def test_bab_features_not_split_yet_are_refused(tmp_path, change, mode, named):
    cfg = _config(tmp_path, BAB_YAML.replace(*change))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=2, mode=mode)
    assert proc.returncode == 1 and results == "error\n"
    assert f"not supported with parallel.world_size > 1 yet: {named}" in proc.stderr


def test_tp_conv_layers_in_matrix_mode(tmp_path):
    """oval21's cifar_base_kw under tp (conv layers column-parallel, ``conv_transpose2d`` around the
    ring): CROWN and α-CROWN equal unpatched α,β-CROWN's within 1e-5, no whole weight on any rank. In
    patches mode (α,β-CROWN's default) tp says which node it cannot shard."""
    oval = BENCH / "oval21"
    args = ["--onnx_path", str(oval / "onnx" / "cifar_base_kw.onnx")]
    args += ["--vnnlib_path", str(oval / "vnnlib" / "cifar_base_kw-img8194-eps0.018300653594771243.vnnlib")]
    matrix = BOUNDS_YAML.format(chunk=256).replace("iteration: 10", "iteration: 3")
    cfg = _config(
        tmp_path,
        matrix.replace("  complete_verifier: skip", "  complete_verifier: skip\n  conv_mode: matrix"),
    )
    p1, ref, _ = run(tmp_path, cfg, *args, name="p1")
    p2, got, _ = run(tmp_path, cfg, *args, P=2, mode="tp", name="tp", env=_env(CVE_ABCROWN_AUDIT="1"))
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-2000:]
    for method in ("crown", "alpha_crown"):
        a, b = ref["bounds"][method], got["bounds"][method]
        assert [x == "inf" for x in a] == [x == "inf" for x in b]
        assert rel([x for x in a if x != "inf"], [x for x in b if x != "inf"]) < 1e-5
    assert got["full_weights_live"] == [[[], []]] * 2
    cfg = _config(tmp_path, BOUNDS_YAML.format(chunk=64))
    proc, s, results = run(tmp_path, cfg, *args, P=2, mode="tp", name="patches")
    assert proc.returncode == 1 and results == "error\n"
    assert "parallel.mode: tp: Conv node" in proc.stderr and "general.conv_mode: matrix" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bab_cut_short_by_max_iterations_is_no_proof(tmp_path):
    """α,β-CROWN's BaB returns "safe" when ``bab.max_iterations`` stops it with domains still open;
    the plugin turns that into unknown (256x6 prop_2_0.05 is open at VNN-COMP 2022)."""
    cfg = _config(tmp_path, BAB_YAML.replace("  timeout: 120", "  timeout: 120\n  max_iterations: 2"))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x6", "prop_2_0.05.vnnlib"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "timeout" and "bab.max_iterations" in proc.stderr


def test_worst_domain_over_the_ranks_treats_nan_as_worst():
    import torch

    from complete_verifier_ext.abcrown_plugin.bab_split import _worst

    nan = torch.tensor([float("nan"), -1.0])
    assert _worst([torch.tensor([0.5]), None, nan]) is nan  # NaN proves nothing: never the best
    a = torch.tensor([-0.2, -3.0])  # its best spec (-0.2) is worse than the other domain's (-0.1)
    assert _worst([a, torch.tensor([-0.1])]) is a
    assert torch.equal(_worst([None, None]), torch.tensor(1e-7))  # α,β-CROWN's value for an empty list


def test_bab_proved_treats_nan_as_not_proven():
    import torch

    from complete_verifier_ext.abcrown_plugin.patches import bab_proved

    assert bab_proved(torch.tensor(0.0)) and bab_proved(float("inf")) and bab_proved(0.3)
    assert not bab_proved(float("nan")) and not bab_proved(-1e-9) and not bab_proved(float("-inf"))


def test_bab_weights_follow_the_mode():
    """``parallel.bab_weights: auto`` (the default) is replicated under fsdp and sharded under tp; tp
    with replicated weights is refused (tp never holds a whole layer)."""
    from complete_verifier_ext.abcrown_plugin import bridge
    from complete_verifier_ext.abcrown_plugin.locate import PluginError

    def of(**sec):
        return bridge.parallel_of({"parallel": {"world_size": 2, **sec}}, [], "x.yaml").bab_weights_resolved

    assert of(mode="fsdp") == "replicated" and of(mode="tp") == "sharded"
    assert of(mode="fsdp", bab_weights="sharded") == "sharded"
    assert bridge.parallel_of({}, ["--parallel_mode", "tp"], None).bab_weights_resolved == "sharded"
    with pytest.raises(PluginError, match="never holds a full layer"):
        of(mode="tp", bab_weights="replicated")
    with pytest.raises(PluginError, match="x.yaml: key 'parallel.bab_weights' must be one of"):
        of(mode="fsdp", bab_weights="some")
