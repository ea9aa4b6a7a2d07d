"""One rank of ``abcrown --general.engine abcrown``: α,β-CROWN's own ``ABCROWN(args).main()`` with our
patches installed from a new :class:`~.run.Run` (undone after), and what the parent reports gathered
from every rank. Rank 0 alone prints; ranks other than 0 write α,β-CROWN's files into a scratch folder
and their stdout to a log there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from ..config import ParallelConfig
from . import bridge, locate, table
from .clocks import OutOfTime
from .patcher import Patcher
from .run import Proofs, Run
from .search.rounds import lockstep_calls
from .weights import shards

AUDIT_ENV = "CVE_ABCROWN_AUDIT"  # "1": count live full-size weights at the start and end of each build


@contextlib.contextmanager
def warnings_to_stdout() -> Iterator[None]:
    """Python warnings (α,β-CROWN's, onnx2pytorch's, torch's at their import) go with α,β-CROWN's log
    on stdout, the rank's log file where that is redirected; stderr keeps our own lines alone."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        shown(message, category, filename, lineno, sys.stdout, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


class _CurrentStdout:
    """A stream that writes to whatever ``sys.stdout`` is when it writes."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def _log_to_stdout() -> None:
    """auto_LiRPA's log handler writes to the ``sys.stdout`` of its import (maybe an earlier run's log
    file, closed since); make it write to the current one, this run's and every later run's."""
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and not isinstance(handler.stream, _CurrentStdout):
            handler.stream = _CurrentStdout()  # not setStream: it flushes the old stream, maybe closed


class Phases:
    """Per-rank peak memory of named, possibly nested phases (the run, the incomplete phase ``bounds``,
    BaB ``bab``) with one high-water mark: every boundary folds the mark into each open phase before
    it is reset, so a phase nested in another costs the outer one nothing. Code pages and torch's
    lazily loaded libraries are left out as ``PeakMemory.peak_mb`` does (``memory.not_bound_mb``;
    on CUDA the allocator never sees them)."""

    def __init__(self, meter) -> None:
        self.meter = meter
        self.open: dict[str, list[float]] = {}  # name -> [baseline, highest mark], MiB less not_bound
        self.peaks: dict[str, float] = {}

    def _fold(self) -> None:
        if self.open:
            mark = self.meter.peak_total_mb() - self.meter.not_bound_mb()
            for span in self.open.values():
                span[1] = max(span[1], mark)

    def start(self, name: str) -> None:
        self._fold()
        self.meter.start()
        base = self.meter.baseline_mb - self.meter.not_bound_mb()
        self.open[name] = [base, base]

    def end(self, name: str) -> None:
        self._fold()
        base, high = self.open.pop(name)
        self.peaks[name] = max(self.peaks.get(name, 0.0), high - base)


def _open_log(scratch: str, rank: int, quiet: bool) -> IO[str] | None:
    """The rank's log in ``scratch``: every rank but 0 has one, and rank 0 too when ``quiet``."""
    return open(os.path.join(scratch, f"rank{rank}.log"), "a") if rank != 0 or quiet else None


def _redirect_to_log(stack: contextlib.ExitStack, log: IO[str] | None, rank: int) -> None:
    """Send stdout (and, except on rank 0, stderr) to ``log`` for as long as ``stack`` is open."""
    if log:
        stack.enter_context(contextlib.redirect_stdout(log))
        if rank != 0:
            stack.enter_context(contextlib.redirect_stderr(log))


def _phase_hook(run: Run, phases: Phases, full_live: list[list[str]] | None) -> Callable[[str, bool], None]:
    """``Probe.on_phase``: starts or ends the phase's peak; with ``full_live`` (the audit of sharded
    weights), first appends the full-size weights alive at each boundary of ``bounds``."""
    from ..parallel import memory

    def on_phase(name: str, start: bool) -> None:
        if name == "bounds" and full_live is not None:
            full_live.append(shards.live_full_weights(run.shards))
        if name == "bounds" and start:  # α-CROWN's first optimizer is near: its libraries are no bound memory
            memory.load_optimizer_libraries()
        (phases.start if start else phases.end)(name)

    return on_phase


def _fits(run: Run) -> int | None:
    """The smallest BaB round that fit after running out of memory, over the run's instances (None: none
    ran out)."""
    fits = [r.bab_fits for r in (*run.probe.records, run.probe.current) if r.bab_fits is not None]
    fits += [run.rounds.fits] if run.rounds.fits is not None else []
    return min(fits, default=None)


def gathered_result(run: Run, phases: Phases, full_live: list[list[str]] | None, crown_batch: int) -> dict:
    """Every rank's peaks, α elements and weight fetches (one all-gather), the probe's records, and
    what each rank dealt; with the audit (``full_live`` not None), every rank's live full-size
    weights. Everything comes from ``run``: nothing of an earlier run in this process is counted."""
    import torch

    from ..parallel import comm, serve

    peaks = phases.peaks
    fetched = {k: v - run.served_at_start.get(k, 0) for k, v in serve.stats().items()}
    row = [peaks.get("run", 0.0), peaks.get("bounds", 0.0), peaks.get("bab", 0.0), run.probe.alpha_elements]
    row += [fetched["full"], fetched["shard"]]
    mine = torch.tensor([row], dtype=torch.float64, device=comm.device())
    every = comm.all_gather_cat(mine, 0).cpu()
    records = [vars(r) for r in run.probe.records]
    return {
        "rank_spread": _agreement(comm.all_gather_object(records)),
        **({"full_weights_live": comm.all_gather_object(full_live)} if full_live is not None else {}),
        "records": records,
        "peak_mb": [float(v) for v in every[:, 0].tolist()],
        "peak_mb_bounds": [float(v) for v in every[:, 1].tolist()],
        "peak_mb_bab": [float(v) for v in every[:, 2].tolist()],
        "alpha_elements": [int(v) for v in every[:, 3].tolist()],
        # weights fetched on request in BaB rounds with the weights sharded (whole ones, single shards)
        "bab_weight_fetches": [[int(a), int(b)] for a, b in every[:, 4:6].tolist()],
        "bab_collectives": comm.all_gather_object(list(run.rounds.collectives)),
        # domains a round that fit after BaB ran out of memory (None: never ran out), per rank
        "bab_fits": comm.all_gather_object(_fits(run)),
        "rows_dealt": comm.all_gather_object(dict(sorted(run.rows.dealt.items()))),
        # every lockstep collective of the run: the same count on every rank, or the ranks diverged
        "collectives": comm.all_gather_object(lockstep_calls() - run.calls_at_start),
        "peak_mb_exact": phases.meter.exact,
        "crown_batch_size": crown_batch,
        "whole_layers": dict(run.shards.whole_layers),
    }


class RanksDisagree(RuntimeError):
    """The ranks ended an instance with different verdicts: a bug (the ranks run in lockstep on the same
    data); the run ends with ``error`` rather than report one rank's answer."""


def _agreement(per_rank: list[list[dict]]) -> float:
    """Every rank's records of the run (``Probe.records``), checked: the same instances and verdicts on
    every rank, else :class:`RanksDisagree`. Returns the largest difference between two ranks' initial
    CROWN or α-CROWN bound of the same clause, relative to the bound (0.0: bit for bit)."""
    first = per_rank[0]
    spread = 0.0
    for rank, records in enumerate(per_rank[1:], 1):
        verdicts = [[r["verdict"] for r in rs] for rs in (first, records)]
        if verdicts[0] != verdicts[1]:
            raise RanksDisagree(f"ranks 0 and {rank} disagree: verdicts {verdicts[0]} and {verdicts[1]}")
        for a, b in zip(first, records, strict=True):
            for key in ("crown", "alpha_crown"):
                if len(a[key]) != len(b[key]):
                    raise RanksDisagree(f"ranks 0 and {rank} disagree: {key} bounds of different lengths")
                for x, y in zip(a[key], b[key], strict=True):
                    spread = max(spread, abs(x - y) / max(1.0, abs(x)))
    return spread


@dataclass(frozen=True)
class RankJob:
    """What every rank of one ``abcrown`` run is handed (pickled to spawned ranks)."""

    checkout: locate.Checkout
    args: list[str]  # the config YAML, then α,β-CROWN's flags
    par: ParallelConfig
    scratch: str  # ranks other than 0 write their files and logs here
    quiet: bool
    started_wall: float  # the verifier's start (time.time())
    one_pass: bool = False  # the config leaves crown.batch_size at its default: P = 1 bounds a layer at once
    proof: str | None = None  # general.proof: where an unsat writes its proof


def rank_main(job: RankJob) -> dict:
    """One rank: α,β-CROWN's ``ABCROWN(args).main()`` with our patches made from a new :class:`Run`
    (undone after), then what :func:`gathered_result` collects; the launcher returns rank 0's. May be
    called again in the same process: each call has its own run."""
    import torch

    from ..parallel import comm, launch, serve
    from ..parallel.memory import PeakMemory
    from ..spec import cache_root

    rank, world = comm.rank(), comm.world_size()
    launch.set_threads(job.par.threads, world)
    if torch.cuda.is_available() and comm.backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    p = Patcher()
    log = _open_log(job.scratch, rank, job.quiet)
    cache = str(cache_root() / "abcrown_specs" / f"rank{rank}")
    run = Run(job.par, world, cache, job.started_wall, served_at_start=dict(serve.stats()))
    run.rows.one_pass = job.one_pass
    run.proof = Proofs(job.proof) if job.proof else None
    run.calls_at_start = lockstep_calls()
    try:
        with contextlib.ExitStack() as quiet_ctx:
            _redirect_to_log(quiet_ctx, log, rank)
            quiet_ctx.enter_context(warnings_to_stdout())
            arguments = bridge.import_abcrown(job.checkout)
            _log_to_stdout()
            import abcrown

            table.install(p, run)  # every patch: table.py
            phases = Phases(PeakMemory(comm.device()))
            audit = os.environ.get(AUDIT_ENV) == "1"
            full_live: list[list[str]] = []
            run.probe.on_phase = _phase_hook(run, phases, full_live if audit and run.sharded else None)
            phases.start("run")
            run.probe.current.started_at = time.time()  # α,β-CROWN imported and patched: work begins
            with contextlib.suppress(OutOfTime):  # reported "timeout" already
                abcrown.ABCROWN(args=bridge.rank_args(job.args[0], job.args[1:], rank, job.scratch)).main()
            phases.end("run")
    finally:
        p.undo()
        if log:
            log.close()
    crown_batch = int(arguments.Config["solver"]["crown"]["batch_size"])
    return gathered_result(run, phases, full_live if audit else None, crown_batch)
