"""Helpers of the plugin's tests (``tests/test_abcrown_plugin_*.py``): the real α,β-CROWN in
``../shared/vendor``, run as a user runs it (an ``abcrown --general.engine abcrown`` subprocess under a
hard time limit, so a hang fails the test), on real gloo ranks.

Tests that need the checkout carry :data:`needs_abcrown`; pure unit tests of the plugin's modules run
without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
VENDOR = SHARED / "vendor" / "alpha-beta-CROWN"
BENCH = SHARED / "benchmarks"
MNIST = BENCH / "mnist_fc"
DEPS = ("onnxoptimizer", "skl2onnx", "psutil", "sortedcontainers", "pandas", "termcolor", "appdirs")


def _missing() -> str | None:
    if not VENDOR.is_dir():
        return f"{VENDOR} not found (the vendored alpha-beta-CROWN)"
    absent = [m for m in DEPS if importlib.util.find_spec(m) is None]
    if absent:
        return f"alpha-beta-CROWN's PyPI dependencies {absent} are missing: pip install -e '.[abcrown]'"
    return None


needs_abcrown = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
"""The mark (``pytestmark``, or per test) of every test that runs α,β-CROWN."""

LIMIT_S = 150

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

CHUNK = 32  # rows a CROWN pass on 256x2: its largest start node has 140 unstable rows, 5 passes


# input-split BaB with α-CROWN bounds, clip-and-verify and the attack each round (sb branching)
INPUT_SPLIT_YAML = """general:
  device: cpu
solver:
  batch_size: 64
  bound_prop_method: alpha-crown
  crown:
    batch_size: 16
  alpha-crown:
    iteration: 10
bab:
  timeout: 60
  branching:
    method: sb
    input_split:
      enable: True
  clip_n_verify:
    clip_input_domain:
      enabled: True
attack:
  pgd_order: skip
  input_split_check_adv:
    enabled: "true"
"""


def plugin_env(**extra: str) -> dict:
    """The environment of a plugin run: the checkout, one thread, no inherited verifier clock."""
    base = {k: v for k, v in os.environ.items() if k != "CVE_CLOCK_START"}
    return {**base, "ABCROWN_PATH": str(VENDOR), "OMP_NUM_THREADS": "1", **extra}


def config(tmp: Path, text: str, name: str = "exp.yaml") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def instance(net: str, prop: str) -> list[str]:
    return ["--onnx_path", str(MNIST / "onnx" / f"{net}.onnx"), "--vnnlib_path", str(MNIST / "vnnlib" / prop)]


_WORKER: dict[str, str] = {}  # this pytest process's resident worker: {"dir": its socket folder}


def warm_prefix(env: dict) -> list[str]:
    """The command prefix that runs ``abcrown`` (the ``cli`` entry) on this pytest process's resident
    worker (``complete_verifier_ext/worker.py``, started on first use: α,β-CROWN imported once per
    pytest process instead of once per run), and sets ``env``'s ``CVE_WORKER_DIR``. The instance runs
    in a process forked from the worker, exactly as a fresh ``python -m complete_verifier_ext.cli``;
    with ``CVE_TEST_WORKER=off`` (or no worker) it is one."""
    if os.environ.get("CVE_TEST_WORKER", "on") == "off" or _missing() is not None:
        return [sys.executable, "-m", "complete_verifier_ext.cli"]
    if "dir" not in _WORKER:
        import tempfile

        _WORKER["dir"] = tempfile.mkdtemp(prefix="cve_test_worker_")
        start_env = plugin_env(CVE_WORKER_DIR=_WORKER["dir"], CVE_WORKER_IDLE_S="300")
        subprocess.run([sys.executable, "-m", "complete_verifier_ext.worker", "start", "abcrown"],
                       env=start_env, capture_output=True, timeout=LIMIT_S)  # fmt: skip
    env["CVE_WORKER_DIR"] = _WORKER["dir"]
    return [sys.executable, "-m", "complete_verifier_ext.worker", "run", "abcrown", "cli"]


def stop_worker() -> None:
    """End this pytest process's worker, if one was started (at the end of the session)."""
    if "dir" in _WORKER:
        env = plugin_env(CVE_WORKER_DIR=_WORKER["dir"])
        subprocess.run([sys.executable, "-m", "complete_verifier_ext.worker", "stop", "abcrown"],
                       env=env, capture_output=True, timeout=60)  # fmt: skip
        import shutil

        shutil.rmtree(_WORKER.pop("dir"), ignore_errors=True)


def run(tmp: Path, cfg: str, *args: str, P: int = 1, env: dict | None = None, name="run", mode="fsdp"):
    """One ``abcrown --general.engine abcrown`` run (on the resident worker: :func:`warm_prefix`);
    returns (process, summary dict or None, results)."""
    out = tmp / name
    out.mkdir(exist_ok=True)
    env = dict(env or plugin_env())
    cmd = [*warm_prefix(env), "--config", cfg, "--general.engine", "abcrown"]
    cmd += ["--summary", str(out / "s.json"), "--results_file", str(out / "out.txt"), *args]
    if P > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(P)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp)
    summary = json.loads((out / "s.json").read_text()) if (out / "s.json").exists() else None
    results = (out / "out.txt").read_text() if (out / "out.txt").exists() else None
    return proc, summary, results


WARM = "from complete_verifier_ext import abcrown_plugin as _p; _p.warm(); del _p\n"


def python(code: str, timeout: float = 60, **extra_env: str) -> subprocess.CompletedProcess:
    """``python -c code`` with the plugin's environment: the process imports α,β-CROWN once, then the
    ranks it starts are forked from it (as from the resident worker: ``CVE_WARM``), not spawned to import
    it again each (one torch thread per process: no OpenMP pool to lose in a fork)."""
    cmd, env = [sys.executable, "-c", WARM + code], plugin_env(CVE_WARM="1", **extra_env)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def run_jobs(*jobs) -> list[dict]:
    """A rank function (``launch.run``): the plugin's rank on each job in turn, in this one process, as
    a process that verifies several instances does: each instance's clock starts where it starts (the
    jobs were all prepared at once), as a csv's instances after the first do."""
    import dataclasses
    import time

    from complete_verifier_ext.abcrown_plugin.rank import rank_main

    return [rank_main(dataclasses.replace(job, started_wall=time.time())) for job in jobs]


def run_calls(*calls: tuple[str, tuple]) -> list[dict]:
    """A rank function: this module's rank functions ``(name, args)`` in turn, in this one process (one
    start of the ranks for several runs); their results in order."""
    return [r for name, args in calls for r in globals()[name](*args)]


def run_jobs_out_of_memory(limit: int, late: bool, final_rows: int | None, *jobs) -> list[dict]:
    """:func:`run_jobs` with a stand-in for a GPU that runs out of memory: on rank 1, a ReLU's step of
    the back-substitution of an intermediate layer raises ``torch.OutOfMemoryError`` (what CUDA raises)
    when the A-matrix it receives has more than ``limit`` elements, midway through a pass (after the
    collectives of the layers above it); ``late``: only where autograd records (α-CROWN's iterations,
    not the CROWN pass before them); ``final_rows``: and a pass of the output node over more than
    that many spec rows (whether autograd records or not)."""
    import torch

    from complete_verifier_ext.abcrown_plugin import bridge, locate
    from complete_verifier_ext.parallel import comm

    bridge.import_abcrown(locate.find(str(VENDOR)))
    from auto_LiRPA.operators import BoundRelu
    from auto_LiRPA.patches import Patches

    orig = BoundRelu.bound_backward

    def size(A) -> int:
        if isinstance(A, Patches):
            return 0 if A.patches is None else A.patches.numel()
        return A.numel() if isinstance(A, torch.Tensor) else 0

    def stand_in(self, last_lA, last_uA, *args, **kwargs):
        start = kwargs.get("start_node")
        if comm.rank() == 1 and start is not None and start.output_name:  # an intermediate layer's pass
            if (torch.is_grad_enabled() or not late) and max(size(last_lA), size(last_uA)) > limit:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        elif comm.rank() == 1 and start is not None and final_rows is not None:  # the output node's
            A = last_lA if last_lA is not None else last_uA
            if isinstance(A, torch.Tensor) and int(A.shape[0]) > final_rows:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return orig(self, last_lA, last_uA, *args, **kwargs)

    BoundRelu.bound_backward = stand_in
    try:
        return run_jobs(*jobs)
    finally:
        BoundRelu.bound_backward = orig


def _bab_stand_ins(limit: int, ranks: tuple[int, ...], where: str) -> list:
    """``(class, method name, make)`` of :func:`run_jobs_bab_out_of_memory`'s stand-ins (``make(original)``
    -> the method that raises ``torch.OutOfMemoryError`` past ``limit`` on ``ranks``)."""
    import sys

    import torch
    from beta_CROWN_solver import LiRPANet
    from branching_domains import BatchedDomainList
    from input_split.branching_domains import UnsortedInputDomainList

    from complete_verifier_ext.parallel import comm

    def check(count: int) -> None:
        if comm.rank() in ranks and count > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    def in_round() -> bool:  # inside α,β-CROWN's input-split round (not a move between the ranks)
        f = sys._getframe()
        while f is not None and not f.f_code.co_filename.endswith("batch_branch_and_bound.py"):
            f = f.f_back
        return f is not None

    def children(update_bounds):
        def f(self, d, *args, **kwargs):
            check(int(next(iter(d["lower_bounds"].values())).shape[0]))
            return update_bounds(self, d, *args, **kwargs)

        return f

    def boxes(naive):
        def f(self, *args, **kwargs):
            check(int(kwargs["dm_l"].shape[0]))
            return naive(self, *args, **kwargs)

        return f

    def picking(interm):
        def f(self, batch, device):
            check(batch)
            return interm(self, batch, device)

        return f

    def picked_boxes(volume):
        def f(self, dm_l, dm_u, sign=1):
            if sign < 0 and in_round():
                check(int(dm_l.shape[0]))
            return volume(self, dm_l, dm_u, sign)

        return f

    return {
        "bound": [(LiRPANet, "update_bounds", children), (LiRPANet, "get_lower_bound_naive", boxes)],
        "pick": [(BatchedDomainList, "_interm_bounds_wo_transfer", picking),
                 (UnsortedInputDomainList, "_add_volume", picked_boxes)],
    }[where]  # fmt: skip


def run_jobs_bab_out_of_memory(limit: int, ranks: tuple[int, ...], where: str, *jobs) -> list[dict]:
    """:func:`run_jobs` with a stand-in for a GPU that runs out of memory in BaB, on the ranks ``ranks``
    (raising ``torch.OutOfMemoryError``, what CUDA raises), where a round handles more than ``limit``
    domains or boxes. ``where`` is ``"bound"``: in the bounding of a round's children (β-CROWN's
    ``LiRPANet.update_bounds``; input-split BaB's ``LiRPANet.get_lower_bound_naive``), after the round's
    domains were picked off the list and branched; or ``"pick"``: in a round's pick, midway (after
    ``BatchedDomainList.pick_out`` popped the per-domain A-matrices, α, specs and thresholds, before
    the intermediate bounds; after an input-split list's ``pick_out_batch`` popped every storage,
    before its volume: not in the moves of boxes between the ranks, picks too)."""
    from complete_verifier_ext.abcrown_plugin import bridge, locate

    bridge.import_abcrown(locate.find(str(VENDOR)))
    stand_ins = _bab_stand_ins(limit, ranks, where)
    kept = [(cls, name, getattr(cls, name)) for cls, name, _ in stand_ins]
    for cls, name, make in stand_ins:
        setattr(cls, name, make(getattr(cls, name)))
    try:
        return run_jobs(*jobs)
    finally:
        for cls, name, orig in kept:
            setattr(cls, name, orig)
