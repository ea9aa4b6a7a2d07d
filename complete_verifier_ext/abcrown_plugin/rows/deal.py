"""Which rank bounds which row of a start node, and the passes every rank runs in lockstep.

auto_LiRPA bounds the unstable neurons of a layer in one pass, or in passes of ``solver.crown.batch_size``
rows when there are more. At P > 1 each rank bounds its own rows (:func:`start_owners`: a contiguous
block of about U / P of them, or whole channels where the start node's α is shared by a channel's
rows), in k passes of at most ``crown.batch_size`` rows, k the same on every rank: a rank with fewer
rows runs one-row dummy passes (:data:`DUMMY`, dropped), so that every rank issues the same
collectives under FSDP and TP (:func:`in_lockstep`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...parallel import comm, oom
from ..run import Rows


def unstable_size(idx) -> int:
    return int(idx[0].numel() if isinstance(idx, tuple) else idx.numel())


def rows_at(idx, positions: Tensor):
    return tuple(u[positions] for u in idx) if isinstance(idx, tuple) else idx[positions]


def flat_positions(idx, shape) -> Tensor:
    """Neuron indices as ``get_unstable_locations`` lists them (a ``(c, h, w)`` tuple, or flat) ->
    flat positions in a node of ``shape`` (without the batch)."""
    if not isinstance(idx, tuple):
        return idx
    flat = torch.zeros_like(idx[0])
    for u, n in zip(idx, shape, strict=True):
        flat = flat * int(n) + u
    return flat


def even_blocks(U: int, world: int | None = None) -> Tensor:
    """The rank of each of U rows dealt in contiguous blocks of ⌊U / P⌋ or ⌈U / P⌉."""
    sizes = comm.shard_sizes(U, world)
    return torch.cat([torch.full((n,), q, dtype=torch.long) for q, n in enumerate(sizes)])


def channel_blocks(channels: Tensor, n_channels: int, world: int | None = None) -> Tensor:
    """The rank of each channel when the rows (their channels ``channels``, sorted) are dealt whole
    channels at a time in contiguous blocks of about U / P rows each."""
    P = comm.world_size() if world is None else world
    counts = torch.bincount(channels.cpu(), minlength=n_channels).double()
    before = counts.cumsum(0) - counts  # rows of the channels before each one
    middle = (before + counts / 2) * P / max(1.0, float(counts.sum()))
    return middle.floor().long().clamp(0, P - 1)


def passes_per_rank(counts: list[int], batch: int) -> int:
    """The passes every rank runs: enough for the largest share in passes of at most ``batch`` rows."""
    return max(1, max(-(-n // max(1, batch)) for n in counts))


DUMMY = torch.full((1,), -1, dtype=torch.long)
"""A pass of no real row (one row bounded and dropped: the same collectives as any pass)."""


def split_passes(rows: Tensor, k: int) -> list[Tensor]:
    """A rank's rows in ``k`` passes of near-equal size (an empty one: a one-row dummy, ``-1``)."""
    return [part if part.numel() else DUMMY for part in torch.tensor_split(rows, k)]


def in_lockstep(state: Rows, name: str, parts: list[Tensor], one_pass, unit: int = 1) -> list:
    """``one_pass(part)`` (the pass's bounds, ...) over this rank's passes ``parts`` (each a tensor of
    row positions, or of channels, ``unit`` rows each; -1 a dummy), in lockstep with the other ranks'
    passes. A pass that runs out of memory on any rank runs again on every rank as two passes of half
    its positions, and so does each pass after it (:func:`.oom.lockstep_on_oom`; a dummy splits
    into two dummies, so every rank runs as many passes); the layer's later bounds take passes of at
    most half the rows of the largest pass that failed (``state.fits``, in rows). Returns what every
    pass returned, in ``parts``' order."""

    def failed(n: int) -> None:
        state.fits[name] = max(1, min(state.fits.get(name, n * unit), n * unit // 2))

    return oom.passes_in_lockstep(
        parts, one_pass, lambda: one_pass(DUMMY), lambda part: int((part >= 0).sum()),
        lambda part: split_passes(part[part >= 0], 2), name, "rows" if unit == 1 else "channels", failed,
    )  # fmt: skip


def start_owners(state: Rows, module, node, dense: bool = False) -> Tensor:
    """The rank of every neuron (flat position) of start node ``node``: whole channels where α is per
    channel (auto_LiRPA's rule of ``get_alpha_crown_start_nodes``; a stable neuron, bounded where
    auto_LiRPA bounds every neuron, uses its channel's α), else contiguous blocks of the unstable
    neurons (of every neuron where the node does not feed a ReLU alone, :func:`_feeds_relu`), -1 for
    the others (then dealt round-robin: their α rows are never trained); ``dense`` (a conv
    start node bounded with dense patches, :func:`_dense_passes`: every neuron a row): contiguous blocks
    of whole channels. Computed from the node's current bounds, the ones auto_LiRPA creates its α from;
    kept in ``state.owners`` while its α is kept by row."""
    kind = start_kind(node)
    conv = kind in ("patches", "sum")
    shape = [int(s) for s in node.output_shape[1:]]
    idx, size = module.get_unstable_locations(node.lower, node.upper, conv=conv)
    flat = flat_positions(idx, shape).cpu()
    if not conv and not _feeds_relu(module, node):  # (auto_LiRPA's α: a row per neuron, every one bounded)
        flat = torch.arange(math.prod(shape))
    owners = torch.full((math.prod(shape),), -1, dtype=torch.long)
    opts = module.bound_opts
    per_channel = conv and (
        not opts.get("use_full_conv_alpha", False) or size > opts.get("use_full_conv_alpha_thresh", 512)
    )
    if dense:
        owners = even_blocks(shape[0]).repeat_interleave(math.prod(shape[1:]))
    elif per_channel:  # every neuron of a channel with the channel (its α row), stable ones too
        of_channel = channel_blocks(idx[0], shape[0])
        owners = of_channel.repeat_interleave(math.prod(shape[1:]))
    else:
        owners[flat] = even_blocks(int(flat.numel()))
    state.owners[node.name] = owners
    return owners


def _feeds_relu(module, node) -> bool:
    """Whether ``node`` feeds a piecewise-linear activation alone, where auto_LiRPA keeps α rows for its
    unstable neurons only (``get_alpha_crown_start_nodes``); a Sigmoid's input has one for every neuron,
    and every one's bound matters."""
    names = node.output_name
    kinds = ("BoundRelu", "BoundSignMerge", "BoundMaxPool")
    return len(names) == 1 and type(module[names[0]]).__name__ in kinds


def owners_of(state: Rows, node, idx) -> Tensor:
    """The rank that bounds each of the rows ``idx``: as :func:`start_owners` laid them out while the
    start node's α is kept by row, else contiguous blocks; rows outside the layout go round-robin."""
    table = state.owners.get(node.name)
    U = unstable_size(idx)
    if table is None:
        return even_blocks(U)
    o = table[flat_positions(idx, [int(s) for s in node.output_shape[1:]]).cpu()]
    extra = (o < 0).nonzero().squeeze(1)
    o[extra] = torch.arange(extra.numel()) % comm.world_size()
    return o


def patches_sum(node) -> bool:
    """A residual sum of conv outputs in patches mode (auto_LiRPA's ``BoundAdd`` / ``BoundSub``), whose
    rows auto_LiRPA bounds in one pass ("Batched CROWN is not supported in this case")."""
    from auto_LiRPA.operators import BoundAdd, BoundSub

    return isinstance(node, (BoundAdd, BoundSub)) and node.mode == "patches" and len(node.output_shape) >= 4


def start_kind(node) -> str:
    """How auto_LiRPA's ``get_sparse_C`` bounds a start node's rows: ``linear`` (one-hot rows),
    ``patches`` (a conv in patches mode), ``sum`` (a residual sum in patches mode) or ``other`` (one-hot
    rows of a dense tensor: a conv in matrix mode, ...)."""
    import os

    from auto_LiRPA.operators import BoundLinear, BoundMatMul

    if isinstance(node, (BoundLinear, BoundMatMul)) and int(os.environ.get("AUTOLIRPA_USE_FULL_C", 0)) == 0:
        return "linear"
    if node.patches_start and node.mode == "patches":
        return "patches"
    return "sum" if patches_sum(node) else "other"


def all_positions(shape: list[int], conv: bool, device) -> Tensor | tuple[Tensor, ...]:
    """Every neuron of a node of ``shape`` (without the batch), as ``get_unstable_locations`` lists
    them: a ``(c, h, w)`` tuple for a conv node, flat indices otherwise."""
    if conv:
        return tuple(torch.ones(shape, dtype=torch.bool, device=device).nonzero().unbind(1))
    return torch.arange(math.prod(shape), device=device)
