"""Concretising a linear bound over a box: ``min over x in box of sum(A * x) = A·mid − |A|·rad``, with an
autograd rule that keeps A's sign instead of A (used by the dense rows and the windows alike)."""

from __future__ import annotations

import torch
from torch import Tensor


def concretize_mid_rad(A: Tensor, mid: Tensor, rad: Tensor) -> Tensor:
    """``(A·mid).sum(-1) − (|A|·rad).sum(-1)`` over A's dimensions from 2 on (``mid``, ``rad``
    broadcast to A). Under autograd it keeps A's sign (int8), not A, for A's gradient ``mid −
    sign(A)·rad``: a quarter of the memory, for the last A of every row of α-CROWN."""
    if not torch.is_grad_enabled() or not A.requires_grad:
        dims = tuple(range(2, A.dim()))
        return (A * mid).sum(dims) - (A.abs() * rad).sum(dims)
    return _Concretize.apply(A, mid, rad)


class _Concretize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A: Tensor, mid: Tensor, rad: Tensor) -> Tensor:
        dims = tuple(range(2, A.dim()))
        out = (A * mid).sum(dims) - (A.abs() * rad).sum(dims)
        box_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(A.sign().to(torch.int8), mid, rad, A if box_grad else None)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        sign, mid, rad, A = ctx.saved_tensors
        g = grad.reshape(*grad.shape, *[1] * (sign.dim() - 2))  # (S, B, 1, ...)
        grad_A = g * (mid - sign * rad) if ctx.needs_input_grad[0] else None
        grad_mid = _sum_to(g * A, mid.shape) if ctx.needs_input_grad[1] else None
        grad_rad = _sum_to(-g * A.abs(), rad.shape) if ctx.needs_input_grad[2] else None
        return grad_A, grad_mid, grad_rad


def _sum_to(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` summed over the dimensions a broadcast to it added or expanded, back to ``shape``."""
    lead = t.dim() - len(shape)
    t = t.sum(tuple(range(lead))) if lead else t
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dims, keepdim=True) if dims else t
