"""``abcrown_plugin/parent.py`` and ``rank.py`` with the launcher: a rank killed mid-α-CROWN or mid-BaB
ends the run with ``error`` within 30 s and no process left; the synced clock keeps the ranks in
lockstep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugin_support import (
    BAB_YAML,
    BOUNDS_YAML,
    CHUNK,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    run,
)
from support import rank_processes


def _kill_rank1_when(tmp_path: Path, cfg: str, args: list[str], ready) -> None:
    """Start a P = 2 run, SIGKILL rank 1 once ``ready(scratch)`` holds (``scratch``: the run's scratch
    folder, with rank 1's log), then expect ``error`` and exit 1 within 30 s, and no process left."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "kill"
    (out / "tmp").mkdir(parents=True)
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", cfg, "--general.engine", "abcrown"]
    cmd += ["--results_file", str(out / "out.txt"), "--parallel.mode", "fsdp", "--parallel.world_size", "2"]
    env = plugin_env(TMPDIR=str(out / "tmp"))
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


@needs_abcrown
def test_a_killed_rank_is_an_error_within_30s(tmp_path):
    """A rank killed with SIGKILL mid-α-CROWN: ``error`` in the results file and exit 1 within 30 s, and
    no process left behind."""
    cfg = config(tmp_path, BOUNDS_YAML.format(chunk=4).replace("iteration: 10", "iteration: 2000"))
    t0 = time.monotonic()
    # ten seconds after the start: well inside α-CROWN's 2000 iterations
    _kill_rank1_when(
        tmp_path, cfg, instance("mnist-net_256x2", "prop_0_0.05.vnnlib"), lambda _: time.monotonic() - t0 > 10
    )


def _in_bab_round(scratch: Path, n: int = 2) -> bool:
    logs = list(scratch.glob("cve_abcrown_*/rank1.log"))
    return bool(logs) and f"BaB round {n}" in logs[0].read_text(errors="replace")


@needs_abcrown
def test_a_rank_killed_mid_bab_is_an_error_within_30s(tmp_path):
    """The same in the middle of BaB (256x6 prop_2_0.05 stays open for minutes), while rank 1 bounds its
    share of the domains, with the weights kept sharded: rank 0 is waiting in a weight request or
    serving rank 1 when it dies."""
    cfg = config(tmp_path, BAB_YAML.replace("batch_size: 8", "batch_size: 64"))
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


@needs_abcrown
def test_clock_skew_on_one_rank_keeps_lockstep(tmp_path, unpatched):
    """Rank 1's clock jumps 1000 s ahead mid-run: every time-limit decision uses the ranks' maximum, so
    both ranks stop together (no collective mismatch) and the verdict is α,β-CROWN's."""
    _, _, ref = unpatched
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW.format(after=5.0))
    cfg = config(tmp_path, BOUNDS_YAML.format(chunk=CHUNK).replace("iteration: 10", "iteration: 200"))
    env = plugin_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc, got, results = run(
        tmp_path, cfg, *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"), "--timeout", "500", P=2, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert got["verdict"] == ref["verdict"] == "timeout" and results.strip() == "timeout"


@needs_abcrown
def test_bab_cut_short_by_max_iterations_is_no_proof(tmp_path):
    """α,β-CROWN's BaB returns "safe" when ``bab.max_iterations`` stops it with domains still open;
    the plugin turns that into unknown (256x6 prop_2_0.05 is open at VNN-COMP 2022)."""
    cfg = config(tmp_path, BAB_YAML.replace("  timeout: 120", "  timeout: 120\n  max_iterations: 2"))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x6", "prop_2_0.05.vnnlib"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "timeout" and "bab.max_iterations" in proc.stderr


def test_bab_proved_treats_nan_as_not_proven():
    import torch

    from complete_verifier_ext.abcrown_plugin.probe import bab_proved

    assert bab_proved(torch.tensor(0.0)) and bab_proved(float("inf")) and bab_proved(0.3)
    assert not bab_proved(float("nan")) and not bab_proved(-1e-9) and not bab_proved(float("-inf"))
