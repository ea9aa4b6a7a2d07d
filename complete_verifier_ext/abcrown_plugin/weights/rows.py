"""Row-sharded A-matrices inside auto_LiRPA: the neurons of the layer being bounded are dealt over the
ranks, so each rank back-substitutes (and holds the A-matrices of) only its rows.

auto_LiRPA already bounds the unstable neurons of a layer in passes of ``solver.crown.batch_size``
rows (``BoundedModule.batched_backward``). The wrapper deals such passes: k on every rank, of c rows
(:func:`pass_rows`: c ≤ ``crown.batch_size``, k = ⌈U / (P · crown.batch_size)⌉, so a layer of 1000
rows at P = 4 is four passes of 250, not two of 512 and two idle ranks); rank r takes the contiguous
block ``shard_range(K)`` of the K = ⌈U / c⌉ passes. Ranks with fewer passes add dummy full passes
(dropped) so that every rank runs the same number (and so the same collectives under FSDP); the one
partial pass stays last. The ``(batch, rows)`` bounds are all-gathered and put back in row order. A
row's bound does not depend on the other rows of its pass, so CROWN's bounds are one process's to
rounding.

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
  best bounds, lr decay). With the passes dealt whole, the bounds are one process's up to the order of
  these sums.

``return_A`` calls (which merge per-chunk A dictionaries) and layers with fewer rows than ranks run
unsharded.

**Row-sharded α.** A ReLU's α for an intermediate start node (auto_LiRPA's ``alpha[start]``,
``(2, S, batch, *relu_shape)``: one slope set per start-node row) is used row by row, and the rows
that ``batched_backward`` deals to rank r are used only there. So right after
``BoundRelu.init_opt_parameters`` creates it, each rank keeps only its own rows, plus one default slot
(row 0, the initial slope): ``(2, 1 + own rows, batch, *relu_shape)``. Adam's state follows (it is
created from these tensors). While rank r deals a start node's rows, ``select_alpha_by_idx`` reads
its local α through a neuron → local-row table. Any other use of that α (every rank bounding the same
rows, e.g. below ``solver.crown.batch_size``) gets the whole α, all-gathered with autograd, so the
ranks stay identical. A row's slopes get their whole gradient on their owner, so the optimiser sums
only the shared slot 0. The rows are kept in the blocks of passes that ``batched_backward`` deals. Only
fully connected start nodes (1-D rows) with more unstable neurons than ``crown.batch_size`` (the ones
whose rows are dealt) are split; the output node's α (one row per spec) stays replicated.
"""

from __future__ import annotations

import contextlib
import math
import types

import torch
from torch import Tensor

from ...parallel import comm
from ..run import Rows, Run


def _unstable_size(idx) -> int:
    return int(idx[0].numel() if isinstance(idx, tuple) else idx.numel())


def _rows(idx, positions: Tensor):
    return tuple(u[positions] for u in idx) if isinstance(idx, tuple) else idx[positions]


def pass_blocks(U: int, c: int, world: int | None = None) -> Tensor:
    """The rank of each of U rows when its passes of c rows are dealt in contiguous blocks."""
    K = -(-U // c)
    owner_of_pass = torch.cat(
        [torch.full((n,), q, dtype=torch.long) for q, n in enumerate(comm.shard_sizes(K, world))]
    )
    return owner_of_pass.repeat_interleave(c)[:U]


def pass_rows(U: int, batch: int, world: int | None = None) -> int:
    """The rows of each dealt pass over U rows: at most ``crown.batch_size``, in k passes on every rank
    (k = ⌈U / (P · batch)⌉), so that no rank holds two passes while another holds none."""
    P = comm.world_size() if world is None else world
    k = -(-U // (P * min(batch, U)))
    return -(-U // (P * k))


def _owners(state: Rows, module, node, idx, c: int) -> Tensor:
    """The rank that bounds each of the U rows: where the start node's α is kept by row, its owner;
    else the pass blocks."""
    if isinstance(idx, Tensor):
        for relu in getattr(module, "relus", ()):
            layout = state.alpha.get(relu, {}).get(node.name)
            if layout is not None:
                return layout.owners_of(idx)
    return pass_blocks(_unstable_size(idx), c)


def _local_rows(owners: Tensor, q: int, c: int, passes: int) -> Tensor:
    """Rank q's rows (positions) in pass order: its full passes, dummy passes (-1) up to ``passes``,
    then its partial pass."""
    mine = (owners == q).nonzero().squeeze(1)
    full = (mine.numel() // c) * c
    dummies = torch.full(((passes - -(-mine.numel() // c)) * c,), -1, dtype=torch.long)
    return torch.cat([mine[:full], dummies, mine[full:]])


def batched_backward(run: Run, orig):
    """``BoundedModule.batched_backward``: each rank back-substitutes its block of row passes; the
    bounds are all-gathered (see the module docstring)."""
    state = run.rows

    def batched_backward(
        self, node, C, unstable_idx, batch_size, bound_lower=True, bound_upper=True, return_A=None
    ):
        want_A = self.return_A if return_A is None else return_A
        P = comm.world_size()
        dense = unstable_idx is None
        dim = 1
        for s in node.output_shape[1:]:
            dim *= int(s)
        idx = torch.arange(dim, device=self.device) if dense else unstable_idx
        U = _unstable_size(idx)
        if not state.active or P == 1 or want_A or U < P:
            return orig(self, node, C, unstable_idx, batch_size, bound_lower, bound_upper, return_A)
        opts = self.bound_opts
        c = pass_rows(U, int(opts["crown_batch_size"]))
        owners = _owners(state, self, node, idx, c).cpu()
        passes = max(-(-int((owners == q).sum()) // c) for q in range(P))
        every = [_local_rows(owners, q, c, passes) for q in range(P)]
        rows = every[comm.rank()]
        filler = rows[rows >= 0][:1] if (rows >= 0).any() else torch.zeros(1, dtype=torch.long)
        local = _rows(idx, torch.where(rows >= 0, rows, filler).to(self.device))
        saved = {k: opts.get(k) for k in ("batched_crown_max_vram_ratio", "crown_batch_size")}
        opts["batched_crown_max_vram_ratio"] = 0.0  # never enlarge a pass on one rank only
        opts["crown_batch_size"] = c
        state.dealing.append(node.name)
        try:
            if patches_sum(node):
                lb, ub = _sum_passes(self, node, local, c, batch_size, bound_lower, bound_upper)
            else:
                lb, ub = orig(self, node, C, local, batch_size, bound_lower, bound_upper, False)[:2]
        finally:
            opts.update(saved)
            state.dealing.pop()
        state.dealt[type(node).__name__] += int((rows >= 0).sum())
        sizes = [r.numel() for r in every]
        flat = torch.cat(every)  # the row of each gathered column (-1: dummy)
        take = torch.empty(U, dtype=torch.long)
        real = flat >= 0
        take[flat[real]] = real.nonzero().squeeze(1)
        take = take.to(self.device)  # gathered column of every row, in row order

        def gathered(t):
            if t is None:
                return None
            full = comm.all_gather_cat_grad(t.reshape(batch_size, -1), 1, sizes=sizes)
            full = full.index_select(1, take)
            return full.reshape(batch_size, *node.output_shape[1:]) if dense else full

        return gathered(lb), gathered(ub)

    return batched_backward


def patches_sum(node) -> bool:
    """A residual sum of conv outputs in patches mode (auto_LiRPA's ``BoundAdd`` / ``BoundSub``), whose
    rows auto_LiRPA bounds in one pass ("Batched CROWN is not supported in this case")."""
    from auto_LiRPA.operators import BoundAdd, BoundSub

    return isinstance(node, (BoundAdd, BoundSub)) and node.mode == "patches" and len(node.output_shape) >= 4


def get_sparse_C(run: Run, orig):
    """``BoundedModule.get_sparse_C``: a patches-mode residual sum is bounded in passes (to be dealt),
    as auto_LiRPA bounds a conv layer's unstable neurons, over the neurons auto_LiRPA itself would
    bound in its one pass: the unstable ones where it uses a sum's sparse C (a sparse-spec α, or no α
    and at most ``minimum_sparsity`` of them unstable), else every neuron (its dense C: with a dense α
    of its own, bounding only the unstable ones moved α-CROWN's result)."""

    def get_sparse_C(self, node, ref_intermediate):
        sparse, ref_lb, ref_ub = ref_intermediate
        if run.rows.active and comm.world_size() > 1 and sparse and patches_sum(node):
            from auto_LiRPA.utils import BatchedCrownC

            opts = self.bound_opts
            idx, size = self.get_unstable_locations(ref_lb, ref_ub, conv=True)
            shape = [int(s) for s in node.output_shape[1:]]
            alpha_sparse = self.check_optimized_variable_sparsity(node)
            sparse_C = alpha_sparse or (
                alpha_sparse is None
                and opts.get("sparse_conv_intermediate_bounds", False)
                and size <= opts.get("minimum_sparsity", 0.9) * math.prod(shape)
            )
            if size > 0 and not sparse_C:
                idx = tuple(torch.ones(shape, dtype=torch.bool, device=ref_lb.device).nonzero().unbind(1))
                size = int(idx[0].numel())
            if size > opts.get("crown_batch_size", float("inf")):
                return BatchedCrownC("Patches"), True, idx, size
        return orig(self, node, ref_intermediate)

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


# ---------------------------------------------------------------------------------------------------------
# Row-sharded α
# ---------------------------------------------------------------------------------------------------------


class RowAlpha:
    """How one (ReLU, start node) α is kept by row on this rank: the rows of ``idx`` (the start node's
    neurons that have their own α row) in the blocks of passes of c rows that ``batched_backward``
    deals (:func:`pass_blocks`), plus a default slot 0."""

    def __init__(self, idx: Tensor, size_s: int, orig_lookup: Tensor | None, full_rows: int, c: int) -> None:
        U = idx.numel()
        blocks = pass_blocks(U, c)
        self.idx, self.size_s, self.orig_lookup, self.full_rows = idx, size_s, orig_lookup, full_rows
        self.sizes = torch.bincount(blocks, minlength=comm.world_size()).tolist()
        mine = (blocks == comm.rank()).nonzero().squeeze(1).to(idx.device)
        self.own = idx[mine]
        self.lookup = torch.zeros(size_s, dtype=torch.long, device=idx.device)  # neuron -> local row
        self.lookup[self.own] = torch.arange(1, self.own.numel() + 1, device=idx.device)
        self.owner = torch.full((size_s,), -1, dtype=torch.long)  # neuron -> rank (-1: slot 0 only)
        self.owner[idx.cpu()] = blocks

    def owners_of(self, rows: Tensor) -> Tensor:
        """The rank that bounds each row: its α's owner; rows without an α row of their own (they use
        slot 0, as in auto_LiRPA) go round-robin."""
        o = self.owner[rows.cpu()]
        extra = (o < 0).nonzero().squeeze(1)
        o[extra] = torch.arange(extra.numel()) % comm.world_size()
        return o

    def split(self, alpha: Tensor) -> Tensor:
        """auto_LiRPA's α (``(2, full_rows, batch, ...)``) -> this rank's ``(2, 1 + own, batch, ...)``.

        With a dense spec (a row for every neuron) the rows of neurons that are not bounded (stable)
        are never trained: slot 0, a copy of the initial slope that every row starts from, stands for
        them."""
        if self.orig_lookup is not None:  # sparse spec: row 0 is auto_LiRPA's own default slot
            rows, default = self.orig_lookup[self.own], alpha[:, :1]
        else:
            rows, default = self.own, alpha[:, self.idx[:1]]  # (also on a rank that owns no row)
        local = torch.cat([default, alpha[:, rows]], 1).detach().clone()
        return local.requires_grad_(alpha.requires_grad)

    def owns(self, alpha: Tensor) -> bool:
        return alpha.shape[1] == 1 + self.own.numel() != self.full_rows

    def whole(self, local: Tensor) -> Tensor:
        """The α as auto_LiRPA laid it out, from every rank's rows (differentiable)."""
        rows = comm.all_gather_cat_grad(local[:, 1:], 1, sizes=self.sizes)  # (2, U, batch, ...)
        if self.orig_lookup is not None:
            return torch.cat([local[:, :1], rows], 1)
        full = local[:, :1].expand(-1, self.size_s, *local.shape[2:])  # dense: one row per neuron
        return full.index_copy(1, self.idx, rows)


def _dealt(relu, start) -> RowAlpha | None:
    """The row layout of ``relu.alpha[start]`` if ``batched_backward`` deals that start node's rows."""
    name, out_shape, unstable_idx, final = start[:4]
    opts = relu.options
    if final or name not in relu.alpha or opts["optimize_bound_args"].get("use_shared_alpha", False):
        return None
    if not isinstance(out_shape, int) and len(out_shape) != 1:  # conv start nodes: not yet
        return None
    if unstable_idx is not None and (not isinstance(unstable_idx, Tensor) or unstable_idx.ndim != 1):
        return None
    size_s = int(out_shape if isinstance(out_shape, int) else out_shape[0])
    U = size_s if unstable_idx is None else unstable_idx.numel()
    if U <= opts.get("crown_batch_size", float("inf")) or U < comm.world_size():
        return None  # bounded in one pass by every rank: kept whole
    lookup = (relu.alpha_lookup_idx or {}).get(name)
    if unstable_idx is None:  # every neuron is bounded
        unstable_idx = torch.arange(size_s, device=relu.alpha[name].device)
    c = pass_rows(U, int(opts["crown_batch_size"]))
    return RowAlpha(unstable_idx, size_s, lookup, relu.alpha[name].shape[1], c)


def init_opt_parameters(run: Run, orig):
    """``BoundRelu.init_opt_parameters``: each rank keeps the α of its own rows."""
    state = run.rows

    def init_opt_parameters(self, start_nodes):
        orig(self, start_nodes)
        if not state.active or comm.world_size() == 1:
            return
        table = {}
        for start in start_nodes:  # (the list can name a start node more than once)
            if start[0] in table:
                continue
            layout = _dealt(self, start)
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
        if local is None or not layout.owns(local):
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        if (
            state.dealing
            and state.dealing[-1] == name
            and isinstance(unstable_idx, Tensor)
            and unstable_idx.ndim == 1
        ):
            return self.non_deter_index_select(local, index=layout.lookup[unstable_idx], dim=1), None
        self.alpha[name] = layout.whole(local)  # every rank bounds these rows: the whole α everywhere
        try:
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        finally:
            self.alpha[name] = local

    return select_alpha_by_idx


def whole_alphas(state: Rows, reference: dict | None) -> None:
    """The α that α,β-CROWN saved after α-CROWN (``reference["alphas"]``: ``{relu: {start: α}}``, or
    ``{relu: {"alpha": {start: α}, ...}}`` as ``dump_alpha`` lays it out) made whole where it was kept by
    row, in place, before BaB stores it per domain (input BaB, ``enable_opt_interm_bounds``). Collective:
    call it on every rank, before :func:`inactive`."""
    saved = (reference or {}).get("alphas") or {}
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        entry = saved.get(relu.name)
        if entry is None:
            continue
        per_start = entry["alpha"] if isinstance(entry.get("alpha"), dict) else entry
        for name, layout in table.items():
            a = per_start.get(name)
            if isinstance(a, Tensor) and layout.owns(a):
                whole = layout.whole(a.detach().to(comm.device(), torch.float32))
                per_start[name] = whole.to(a.device, a.dtype)


@contextlib.contextmanager
def inactive(state: Rows):
    """Rows not dealt while inside (a rank's share of a BaB round is rank-local work). On entry the α
    kept by row become whole again on every rank (collective)."""
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        for name, layout in table.items():
            a = relu.alpha.get(name) if relu.alpha else None
            if a is not None and layout.owns(a):
                relu.alpha[name] = layout.whole(a).detach().requires_grad_(a.requires_grad)
    state.alpha.clear()
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


def optim(run: Run, orig: types.ModuleType) -> types.ModuleType:
    """The ``optim`` that auto_LiRPA's ``optimized_bounds`` sees: ``torch.optim`` (``orig``) with Adam and
    SGD summing every gradient over the ranks before their step."""
    synced = types.ModuleType("optim")
    synced.__dict__.update(orig.__dict__)
    synced.Adam = _synced(run.rows, orig.Adam)  # type: ignore[attr-defined]
    synced.SGD = _synced(run.rows, orig.SGD)  # type: ignore[attr-defined]
    return synced
