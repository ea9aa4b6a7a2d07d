"""The process group of this rank: starting and ending it, who this rank is, whether a collective
communicates (world size above 1, outside :func:`solo`, and, inside :mod:`.serve`'s serving, only in
its request ticks: :func:`lockstep`). With :mod:`.comm` (which re-exports its public names) the only
modules that call ``torch.distributed``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def resolve_backend(backend: str, ranks_per_host: int = 1) -> str:
    """``"auto"`` -> ``"nccl"`` when CUDA has a GPU for each of this host's ranks, else ``"gloo"``.

    Other names pass through unchanged.
    """
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if gpus >= max(1, ranks_per_host) else "gloo"
    return backend


def init(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 30.0,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> None:
    """Join (create) the default process group over TCP at ``master_addr:master_port``.

    At ``world_size == 1`` no group is created: every helper is then a no-op.
    With NCCL the rank's GPU (``local_rank``, default ``rank`` modulo the GPU count) becomes the
    current device. ``auto`` resolves with ``local_world_size`` ranks on this host (default all).
    ``timeout_s`` bounds every collective: a backstop against a dead peer.
    """
    backend = resolve_backend(backend, local_world_size or world_size)
    if world_size <= 1:
        return
    if backend == "nccl":
        gpu = local_rank if local_rank is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_from_env(backend: str = "auto", timeout_s: float = 30.0) -> None:
    """Join the group described by torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
    LOCAL_WORLD_SIZE."""
    env = os.environ
    local = env.get("LOCAL_RANK")
    local_world = env.get("LOCAL_WORLD_SIZE")
    init(
        backend,
        int(env["RANK"]),
        int(env["WORLD_SIZE"]),
        env.get("MASTER_ADDR", "127.0.0.1"),
        int(env.get("MASTER_PORT", "29500")),
        timeout_s,
        local_rank=int(local) if local is not None else None,
        local_world_size=int(local_world) if local_world is not None else None,
    )


def shutdown() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if active():
        dist.destroy_process_group()


_solo = False  # inside solo(): this rank computes alone, as a single process


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and not _solo


@contextmanager
def solo() -> Iterator[None]:
    """This rank computes alone while inside, as if it were the only process (rank 0 of 1: every
    collective a no-op), e.g. rank 0 running a search phase that cannot be split while the others wait
    (:func:`wait_patiently`). What it computes must need nothing from the other ranks."""
    global _solo
    before, _solo = _solo, True
    try:
        yield
    finally:
        _solo = before


def is_solo() -> bool:
    return _solo


def group_rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if active() else 0


def rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world; 0 without a process group)."""
    return group_rank(group)


def world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks of ``group`` (default: the world; 1 without a process group)."""
    return dist.get_world_size(group) if active() else 1


def backend(group: ProcessGroup | None = None) -> str | None:
    """Backend name of ``group`` (default: the world's), or None without a process group."""
    return str(dist.get_backend(group)) if active() else None


def device() -> torch.device:
    """Device that this rank's tensors (and collective buffers) live on: its GPU under NCCL, else CPU."""
    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_lockstep = True  # False inside serve.serving() outside its own request ticks


def communicates(group: ProcessGroup | None = None) -> bool:
    """True when ``group`` has more than one rank, i.e. a collective over it moves data. Every
    collective asks this first; with the ranks out of lockstep (``serve.serving()``) it raises instead
    of letting the collective pair up with whatever another rank calls."""
    if not (active() and dist.get_world_size(group) > 1):
        return False
    if not _lockstep:
        raise RuntimeError(
            "a collective was called while the ranks run different work (inside parallel.serve.serving(), "
            "where only weight requests may communicate)"
        )
    return True


@contextmanager
def lockstep(on: bool) -> Iterator[None]:
    """Whether collectives may run (for :mod:`.serve`: off inside ``serving()``, on inside a tick)."""
    global _lockstep
    before, _lockstep = _lockstep, on
    try:
        yield
    finally:
        _lockstep = before
