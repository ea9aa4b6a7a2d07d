"""Branching for ReLU-split BaB: which neuron each domain splits next.

* BaBSR: the free unstable neuron with the largest BaBSR score (``Relu.branch_scores``: the
  relaxation's intercept and the pre-activation bias that a split changes, through the A-matrices of
  the domain's best bound, over the spec rows that are not yet verified).
* FSB (``fsb``, ``kfsb``): the ``candidates`` best neurons by that score and the ``candidates`` best by
  the intercept term alone (α,β-CROWN's kfsb) are each tried with one cheap bound of both children
  (the domain's α and β, no optimisation), one batched back-substitution per candidate rank for all
  domains (``candidates`` calls on every rank, an empty batch where a rank has none, for lockstep);
  the candidate whose children score best under ``reduceop`` (their worst clause margin, min or max
  of the two) wins.

Every domain's choice depends on that domain alone, so it is the same at any P.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..bounds.beta import split_bound
from ..bounds.crown import spec_matrix
from ..bounds.ops import Relu
from ..bounds.walk import Bounds
from ..spec import Clauses
from .common import BabOptions
from .domain import BetaCrown

Branch = tuple[int, int]  # (pre-activation node, flat neuron index)


def babsr_scores(
    bc: BetaCrown, record: dict[int, Tensor], bounds: Bounds, split: dict[int, Tensor], rows: Tensor
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """BaBSR's score and intercept term (``Relu.branch_scores``) of splitting each free unstable
    neuron, from the recorded A-matrices of the domains' best bounds, over the rows that are not yet
    verified (``rows`` (B, S), 1 where open). Two dicts of (B, n_k) per node."""
    scores, intercepts = {}, {}
    for j in bc.relus:
        k = bc.relu_in[j]
        A = record.get(j)
        if A is None:
            continue
        lo, hi = bounds[k]
        bias = bc.graph.nodes[k].op.neuron_bias()
        score, term = Relu.branch_scores(A, lo, hi, bias, rows.T, split[k] == 0)
        scores[k], intercepts[k] = score.flatten(1), term.flatten(1)
    return scores, intercepts


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


def babsr(scores: tuple[dict[int, Tensor], dict[int, Tensor]], B: int) -> list[Branch | None]:
    """Each domain's neuron of the best BaBSR score; None where no neuron is free and unstable."""
    every, offsets = flat_scores(scores[0], B)
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
    scores: tuple[dict[int, Tensor], dict[int, Tensor]],
    B: int,
) -> list[Branch | None]:
    """Filtered smart branching (see the module docstring). ``scores``: BaBSR's score and intercept
    term (:func:`babsr_scores`); the ``k`` best neurons of each are the candidates. Candidate rank
    ``c`` of both lists is bounded in one call, a batch of ``4 B`` trial children (domain-major, then
    list, then (active, inactive)), so that the trial batch is never larger than four times the
    domains; every rank makes the same ``k`` calls (``k`` depends on the model only), whatever its
    ``B``."""
    every, offsets = flat_scores(scores[0], B)
    inter, _ = flat_scores(scores[1], B)
    n_free = sum(math.prod(bc.graph.nodes[q].shape) for q in bc.pre)
    k = max(1, min(opts.candidates, n_free))
    if B:
        kk = min(k, every.shape[1])
        top = [every.topk(kk, dim=1), inter.topk(kk, dim=1)]  # (B, kk) each
        top_score = torch.stack([t.values for t in top], 2)  # (B, kk, 2)
        top_flat = torch.stack([t.indices for t in top], 2)
    S, shapes = problem.C.shape[0], {q: bc.graph.nodes[q].shape for q in bc.pre}
    n = 4  # trial children per domain and call: 2 lists x (active, inactive)
    trial_split = {q: split[q].repeat_interleave(n, 0) if B else torch.zeros(0, *shapes[q]) for q in bc.pre}
    trial_beta = {q: beta[q].repeat_interleave(n, 1) if B else torch.zeros(S, 0, *shapes[q]) for q in bc.pre}
    trial_alpha = {j: a.repeat_interleave(n, 1) for j, a in alpha.items()}
    box = (bc.box[0].expand(n * B, *bc.box[0].shape[1:]), bc.box[1].expand(n * B, *bc.box[1].shape[1:]))
    A = spec_matrix(problem.C, n * B, bc.graph.nodes[bc.out].shape)
    pair = torch.full((B, k, 2), -torch.inf)
    for c in range(k):
        has = B > 0 and c < kk  # else an empty batch: this rank stays in lockstep
        m = n * B if has else 0
        columns = top_flat[:, c].contiguous() if has else None
        trial = _children_bounds(bc, bounds, offsets, columns, 2, m // n)
        alpha_m, beta_m = ({j: a[:, :m] for j, a in d.items()} for d in (trial_alpha, trial_beta))
        split_m, box_m = {q: t[:m] for q, t in trial_split.items()}, (box[0][:m], box[1][:m])
        lb = split_bound(bc.graph, bc.out, A[:, :m], trial, box_m, alpha_m, split_m, beta_m).T  # (n B, S)
        if has:
            child_worst = problem.margins(lb).min(1).values.view(B, 2, 2)
            reduce = child_worst.amin if opts.reduceop == "min" else child_worst.amax
            pair[:, c] = reduce(2)
    if not B:
        return []
    pair = torch.where(top_score >= 0, pair[:, :kk], -torch.inf).flatten(1)  # (B, 2 kk): rank, then list
    flat = top_flat.flatten(1)
    return [
        None if float(top_score[b, 0, 0]) < 0 else locate(offsets, int(flat[b, int(pair[b].argmax())]))
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
