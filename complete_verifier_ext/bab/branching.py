"""Branching for ReLU-split BaB: which neuron each domain splits next.

* BaBSR: the free unstable neuron with the largest ``Relu.split_score``, weighted by |A| summed over
  the spec rows that are not yet verified (A: the recorded A-matrices of the domain's best bound).
* FSB (``fsb``, ``kfsb``): the ``candidates`` best neurons by that score are each tried with one
  cheap bound of both children (the domain's α and β, no optimisation), all candidates of all domains
  in ONE batched back-substitution (also run with an empty batch, for lockstep); the candidate whose
  children score best under ``reduceop`` (their worst clause margin, min or max of the two) wins.

Every domain's choice depends on that domain alone, so it is the same at any P.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..bounds.beta import split_bound
from ..bounds.crown import spec_matrix
from ..bounds.ops import Relu
from ..bounds.walk import Bounds
from ..spec import Clauses
from .common import BabOptions

if TYPE_CHECKING:
    from .relu_split import BetaCrown

Branch = tuple[int, int]  # (pre-activation node, flat neuron index)


def babsr_scores(
    bc: BetaCrown, record: dict[int, Tensor], bounds: Bounds, split: dict[int, Tensor], rows: Tensor
) -> dict[int, Tensor]:
    """Score of splitting each free unstable neuron (``Relu.split_score``), its weight |A| summed over
    the rows that are not yet verified (``rows`` (B, S), 1 where open).  (B, n_k) per node."""
    scores = {}
    for j in bc.relus:
        k = bc.relu_in[j]
        lo, hi = bounds[k]
        A = record.get(j)
        if A is None:
            continue
        w = (A.abs() * rows.T.reshape(A.shape[0], A.shape[1], *[1] * (A.dim() - 2))).sum(0)  # (B, *shape)
        scores[k] = Relu.split_score(w, lo, hi, split[k] == 0).flatten(1)
    return scores


def flat_scores(scores: dict[int, Tensor], B: int) -> tuple[Tensor, list[tuple[int, int]]]:
    """All nodes' scores side by side (B, N), and (node, offset) of each node's block."""
    blocks, offsets, o = [], [], 0
    for k, sc in scores.items():
        blocks.append(sc)
        offsets.append((k, o))
        o += sc.shape[1]
    return (torch.cat(blocks, 1) if blocks else torch.zeros(B, 0)), offsets


def locate(offsets: list[tuple[int, int]], flat: int) -> Branch:
    """The (node, neuron) of column ``flat`` of :func:`flat_scores`."""
    for k, o in reversed(offsets):
        if flat >= o:
            return k, flat - o
    raise IndexError(flat)


def babsr(scores: dict[int, Tensor], B: int) -> list[Branch | None]:
    """Each domain's best-scoring neuron; None where no neuron is free and unstable."""
    every, offsets = flat_scores(scores, B)
    out: list[Branch | None] = []
    for b in range(B):
        if every.shape[1] == 0 or float(every[b].max()) < 0:
            out.append(None)
        else:
            out.append(locate(offsets, int(every[b].argmax())))
    return out


@torch.no_grad()
def fsb(
    bc: BetaCrown,
    problem: Clauses,
    opts: BabOptions,
    bounds: Bounds,
    split: dict[int, Tensor],
    alpha: dict[int, Tensor],
    beta: dict[int, Tensor],
    scores: dict[int, Tensor],
    B: int,
) -> list[Branch | None]:
    """Filtered smart branching (see the module docstring). Children are laid out domain-major, then
    candidate, then (active, inactive): child ``(b * k + c) * 2 + side``."""
    every, offsets = flat_scores(scores, B)
    k = max(1, min(opts.candidates, every.shape[1])) if B else 1
    top_score, top_flat = every.topk(k, dim=1) if B else (None, None)  # (B, k)
    n = 2 * k * B
    trial = _children_bounds(bc, bounds, offsets, top_flat, k, B)
    S, shapes = problem.C.shape[0], {q: bc.graph.nodes[q].shape for q in bc.pre}
    trial_split = {
        q: split[q].repeat_interleave(2 * k, 0) if B else torch.zeros(0, *shapes[q]) for q in bc.pre
    }
    trial_beta = {
        q: beta[q].repeat_interleave(2 * k, 1) if B else torch.zeros(S, 0, *shapes[q]) for q in bc.pre
    }
    trial_alpha = {j: a.repeat_interleave(2 * k, 1) for j, a in alpha.items()}
    box = (bc.box[0].expand(n, *bc.box[0].shape[1:]), bc.box[1].expand(n, *bc.box[1].shape[1:]))
    A = spec_matrix(problem.C, n, bc.graph.nodes[bc.out].shape)
    lb = split_bound(bc.graph, bc.out, A, trial, box, trial_alpha, trial_split, trial_beta).T  # (n, S)
    if not B:
        return []
    child_worst = problem.margins(lb).min(1).values.view(B, k, 2)
    pair = child_worst.min(2).values if opts.reduceop == "min" else child_worst.max(2).values
    pair = torch.where(top_score >= 0, pair, torch.full_like(pair, -torch.inf))
    return [
        None if float(top_score[b, 0]) < 0 else locate(offsets, int(top_flat[b, int(pair[b].argmax())]))
        for b in range(B)
    ]


def _children_bounds(
    bc: BetaCrown, bounds: Bounds, offsets: list[tuple[int, int]], top_flat: Tensor | None, k: int, B: int
) -> Bounds:
    """Every domain's bounds repeated for its ``2 k`` trial children, each candidate neuron clamped to
    ``l >= 0`` in its active child and ``u <= 0`` in its inactive one."""
    g, n = bc.graph, 2 * k * B
    out: Bounds = {}
    if B:
        starts = torch.tensor([o for _, o in offsets])
        block = torch.searchsorted(starts, top_flat, right=True) - 1  # (B, k): which node's block
        neuron = top_flat - starts[block]
    for q in bc.pre:
        shape = g.nodes[q].shape
        if not B:
            out[q] = (torch.zeros(0, *shape), torch.zeros(0, *shape))
            continue
        lo = bounds[q][0].repeat_interleave(2 * k, 0).flatten(1).clone()
        hi = bounds[q][1].repeat_interleave(2 * k, 0).flatten(1).clone()
        here = [i for i, (node, _) in enumerate(offsets) if node == q]
        for c in range(k):
            chosen = (block[:, c] == here[0]) if here else torch.zeros(B, dtype=torch.bool)
            dom, nr = chosen.nonzero().flatten(), neuron[chosen, c]
            active, inactive = (dom * k + c) * 2, (dom * k + c) * 2 + 1
            lo[active, nr] = lo[active, nr].clamp(min=0.0)
            hi[inactive, nr] = hi[inactive, nr].clamp(max=0.0)
        out[q] = (lo.view(n, *shape), hi.view(n, *shape))
    return out
