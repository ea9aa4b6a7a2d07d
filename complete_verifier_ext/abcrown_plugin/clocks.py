"""The clocks: the first instance's clock starts at the verifier's start, and at P > 1 ``time`` in the
modules whose clock feeds a time limit is the all-reduced maximum of the ranks' clocks, so that every
time-limit decision is the same on every rank.

Every replacement here is a ``make(run, original)`` (:mod:`.table`); their state is the run's
:class:`~.run.Clocks`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time as _time
import types
from collections.abc import Iterator
from typing import Any

from ..clock import END_RESERVE_S
from .locate import PluginError
from .run import Clocks, Run

# every module whose clock feeds a time-limit decision (the BaB and α/β optimisation limits, the time
# left for BaB after the incomplete phase, the per-instance start)
CLOCK_MODULES = (
    "abcrown",
    "utils",
    "complete_verifier_func",
    "bab",
    "input_split.batch_branch_and_bound",
    "lp_mip_solver",
    "lp_mip_solver.refine_core",
    "auto_LiRPA.optimized_bounds",
)


class OutOfTime(Exception):
    """A single instance's time ran out before its verification started (start-up took it all)."""


def record_start_time(run: Run, orig):
    """``Logger.record_start_time``: the first instance's clock (``Logger.start_time``, from which
    α,β-CROWN measures its timeout) starts at the verifier's start, so that start-up (imports, starting
    the ranks) counts against the timeout as in a VNN-COMP harness, and ``END_RESERVE_S`` before it, so
    that the search ends that much before the timeout and the answer is written inside it; later
    instances start when they start."""
    clock = run.clock

    def record_start_time(logger):
        orig(logger)  # the same calls (and clock collectives) on every rank
        clock.shift = 0.0
        if clock.first:
            clock.first, clock.check, clock.shift = False, True, END_RESERVE_S
            logger.start_time = min(logger.start_time, clock.started_wall) - END_RESERVE_S

    return record_start_time


def update_timeout(run: Run, orig):
    """``Logger.update_timeout``: a single instance whose time is gone once its timeout is known (after
    loading) is reported ``timeout`` at once (:class:`OutOfTime` ends ``ABCROWN.main``), not after the
    incomplete phase and a BaB round that α,β-CROWN would still run."""
    clock = run.clock
    utils = importlib.import_module("utils")

    def update_timeout(logger, timeout):
        orig(logger, timeout)
        if clock.check and logger.run_mode == "single_vnnlib":
            clock.check = False
            if utils.time.time() - logger.start_time >= float(timeout):  # the synced clock at P > 1
                logger.summarize_results("unknown (the time ran out before verification started)", 0)
                raise OutOfTime

    return update_timeout


class SyncedTime(types.ModuleType):
    """A stand-in for the ``time`` module whose ``time()`` is the maximum over the ranks (one all-reduce
    per call: α,β-CROWN calls it at the same points on every rank, since all else is replicated), except
    inside :func:`local_clock` (rank-local work, such as a rank's share of a BaB round)."""

    def __init__(self, clock: Clocks) -> None:
        super().__init__("time")
        self._clock = clock
        self._rank_pid = os.getpid()  # a process forked from the rank (a MIP solver) reads its own clock

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    def time(self) -> float:
        import torch

        from ..parallel import comm

        if self._clock.local or os.getpid() != self._rank_pid:
            return _time.time()
        t = torch.tensor([_time.time()], dtype=torch.float64, device=comm.device())
        return float(comm.all_reduce(t, "max").item())


def synced_time(run: Run, orig: Any) -> SyncedTime:
    """The replacement of a module's ``time`` (``orig``: it must be the time module itself)."""
    if orig is not _time:
        raise PluginError(f"{orig!r} is not the time module: not the supported release")
    return SyncedTime(run.clock)


@contextlib.contextmanager
def local_clock(run: Run) -> Iterator[None]:
    """The rank's own clock inside (no collective per call)."""
    saved, run.clock.local = run.clock.local, True
    try:
        yield
    finally:
        run.clock.local = saved
