"""The generic backward walker (CROWN back-substitution) and input-box concretisation.

The walker knows nothing about any operator: it asks each node's op for ``backward``.  Given
``A`` of shape ``(S, B, *shape_start)`` it returns, for each of the S rows, a lower bound of
``sum(A[s] * x_start)`` over the input box, as a tensor ``(S, B)``.
"""

from __future__ import annotations

from torch import Tensor

from ..model.graph import Graph

Box = tuple[Tensor, Tensor]
Bounds = dict[int, Box]  # node index -> (lower, upper), each (B, *shape)
Alphas = dict[int, Tensor]  # ReLU node index -> slopes (S, B, *shape)


def concretize(A: Tensor, box: Box) -> Tensor:
    """min over x in box of sum(A * x): ``A·mid − |A|·rad``.  A: (S, B, *in), box: (B, *in) -> (S, B)."""
    lo, hi = box
    mid, rad = (hi + lo) / 2, (hi - lo) / 2
    A = A.flatten(2)  # (S, B, n)
    return (A * mid.flatten(1)).sum(-1) - (A.abs() * rad.flatten(1)).sum(-1)


def back_substitute(
    graph: Graph,
    start: int,
    A: Tensor,
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
    """
    pending: dict[int, Tensor] = {start: A}
    bias: Tensor | float = 0.0
    for k in range(start, 0, -1):
        A_k = pending.pop(k, None)
        if A_k is None:
            continue
        if betas is not None and k in betas:
            A_k = A_k + betas[k]
        node = graph.nodes[k]
        if record is not None and node.op.is_relu:
            record[k] = A_k
        if node.op.is_relu:
            lo, hi = bounds[node.inputs[0]]
            alpha = None if alphas is None else alphas.get(k)
            A_in, b = node.op.backward_relu(A_k, lo, hi, alpha)
        else:
            A_in, b = node.op.backward(A_k, *(graph.nodes[i].shape for i in node.inputs))
        del A_k
        bias = bias + b
        for i, Ai in zip(node.inputs, A_in):
            if Ai is not None:
                pending[i] = Ai if i not in pending else pending[i] + Ai
    A0 = pending.pop(0, None)
    if A0 is None:  # the start node does not depend on the input
        return bias + A.new_zeros(A.shape[:2])
    if record is not None:
        record[0] = A0
    return concretize(A0, box) + bias
