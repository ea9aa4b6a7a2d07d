"""Row-sharded A-matrices inside auto_LiRPA: the neurons of the layer being bounded are dealt over the
ranks, so each rank back-substitutes (and holds the A-matrices and autograd state of) only its rows.

auto_LiRPA bounds the unstable neurons of a layer in one pass, or in passes of
``solver.crown.batch_size`` rows when there are more (``BoundedModule.batched_backward``). At P > 1
every intermediate layer goes through passes (:func:`get_sparse_C`), however few its unstable neurons:
certified-trained nets, whose layers have few, are the common case. Each rank bounds its own rows
(:func:`start_owners`: a contiguous block of about U / P of them, or whole channels where the start
node's α is shared by a channel's rows), in k passes of at most ``crown.batch_size`` rows, k the same
on every rank (a rank with fewer rows runs one-row dummy passes, dropped, so that every rank issues the
same collectives under FSDP and TP). The ``(batch, rows)`` bounds are all-gathered and put back in row
order. A row's bound does not depend on the other rows of its pass (each pass's C is the one auto_LiRPA
builds for those rows), so CROWN's bounds are one process's to rounding.

α-CROWN optimises through these bounds, so the gather is differentiable (``all_gather_cat_grad``: its
backward, one reduce-scatter, sums the gradient over the ranks and keeps the rank's block), and the
gradient protocol makes the result that of one process:

* every rank computes the same loss from the same gathered bounds; the bounds that leave
  ``_compute_bounds_main`` carry their gradient on rank 0 alone (a factor 0 elsewhere), so what every
  rank computes identically is counted once in each sum over the ranks, exactly (a factor 1/P on
  every rank is not exact for P = 3);
* the optimiser (``torch.optim.Adam``/``SGD`` as auto_LiRPA's ``optimized_bounds`` sees them) sums
  every parameter's gradient over the ranks before its step (an α kept by row: only its slot 0). The
  parameters stay equal on every rank, and so do all the decisions made from the bounds (early stop,
  best bounds, lr decay). The bounds are one process's up to the order of these sums.

A conv start node (or a residual sum in patches mode) that P = 1 bounds with auto_LiRPA's dense patches
(every neuron, identity C) is dealt
whole channels at a time and bounded densely (:func:`_dense_passes`): sparse rows would hold the slopes
that a position's rows share once per row.

``return_A`` calls (which merge per-chunk A dictionaries) run unsharded.

**Row-sharded α.** A ReLU's α for an intermediate start node (auto_LiRPA's ``alpha[start]``,
``(2, R, batch, *relu_shape)``) has one slope set per start-node row, or, for a conv start node with
``full_conv_alpha`` off or more than ``use_full_conv_alpha_thresh`` unstable neurons, one per channel,
shared by the channel's rows. Every start row is bounded on one rank, and every α row is used only by
rows of one rank (a channel's rows are dealt together where α is per channel). So right after
``BoundRelu.init_opt_parameters`` creates it, each rank keeps only the α rows its own start rows use,
plus one default slot (row 0, the initial slope): ``(2, 1 + held, batch, *relu_shape)``
(:class:`AlphaLayout`). Adam's state follows (it is created from these tensors). While rank r deals a
start node's rows, ``select_alpha_by_idx`` hands auto_LiRPA its local α with a local lookup table (in
patches mode auto_LiRPA unfolds the whole α it is given, so this also shrinks every pass); any other
use of that α (every rank bounding the same rows) gets the whole α, all-gathered with autograd, so the
ranks stay identical. An α row gets its whole gradient on the rank that holds it, so the optimiser
sums only the shared slot 0.
"""

from __future__ import annotations

import contextlib
import math
import types
import weakref

import torch
from torch import Tensor

from ...parallel import comm, memory
from ..run import Rows, Run


def _unstable_size(idx) -> int:
    return int(idx[0].numel() if isinstance(idx, tuple) else idx.numel())


def _rows(idx, positions: Tensor):
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


def _in_lockstep(state: Rows, name: str, parts: list[Tensor], one_pass, unit: int = 1) -> list:
    """``one_pass(part)`` (the pass's bounds, ...) over this rank's passes ``parts`` (each a tensor of
    row positions, or of channels, ``unit`` rows each; -1 a dummy), in lockstep with the other ranks'
    passes. A pass that runs out of memory on any rank runs again on every rank as two passes of half
    its positions, and so does each pass after it (:func:`.memory.lockstep_on_oom`; a dummy splits
    into two dummies, so every rank runs as many passes); the layer's later bounds take passes of at
    most half the rows of the largest pass that failed (``state.fits``, in rows). Returns what every
    pass returned, in ``parts``' order."""

    def failed(n: int) -> None:
        state.fits[name] = max(1, min(state.fits.get(name, n * unit), n * unit // 2))

    return memory.passes_in_lockstep(
        parts, one_pass, lambda: one_pass(DUMMY), lambda part: int((part >= 0).sum()),
        lambda part: split_passes(part[part >= 0], 2), name, "rows" if unit == 1 else "channels", failed,
    )  # fmt: skip


def start_owners(state: Rows, module, node, dense: bool = False) -> Tensor:
    """The rank of every neuron (flat position) of start node ``node``: whole channels where α is per
    channel (auto_LiRPA's rule of ``get_alpha_crown_start_nodes``; a stable neuron, bounded where
    auto_LiRPA bounds every neuron, uses its channel's α), else contiguous blocks of the unstable
    neurons, -1 for the others (then dealt round-robin: their α rows are never trained); ``dense`` (a conv
    start node bounded with dense patches, :func:`_dense_passes`: every neuron a row): contiguous blocks
    of whole channels. Computed from the node's current bounds, the ones auto_LiRPA creates its α from;
    kept in ``state.owners`` while its α is kept by row."""
    kind = start_kind(node)
    conv = kind in ("patches", "sum")
    shape = [int(s) for s in node.output_shape[1:]]
    idx, size = module.get_unstable_locations(node.lower, node.upper, conv=conv)
    flat = flat_positions(idx, shape).cpu()
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


def _owners(state: Rows, node, idx) -> Tensor:
    """The rank that bounds each of the rows ``idx``: as :func:`start_owners` laid them out while the
    start node's α is kept by row, else contiguous blocks; rows outside the layout go round-robin."""
    table = state.owners.get(node.name)
    U = _unstable_size(idx)
    if table is None:
        return even_blocks(U)
    o = table[flat_positions(idx, [int(s) for s in node.output_shape[1:]]).cpu()]
    extra = (o < 0).nonzero().squeeze(1)
    o[extra] = torch.arange(extra.numel()) % comm.world_size()
    return o


def batched_backward(run: Run, orig):
    """``BoundedModule.batched_backward``: each rank back-substitutes its rows in k passes (k the same
    on every rank); the bounds are all-gathered (see the module docstring)."""
    state = run.rows

    def batched_backward(
        self, node, C, unstable_idx, batch_size, bound_lower=True, bound_upper=True, return_A=None
    ):
        want_A = self.return_A if return_A is None else return_A
        P = comm.world_size()
        dense = unstable_idx is None
        shape = [int(s) for s in node.output_shape[1:]]
        idx = torch.arange(math.prod(shape), device=self.device) if dense else unstable_idx
        U = _unstable_size(idx)
        if not state.active or P == 1 or want_A:
            return orig(self, node, C, unstable_idx, batch_size, bound_lower, bound_upper, return_A)
        opts = self.bound_opts
        if node.name in state.dense and isinstance(idx, tuple) and U == math.prod(shape):
            return _dense_passes(state, self, node, batch_size, bound_lower, bound_upper)
        owners = _owners(state, node, idx)
        mine = (owners == comm.rank()).nonzero().squeeze(1)
        counts = torch.bincount(owners, minlength=P).tolist()
        k = passes_per_rank(counts, min(int(opts["crown_batch_size"]), state.fits.get(node.name, math.inf)))
        saved = {key: opts.get(key) for key in ("batched_crown_max_vram_ratio", "crown_batch_size")}
        opts["batched_crown_max_vram_ratio"] = 0.0  # never enlarge a pass on one rank only

        def one_pass(part: Tensor):
            real = part >= 0
            rows = _rows(idx, torch.where(real, part, 0).to(self.device))  # a dummy: row 0
            opts["crown_batch_size"] = int(part.numel())
            if patches_sum(node):
                c = int(part.numel())
                lb, ub = _sum_passes(self, node, rows, c, batch_size, bound_lower, bound_upper)
            else:
                lb, ub = orig(self, node, C, rows, batch_size, bound_lower, bound_upper, False)[:2]
            n = int(real.sum())  # a dummy's bound is dropped, its graph kept (the gather's backward)
            return (None if lb is None else lb.reshape(batch_size, -1)[:, :n],
                    None if ub is None else ub.reshape(batch_size, -1)[:, :n])  # fmt: skip

        state.dealing.append(node.name)
        try:
            lbs, ubs = zip(*_in_lockstep(state, node.name, split_passes(mine, k), one_pass), strict=True)
        finally:
            opts.update(saved)
            state.dealing.pop()
        state.dealt[type(node).__name__] += int(mine.numel())
        order = torch.cat([(owners == q).nonzero().squeeze(1) for q in range(P)])  # gathered -> rows
        take = torch.empty(U, dtype=torch.long)
        take[order] = torch.arange(U)
        take = take.to(self.device)  # the gathered column of every row, in row order

        def gathered(ts: list, wanted: bool):
            if not wanted:
                return None
            local = torch.cat(ts, 1)  # (batch, this rank's rows)
            full = comm.all_gather_cat_grad(local, 1, sizes=counts).index_select(1, take)
            return full.reshape(batch_size, *shape) if dense else full

        return gathered(lbs, bound_lower), gathered(ubs, bound_upper)

    return batched_backward


def _channel_owners(state: Rows, node) -> Tensor:
    """The rank of every channel of a conv start node bounded densely: as its α's layout deals them
    (whole channels, :func:`start_owners`), else contiguous blocks of channels."""
    C, H, W = (int(s) for s in node.output_shape[1:])
    table = state.owners.get(node.name)
    if table is not None:
        per = table.view(C, H * W)
        if bool((per == per[:, :1]).all()) and bool((per >= 0).all()):
            return per[:, 0].clone()
    return even_blocks(C)


def _dense_passes(state: Rows, module, node, batch_size: int, bound_lower: bool, bound_upper: bool):
    """A conv start node that P = 1 bounds with auto_LiRPA's dense patches (every neuron, identity C):
    each rank bounds its whole channels, in k passes (the same k on every rank; a rank short of channels
    runs a pass of channel 0, dropped), each a dense C of unit patches on those channels: one pass where
    P = 1 makes one, else passes of ``crown.batch_size`` rows' worth of channels. The relaxation's
    slopes stay shared by the rows of a position, as at P = 1 (the sparse rows of ``batched_backward``
    hold them once per row: twice P = 1's memory per row). Returns the ``(batch, C·H·W)`` bounds,
    gathered, in flat order."""
    from auto_LiRPA.patches import Patches

    C, H, W = (int(s) for s in node.output_shape[1:])
    P, me = comm.world_size(), comm.rank()
    owners = _channel_owners(state, node)
    counts = torch.bincount(owners, minlength=P).tolist()
    mine = (owners == me).nonzero().squeeze(1)
    # one pass where P = 1 makes one (what a pass holds once, the slopes and input bounds shared by its
    # rows, would be held once per pass), else passes of ``crown.batch_size`` rows' worth of channels
    per_pass = (
        C if state.one_pass else max(1, int(min(module.bound_opts["crown_batch_size"], C * H * W)) // (H * W))
    )
    if node.name in state.fits:  # a pass ran out of memory: at most that many rows' worth of channels
        per_pass = max(1, min(per_pass, state.fits[node.name] // (H * W)))
    k = passes_per_rank(counts, per_pass)
    dtype = next(module.parameters()).dtype
    shape = node.output_shape

    def one_pass(part: Tensor):
        real = int((part >= 0).sum())
        ch = part.clamp(min=0).to(module.device)  # a dummy: channel 0
        n = int(ch.numel())
        unit = torch.nn.functional.one_hot(ch, C).to(dtype).view(n, 1, 1, 1, C, 1, 1)
        unit = unit.expand(n, batch_size, H, W, C, 1, 1)
        pass_C = Patches(unit, 1, 0, unit.shape, output_shape=[batch_size, C, H, W])
        state.dense_pass = (ch, C, H * W)
        node.output_shape = torch.Size([batch_size, n, H, W])  # the bounds of this pass's channels
        try:
            lb, ub = module.backward_general(
                node, pass_C, bound_lower=bound_lower, bound_upper=bound_upper, unstable_idx=None
            )[:2]
        finally:
            node.output_shape, state.dense_pass = shape, None
        for act in module.nodes():  # the patch size α is made from (init_alpha): all C channels
            sizes = getattr(act, "patch_size", None)
            if isinstance(sizes, dict) and node.name in sizes:
                sizes[node.name] = [C, *list(sizes[node.name])[1:]]
        return (None if lb is None else lb.reshape(batch_size, -1)[:, : real * H * W],
                None if ub is None else ub.reshape(batch_size, -1)[:, : real * H * W])  # fmt: skip

    state.dealing.append(node.name)
    try:
        done = _in_lockstep(state, node.name, split_passes(mine, k), one_pass, unit=H * W)
        lbs, ubs = zip(*done, strict=True)
    finally:
        state.dealing.pop()
    state.dealt[type(node).__name__] += int(mine.numel()) * H * W
    flat = owners.repeat_interleave(H * W)
    order = torch.cat([(flat == q).nonzero().squeeze(1) for q in range(P)])  # gathered -> rows
    take = torch.empty(C * H * W, dtype=torch.long)
    take[order] = torch.arange(C * H * W)
    take = take.to(module.device)
    sizes = [c * H * W for c in counts]

    def gathered(ts: list, wanted: bool):
        if not wanted:
            return None
        return comm.all_gather_cat_grad(torch.cat(ts, 1), 1, sizes=sizes).index_select(1, take)

    return gathered(lbs, bound_lower), gathered(ubs, bound_upper)


def halving_on_oom(run: Run, orig):
    """``BoundedModule.compute_intermediate_bounds`` when the device runs out of memory bounding a layer:
    at P = 1 the layer again with its rows in passes of half as many (``crown.batch_size`` for that
    layer: half its neurons, then half again; auto_LiRPA's growing of it off), one warning line each
    time, down to one row. At P > 1 a dealt pass that runs out of memory on any rank runs again on
    every rank in halves (:func:`_in_lockstep`), and this sees only what ran out elsewhere: one line and
    the error. The size that fitted is kept for the layer's later bounds (α-CROWN's iterations, BaB's
    rounds). A layer that never ran out is auto_LiRPA's (at P > 1, dealt)."""
    fits = run.rows.fits

    def compute_intermediate_bounds(self, node, prior_checked=False):
        opts = self.bound_opts
        saved = {key: opts.get(key) for key in ("batched_crown_max_vram_ratio", "crown_batch_size")}
        whole = max(1, int(min(saved["crown_batch_size"] or math.inf, math.prod(node.output_shape[1:]))))

        stale = [(n, n._lower, n._upper) for n in self.nodes() if not n.is_lower_bound_current()]

        def attempt(size: int):
            if size < whole:
                opts.update(crown_batch_size=size, batched_crown_max_vram_ratio=0.0)
                for n, lower, upper in stale:  # what a failed pass left (IBP's bounds) is not taken for done
                    n._lower, n._upper = lower, upper
                    n._is_lower_bound_current = n._is_upper_bound_current = False
            return orig(self, node, prior_checked)

        try:
            ret, size = memory.halving_on_oom(
                attempt, fits.get(node.name, whole), node.name, retry=comm.world_size() == 1
            )
        finally:
            opts.update(saved)
        if size < whole:  # (a dealt pass that ran out at P > 1 may have set a smaller one meanwhile)
            fits[node.name] = min(size, fits.get(node.name, size))
        return ret

    return compute_intermediate_bounds


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


def get_sparse_C(run: Run, orig):
    """``BoundedModule.get_sparse_C``: at P > 1 every start node's rows are bounded in passes (to be
    dealt: ``BatchedCrownC``), however few: the neurons auto_LiRPA itself would bound in its one pass,
    i.e. the unstable ones where it uses a sparse C (a sparse-spec α, or no α and at most
    ``minimum_sparsity`` of them unstable), else every neuron (its dense C). Each pass's C is then the
    one auto_LiRPA builds for those rows, so every row's bound is the one-pass bound. A residual sum in
    patches mode, which auto_LiRPA never bounds in passes, is bounded by :func:`_sum_passes`. A pass
    that returns its A-matrices (``return_A``) gets P = 1's C and runs unsharded."""

    def get_sparse_C(self, node, ref_intermediate):
        from auto_LiRPA.utils import BatchedCrownC

        sparse, ref_lb, ref_ub = ref_intermediate
        # a pass that returns its A-matrices (clip-and-verify's domain clipper keeps them by the layer's
        # rows as P = 1 numbers them) runs unsharded: P = 1's C
        if not (run.rows.active and comm.world_size() > 1 and sparse) or self.return_A:
            return orig(self, node, ref_intermediate)
        run.rows.module = weakref.ref(self)
        kind = start_kind(node)
        if kind == "linear" and len(node.output_shape) > 2:
            return orig(self, node, ref_intermediate)
        opts = self.bound_opts
        conv = kind in ("patches", "sum")
        idx, size = self.get_unstable_locations(ref_lb, ref_ub, conv=conv)
        if size == 0:
            return orig(self, node, ref_intermediate)
        shape = [int(s) for s in node.output_shape[1:]]
        alpha_sparse = self.check_optimized_variable_sparsity(node)
        below = size <= opts.get("minimum_sparsity", 0.9) * math.prod(shape)
        if conv:
            below = below and opts.get("sparse_conv_intermediate_bounds", False)
        sparse_C = (below and alpha_sparse is None) or alpha_sparse
        batch = opts.get("crown_batch_size", float("inf"))
        if conv and not sparse_C and (run.rows.one_pass or size <= batch or kind == "sum"):
            # P = 1 bounds every neuron at once with auto_LiRPA's dense patches (the slopes shared by
            # the rows of a position stay shared): dealt whole channels at a time, still dense
            run.rows.dense.add(node.name)
            idx = all_positions(shape, conv, ref_lb.device)
            return BatchedCrownC("Patches"), True, idx, _unstable_size(idx)
        run.rows.dense.discard(node.name)
        batched = size > batch and kind != "sum"
        if not (batched or sparse_C):  # auto_LiRPA's dense C: every neuron
            idx = all_positions(shape, conv, ref_lb.device)
        C = BatchedCrownC({"linear": "OneHot", "patches": "Patches", "sum": "Patches", "other": "eye"}[kind])
        return C, True, idx, _unstable_size(idx)

    return get_sparse_C


def _sum_passes(self, node, idx: tuple, c: int, batch_size: int, bound_lower: bool, bound_upper: bool):
    """``batched_backward``'s passes of c rows for a residual sum: each pass's C is auto_LiRPA's sparse
    C of such a node (a unit patch on the row's channel)."""
    from auto_LiRPA.patches import Patches

    channels = int(node.output_shape[-3])
    dtype = next(self.parameters()).dtype
    out_shape = [batch_size, *node.output_shape[1:]]
    lbs, ubs = [], []
    for i in range(0, int(idx[0].numel()), c):
        part = tuple(u[i : i + c] for u in idx)
        unit = torch.nn.functional.one_hot(part[0], channels).to(dtype).view(-1, 1, channels, 1, 1)
        unit = unit.expand(-1, batch_size, -1, -1, -1)
        C = Patches(unit, 1, 0, unit.shape, unstable_idx=part, output_shape=out_shape)
        lb, ub = self.backward_general(
            node, C, bound_lower=bound_lower, bound_upper=bound_upper, unstable_idx=part
        )[:2]
        lbs.append(lb)
        ubs.append(ub)

    def cat(ts):
        return None if ts[0] is None else torch.cat([t.reshape(batch_size, -1) for t in ts], 1)

    return cat(lbs), cat(ubs)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def compute_bounds_main(run: Run, orig):
    """``BoundedModule._compute_bounds_main``: the bounds it returns carry their gradient on rank 0
    alone (a factor 0 elsewhere): what every rank computes identically is then counted once in the
    sums over the ranks, exactly."""

    def _compute_bounds_main(self, *args, **kwargs):
        ret = orig(self, *args, **kwargs)
        active = run.rows.active and comm.world_size() > 1
        if not active or not torch.is_grad_enabled() or not isinstance(ret, tuple):
            return ret
        scale = 1.0 if comm.rank() == 0 else 0.0

        def once(t):
            return _GradScale.apply(t, scale) if isinstance(t, Tensor) and t.requires_grad else t

        return (once(ret[0]), once(ret[1]), *ret[2:])

    return _compute_bounds_main


def _spec_passes_possible(module, bound_node, C, plain: bool) -> bool:
    """Whether the back-substitution of ``bound_node`` can run in passes of spec rows: the output node,
    a plain C over several spec rows (``(batch, spec, ...)``), nothing else asked of it (no A-matrices
    returned, no cuts, no output constraints)."""
    return (
        plain
        and bound_node.name == module.final_name
        and isinstance(C, Tensor)
        and C.dim() >= 3
        and int(C.shape[1]) > 1
        and not module.return_A
        and not getattr(module, "cut_used", False)
        and not module.invprop_enabled()
    )


def _final_dealt(state: Rows, module, bound_node, C, plain: bool) -> bool:
    """Whether the output node's spec rows are dealt in this back-substitution: inside α-CROWN's
    iterations with a gradient (the last one, without, runs whole on every rank: α,β-CROWN reads its
    A-matrices, ``lA``, for BaB), for a plain C over several spec rows, nothing else asked of it."""
    return (
        state.active
        and comm.world_size() > 1
        and torch.is_grad_enabled()
        and type(bound_node).__name__ in ("BoundLinear", "BoundMatMul")  # its A-matrices stay dense
        and _spec_passes_possible(module, bound_node, C, plain)
        and _final_alpha_by_row(state, module)
    )


def whole_lA(state: Rows) -> None:
    """Every ``lA`` that the last back-substitution of the output node left as this rank's spec rows,
    all-gathered (detached), in the same order on every rank. Collective."""
    for node, counts in state.local_lA:
        lA = node.lA
        if not isinstance(lA, Tensor):
            raise RuntimeError(f"{node.name}: the output node's A-matrix is not a tensor; cannot gather it")
        local = lA.detach()[: counts[comm.rank()]]
        node.lA = comm.all_gather_cat(local.contiguous(), 0, sizes=counts)
    state.local_lA.clear()


def get_lA(run: Run, orig):
    """``LiRPANet.get_lA``: the ``lA`` it reads whole, where the last α-CROWN iteration left it dealt."""

    def get_lA(self, preserve_mask=None, tot_cells=None, transpose=True, device=None):
        whole_lA(run.rows)
        return orig(self, preserve_mask, tot_cells, transpose, device)

    return get_lA


def _final_alpha_by_row(state: Rows, module) -> bool:
    """Whether every α of the output node in use is kept by spec row (else the rows are not dealt)."""
    for relu in module.relus:
        if relu.opt_stage in ("opt", "reuse") and module.final_name in (relu.alpha or {}):
            layout = state.alpha.get(relu, {}).get(module.final_name)
            if layout is None or not layout.owns(relu.alpha[module.final_name]):
                return False
    return True


def backward_general(run: Run, orig):
    """``BoundedModule.backward_general`` of the output node, over a plain C of spec rows: at P > 1 in
    α-CROWN's iterations dealt by spec rows (C's rows, ``(batch, spec, ...)``) in contiguous blocks,
    with the α of the output node kept by spec row, the bounds all-gathered (differentiable); and at
    every P in passes of spec rows where a pass runs out of memory (:func:`_spec_passes`). Every other
    call is auto_LiRPA's."""
    state = run.rows

    def backward_general(self, bound_node, C, start_backpropagation_at_node=None, bound_lower=True,
                         bound_upper=True, average_A=False, need_A_only=False, unstable_idx=None,
                         update_mask=None, apply_output_constraints_to=None, initial_As=None,
                         initial_lb=None, initial_ub=None):  # fmt: skip
        args = (start_backpropagation_at_node, bound_lower, bound_upper, average_A, need_A_only,
                unstable_idx, update_mask, apply_output_constraints_to, initial_As, initial_lb,
                initial_ub)  # fmt: skip
        plain = start_backpropagation_at_node is None and not (average_A or need_A_only)
        plain = plain and unstable_idx is None and initial_As is None and initial_lb is None
        plain = plain and initial_ub is None and not apply_output_constraints_to
        if not _spec_passes_possible(self, bound_node, C, plain):
            if bound_node.name == self.final_name:
                state.local_lA.clear()  # a whole pass: every lA whole again
            return orig(self, bound_node, C, *args)
        S, batch = int(C.shape[1]), int(C.shape[0])
        if not _final_dealt(state, self, bound_node, C, plain):
            state.local_lA.clear()  # a whole pass: every lA whole again
            return _spec_passes(state, self, orig, bound_node, C, args, [S], 0)
        counts = comm.shard_sizes(S)
        state.dealing.append(bound_node.name)
        try:
            lb, ub = _spec_passes(state, self, orig, bound_node, C, args, counts, comm.rank())
        finally:
            state.dealing.pop()
        state.dealt[type(bound_node).__name__] += counts[comm.rank()]
        # what α,β-CROWN reads back (get_lA: BaB's branching, prune_after_crown's recover) is whole
        state.local_lA[:] = [(n, counts) for n in self.get_splittable_activations() if n.lA is not None]

        def gathered(t):
            return None if t is None else comm.all_gather_cat_grad(t, 1, sizes=counts).reshape(batch, S)

        return gathered(lb), gathered(ub)

    return backward_general


def _spec_passes(state: Rows, module, orig, bound_node, C, args: tuple, counts: list[int], me: int):
    """The output node's bounds over share ``me`` of the spec rows, shared out as ``counts`` (the
    ranks' dealt shares, or ``[S]``: every row), ``(batch, rows)`` each: one pass of them, as
    auto_LiRPA runs it, or where that runs out of memory, passes of fewer rows, each auto_LiRPA's
    back-substitution of its rows of C with ``unstable_idx`` naming them (by which auto_LiRPA, and
    :meth:`AlphaLayout.select` for a dealt share, pick the rows' α). At P = 1, and inside a BaB round
    (rank-local work), halved until the passes fit (:func:`.memory.halving_on_oom`); where the ranks
    run the pass together (α-CROWN, CROWN at P > 1), in lockstep (:func:`_in_lockstep`: a rank's extra
    pass, or its share of no row, bounds one row and drops it). After several passes every node's
    ``lA`` / ``uA`` (spec rows first) is theirs put together, as one pass leaves them. The size that
    fitted is kept for the node's later bounds (``state.fits``)."""
    name, S = bound_node.name, int(C.shape[1])
    lo, mine = sum(counts[:me]), counts[me]
    bound_lower, bound_upper = args[1], args[2]

    def one_pass(part: Tensor):
        real = part >= 0
        n = int(real.sum())
        if n == mine:  # this rank's rows in one pass (no row: a one-row dummy), as before any ran out
            return (*orig(module, bound_node, C[:, lo : lo + max(1, mine)], *args)[:2], None)
        rows = torch.where(real, part, min(lo, S - 1)).to(C.device)  # a dummy: a row bounded, dropped
        lb, ub = orig(module, bound_node, C.index_select(1, rows), *args[:5], rows, *args[6:])[:2]
        As = {node: (node.lA, node.uA) for node in module.nodes() if (node.lA, node.uA) != (None, None)}
        return lb, ub, (As if n else None)

    share = torch.arange(lo, lo + mine)
    fits = state.fits.get(name)
    if state.active and comm.world_size() > 1:
        k = passes_per_rank(counts, fits or S)
        done = _in_lockstep(state, name, split_passes(share, k), one_pass)
    else:

        def attempt(size: int) -> list:
            return [one_pass(part) for part in share.split(size)]

        done, size = memory.halving_on_oom(attempt, min(fits or mine, mine), name)
        if size < mine:
            state.fits[name] = size
    if len(done) == 1:
        lb, ub, _ = done[0]
    else:
        _put_together([As for _, _, As in done if As is not None])  # (none on a share of no row)
        lb = torch.cat([d[0] for d in done], 1) if bound_lower else None
        ub = torch.cat([d[1] for d in done], 1) if bound_upper else None

    def mine_of(t):
        return None if t is None else t.reshape(t.shape[0], -1)[:, :mine]

    return mine_of(lb), mine_of(ub)


def _put_together(kept: list[dict]) -> None:
    """Every node's ``lA`` / ``uA`` after several passes of spec rows (``kept``: each pass's), joined
    along the spec rows (dim 0)."""
    for node in kept[-1] if kept else ():
        for i, side in enumerate(("lA", "uA")):
            parts = [k[node][i] for k in kept if node in k]
            if len(parts) < len(kept) or any(t is None for t in parts):
                setattr(node, side, None)
            elif all(isinstance(t, Tensor) for t in parts):
                setattr(node, side, torch.cat(parts, 0))
            else:
                raise RuntimeError(f"{node.name}: an A-matrix of the output node is not a tensor; not joined")


# ---------------------------------------------------------------------------------------------------------
# Row-sharded α
# ---------------------------------------------------------------------------------------------------------


class AlphaLayout:
    """How one (ReLU, start node) α is kept on this rank: the α rows used by its own start rows (as
    :func:`start_owners` deals them), in global order, after a default slot 0.

    ``owners``: the rank of every start neuron (flat position; -1: not dealt to anyone, a stable
    neuron). ``alpha_row``: the global α row of every start neuron: auto_LiRPA's lookup table where it
    has one (sparse-spec α; 0: its default slot, held by no one), else the neuron itself. Where α is
    per channel, ``channel_row`` is the global α row of every channel, and each neuron's is its
    channel's. The local lookup table is shaped like the one auto_LiRPA selects with
    (``lookup_shape``: the channels, ``(c, h, w)`` of a conv start node, or the neurons)."""

    def __init__(self, owners: Tensor, alpha_row: Tensor, sparse: bool, n_alpha: int,
                 lookup_shape: tuple[int, ...], channel_row: Tensor | None = None,
                 final: bool = False) -> None:  # fmt: skip
        P, me = comm.world_size(), comm.rank()
        self.n_alpha, self.final = n_alpha, final
        self.held = []  # the global α rows each rank holds, sorted
        for q in range(P):
            used = alpha_row[owners == q]
            self.held.append(torch.unique(used[used > 0] if sparse else used))
        self.sizes = [int(h.numel()) for h in self.held]
        self.order = torch.cat(self.held)  # the global α row of every gathered row
        local_of = torch.zeros(n_alpha, dtype=torch.long)  # global α row -> local row (0: slot 0)
        local_of[self.held[me]] = torch.arange(1, self.sizes[me] + 1)
        rows = channel_row if channel_row is not None else alpha_row
        self.lookup = local_of[rows].view(lookup_shape)  # for maybe_unfold_patches / selection
        self.flat_lookup = local_of[alpha_row]  # by flat neuron position
        # a rank whose local α would have the global α's shape would be taken for whole
        self.ambiguous = any(1 + n == n_alpha for n in self.sizes)

    def to(self, device) -> AlphaLayout:
        self.lookup, self.flat_lookup = self.lookup.to(device), self.flat_lookup.to(device)
        return self

    def split(self, alpha: Tensor) -> Tensor:
        """auto_LiRPA's α (``(2, n_alpha, batch, ...)``) -> this rank's ``(2, 1 + held, batch, ...)``.
        Every row starts from the same initial slope, so slot 0, a copy of row 0, stands for the rows
        this rank does not hold (auto_LiRPA's own slot 0, and the rows of stable neurons, never
        trained: their gradient is 0)."""
        rows = self.held[comm.rank()].to(alpha.device)
        local = torch.cat([alpha[:, :1], alpha.index_select(1, rows)], 1).detach().clone()
        return local.requires_grad_(alpha.requires_grad)

    def owns(self, alpha: Tensor) -> bool:
        return alpha.shape[1] == 1 + self.sizes[comm.rank()]

    def whole(self, local: Tensor) -> Tensor:
        """The α as auto_LiRPA laid it out, from every rank's rows (differentiable)."""
        rows = comm.all_gather_cat_grad(local[:, 1:], 1, sizes=self.sizes)  # (2, held rows, batch, ...)
        base = local[:, :1].expand(-1, self.n_alpha, *local.shape[2:])
        return base.index_copy(1, self.order.to(local.device), rows)

    def select(self, local: Tensor, last_lA, last_uA, unstable_idx, shape: list[int]):
        """What auto_LiRPA's ``select_alpha_by_idx`` returns for the rows ``unstable_idx`` of a dealt
        pass, from the local α: in patches mode the α and its lookup table, which
        ``maybe_unfold_patches`` selects with; with matrices the rows' own α."""
        if self.final and unstable_idx is not None:  # a pass of some spec rows (after running out)
            return local.index_select(1, self.flat_lookup[unstable_idx]), None
        if self.final:  # the rank's spec rows, in order: its local rows (none: a dummy row, slot 0)
            return (local[:, 1:] if local.shape[1] > 1 else local[:, :1]), None
        patches = not isinstance(last_lA, Tensor) and not isinstance(last_uA, Tensor)
        if isinstance(unstable_idx, tuple) and patches:
            return local, self.lookup
        rows = self.flat_lookup[flat_positions(unstable_idx, shape)]
        return local.index_select(1, rows), self.lookup


def _layout(relu, start, module, state: Rows) -> AlphaLayout | None:
    """The row layout of ``relu.alpha[start]``, or None: kept whole (the final node, shared α, a
    layout this code does not know, or one where some rank would hold every row)."""
    name, out_shape, _, final = start[:4]
    opts = relu.options
    if name not in relu.alpha or opts["optimize_bound_args"].get("use_shared_alpha", False):
        return None
    if final:  # one α row per spec row, dealt as the spec rows are (final_rows)
        S = int(relu.alpha[name].shape[1])
        if S != (out_shape if isinstance(out_shape, int) else math.prod(out_shape)):
            return None
        layout = AlphaLayout(even_blocks(S), torch.arange(S), False, S, (S,), final=True)
        return None if layout.ambiguous else layout.to(relu.alpha[name].device)
    node = module[name]
    shape = [int(s) for s in node.output_shape[1:]]
    n = math.prod(shape)
    n_alpha = int(relu.alpha[name].shape[1])
    lookup = (relu.alpha_lookup_idx or {}).get(name)
    owners = state.owners.get(name)
    if owners is None:  # α without a lookup table on a conv start node in patches mode: bounded densely
        dense = lookup is None and start_kind(node) in ("patches", "sum") and name in state.dense
        owners = start_owners(state, module, node, dense)
    channel_row = None
    if isinstance(out_shape, int) and len(shape) == 3:  # per channel
        channel_row = lookup.cpu() if lookup is not None else torch.arange(shape[0])
        alpha_row = channel_row.repeat_interleave(n // shape[0])
        lookup_shape: tuple[int, ...] = (shape[0],)
    else:
        alpha_row = lookup.cpu().reshape(-1) if lookup is not None else torch.arange(n)
        lookup_shape = (
            tuple(shape) if len(shape) == 3 and isinstance(lookup, Tensor) and lookup.dim() == 3 else (n,)
        )
        if lookup is None and len(shape) == 3 and start_kind(node) in ("patches", "sum"):
            lookup_shape = tuple(shape)
    if alpha_row.numel() != n or owners.numel() != n or int(alpha_row.max()) >= n_alpha:
        return None
    layout = AlphaLayout(owners, alpha_row, lookup is not None, n_alpha, lookup_shape, channel_row)
    return None if layout.ambiguous else layout.to(relu.alpha[name].device)


def init_opt_parameters(run: Run, orig):
    """``BoundRelu.init_opt_parameters``: each rank keeps the α rows of its own start rows."""
    state = run.rows

    def init_opt_parameters(self, start_nodes):
        orig(self, start_nodes)
        module = state.module() if state.module is not None else None
        if not state.active or comm.world_size() == 1 or module is None:
            return
        table = {}
        for start in start_nodes:  # (the list can name a start node more than once)
            if start[0] in table:
                continue
            layout = _layout(self, start, module, state)
            if layout is not None:
                self.alpha[start[0]] = layout.split(self.alpha[start[0]])
                table[start[0]] = layout
        state.alpha[self] = table

    return init_opt_parameters


def select_alpha_by_idx(run: Run, orig):
    """``BoundRelu.select_alpha_by_idx``: a rank reads its local α rows."""
    state = run.rows

    def select_alpha_by_idx(self, last_lA, last_uA, unstable_idx, start_node):
        name = start_node.name
        layout = state.alpha.get(self, {}).get(name)
        local = self.alpha.get(name) if layout is not None else None
        if state.dense_pass is not None and unstable_idx is None and state.dealing[-1] == name:
            return _dense_alpha(self, orig, layout, local, last_lA, last_uA, start_node, state.dense_pass)
        if local is None or not layout.owns(local):
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        if state.dealing and state.dealing[-1] == name and (unstable_idx is not None or layout.final):
            shape = [int(d) for d in start_node.output_shape[1:]]
            return layout.select(local, last_lA, last_uA, unstable_idx, shape)
        self.alpha[name] = layout.whole(local)  # every rank bounds these rows: the whole α everywhere
        try:
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        finally:
            self.alpha[name] = local

    return select_alpha_by_idx


def _dense_alpha(relu, orig, layout, local, last_lA, last_uA, start_node, dense_pass: tuple):
    """The α of a dense pass over some channels of a conv start node (:func:`_dense_passes`): those
    channels' α rows, in order: one per channel (α per channel) or one per neuron (full conv α)."""
    channels, C, HW = dense_pass
    flat = (channels[:, None] * HW + torch.arange(HW, device=channels.device)).reshape(-1)
    if layout is not None and local is not None and layout.owns(local):
        per_channel = layout.lookup.dim() == 1 and int(layout.lookup.numel()) == C
        rows = layout.lookup[channels] if per_channel else layout.flat_lookup[flat]
        return local.index_select(1, rows), None
    selected, lookup = orig(relu, last_lA, last_uA, None, start_node)
    if isinstance(selected, Tensor) and selected.dim() > 1 and lookup is None:
        if int(selected.shape[1]) == C:  # α per channel, whole on every rank
            selected = selected.index_select(1, channels)
        elif int(selected.shape[1]) == C * HW:  # full conv α, whole on every rank
            selected = selected.index_select(1, flat)
    return selected, lookup


def whole_alpha_dict(state: Rows, alphas: dict | None, only: str | None = None) -> None:
    """α as α,β-CROWN hands it around (``{relu: {start: α}}``, or ``{relu: {"alpha": {start: α},
    ...}}`` as ``get_alpha(full_info=True)`` lays it out) made whole where it was kept by row, in place
    (``only``: that start node alone). Collective: call it on every rank at the same point."""
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        entry = (alphas or {}).get(relu.name)
        if entry is None:
            continue
        per_start = entry["alpha"] if isinstance(entry.get("alpha"), dict) else entry
        for name, layout in table.items():
            a = per_start.get(name)
            if (only is None or name == only) and isinstance(a, Tensor) and layout.owns(a):
                # α,β-CROWN stores α in float16 by default (``alpha_dtype``): gathered in float32 at
                # least, float64 kept (``double_fp`` with ``alpha_dtype: auto``)
                wide = torch.promote_types(a.dtype, torch.float32)
                whole = layout.whole(a.detach().to(comm.device(), wide))
                per_start[name] = whole.to(a.device, a.dtype)


def whole_alphas(state: Rows, reference: dict | None) -> None:
    """The α that α,β-CROWN saved after α-CROWN (``reference["alphas"]``) made whole where it was kept
    by row, in place, before BaB stores it per domain (input BaB, ``enable_opt_interm_bounds``).
    Collective: call it on every rank, before :func:`inactive`."""
    whole_alpha_dict(state, (reference or {}).get("alphas"))


def _whole_final(state: Rows, final: str) -> list:
    """The output node's α whole again on every ReLU (its layout dropped); returns those ReLUs."""
    relus = []
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        layout = table.pop(final, None)
        a = (relu.alpha or {}).get(final)
        if layout is not None and a is not None and layout.owns(a):
            relu.alpha[final] = layout.whole(a).detach().requires_grad_(a.requires_grad)
            relus.append(relu)
    return relus


def prune_after_crown(run: Run, orig):
    """``prune.PruneAfterCROWN.__init__``: α,β-CROWN drops the spec rows CROWN already verified from the
    output node's α, which it takes whole: the α is made whole for it, then kept by the new spec rows."""
    state = run.rows

    def __init__(self, net, x, c, rhs, lb, aux_reference_bounds, stop_criterion, or_spec_size=None):
        relus = _whole_final(state, net.final_name) if state.active and comm.world_size() > 1 else []
        orig(self, net, x, c, rhs, lb, aux_reference_bounds, stop_criterion, or_spec_size)
        for relu in relus:
            start = (net.final_name, int(relu.alpha[net.final_name].shape[1]), None, True)
            layout = _layout(relu, start, None, state)
            if layout is not None:
                relu.alpha[net.final_name] = layout.split(relu.alpha[net.final_name])
                state.alpha[relu][net.final_name] = layout

    return __init__


def prune_recover(run: Run, orig):
    """``prune.PruneAfterCROWN.recover``: puts the pruned spec rows of the output node's α (among
    others) back in place, on the whole α: made whole for it."""
    state = run.rows

    def recover(self, lb, ub, lA, alphas, mask, input_split_idx, full_alpha_info):
        if state.active and comm.world_size() > 1:
            whole_alpha_dict(state, alphas, only=self.net.final_name)
        return orig(self, lb, ub, lA, alphas, mask, input_split_idx, full_alpha_info)

    return recover


@contextlib.contextmanager
def inactive(state: Rows):
    """Rows not dealt while inside (a rank's share of a BaB round is rank-local work). On entry the α
    kept by row become whole again on every rank (collective)."""
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        for name, layout in table.items():
            a = relu.alpha.get(name) if relu.alpha else None
            if a is not None and layout.owns(a):
                relu.alpha[name] = layout.whole(a).detach().requires_grad_(a.requires_grad)
    whole_lA(state)
    state.alpha.clear()
    state.owners.clear()
    was, state.active = state.active, False
    try:
        yield
    finally:
        state.active = was


def _row_alphas(state: Rows) -> set[int]:
    """ids of the α tensors that are kept by row now (their owner has their rows' whole gradient)."""
    out = set()
    for relu, table in list(state.alpha.items()):
        for name, layout in table.items():
            t = relu.alpha.get(name) if relu.alpha else None
            if t is not None and layout.owns(t):
                out.add(id(t))
    return out


def _sum_grads(state: Rows, params) -> None:
    """Sum every gradient over the ranks, except the rows of an α kept by row (whole on their owner):
    of those only the shared slot 0."""
    by_row = _row_alphas(state)
    for group in params:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if id(p) in by_row:
                p.grad[:, :1] = comm.all_reduce(p.grad[:, :1], "sum")
            else:
                p.grad.copy_(comm.all_reduce(p.grad, "sum"))


def _synced(state: Rows, cls):
    class Synced(cls):
        def step(self, *args, **kwargs):
            if state.active and comm.world_size() > 1:
                _sum_grads(state, self.param_groups)
            return super().step(*args, **kwargs)

    Synced.__name__ = Synced.__qualname__ = f"Synced{cls.__name__}"
    return Synced


def tqdm(run: Run, orig):
    """auto_LiRPA's ``batched_backward`` progress bar (``backward_bound.tqdm``), off: at P > 1 every
    layer is bounded in passes, and a bar for each would fill the user's terminal."""

    def quiet(*args, **kwargs):
        return orig(*args, **{**kwargs, "disable": True})

    return quiet


def optim(run: Run, orig: types.ModuleType) -> types.ModuleType:
    """The ``optim`` that auto_LiRPA's ``optimized_bounds`` sees: ``torch.optim`` (``orig``) with Adam and
    SGD summing every gradient over the ranks before their step."""
    synced = types.ModuleType("optim")
    synced.__dict__.update(orig.__dict__)
    synced.Adam = _synced(run.rows, orig.Adam)  # type: ignore[attr-defined]
    synced.SGD = _synced(run.rows, orig.SGD)  # type: ignore[attr-defined]
    return synced
