"""Every mistake a user can make on the plugin path (``general.engine: abcrown``, the real α,β-CROWN in
``../shared/vendor``), run from a shell as a user would: one line on stderr naming the file and the
key, line or node, ``error`` in the results file, exit 1, no traceback, the same line at P = 1 and
P = 2. Also: the instance clock counts from the verifier's start, SIGTERM cleans up, a stopped rank
ends the run with one line, ``--help`` lists α,β-CROWN's own keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugin_support import LIMIT_S, MNIST, needs_abcrown, plugin_env
from support import rank_processes

NET = MNIST / "onnx" / "mnist-net_256x2.onnx"
PROP = MNIST / "vnnlib" / "prop_0_0.05.vnnlib"

pytestmark = needs_abcrown

CONFIG = """general:
  device: cpu
  complete_verifier: skip
attack:
  pgd_order: skip
"""


def abcrown(tmp: Path, *args: str, config: str = CONFIG, P: int = 1, results: Path | None = None, env=None):
    """``abcrown --general.engine abcrown`` from a shell; returns (exit code, stderr, results file text)."""
    cfg = tmp / "exp.yaml"
    cfg.write_text(config)
    results = results or tmp / "out.txt"
    results.unlink(missing_ok=True) if results.parent.is_dir() else None
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(cfg), "--general.engine"]
    cmd += ["abcrown", "--results_file", str(results), *args]
    if P > 1:
        cmd += ["--parallel.mode", "fsdp", "--parallel.world_size", str(P)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp, env=env or plugin_env()
    )
    text = results.read_text() if results.is_file() else None
    return out.returncode, out.stderr, text


def one_error_line(code: int, err: str, results: str | None, *needles: str) -> str:
    """The checks every user mistake must pass; returns the error line."""
    assert code == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert results is not None and results.strip() == "error"
    return lines[0]


def _bad_files(tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """name -> (abcrown arguments, what the error line must name)."""
    trunc = tmp / "trunc.onnx"
    trunc.write_bytes(NET.read_bytes()[:20000])
    syntax = tmp / "syntax.vnnlib"
    syntax.write_text(PROP.read_text()[:3000] + "\n(assert (<= X_0 oops\n")
    empty = tmp / "empty.vnnlib"
    empty.write_text("")
    small = tmp / "small.vnnlib"
    decl = [f"(declare-const X_{i} Real)" for i in range(10)] + [
        f"(declare-const Y_{i} Real)" for i in range(10)
    ]
    box = [f"(assert (>= X_{i} 0.0))\n(assert (<= X_{i} 0.1))" for i in range(10)]
    small.write_text("\n".join([*decl, *box, "(assert (<= Y_0 Y_1))"]) + "\n")
    return {
        "truncated onnx": (["--onnx_path", str(trunc), "--vnnlib_path", str(PROP)], (str(trunc), "ONNX")),
        "vnnlib syntax": (["--onnx_path", str(NET), "--vnnlib_path", str(syntax)], (f"{syntax}:",)),
        "empty vnnlib": (["--onnx_path", str(NET), "--vnnlib_path", str(empty)], (str(empty),)),
        "input size": (["--onnx_path", str(NET), "--vnnlib_path", str(small)], (str(NET), "784", "10")),
    }


# (case, also at P = 2): every rank reads the files the same way, so P = 2 is run for one bad model
# and one bad spec, each against its P = 1 line
@pytest.mark.parametrize(
    ("case", "p2"),
    [("truncated onnx", True), ("vnnlib syntax", True), ("empty vnnlib", False), ("input size", False)],
)
def test_a_bad_model_or_spec_is_one_line_at_p1_and_p2(tmp_path, case, p2):
    args, needles = _bad_files(tmp_path)[case]
    lines = []
    for P in (1, 2) if p2 else (1,):
        lines.append(one_error_line(*abcrown(tmp_path, *args, P=P), *needles))
    assert lines[0] == lines[-1]  # the same text at every P
    assert len(lines[0]) < 400  # never the whole spec


@pytest.mark.parametrize(
    ("parallel", "needle"),
    [
        ("parallel: [1, 2]", "section 'parallel' must be a mapping"),
        ("parallel: 2", "section 'parallel' must be a mapping"),
        ("parallel: {mode: fsdp, world_size: 2.5}", "'parallel.world_size' expects an integer, got 2.5"),
        ("parallel: {mode: fsdp, world_size: true}", "'parallel.world_size' expects an integer, got True"),
        ("parallel: {mode: fsdp, world_size: two}", "'parallel.world_size' expects an integer, got 'two'"),
        ("parallel: {mode: foo}", "'parallel.mode' must be one of none|fsdp|tp, got 'foo'"),
    ],
)
def test_a_bad_parallel_section_names_the_file_and_key(tmp_path, parallel, needle):
    code, err, results = abcrown(tmp_path, "--onnx_path", str(NET), "--vnnlib_path", str(PROP),
                                 config=CONFIG + parallel + "\n")  # fmt: skip
    one_error_line(code, err, results, f"{tmp_path / 'exp.yaml'}: ", needle)


@pytest.mark.parametrize("where", ["parent is a file", "missing folder"])
def test_a_bad_results_path_is_refused_before_any_verification(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    results = blocker / "out.txt" if where == "parent is a file" else tmp_path / "nope" / "out.txt"
    t0 = time.monotonic()
    code, err, _ = abcrown(tmp_path, "--onnx_path", str(NET), "--vnnlib_path", str(PROP), results=results)
    assert code == 1 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "general.results_file" in lines[0] and str(results) in lines[0], err
    assert "Result:" not in err and time.monotonic() - t0 < 60  # refused, not verified then lost


def test_the_first_instance_counts_from_the_verifiers_start(tmp_path):
    """Start-up counts: with ``CVE_CLOCK_START`` (set by run_instance.sh) 100 s ago and a 50 s timeout,
    the run ends ``timeout`` at once, reporting more than 100 s, at P = 1 and P = 2 (where the ranks
    are started with the launcher's start)."""
    import json

    config = CONFIG.replace("complete_verifier: skip", "complete_verifier: bab") + "bab:\n  timeout: 50\n"
    for P in (1, 2):
        summary = tmp_path / f"s{P}.json"
        env = plugin_env(CVE_CLOCK_START=repr(time.time() - 100))
        args = ["--onnx_path", str(NET), "--vnnlib_path", str(PROP), "--summary", str(summary)]
        code, err, results = abcrown(tmp_path, *args, config=config, P=P, env=env)
        assert code == 0, err[-3000:]
        assert results.strip() == "timeout"
        record = json.loads(summary.read_text())
        assert record["time_s"] >= 100 and record["bab"]["domains"] == 0


def test_the_clock_starts_at_the_verifier_not_at_the_fork():
    """A shell execs the last command of a list in the process it forked: the seconds before the exec
    are not the verifier's."""
    code = "import time, complete_verifier_ext.clock as c; print(time.monotonic() - c.started_monotonic())"
    cmd = f"sleep 2; exec {sys.executable} -c '{code}'"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60, env=plugin_env())
    assert float(out.stdout) < 1.5, out.stdout


def _start(tmp: Path, *args: str) -> subprocess.Popen:
    """A P = 2 run that stays busy for minutes (BaB on mnist-net_256x6 prop_2_0.05), in its own TMPDIR."""
    config = CONFIG.replace("complete_verifier: skip", "complete_verifier: bab") + "bab:\n  timeout: 600\n"
    config += "solver:\n  alpha-crown:\n    iteration: 2\n"  # on to BaB at once
    cfg = tmp / "exp.yaml"
    cfg.write_text(config)
    (tmp / "tmp").mkdir()
    net, prop = MNIST / "onnx" / "mnist-net_256x6.onnx", MNIST / "vnnlib" / "prop_2_0.05.vnnlib"
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(cfg),
           "--general.engine", "abcrown", "--results_file", str(tmp / "out.txt"),
           "--onnx_path", str(net), "--vnnlib_path", str(prop),
           "--parallel.mode", "fsdp", "--parallel.world_size", "2", *args]  # fmt: skip
    return subprocess.Popen(cmd, env=plugin_env(TMPDIR=str(tmp / "tmp")), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp)  # fmt: skip


def _ranks_busy(proc: subprocess.Popen, tmp: Path) -> list[int]:
    """The two ranks, once rank 1's log shows BaB's second round."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ranks = rank_processes(proc.pid)
        logs = list((tmp / "tmp").glob("cve_abcrown_*/rank1.log"))
        if len(ranks) == 2 and logs and "BaB round 2" in logs[0].read_text(errors="replace"):
            return ranks
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    raise AssertionError("the ranks did not start BaB")


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    """(SIGHUP takes the same path: ``test_cli.py`` sends it on the native engine.)"""
    sig = signal.SIGTERM
    proc = _start(tmp_path)
    try:
        ranks = _ranks_busy(proc, tmp_path)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "leaked" not in err, err[-3000:]
    assert not list((tmp_path / "tmp").glob("cve_abcrown_*"))  # no scratch folder left
    time.sleep(0.5)
    assert not [r for r in ranks if Path(f"/proc/{r}").exists() and "zombie" not in
                Path(f"/proc/{r}/status").read_text()]  # fmt: skip


def test_a_stopped_rank_ends_the_run_with_one_line(tmp_path):
    """SIGSTOP on rank 1: rank 0's next collective times out (``parallel.collective_timeout``); one
    line naming rank 1."""
    proc = _start(tmp_path, "--parallel.collective_timeout", "5")
    try:
        ranks = _ranks_busy(proc, tmp_path)
        os.kill(ranks[1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 "), err[-3000:]
    assert (tmp_path / "out.txt").read_text().strip() == "error"
    assert not list((tmp_path / "tmp").glob("cve_abcrown_*"))


def test_help_lists_abcrowns_own_keys_and_our_real_defaults(tmp_path):
    for args in (["--general.engine", "abcrown"], ["--config", str(tmp_path / "c.yaml")]):
        (tmp_path / "c.yaml").write_text("general:\n  engine: abcrown\n")
        cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--help", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=plugin_env())
        assert out.returncode == 0, out.stderr[-3000:]
        keys = ["general.conv_mode = patches", "solver.beta-crown.enable_opt_interm_bounds = False"]
        keys += ["bab.cut.enabled = False", "parallel.bab_weights = auto", "parallel.world_size = 1"]
        for key in keys:
            assert key in out.stdout, key
