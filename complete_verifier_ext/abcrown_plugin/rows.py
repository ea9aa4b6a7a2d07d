"""Row-sharded A-matrices inside auto_LiRPA: the neurons of the layer being bounded are dealt over the
ranks, so each rank back-substitutes (and holds the A-matrices of) only its rows.

auto_LiRPA already bounds the unstable neurons of a layer in chunks of ``solver.crown.batch_size``
(``BoundedModule.batched_backward``). The wrapper gives rank r the contiguous block
``shard_range(U)`` of the U neurons, padded (with its last neuron) to the largest block so that every
rank runs the same number of chunks (and so the same collectives under FSDP), calls the original on
it, and all-gathers the ``(batch, rows)`` bounds in rank order.

α-CROWN optimises through these bounds, so the gather is differentiable (``all_gather_cat_grad``: its
backward all-reduces the gradient and keeps the rank's own block) and the gradient protocol makes the
result that of one process:

* every rank computes the same loss from the same gathered bounds; the bounds that leave
  ``_compute_bounds_main`` pass through a gradient scale of 1/P;
* the optimiser (``torch.optim.Adam``/``SGD`` as auto_LiRPA's ``optimized_bounds`` sees them) sums
  every parameter's gradient over the ranks before its step; so a replicated α gets P × 1/P of its
  gradient and a row α, whose gradient exists only on its owner, gets it once. The α stay equal on
  every rank, and so do all the decisions made from the bounds (early stop, best bounds, lr decay).

``return_A`` calls (which merge per-chunk A dictionaries) and layers with fewer neurons than ranks
run unsharded.

**Row-sharded α.** A ReLU's α for an intermediate start node (auto_LiRPA's ``alpha[start]``,
``(2, S, batch, *relu_shape)``: one slope set per start-node row) is used row by row, and the rows
that ``batched_backward`` deals to rank r are used only there. So right after
``BoundRelu.init_opt_parameters`` creates it, each rank keeps only its own rows, plus one default slot
(row 0, the initial slope): ``(2, 1 + own rows, batch, *relu_shape)``. Adam's state follows (it is
created from these tensors). While rank r deals a start node's rows, ``select_alpha_by_idx`` reads
its local α through a neuron → local-row table. Any other use of that α (every rank bounding the same
rows, e.g. below ``solver.crown.batch_size``) gets the whole α, all-gathered with autograd, so the
ranks stay identical. These α get their whole gradient on their owner (the gathers' backward sums it),
so the optimiser does not sum them; it sums every replicated parameter as before. Only fully
connected start nodes (1-D rows) with more unstable neurons than ``crown.batch_size`` (the ones whose
rows are dealt) are split; the output node's α (one row per spec) stays replicated.
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
from torch import Tensor

from ..parallel import comm

_active = False  # rows are sharded only inside the patched run
_dealing: list[str] = []  # the start nodes whose rows batched_backward is dealing now (innermost last)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def _scaled(t):
    if isinstance(t, Tensor) and t.requires_grad:
        return _GradScale.apply(t, 1.0 / comm.world_size())
    return t


def _unstable_size(idx) -> int:
    return int(idx[0].numel() if isinstance(idx, tuple) else idx.numel())


def _rows(idx, positions: Tensor):
    return tuple(u[positions] for u in idx) if isinstance(idx, tuple) else idx[positions]


def _owners(module, node, idx) -> Tensor:
    """The rank that bounds each of the U rows: the owner of the row's α where the start node's α is
    kept by row, else contiguous blocks (``shard_range``)."""
    if isinstance(idx, Tensor):
        for relu in getattr(module, "relus", ()):
            layout = _ALPHA.get(relu, {}).get(node.name)
            if layout is not None:
                return layout.owners_of(idx)
    sizes = comm.shard_sizes(_unstable_size(idx))
    return torch.cat([torch.full((n,), q, dtype=torch.long) for q, n in enumerate(sizes)])


def wrap_batched_backward(orig):
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
        if not _active or P == 1 or want_A or U < P:
            return orig(self, node, C, unstable_idx, batch_size, bound_lower, bound_upper, return_A)
        owners = _owners(self, node, idx).cpu()
        counts = torch.bincount(owners, minlength=P).tolist()
        most = max(counts)
        mine = (owners == comm.rank()).nonzero().squeeze(1)
        pad = mine[-1:] if mine.numel() else torch.zeros(1, dtype=torch.long)  # a row to repeat, dropped
        positions = torch.cat([mine, pad.expand(most - mine.numel())]).to(self.device)
        opts = self.bound_opts
        saved_ratio = opts.get("batched_crown_max_vram_ratio")
        opts["batched_crown_max_vram_ratio"] = 0.0  # never enlarge a chunk on one rank only
        _dealing.append(node.name)
        try:
            mine_idx = _rows(idx, positions)
            lb, ub = orig(self, node, C, mine_idx, batch_size, bound_lower, bound_upper, False)[:2]
        finally:
            opts["batched_crown_max_vram_ratio"] = saved_ratio
            _dealing.pop()
        keep = torch.cat([torch.arange(q * most, q * most + n) for q, n in enumerate(counts)])
        order = torch.cat([(owners == q).nonzero().squeeze(1) for q in range(P)])  # row of each kept column
        back = torch.empty_like(order)
        back[order] = torch.arange(U)
        take = keep.index_select(0, back).to(self.device)  # gathered column of every row, in row order

        def gathered(t):
            if t is None:
                return None
            full = comm.all_gather_cat_grad(t.reshape(batch_size, most), 1, sizes=[most] * P)
            full = full.index_select(1, take)
            return full.reshape(batch_size, *node.output_shape[1:]) if dense else full

        return gathered(lb), gathered(ub)

    return batched_backward


def wrap_compute_bounds_main(orig):
    def _compute_bounds_main(self, *args, **kwargs):
        ret = orig(self, *args, **kwargs)
        if not _active or comm.world_size() == 1 or not torch.is_grad_enabled() or not isinstance(ret, tuple):
            return ret
        return (_scaled(ret[0]), _scaled(ret[1]), *ret[2:])

    return _compute_bounds_main


# ---------------------------------------------------------------------------------------------------------
# Row-sharded α
# ---------------------------------------------------------------------------------------------------------


class RowAlpha:
    """How one (ReLU, start node) α is kept by row on this rank: the rows of ``idx`` (the start node's
    neurons that have their own α row) in contiguous blocks over the ranks, plus a default slot 0."""

    def __init__(self, idx: Tensor, size_s: int, orig_lookup: Tensor | None, full_rows: int) -> None:
        U = idx.numel()
        lo, hi = comm.shard_range(U)
        self.idx, self.size_s, self.orig_lookup, self.full_rows = idx, size_s, orig_lookup, full_rows
        self.sizes = comm.shard_sizes(U)
        self.own = idx[lo:hi]
        self.lookup = torch.zeros(size_s, dtype=torch.long, device=idx.device)  # neuron -> local row
        self.lookup[self.own] = torch.arange(1, hi - lo + 1, device=idx.device)
        self.owner = torch.full((size_s,), -1, dtype=torch.long)  # neuron -> rank (-1: slot 0 only)
        blocks = [torch.full((n,), q, dtype=torch.long) for q, n in enumerate(self.sizes)]
        self.owner[idx.cpu()] = torch.cat(blocks)

    def owners_of(self, rows: Tensor) -> Tensor:
        """The rank that bounds each row: its α's owner; rows without an α row of their own (they use
        slot 0, as in auto_LiRPA) go round-robin."""
        o = self.owner[rows.cpu()]
        extra = (o < 0).nonzero().squeeze(1)
        o[extra] = torch.arange(extra.numel()) % comm.world_size()
        return o

    def split(self, alpha: Tensor) -> Tensor:
        """auto_LiRPA's α (``(2, full_rows, batch, ...)``) -> this rank's ``(2, 1 + own, batch, ...)``."""
        if self.orig_lookup is not None:  # sparse spec: row 0 is auto_LiRPA's own default slot
            rows, default = self.orig_lookup[self.own], alpha[:, :1]
        else:
            rows, default = self.own, alpha[:, self.own[:1]]
        local = torch.cat([default, alpha[:, rows]], 1).detach().clone()
        return local.requires_grad_(alpha.requires_grad)

    def owns(self, alpha: Tensor) -> bool:
        return alpha.shape[1] == 1 + self.own.numel() != self.full_rows

    def whole(self, local: Tensor) -> Tensor:
        """The α as auto_LiRPA laid it out, from every rank's rows (differentiable)."""
        rows = comm.all_gather_cat_grad(local[:, 1:], 1, sizes=self.sizes)  # (2, U, batch, ...)
        if self.orig_lookup is not None:
            return torch.cat([local[:, :1], rows], 1)
        return rows  # dense: idx is every neuron, in order


_ALPHA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BoundRelu -> {start name: RowAlpha}


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
    if lookup is None:  # dense spec: every neuron has its own α row
        unstable_idx = torch.arange(size_s, device=relu.alpha[name].device)
    return RowAlpha(unstable_idx, size_s, lookup, relu.alpha[name].shape[1])


def wrap_init_opt_parameters(orig):
    def init_opt_parameters(self, start_nodes):
        orig(self, start_nodes)
        if not _active or comm.world_size() == 1:
            return
        table = {}
        for start in start_nodes:  # (the list can name a start node more than once)
            if start[0] in table:
                continue
            layout = _dealt(self, start)
            if layout is not None:
                self.alpha[start[0]] = layout.split(self.alpha[start[0]])
                table[start[0]] = layout
        _ALPHA[self] = table

    return init_opt_parameters


def wrap_select_alpha_by_idx(orig):
    def select_alpha_by_idx(self, last_lA, last_uA, unstable_idx, start_node):
        name = start_node.name
        layout = _ALPHA.get(self, {}).get(name)
        local = self.alpha.get(name) if layout is not None else None
        if local is None or not layout.owns(local):
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        if _dealing and _dealing[-1] == name and isinstance(unstable_idx, Tensor) and unstable_idx.ndim == 1:
            return self.non_deter_index_select(local, index=layout.lookup[unstable_idx], dim=1), None
        self.alpha[name] = layout.whole(local)  # every rank bounds these rows: the whole α everywhere
        try:
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        finally:
            self.alpha[name] = local

    return select_alpha_by_idx


@contextlib.contextmanager
def inactive():
    """Rows not dealt while inside (a rank's share of a BaB round is rank-local work). On entry the α
    kept by row become whole again on every rank (collective)."""
    global _active
    for relu, table in list(_ALPHA.items()):  # the same order on every rank
        for name, layout in table.items():
            a = relu.alpha.get(name) if relu.alpha else None
            if a is not None and layout.owns(a):
                relu.alpha[name] = layout.whole(a).detach().requires_grad_(a.requires_grad)
    _ALPHA.clear()
    was, _active = _active, False
    try:
        yield
    finally:
        _active = was


def _row_alphas() -> set[int]:
    """ids of the α tensors that are kept by row now (their owner has their rows' whole gradient)."""
    out = set()
    for relu, table in list(_ALPHA.items()):
        for name, layout in table.items():
            t = relu.alpha.get(name) if relu.alpha else None
            if t is not None and layout.owns(t):
                out.add(id(t))
    return out


def _sum_grads(params) -> None:
    local = _row_alphas()
    for group in params:
        for p in group["params"]:
            if id(p) in local:  # only the shared default slot is summed
                if p.grad is not None:
                    p.grad[:, :1] = comm.all_reduce(p.grad[:, :1], "sum")
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(comm.all_reduce(p.grad, "sum"))


def _synced(cls):
    class Synced(cls):
        def step(self, *args, **kwargs):
            if _active and comm.world_size() > 1:
                _sum_grads(self.param_groups)
            return super().step(*args, **kwargs)

    Synced.__name__ = Synced.__qualname__ = f"Synced{cls.__name__}"
    return Synced


def install(p) -> None:
    import sys

    import auto_LiRPA.optimized_bounds as ob

    p.wrap("auto_LiRPA.BoundedModule.batched_backward", wrap_batched_backward)
    p.wrap("auto_LiRPA.BoundedModule._compute_bounds_main", wrap_compute_bounds_main)
    p.wrap("auto_LiRPA.operators.BoundRelu.init_opt_parameters", wrap_init_opt_parameters)
    p.wrap("auto_LiRPA.operators.BoundRelu.select_alpha_by_idx", wrap_select_alpha_by_idx)
    optim = types.ModuleType("optim")
    optim.__dict__.update(torch.optim.__dict__)
    optim.Adam = _synced(torch.optim.Adam)  # type: ignore[attr-defined]
    optim.SGD = _synced(torch.optim.SGD)  # type: ignore[attr-defined]
    p.set(ob, "optim", optim)
    p.set(sys.modules[__name__], "_active", True)
