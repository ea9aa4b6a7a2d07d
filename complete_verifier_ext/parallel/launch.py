"""Start P ranks and run one function on each: ``run(fn, world_size, args)``.

Three ways in:

* ``world_size == 1`` (and no torchrun environment): ``fn(*args)`` in this process, no group;
* started by torchrun (``RANK`` and ``WORLD_SIZE`` in the environment): join that group
  (``comm.init_from_env``), call ``fn`` here, return its result on every rank (rank 0 prints);
* otherwise: spawn ``world_size`` processes (``torch.multiprocessing``, start method ``spawn``), each
  joins the group (``comm.init``) and calls ``fn(*args)``; rank 0's return value comes back.

``fn`` and ``args`` must be picklable (module-level functions); the result must be picklable with plain
``pickle`` (return CPU tensors). Backend ``auto``: NCCL with one GPU per rank when CUDA has enough
GPUs, else gloo. The port is ``MASTER_PORT`` if set, else a free one; the address ``MASTER_ADDR`` or
127.0.0.1. ``memory.EXACT_MEMORY_ENV`` (glibc's mmap threshold, MKL's buffer cache off) is put in the
children's environment unless already set.

Failures never hang: a rank that raises sends its formatted error back; a rank that dies (signal,
``os._exit``) is noticed by polling the children. Then every other child is terminated (it may be
blocked in a collective), killed if it does not stop, joined, and ``RankFailure`` is raised, naming the
rank: ``"rank 1 failed: ValueError: ..."`` or ``"rank 1 died (signal 9)"``. When several ranks fail
together, a rank that died is reported first, else the earliest error (the others are usually
collateral, e.g. "connection closed" in a collective); all are in ``RankFailure.failures``.
``timeout_s`` also bounds every collective (``init_process_group``), as a backstop.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import re
import signal
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from ..errors import UserError
from . import comm
from .memory import EXACT_MEMORY_ENV, available_mb

__all__ = ["RankFailure", "check_gpus", "check_world_size", "is_rank0", "run", "set_threads"]

T = TypeVar("T")

_POLL_S = 0.5  # how often the parent looks at its children when nothing happens
_GRACE_S = 1.0  # after a first failure, how long to wait for the root cause to show up
_STOP_S = 3.0  # how long a child gets to stop after SIGTERM, before SIGKILL
_FINISH_S = 15.0  # how long ranks that succeeded get for their own shutdown (freeing GBs of domains can
# take seconds; a SIGTERM during gloo's teardown makes C++ print "terminate called ..." to stderr)


@dataclass(frozen=True)
class _Failure:
    rank: int
    reason: str  # "failed: ValueError: ..." or "died (signal 9)"
    details: str = ""  # the child's traceback, if any
    died: bool = False
    when: float = float("inf")  # the child's clock at the error (time.time())
    user: str | None = None  # a UserError's message: the user's mistake, raised as such by the parent
    lost: bool = False  # a collective failed because a peer died or hung (collateral, never the cause)


class RankFailure(RuntimeError):
    """A rank raised or died. ``rank``, ``reason`` and ``details`` (traceback) describe the one reported;
    ``failures`` lists every failure seen."""

    def __init__(self, failure: _Failure, failures: list[_Failure] | None = None) -> None:
        self.rank, self.reason, self.details = failure.rank, failure.reason, failure.details
        self.failures = failures or [failure]
        message = f"rank {failure.rank} {failure.reason}"
        super().__init__(f"{message}\n{failure.details}".rstrip() if failure.details else message)


RANK_MB = 400  # resident memory of one idle rank (Python, torch, the package), measured here: ~350 MB


def is_rank0() -> bool:
    """Whether this process is the one that reports: not started by torchrun, or torchrun's rank 0.
    Decided from the environment, before (and after) any process group exists."""
    return os.environ.get("RANK", "0") == "0"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_world_size(world_size: int) -> list[str]:
    """Warnings for a world size that will run slowly (more ranks than cores); a ``ValueError`` for one
    that cannot run here at all: more ranks than the memory available holds (``RANK_MB`` each)."""
    if world_size <= 1 or "RANK" in os.environ:  # torchrun placed the ranks itself
        return []
    avail_mb = available_mb()
    if world_size * RANK_MB > avail_mb:
        raise UserError(
            f"parallel.world_size {world_size} needs about {world_size * RANK_MB} MB for the ranks alone "
            f"({RANK_MB} MB each), but {avail_mb:.0f} MB are available"
        )
    cores = available_cores()
    if world_size > cores:
        return [f"parallel.world_size {world_size} exceeds the {cores} cores available: ranks share them"]
    return []


def check_gpus(world_size: int, device: str, backend: str) -> list[str]:
    """A warning when ranks asked to run on GPUs will run on the CPU: ``auto`` chooses NCCL only with a
    GPU for every rank of this host, else gloo, whose ranks compute on the CPU."""
    if world_size <= 1 or device == "cpu" or backend != "auto" or "RANK" in os.environ:
        return []
    if comm.resolve_backend("auto", world_size) == "nccl":
        return []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [
        f"general.device {device} with parallel.world_size {world_size}, but {gpus} GPU(s) here: the ranks "
        "run on the CPU under gloo (NCCL needs a GPU for every rank)"
    ]


def set_threads(threads: int, world_size: int) -> int:
    """Set this rank's torch threads: ``threads``, or for 0 the cores available less one, divided
    among the ranks on this host (at least 1); one inter-op thread (the engine runs no parallel graph
    ops).  Returns the number set.  The core left over is for everything else on the machine: OpenMP
    threads that wait for each other at every barrier collapse when another job takes one of their
    cores (``benchmarks/results/threads/threads.md``: plain BaB on mnist-net_256x4 prop_3_0.05 with a busy
    process beside it, 17.2 s with 1 thread, a timeout at 60 s with 2; alone, 15.9 s and 16.8 s)."""
    n = threads if threads > 0 else max(1, (available_cores() - 1) // max(1, _local_world(world_size)))
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # only settable before the first parallel op
        torch.set_num_interop_threads(1)
    return n


def _local_world(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def run(
    fn: Callable[..., T],
    world_size: int,
    args: tuple = (),
    backend: str = "auto",
    timeout_s: float = 30.0,
    exact_memory: bool = True,
    fork: bool = False,
) -> T:
    """Run ``fn(*args)`` on ``world_size`` ranks; return rank 0's result (see the module docstring).
    ``exact_memory``: spawned ranks start with ``EXACT_MEMORY_ENV`` (RSS follows live tensors).
    ``fork``: with gloo, fork the ranks from this process instead of starting fresh interpreters, so
    that what it has imported (α,β-CROWN: seconds per rank) is not imported again; the caller must
    not have used CUDA or run a parallel torch operation (an OpenMP pool does not survive a fork)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_joined(fn, world_size, args, backend, timeout_s)
    if world_size == 1:
        return fn(*args)
    backend = comm.resolve_backend(backend, world_size)
    # an instance forked from the resident worker (worker.py) has its imports and no OpenMP pool
    fork = fork or os.environ.get(WARM_ENV) == "1"
    method = "fork" if fork and backend == "gloo" and exact_memory is False else "spawn"
    return _run_spawned(fn, world_size, args, backend, timeout_s, exact_memory, method)


def _run_joined(fn: Callable[..., T], world_size: int, args: tuple, backend: str, timeout_s: float) -> T:
    """Started by torchrun: join its group (unless already in one) and run ``fn`` here."""
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        warnings.warn(f"torchrun started {env_world} ranks; ignoring world_size={world_size}", stacklevel=3)
    if comm.world_size() > 1:
        return fn(*args)
    comm.init_from_env(backend, timeout_s)
    rank = comm.rank()
    done = False
    try:
        result = fn(*args)
        done = True
        return result
    except RuntimeError as e:  # gloo and NCCL raise plain RuntimeErrors when a peer is gone
        if not _is_lost_peer(e):
            raise
        raise RankFailure(_Failure(rank, f"lost a peer rank (it died or hung): {_first_line(e)}")) from None
    finally:
        with contextlib.suppress(Exception):  # a group whose peer is gone may not shut down cleanly
            if done:  # no rank tears gloo down while another still uses it (that aborted rank 0 under load)
                comm.barrier()
            comm.shutdown()


def _is_lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank died or stopped responding."""
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    words = ("gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "timed out")
    return isinstance(e, RuntimeError) and any(w in text for w in words)


def _first_line(e: BaseException) -> str:
    """The first line of a transport error, without gloo's source location and its advice."""
    first = re.sub(r"^\[[^\]]*\] ", "", (str(e).strip() or type(e).__name__).splitlines()[0])
    return first.split(". This is typically")[0]


# ----------------------------------------------------------------------------------------------------------
# Spawning
# ----------------------------------------------------------------------------------------------------------


def _free_port(addr: str) -> int:
    """A TCP port that is free on ``addr`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Put ``EXACT_MEMORY_ENV`` (each variable unless set) in the environment that spawned children
    inherit."""
    added = {k: v for k, v in EXACT_MEMORY_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


WARM_ENV = "CVE_WARM"  # "1" in an instance forked from the resident worker (worker.py)
RANK_NAME = "cve-rank{}"  # the process name of a spawned or forked rank (``ps``, /proc/PID/comm)


def _die_with_parent(rank: int) -> None:
    """Ask Linux to SIGKILL this rank when the launching process dies, however it dies (a killed
    ``abcrown`` must not leave ranks running), and name the process ``cve-rankN``.  Elsewhere a no-op;
    the parent's own cleanup remains."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, RANK_NAME.format(rank).encode()[:15], 0, 0, 0)  # PR_SET_NAME
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the call above took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    backend: str,
    addr: str,
    port: int,
    timeout_s: float,
    conn: Connection,
) -> None:
    """Body of a spawned rank: join, run, send ``("ok", pickled result | None)`` or ``("error", ...)``."""
    _die_with_parent(rank)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a forked rank inherits the command's handlers
        signal.signal(sig, signal.SIG_DFL)
    try:
        comm.init(backend, rank, world_size, addr, port, timeout_s)
        if world_size > 1:  # every rank's mesh complete before any rank may fail and end the run (a
            torch.distributed.barrier()  # peer still connecting logged gloo's "connectFullMesh failed")
        conn.send(("joined",))
        result = fn(*args)
        message: tuple = ("ok", pickle.dumps(result, pickle.HIGHEST_PROTOCOL) if rank == 0 else None)
    except UserError as exc:  # the user's mistake: the parent raises it as such (one line, no traceback)
        message = ("user", str(exc), time.time())
    except BaseException as exc:  # everything, KeyboardInterrupt included, goes back to the parent
        if _is_lost_peer(exc):
            message = ("lost", _first_line(exc), time.time())
        else:
            message = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), time.time())
    conn.send(message)
    conn.close()
    if message[0] == "ok":
        comm.shutdown()


def _run_spawned(
    fn: Callable[..., T],
    world_size: int,
    args: tuple,
    backend: str,
    timeout_s: float,
    exact_memory: bool,
    method: str = "spawn",
) -> T:
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise UserError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else _free_port(addr)
    ctx = mp.get_context(method)
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        with _child_environment() if exact_memory else contextlib.nullcontext():
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                child_args = (rank, world_size, fn, args, backend, addr, port, timeout_s, send)
                proc = ctx.Process(target=_child, args=child_args, name=f"rank{rank}")
                proc.start()
                send.close()  # the child holds the write end now
                procs.append(proc)
                conns.append(recv)
        payload = _collect(procs, conns)
        _join(procs, _FINISH_S)  # let the ranks finish their shutdown
        return pickle.loads(payload)
    finally:
        _reap(procs)
        for c in conns:
            c.close()


def _poll(rank: int, proc: Any, conn: Connection) -> tuple[str, Any] | None:
    """One look at a child: ``("ok", payload)``, ``("failed", _Failure)`` or None (still running)."""
    alive = proc.is_alive()  # before the poll: a child that exits has finished sending
    message = None
    if conn.poll():
        with contextlib.suppress(EOFError, OSError):
            message = conn.recv()
    if message is not None and message[0] == "joined":
        return "joined", None
    if message is not None and message[0] == "ok":
        return "ok", message[1]
    if message is not None and message[0] == "user":
        return "failed", _Failure(rank, f"failed: {message[1]}", when=message[2], user=message[1])
    if message is not None and message[0] == "lost":
        reason = f"lost a peer rank (it died or hung): {message[1]}"
        return "failed", _Failure(rank, reason, when=message[2], lost=True)
    if message is not None:
        _, summary, details, when = message
        return "failed", _Failure(rank, f"failed: {summary}", details, when=when)
    if alive:
        return None
    code = proc.exitcode
    reason = f"died (signal {-code})" if code is not None and code < 0 else f"died (exit code {code})"
    return "failed", _Failure(rank, reason, died=True)


def start_limit_s(world_size: int) -> float:
    """How long the ranks get to start and join the group: generous (imports on a loaded machine),
    but never a hang."""
    return 60.0 + 5.0 * world_size


def _collect(procs: list[Any], conns: list[Connection]) -> bytes:
    """Wait until every rank reported success (return rank 0's pickled result) or one failed (raise);
    a rank that has not joined the group within ``start_limit_s`` fails too."""
    pending = set(range(len(procs)))
    joined: set[int] = set()
    start_deadline = time.monotonic() + start_limit_s(len(procs))
    payload: bytes | None = None
    while pending:
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=_POLL_S)
        if len(joined) < len(procs) and time.monotonic() > start_deadline:
            late = min(set(range(len(procs))) - joined)
            limit = start_limit_s(len(procs))
            reason = f"did not start and join the group within {limit:.0f} s (too many ranks here?)"
            _raise_root_cause(_Failure(late, reason), procs, conns, pending - {late})
        for rank in sorted(pending):
            seen = _poll(rank, procs[rank], conns[rank])
            while seen is not None and seen[0] == "joined":
                joined.add(rank)
                seen = _poll(rank, procs[rank], conns[rank])
            if seen is None:
                continue
            joined.add(rank)
            if seen[0] == "failed":
                _raise_root_cause(seen[1], procs, conns, pending - {rank})
            pending.discard(rank)
            payload = seen[1] if rank == 0 else payload
    assert payload is not None
    return payload


def _raise_root_cause(first: _Failure, procs: list[Any], conns: list[Connection], others: set[int]) -> None:
    """Give the other ranks a moment to report, then raise the most likely root cause."""
    failures = [first]
    deadline = time.monotonic() + _GRACE_S
    while others and time.monotonic() < deadline:
        wait([conns[r] for r in others] + [procs[r].sentinel for r in others], timeout=0.1)
        for rank in sorted(others):
            seen = _poll(rank, procs[rank], conns[rank])
            if seen is not None and seen[0] != "joined":  # a rank that only joined may still fail
                others.discard(rank)
                if seen[0] == "failed":
                    failures.append(seen[1])
    if all(f.lost for f in failures):  # every report is collateral: blame a rank that stays silent
        silent = [r for r in sorted(others) if procs[r].is_alive()]
        if silent:
            failures.append(_Failure(silent[0], "stopped responding (a collective waited for it in vain)"))
    root = min(failures, key=lambda f: (not f.died, f.lost, f.when, f.rank))
    if root.user is not None and not any(f.died for f in failures):
        raise UserError(root.user)
    raise RankFailure(root, sorted(failures, key=lambda f: f.rank))


def _join(procs: list[Any], timeout_s: float) -> None:
    """Join every child, all within ``timeout_s`` together."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def _reap(procs: list[Any]) -> None:
    """Terminate (then kill) every child that is still running, and join them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join(procs, _STOP_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=_STOP_S)
