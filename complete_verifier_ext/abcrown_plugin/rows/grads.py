"""The gradient protocol that makes α-CROWN over dealt rows one process's.

α-CROWN optimises through the dealt bounds, so their gather is differentiable (``all_gather_cat_grad``:
its backward, one reduce-scatter, sums the gradient over the ranks and keeps the rank's block), and:

* every rank computes the same loss from the same gathered bounds; the bounds that leave
  ``_compute_bounds_main`` carry their gradient on rank 0 alone (a factor 0 elsewhere), so what every
  rank computes identically is counted once in each sum over the ranks, exactly (a factor 1/P on
  every rank is not exact for P = 3);
* the optimiser (``torch.optim.Adam``/``SGD`` as auto_LiRPA's ``optimized_bounds`` sees them) sums
  every parameter's gradient over the ranks before its step (an α kept by row: only its slot 0). The
  parameters stay equal on every rank, and so do all the decisions made from the bounds (early stop,
  best bounds, lr decay). The bounds are one process's up to the order of these sums.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from ...parallel import comm
from ..run import Rows, Run


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
