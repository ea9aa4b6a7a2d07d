"""The rows of every intermediate layer dealt over the ranks (``BoundedModule.batched_backward``).

At P > 1 every intermediate layer goes through passes (:func:`get_sparse_C`), however few its unstable
neurons: certified-trained nets, whose layers have few, are the common case. Each rank bounds its own
rows (:mod:`.deal`); the ``(batch, rows)`` bounds are all-gathered (differentiably, for α-CROWN:
:mod:`.grads`) and put back in row order. A row's bound does not depend on the other rows of its pass
(each pass's C is the one auto_LiRPA builds for those rows), so CROWN's bounds are one process's to
rounding.

A conv start node (or a residual sum in patches mode) that P = 1 bounds with auto_LiRPA's dense patches
(every neuron, identity C) is dealt whole channels at a time and bounded densely
(:func:`_dense_passes`): sparse rows would hold the slopes that a position's rows share once per row.
A pass that returns its A-matrices (``return_A``: clip-and-verify's domain clipper) runs unsharded,
with one process's C.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from ...parallel import comm, oom
from ..run import Rows, Run
from .deal import (
    all_positions,
    even_blocks,
    in_lockstep,
    owners_of,
    passes_per_rank,
    patches_sum,
    rows_at,
    split_passes,
    start_kind,
    unstable_size,
)


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
        U = unstable_size(idx)
        if not state.active or P == 1 or want_A:
            return orig(self, node, C, unstable_idx, batch_size, bound_lower, bound_upper, return_A)
        opts = self.bound_opts
        if node.name in state.dense and isinstance(idx, tuple) and U == math.prod(shape):
            return _dense_passes(state, self, node, batch_size, bound_lower, bound_upper)
        owners = owners_of(state, node, idx)
        mine = (owners == comm.rank()).nonzero().squeeze(1)
        counts = torch.bincount(owners, minlength=P).tolist()
        k = passes_per_rank(counts, min(int(opts["crown_batch_size"]), state.fits.get(node.name, math.inf)))
        saved = {key: opts.get(key) for key in ("batched_crown_max_vram_ratio", "crown_batch_size")}
        opts["batched_crown_max_vram_ratio"] = 0.0  # never enlarge a pass on one rank only

        def one_pass(part: Tensor):
            real = part >= 0
            rows = rows_at(idx, torch.where(real, part, 0).to(self.device))  # a dummy: row 0
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
            lbs, ubs = zip(*in_lockstep(state, node.name, split_passes(mine, k), one_pass), strict=True)
        finally:
            opts.update(saved)
            state.dealing.pop()
        state.dealt[type(node).__name__] += int(mine.numel())
        take, _ = _row_order(owners, self.device)
        lb, ub = _gathered(lbs, bound_lower, take, counts), _gathered(ubs, bound_upper, take, counts)
        if dense:
            lb, ub = (None if t is None else t.reshape(batch_size, *shape) for t in (lb, ub))
        return lb, ub

    return batched_backward


def _row_order(owners: Tensor, device) -> tuple[Tensor, list[int]]:
    """For rows dealt as ``owners`` says (the rank of each), gathered rank after rank: the gathered
    column of every row, in row order, and each rank's count."""
    P, n = comm.world_size(), int(owners.numel())
    order = torch.cat([(owners == q).nonzero().squeeze(1) for q in range(P)])  # gathered -> rows
    take = torch.empty(n, dtype=torch.long)
    take[order] = torch.arange(n)
    return take.to(device), torch.bincount(owners, minlength=P).tolist()


def _gathered(ts: list, wanted: bool, take: Tensor, counts: list[int]) -> Tensor | None:
    """This rank's passes' bounds ``ts`` (``(batch, rows)`` each) gathered from every rank
    (differentiably) and put in row order (``take``, :func:`_row_order`)."""
    if not wanted:
        return None
    return comm.all_gather_cat_grad(torch.cat(ts, 1), 1, sizes=counts).index_select(1, take)


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
    runs a pass of channel 0, dropped), each a dense C of unit patches on those channels
    (:func:`_dense_pass`): one pass where P = 1 makes one, else passes of ``crown.batch_size`` rows'
    worth of channels. The relaxation's slopes stay shared by the rows of a position, as at P = 1 (the
    sparse rows of ``batched_backward`` hold them once per row: twice P = 1's memory per row). Returns
    the ``(batch, C·H·W)`` bounds, gathered, in flat order."""
    C, H, W = (int(s) for s in node.output_shape[1:])
    owners = _channel_owners(state, node)
    counts = torch.bincount(owners, minlength=comm.world_size()).tolist()
    mine = (owners == comm.rank()).nonzero().squeeze(1)
    # one pass where P = 1 makes one (what a pass holds once, the slopes and input bounds shared by its
    # rows, would be held once per pass), else passes of ``crown.batch_size`` rows' worth of channels
    per_pass = (
        C if state.one_pass else max(1, int(min(module.bound_opts["crown_batch_size"], C * H * W)) // (H * W))
    )
    if node.name in state.fits:  # a pass ran out of memory: at most that many rows' worth of channels
        per_pass = max(1, min(per_pass, state.fits[node.name] // (H * W)))
    k = passes_per_rank(counts, per_pass)

    def one_pass(part: Tensor):
        return _dense_pass(state, module, node, part, batch_size, bound_lower, bound_upper)

    state.dealing.append(node.name)
    try:
        done = in_lockstep(state, node.name, split_passes(mine, k), one_pass, unit=H * W)
        lbs, ubs = zip(*done, strict=True)
    finally:
        state.dealing.pop()
    state.dealt[type(node).__name__] += int(mine.numel()) * H * W
    take, sizes = _row_order(owners.repeat_interleave(H * W), module.device)
    return _gathered(lbs, bound_lower, take, sizes), _gathered(ubs, bound_upper, take, sizes)


def _dense_pass(state: Rows, module, node, part: Tensor, batch_size: int, lower: bool, upper: bool):
    """One dense pass over the channels ``part`` of a conv start node (-1: a dummy, channel 0, whose
    bounds are dropped): a C of unit patches on them; their ``(batch, channels·H·W)`` bounds."""
    from auto_LiRPA.patches import Patches

    C, H, W = (int(s) for s in node.output_shape[1:])
    real = int((part >= 0).sum())
    ch = part.clamp(min=0).to(module.device)
    n = int(ch.numel())
    dtype = next(module.parameters()).dtype
    unit = torch.nn.functional.one_hot(ch, C).to(dtype).view(n, 1, 1, 1, C, 1, 1)
    unit = unit.expand(n, batch_size, H, W, C, 1, 1)
    pass_C = Patches(unit, 1, 0, unit.shape, output_shape=[batch_size, C, H, W])
    state.dense_pass, shape = (ch, C, H * W), node.output_shape
    node.output_shape = torch.Size([batch_size, n, H, W])  # the bounds of this pass's channels
    try:
        out = module.backward_general(node, pass_C, bound_lower=lower, bound_upper=upper, unstable_idx=None)
        lb, ub = out[:2]
    finally:
        node.output_shape, state.dense_pass = shape, None
    for act in module.nodes():  # the patch size α is made from (init_alpha): all C channels
        sizes = getattr(act, "patch_size", None)
        if isinstance(sizes, dict) and node.name in sizes:
            sizes[node.name] = [C, *list(sizes[node.name])[1:]]
    return (None if lb is None else lb.reshape(batch_size, -1)[:, : real * H * W],
            None if ub is None else ub.reshape(batch_size, -1)[:, : real * H * W])  # fmt: skip


def halving_on_oom(run: Run, orig):
    """``BoundedModule.compute_intermediate_bounds`` when the device runs out of memory bounding a layer:
    at P = 1 the layer again with its rows in passes of half as many (``crown.batch_size`` for that
    layer: half its neurons, then half again; auto_LiRPA's growing of it off), one warning line each
    time, down to one row. At P > 1 a dealt pass that runs out of memory on any rank runs again on
    every rank in halves (:func:`in_lockstep`), and this sees only what ran out elsewhere: one line and
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
            ret, size = oom.halving_on_oom(
                attempt, fits.get(node.name, whole), node.name, retry=comm.world_size() == 1
            )
        finally:
            opts.update(saved)
        if size < whole:  # (a dealt pass that ran out at P > 1 may have set a smaller one meanwhile)
            fits[node.name] = min(size, fits.get(node.name, size))
        return ret

    return compute_intermediate_bounds


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
            return BatchedCrownC("Patches"), True, idx, unstable_size(idx)
        run.rows.dense.discard(node.name)
        batched = size > batch and kind != "sum"
        if not (batched or sparse_C):  # auto_LiRPA's dense C: every neuron
            idx = all_positions(shape, conv, ref_lb.device)
        C = BatchedCrownC({"linear": "OneHot", "patches": "Patches", "sum": "Patches", "other": "eye"}[kind])
        return C, True, idx, unstable_size(idx)

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
