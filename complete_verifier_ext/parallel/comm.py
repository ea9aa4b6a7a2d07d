"""Collective helpers: the only module of the project that calls ``torch.distributed``.

Three layers, in the order of this file:

1. group state (``init``, ``init_from_env``, ``shutdown``, ``rank``, ``world_size``, ``device``) and
   ``shard_range``, the one rule that says which rows a rank owns;
2. plain helpers (``all_gather_cat``, ``all_reduce``, ``all_reduce_flag``, ``broadcast``,
   ``broadcast_object``, ``ring_pass``, ``ring_pass_start``, ``barrier``), no autograd;
3. autograd-aware helpers: ``all_gather_cat_grad`` (backward: a reduce-scatter),
   ``all_gather_cat_same_loss`` and ``reduce_grad``.

Every helper returns its input (or the identity result) when the world size is 1 or no process group
is initialised, so one process runs exactly the code path the sharded runs are compared against.

Process groups: every collective, ``rank``, ``world_size``, ``shard_range`` and ``shard_sizes`` take an
optional keyword ``group`` (a ``torch.distributed`` group made by ``dist.new_group``); ``None``, the
default, is the default (world) group, as in Megatron-LM. Ranks, sizes and ``src`` are then those of
the group (rank ``src`` of ``group``, the ring ``rank +- 1`` within it), so that a TP x domain layout
can run each kind of collective in its own group. Only the group's members may call a helper with it,
and a group of one rank is a no-op like world size 1.

Every collective is counted in ``stats()`` (per name: calls and bytes this rank contributed). Names:
``all_gather``, ``all_gather_sizes`` (the size exchange of ``all_gather_cat`` when the caller does not
pass ``sizes``), ``all_reduce``, ``reduce_scatter`` (the backward of ``all_gather_cat_grad``),
``all_reduce_flag``, ``broadcast``, ``broadcast_object``,
``ring_pass``, ``ring_pass_shape`` (the shape exchange of ``ring_pass`` when ``recv_shape`` is not
given), ``exchange`` (point-to-point sends of :func:`exchange`) and ``barrier``. Nothing is counted at
world size 1.

Lockstep rule: every rank (of the group) must call the same helpers in the same order with the same
``sizes`` / ``recv_shape`` arguments (sizes are global knowledge, e.g. from ``shard_range``), whatever its
data. Helpers skip a transfer only on conditions every rank sees identically (e.g. all blocks empty).

``issued()`` counts the helpers this process called (a helper that calls another is one). A rank that
left a pass midway (out of memory) ends it with the others by running it again over a dummy row
inside ``replaying(n)``: the n helpers it called already are not called again but stood in for by a
result of their shape (``oom.lockstep_on_oom``), or, for a decision (``all_reduce_flag``, an
``all_reduce`` of at most ``DECISION_NUMEL`` elements: a vote, a stop), by the very result it had, so
that the replay takes the branches the pass took.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import replay
from .group import (
    backend,
    communicates,
    device,
    group_rank,
    init,
    init_from_env,
    is_solo,
    lockstep,
    rank,
    resolve_backend,
    shutdown,
    solo,
    world_size,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "init",
    "init_from_env",
    "shutdown",
    "rank",
    "world_size",
    "device",
    "backend",
    "resolve_backend",
    "shard_range",
    "shard_sizes",
    "all_gather_cat",
    "all_gather_into",
    "all_gather_cat_grad",
    "reduce_grad",
    "all_reduce",
    "all_reduce_flag",
    "broadcast",
    "broadcast_object",
    "ring_pass",
    "ring_pass_start",
    "RingPass",
    "exchange",
    "barrier",
    "stats",
    "reset_stats",
    "issued",
    "replaying",
    "NotReplayable",
    "solo",
    "is_solo",
    "lockstep",
]

_REDUCE_OPS = MappingProxyType({"sum": "SUM", "max": "MAX", "min": "MIN"})


issued, replaying, NotReplayable = replay.issued, replay.replaying, replay.NotReplayable
_counted = functools.partial(replay.counted, parallel=communicates)


def _not_replayable(name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotReplayable(f"{name}: its result depends on the other ranks' data; cannot replay it")

    return stand_in


def _gathered_like(t: Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None, **_: Any) -> Tensor:
    """The shape of ``all_gather_cat(t, dim, sizes=sizes)`` (zeros)."""
    if sizes is None:
        raise NotReplayable("all_gather_cat without sizes: cannot replay it")
    shape = list(t.shape)
    shape[dim % t.dim()] = sum(sizes)
    return t.new_zeros(shape)


def _received_like(t: Tensor, recv_shape: Sequence[int] | None = None, **_: Any) -> RingPass:
    if recv_shape is None:
        raise NotReplayable("ring_pass_start without recv_shape: cannot replay it")
    return RingPass(t.new_empty(recv_shape), [])


def _global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The world rank of rank ``group_rank`` of ``group`` (itself for the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def shard_range(
    n: int, rank: int | None = None, world: int | None = None, *, group: ProcessGroup | None = None
) -> tuple[int, int]:
    """Rows ``[r*n//P, (r+1)*n//P)`` owned by rank ``r`` of ``P``; contiguous, ordered, may be empty.

    ``r`` and ``P`` default to this process's rank in ``group`` and the group's size.
    """
    r = group_rank(group) if rank is None else rank
    p = world_size(group) if world is None else world
    return r * n // p, (r + 1) * n // p


def shard_sizes(n: int, world: int | None = None, *, group: ProcessGroup | None = None) -> list[int]:
    """Number of rows of every rank under ``shard_range`` (``world`` defaults to ``group``'s size)."""
    p = world_size(group) if world is None else world
    return [(q + 1) * n // p - q * n // p for q in range(p)]


# ----------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, name: str, nbytes: int) -> None:
        entry = self.counts.setdefault(name, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += int(nbytes)


_STATS = _Stats()


def stats() -> dict[str, dict[str, int]]:
    """Per collective name ``{"calls": n, "bytes": b}`` since the last ``reset_stats`` (a copy).

    ``bytes`` counts what this rank contributed (its padded block, its reduced tensor, the padded full
    tensor it reduce-scatters, what it sent).
    """
    return {name: dict(entry) for name, entry in _STATS.counts.items()}


def reset_stats() -> None:
    """Forget all counts."""
    _STATS.counts.clear()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------------------------------------
# Plain collectives (no autograd)
# ----------------------------------------------------------------------------------------------------------


def _all_gather_flat(out: Tensor, block: Tensor, group: ProcessGroup | None = None) -> None:
    """All-gather equal-size contiguous ``block`` of every rank of ``group`` into ``out`` (P * numel)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, block, group=group)


@_counted(lambda out, block, **_: out)
def all_gather_into(out: Tensor, block: Tensor, *, group: ProcessGroup | None = None) -> Tensor:
    """All-gather equal-size blocks: ``out`` (P * block.numel() elements, contiguous) receives every
    rank's ``block`` in rank order. No autograd; returns ``out``. One ``all_gather``.

    For callers that own a reusable receive buffer (``ShardedWeight.gathered``).
    """
    if not communicates(group):
        return out.copy_(block.reshape(out.shape))
    _STATS.add("all_gather", _nbytes(block))
    _gather_into(out, block.contiguous(), group)
    return out


_RING_MIN_BYTES = 1 << 20  # from this block size on, gloo's staging copy is worth avoiding


def _gather_into(out: Tensor, block: Tensor, group: ProcessGroup | None = None) -> None:
    """:func:`_all_gather_flat`, but on gloo, whose all-gather stages the result in a temporary as large
    as ``out``, a block of 1 MiB or more goes round the ring straight into ``out``."""
    if backend(group) == "gloo" and _nbytes(block) >= _RING_MIN_BYTES:
        _ring_gather_into(out.view(-1), block.view(-1), group)
    else:
        _all_gather_flat(out, block, group)


def _ring_gather_into(out: Tensor, block: Tensor, group: ProcessGroup | None = None) -> None:
    """``out`` (flat, P blocks) receives every rank's ``block`` straight into its place: the own block
    copied, then P - 1 ring steps (pass block r - k to rank + 1, receive block r - k - 1 from rank - 1),
    so that nothing beside ``out`` is allocated."""
    p, r = world_size(group), group_rank(group)
    blocks = out.view(p, -1)
    blocks[r].copy_(block)
    for k in range(p - 1):
        _p2p(blocks[(r - k) % p], blocks[(r - k - 1) % p], group).wait()


def _exchange_sizes(n_local: int, dev: torch.device, group: ProcessGroup | None = None) -> list[int]:
    """Every rank's ``n_local`` (one small all-gather, counted as ``all_gather_sizes``)."""
    mine = torch.tensor([n_local], dtype=torch.int64, device=dev)
    out = torch.empty(world_size(group), dtype=torch.int64, device=dev)
    _STATS.add("all_gather_sizes", _nbytes(mine))
    _all_gather_flat(out, mine, group)
    return [int(v) for v in out.tolist()]


def _gather_dim0(block: Tensor, sizes: Sequence[int], group: ProcessGroup | None = None) -> Tensor:
    """Concatenate every rank's ``block`` (n_r, *rest) along dim 0; blocks padded to the largest size."""
    p, most = len(sizes), max(sizes)
    rest = block.shape[1:]
    if most == 0:
        return block.new_empty((0, *rest))
    if block.shape[0] < most:
        pad = block.new_zeros((most - block.shape[0], *rest))
        block = torch.cat([block, pad], 0)
    block = block.contiguous()
    out = block.new_empty((p * most, *rest))  # (P*m, *rest)
    _STATS.add("all_gather", _nbytes(block))
    _gather_into(out, block, group)
    if all(s == most for s in sizes):
        return out
    return torch.cat([out[q * most : q * most + s] for q, s in enumerate(sizes)], 0)


@_counted(_gathered_like)
def all_gather_cat(
    t: Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None, group: ProcessGroup | None = None
) -> Tensor:
    """Concatenate every rank's ``t`` along ``dim``: (.., n_r, ..) -> (.., sum_r n_r, ..). No autograd.

    Blocks may differ in size along ``dim`` (zero included); all other dims must be equal. Pass
    ``sizes`` (every rank's size along ``dim``, identical on all ranks) to skip the size exchange; without
    it one small extra all-gather (``all_gather_sizes``) learns them. Cost: one ``all_gather`` of the
    largest block, none when every block is empty. The result is bitwise the blocks' values.

    Not autograd-aware: at P > 1 the result is detached, while at P = 1 ``t`` itself comes back with
    its graph. Where gradients must flow, use ``all_gather_cat_grad`` so that P = 1 and P > 1 agree.
    """
    if not communicates(group):
        return t
    dim = dim % t.dim()
    p, r = world_size(group), group_rank(group)
    if sizes is None:
        sizes = _exchange_sizes(t.shape[dim], t.device, group)
    elif len(sizes) != p or sizes[r] != t.shape[dim]:
        raise ValueError(f"sizes {list(sizes)} do not match world size {p} / local {t.shape[dim]}")
    with torch.no_grad():
        full = _gather_dim0(t.movedim(dim, 0), sizes, group)  # (sum n_r, *rest)
    return full.movedim(0, dim).contiguous()


def _reduce_scatter_dim0(full: Tensor, sizes: Sequence[int], group: ProcessGroup | None = None) -> Tensor:
    """This rank's block (n_r, *rest) of the sum over ranks of ``full`` (sum n_r, *rest), whose blocks
    are in rank order: one reduce-scatter, the blocks padded to the largest one and narrowed after."""
    p, most, me = len(sizes), max(sizes), group_rank(group)
    rest = full.shape[1:]
    if most == 0:
        return full.new_zeros((0, *rest))
    if all(s == most for s in sizes):
        padded = full.contiguous()
    else:
        padded = full.new_zeros((p * most, *rest))  # (P*m, *rest)
        for q, (start, size) in enumerate(zip(_starts(sizes), sizes, strict=True)):
            padded[q * most : q * most + size] = full[start : start + size]
    out = full.new_empty((most, *rest))
    _STATS.add("reduce_scatter", _nbytes(padded))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, padded, group=group)
    return out[: sizes[me]]


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each block begins in the concatenation of blocks of ``sizes``."""
    return [sum(sizes[:q]) for q in range(len(sizes))]


@_counted(lambda t, op="sum", **_: t.detach().clone(), lambda t, *_, **__: t.numel() <= replay.DECISION_NUMEL)
def all_reduce(t: Tensor, op: str = "sum", *, group: ProcessGroup | None = None) -> Tensor:
    """Element-wise reduction over ranks (``"sum"``, ``"max"``, ``"min"``); out of place, no autograd."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_REDUCE_OPS)}")
    if not communicates(group):
        return t
    out = t.detach().clone().contiguous()
    _STATS.add("all_reduce", _nbytes(out))
    dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]), group=group)
    return out


@_counted(_not_replayable("all_reduce_flag"), lambda *_, **__: True)
def all_reduce_flag(flag: bool, op: str = "or", *, group: ProcessGroup | None = None) -> bool:
    """Collective decision: logical ``"or"`` / ``"and"`` of every rank's ``flag``."""
    if op not in ("or", "and"):
        raise ValueError(f"unknown flag op {op!r}; expected 'or' or 'and'")
    if not communicates(group):
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=device())
    _STATS.add("all_reduce_flag", _nbytes(t))
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "or" else dist.ReduceOp.MIN, group=group)
    return bool(t.item())


@_counted(lambda t, src=0, **_: t.detach().clone())
def broadcast(t: Tensor, src: int = 0, *, group: ProcessGroup | None = None) -> Tensor:
    """Rank ``src``'s ``t`` (``src`` is a rank of ``group``) on every rank. Every rank passes a tensor of
    the same shape and dtype.

    Out of place on receivers (a new tensor); ``src`` gets its own ``t`` back.
    """
    if not communicates(group):
        return t
    if group_rank(group) == src:
        buf = t.detach().contiguous()
    else:
        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    _STATS.add("broadcast", _nbytes(buf))
    dist.broadcast(buf, src=_global_rank(group, src), group=group)
    return buf


@_counted(_not_replayable("broadcast_object"))
def broadcast_object(obj: Any, src: int = 0, *, group: ProcessGroup | None = None) -> Any:
    """Rank ``src``'s (of ``group``) picklable ``obj`` on every rank (others pass anything, e.g. None)."""
    if not communicates(group):
        return obj
    box = [obj]
    _STATS.add("broadcast_object", 0)
    dist.broadcast_object_list(box, src=_global_rank(group, src), group=group)
    return box[0]


@_counted(_not_replayable("all_gather_object"))
def all_gather_object(obj: Any, *, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if not communicates(group):
        return [obj]
    out: list[Any] = [None] * world_size(group)
    _STATS.add("all_gather_object", 0)
    dist.all_gather_object(out, obj, group=group)
    return out


_PATIENT = iter(range(1 << 62))  # one store key per patient wait, the same sequence on every rank


@_counted(_not_replayable("wait_patiently"))
def wait_patiently(poll_s: float = 0.02) -> None:
    """Wait, however long it takes, until every rank of the default group has called this (the same
    number of times): for the end of rank-local work of very unequal length (a rank's share of MIP
    solves, work done on rank 0 alone), which a collective would time out on. Polls the group's
    store (no collective, so no collective timeout); a rank that dies ends the run through the
    launcher. Follow it with the collective that exchanges the results."""
    if not communicates(None):
        return
    import time

    _STATS.add("wait_patiently", 0)
    store = dist.distributed_c10d._get_default_store()
    key = f"cve/patient/{next(_PATIENT)}"
    store.add(key, 1)
    while store.add(key, 0) < world_size():
        time.sleep(poll_s)


def from_rank0(compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0 alone, as a single process (:func:`solo`), while the other ranks wait
    however long it takes (:func:`wait_patiently`); its result, broadcast, is every rank's. For work
    that is not split (and must need nothing from the other ranks)."""
    result = None
    if rank() == 0:
        with solo():
            result = compute()
    wait_patiently()
    return broadcast_object(result, 0)


@_counted(lambda **_: None)
def barrier(*, group: ProcessGroup | None = None) -> None:
    """Wait for every rank."""
    if not communicates(group):
        return
    _STATS.add("barrier", 0)
    dist.barrier(group=group)


@dataclass
class RingPass:
    """An in-flight ring exchange; ``wait()`` returns the tensor received from rank - 1."""

    received: Tensor
    works: list[Any]

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        return self.received


def _ring_shape(t: Tensor, group: ProcessGroup | None = None) -> torch.Size:
    """Shape of the tensor that rank - 1 is passing (one small ring exchange, ``ring_pass_shape``)."""
    shape = torch.tensor(t.shape, dtype=torch.int64, device=t.device)
    _STATS.add("ring_pass_shape", _nbytes(shape))
    return torch.Size(_p2p(shape, torch.empty_like(shape), group).wait().tolist())


def _p2p(send: Tensor, recv: Tensor, group: ProcessGroup | None = None, shift: int = 1) -> RingPass:
    """Post send of ``send`` to rank + shift and receive into ``recv`` from rank - shift of ``group``
    (empty tensors skipped)."""
    p, r = world_size(group), group_rank(group)
    ops = []
    if send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, _global_rank(group, (r + shift) % p), group))
    if recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, _global_rank(group, (r - shift) % p), group))
    works = dist.batch_isend_irecv(ops) if ops else []
    return RingPass(recv, list(works))


@_counted(_received_like)
def ring_pass_start(
    t: Tensor, recv_shape: Sequence[int] | None = None, *, group: ProcessGroup | None = None
) -> RingPass:
    """Start sending ``t`` to rank + 1 and receiving rank - 1's tensor; returns a handle to ``wait()`` on.

    ``recv_shape`` (shape of the incoming tensor, same dtype) skips the shape exchange; without it one
    small extra ring exchange (``ring_pass_shape``) learns it. Keep ``t`` alive and unmodified until
    ``wait()`` returns. At world size 1 the handle returns ``t``.
    """
    if not communicates(group):
        return RingPass(t, [])
    send = t.detach().contiguous()
    shape = torch.Size(recv_shape) if recv_shape is not None else _ring_shape(send, group)
    recv = torch.empty(shape, dtype=send.dtype, device=send.device)
    _STATS.add("ring_pass", _nbytes(send))
    return _p2p(send, recv, group)


@_counted(lambda send, recv, k, **_: recv)
def shard_pass(send: Tensor, recv: Tensor, k: int, *, group: ProcessGroup | None = None) -> Tensor:
    """Step ``k`` (1 .. P-1) of passing every rank's resident shard to every other: send ``send`` to
    rank + k, receive rank - k's into ``recv`` (a buffer the caller may reuse from step to step; empty
    tensors are skipped). Waits; returns ``recv``."""
    if not communicates(group):
        return recv.copy_(send)
    _STATS.add("shard_pass", _nbytes(send))
    return _p2p(send.contiguous(), recv, group, shift=k).wait()


def ring_pass(
    t: Tensor, recv_shape: Sequence[int] | None = None, *, group: ProcessGroup | None = None
) -> Tensor:
    """Send ``t`` to rank + 1, return what rank - 1 sent (shapes may differ). No autograd."""
    return ring_pass_start(t, recv_shape, group=group).wait()


@_counted(lambda sends, recvs, **_: None)
def exchange(
    sends: Sequence[tuple[int, Tensor]],
    recvs: Sequence[tuple[int, Tensor]],
    *,
    group: ProcessGroup | None = None,
) -> None:
    """Point-to-point: send each ``(dst, tensor)`` and receive into each ``(src, buffer)`` (ranks of
    ``group``), all posted at once and waited for. Every pair must be matched by the peer's call (the
    caller derives both sides from knowledge every rank shares, e.g. an all-gathered request list);
    messages between the same two ranks pair up in the order given."""
    if not communicates(group):
        return
    ops = []
    for dst, t in sends:
        t = t.detach().contiguous()
        _STATS.add("exchange", _nbytes(t))
        ops.append(dist.P2POp(dist.isend, t, _global_rank(group, dst), group))
    ops += [dist.P2POp(dist.irecv, buf, _global_rank(group, src), group) for src, buf in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


# ----------------------------------------------------------------------------------------------------------
# Autograd-aware gather
# ----------------------------------------------------------------------------------------------------------


class _GatherCatGrad(torch.autograd.Function):
    """Forward: all-gather-cat along ``dim``. Backward: reduce-scatter (SUM) of the full gradient, so
    that each rank receives only its own block, summed.

    Each rank's loss may depend on the whole gathered tensor, so the gradient of the total objective
    (the sum of every rank's loss) wrt this rank's block is the sum over ranks of the block's slice.
    A reduce-scatter moves half the bytes of an all-reduce of the whole gradient followed by a narrow
    to the own block, and gives the same values up to the order of the sum over ranks (bitwise at
    P = 2; at P >= 3 neither collective adds the ranks in a fixed order).
    """

    @staticmethod
    def forward(ctx: Any, t: Tensor, dim: int, sizes: list[int], group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return all_gather_cat(t, dim, sizes=sizes, group=group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        with torch.no_grad():
            mine = _reduce_scatter_dim0(grad.movedim(ctx.dim, 0), ctx.sizes, ctx.group)  # (n_r, *rest)
        return mine.movedim(0, ctx.dim), None, None, None


def _sizes_along(t: Tensor, dim: int, sizes: Sequence[int] | None, group: ProcessGroup | None) -> list[int]:
    """``sizes`` as a list, or every rank's size of ``t`` along ``dim`` from one exchange."""
    return list(sizes) if sizes is not None else _exchange_sizes(t.shape[dim], t.device, group)


@_counted(_gathered_like)
def all_gather_cat_grad(
    t: Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None, group: ProcessGroup | None = None
) -> Tensor:
    """``all_gather_cat`` with autograd: backward = one ``reduce_scatter`` (SUM) of the full gradient,
    padded to the largest block (none when every block is empty).

    Gradient convention (see the package docstring): the objective is the SUM over ranks of each rank's
    loss; the gradient delivered to ``t`` is that objective's gradient wrt this rank's block. Every rank
    must run backward through this node (lockstep), even if its loss ignores the result.
    """
    if not communicates(group):
        return t
    dim = dim % t.dim()
    return _GatherCatGrad.apply(t, dim, _sizes_along(t, dim, sizes, group), group)


class _GatherCatSameLoss(torch.autograd.Function):
    """Forward: all-gather-cat along ``dim``. Backward: this rank's block of the gradient, no
    communication (Megatron's "gather from region": every rank computes the same loss)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, dim: int, sizes: list[int], group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, group_rank(group)
        return all_gather_cat(t, dim, sizes=sizes, group=group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        start = sum(ctx.sizes[: ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[ctx.rank]), None, None, None


@_counted(_gathered_like)
def all_gather_cat_same_loss(
    t: Tensor, dim: int = 0, *, sizes: Sequence[int] | None = None, group: ProcessGroup | None = None
) -> Tensor:
    """``all_gather_cat`` with autograd for a loss that every rank computes identically from the result
    (a replicated attack): backward keeps the rank's own block of the gradient. Pair it with
    :func:`reduce_grad` on the replicated input of a column-parallel layer."""
    if not communicates(group):
        return t
    dim = dim % t.dim()
    return _GatherCatSameLoss.apply(t, dim, _sizes_along(t, dim, sizes, group), group)


class _ReduceGrad(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (SUM) of the gradient (Megatron's "copy to region")."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce(grad.contiguous(), "sum", group=ctx.group), None


@_counted(lambda t, **_: t)
def reduce_grad(t: Tensor, *, group: ProcessGroup | None = None) -> Tensor:
    """Mark a replicated tensor whose gradient every rank needs in full.

    A column-parallel layer gives each rank only its own block's part of the gradient wrt its
    (replicated) input; wrapping that input here sums the parts in backward, so every rank sees the
    same, complete gradient (e.g. PGD's input, which must stay identical on all ranks)."""
    if not communicates(group) or not t.requires_grad:
        return t
    return _ReduceGrad.apply(t, group)
