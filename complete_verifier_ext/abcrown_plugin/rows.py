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
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from ..parallel import comm

_active = False  # rows are sharded only inside the patched run


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


def _take(idx, lo: int, hi: int, pad: int):
    """Rows ``[lo, hi)`` of the index (tensor or tuple of tensors), padded with ``pad`` copies of the last."""

    def one(u: Tensor) -> Tensor:
        part = u[lo:hi]
        if pad:
            part = torch.cat([part, part[-1:].expand(pad, *part.shape[1:])])
        return part

    return tuple(one(u) for u in idx) if isinstance(idx, tuple) else one(idx)


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
        sizes = comm.shard_sizes(U)
        most = max(sizes)
        lo, hi = comm.shard_range(U)
        local = _take(idx, lo, hi, most - (hi - lo))
        opts = self.bound_opts
        saved_ratio = opts.get("batched_crown_max_vram_ratio")
        opts["batched_crown_max_vram_ratio"] = 0.0  # never enlarge a chunk on one rank only
        try:
            lb, ub = orig(self, node, C, local, batch_size, bound_lower, bound_upper, False)[:2]
        finally:
            opts["batched_crown_max_vram_ratio"] = saved_ratio
        keep = torch.cat([torch.arange(q * most, q * most + n) for q, n in enumerate(sizes)]).to(self.device)

        def gathered(t):
            if t is None:
                return None
            full = comm.all_gather_cat_grad(t.reshape(batch_size, most), 1, sizes=[most] * P)
            full = full.index_select(1, keep)
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


def _sum_grads(params) -> None:
    for group in params:
        for p in group["params"]:
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
    optim = types.ModuleType("optim")
    optim.__dict__.update(torch.optim.__dict__)
    optim.Adam = _synced(torch.optim.Adam)  # type: ignore[attr-defined]
    optim.SGD = _synced(torch.optim.SGD)  # type: ignore[attr-defined]
    p.set(ob, "optim", optim)
    p.set(sys.modules[__name__], "_active", True)
