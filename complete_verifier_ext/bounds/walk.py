"""The generic backward walker (CROWN back-substitution) and input-box concretisation.

The walker knows nothing about any operator: it asks each node's op for ``backward``.  Given
``A`` of shape ``(S, B, *shape_start)`` it returns, for each of the S rows, a lower bound of
``sum(A[s] * x_start)`` over the input box, as a tensor ``(S, B)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .concretize import concretize_mid_rad
from .graph import Graph
from .ops import Slopes
from .window import Window, accumulate, as_dense

Box = tuple[Tensor, Tensor]
Bounds = dict[int, Box]  # node index -> (lower, upper), each (B, *shape)
Alphas = dict[int, Tensor | Slopes]  # ReLU node index -> slopes (S, B, *shape), or sparse ones


def finite_batch(box: Box) -> Tensor:
    """(B,) True where every lower and upper bound of batch element b is finite, and so is every width
    ``hi − lo`` (finite bounds such as ±2e38 have a width that overflows float32, and the ReLU
    relaxation's slope ``u / (u − l)`` then comes out 0: an upper line below the ReLU)."""
    lo, hi = box
    return torch.isfinite(hi - lo).flatten(1).all(1)


def proven_only(lb: Tensor, ok: Tensor | None = None) -> Tensor:
    """Lower bounds (S, B) with every value that proves nothing set to ``-inf``: a NaN or infinite bound,
    and every bound of a batch element whose ``ok`` (B,) is False (a non-finite bound it was built from).

    A relaxation built from a non-finite bound divides inf by inf or multiplies it by 0, and what comes
    out is NaN or, worse, a finite number with no meaning; so *every* lower bound leaves the walker (and
    IBP) through this function, and every comparison with 0 downstream sees ``-inf``: not proven."""
    keep = torch.isfinite(lb)
    if ok is not None:
        keep = keep & ok
    return torch.where(keep, lb, torch.full_like(lb, -torch.inf))


ROUNDING = 2.0**-20  # about 8 float32 ulps: what float32 evaluation order can move an output by


def margin(lb: Tensor, d: Tensor) -> Tensor:
    """``lb - d`` (float64), safe to compare with 0: a clause row counts as proven only when its lower
    bound clears the threshold by more than float32 rounding, ``ROUNDING * (|lb| + |d|)`` (the network
    itself, run in float32 by torch or onnxruntime in another order, can land that far from where the
    bound was computed: on a zero-width box the bound *is* one such evaluation); NaN is ``-inf``.  For
    ``d = 0`` (robustness rows) the sign never changes."""
    lb, d = lb.double(), torch.as_tensor(d, dtype=torch.float64, device=lb.device)
    m = lb - d - ROUNDING * (lb.abs() + d.abs())
    return torch.where(torch.isnan(m), -torch.inf, m)


def concretize(A: Tensor, box: Box) -> Tensor:
    """min over x in box of sum(A * x): ``A·mid − |A|·rad``.  A: (S, B, *in), box: (B, *in) -> (S, B)."""
    lo, hi = box
    mid, rad = (hi + lo) / 2, (hi - lo) / 2
    return concretize_mid_rad(A.flatten(2), mid.flatten(1), rad.flatten(1))


def back_substitute(
    graph: Graph,
    start: int,
    A: Tensor | Window,
    bounds: Bounds,
    box: Box,
    alphas: Alphas | None = None,
    betas: dict[int, Tensor] | None = None,
    record: dict[int, Tensor] | None = None,
) -> Tensor:
    """Lower bounds (S, B) of ``sum(A * value(start))`` over the input box.

    ``bounds`` must hold the pre-activation bounds of every ReLU between the input and ``start``;
    ``alphas`` optionally gives α-CROWN lower slopes for those ReLUs (rows matching A's rows).
    ``betas[k]`` (S, B, *shape_k), β-CROWN: a Lagrangian term ``sum(betas[k] * value(k))`` added
    when the walk reaches node k; it must be <= 0 on the domain (``-β z`` for a split ``z >= 0``,
    ``+β z`` for ``z <= 0``, β >= 0), so the result stays a lower bound there.
    ``record``, if given, receives the A-matrix arriving at every ReLU output and, under key 0, the
    one at the input.  Each A-matrix is dropped as soon as it has been pushed through its node.
    ``A`` may be a :class:`Window` (rows of conv neurons): it stays one through the ops that take
    windows and becomes dense before any other.
    A bound that is not finite, or that some non-finite ReLU input bound went into, comes out as
    ``-inf`` (:func:`proven_only`).
    """
    base = A.values if isinstance(A, Window) else A
    no_input = base.new_zeros(base.shape[:2])  # the rows' bias alone, should the walk not reach the input
    pending: dict[int, Tensor | Window] = {start: A}
    del A, base  # each A-matrix lives only until its node has pushed it through (the caller holds none)
    bias: Tensor | float = 0.0
    ok = finite_batch(box)  # (B,): no non-finite bound has gone into batch element b
    for k in range(start, 0, -1):
        A_k = pending.pop(k, None)
        if A_k is None:
            continue
        node, beta = graph.nodes[k], None if betas is None else betas.get(k)
        if not node.op.windows or beta is not None or (record is not None and node.op.is_relu):
            A_k = as_dense(A_k)
        if beta is not None:
            A_k = A_k + beta
        if record is not None and node.op.is_relu:
            record[k] = A_k
        in_bounds = [bounds[i] for i in node.inputs] if node.op.needs_bounds else []
        for b in in_bounds:  # a relaxation built from a non-finite bound proves nothing
            ok = ok & finite_batch(b)
        alpha = None if alphas is None else alphas.get(k)
        shapes = [graph.nodes[i].shape for i in node.inputs]
        A_in, b = node.op.bound_backward(A_k, shapes, in_bounds, alpha)
        del A_k
        bias = bias + b
        for i, Ai in zip(node.inputs, A_in, strict=True):
            if Ai is not None:
                pending[i] = Ai if i not in pending else accumulate(pending[i], Ai)
    A0 = pending.pop(0, None)
    if A0 is None:  # the start node does not depend on the input
        return proven_only(bias + no_input, ok)
    if record is not None:
        A0 = record[0] = as_dense(A0)
    lb = A0.concretize(box) if isinstance(A0, Window) else concretize(A0, box)
    return proven_only(lb + bias, ok)
