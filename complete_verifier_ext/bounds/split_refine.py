"""Tightening intermediate bounds by splitting earlier neurons (``solver.mip.refine_method: split``).

To bound ``s * z_j`` (a pre-activation neuron of node k, side s = ±1), pick the ``depth`` unstable
neurons before k that matter most to its CROWN bound (|A| at their ReLU times the gap of their
triangle relaxation: BaBSR's score, per target), and bound ``s * z_j`` on each of the ``2^depth``
sign patterns of those neurons with β-CROWN: the split neurons' bounds are fixed (``l = 0`` or
``u = 0``), β adds ``-β z`` / ``+β z`` for the splits (β >= 0, <= 0 on the pattern), and α and β are
optimised jointly by Adam for ``iteration`` steps, keeping the best bound of any step.  The patterns
cover the box, so the minimum over them is a sound lower bound of ``s * z_j``.  Every (target,
pattern) pair is one element of the engine's batch axis, so a layer costs a few large batched
back-substitutions instead of a MILP per neuron, and it works on any graph the engine bounds.

``refine.refine_in_order`` runs the layers in order and deals the targets over the ranks; the
back-substitutions here issue no collective, so the graph must be whole on every rank (mode
``none``, or inside ``Graph.replicated()`` under FSDP).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from ..parallel import comm
from .beta import optimise_alpha_beta, split_bound
from .crown import ancestors_relus, exact_by_ibp, pre_activation_nodes
from .graph import Graph
from .ops import Relu
from .refine import FlatBounds, Task, refine_in_order
from .walk import Bounds, Box, back_substitute

MAX_ELEMENTS = 1 << 25  # per batched bound tensor (domains × earlier neurons): about 128 MB in float32


@dataclass(frozen=True)
class SplitOptions:
    depth: int = 6  # neurons split per target: 2^depth patterns
    layers: int = 0  # how many layers after the first to refine; 0: all
    iteration: int = 20
    lr_alpha: float = 0.1
    lr_beta: float = 0.05
    lr_decay: float = 0.98
    max_domains: int = 8192  # (target, pattern) pairs bounded together
    passes: int = 1  # at most this many passes, each at depth + 2 from the bounds of the one before


def _expand(t: Tensor, B: int) -> Tensor:
    return t.expand(B, *t.shape[1:])


def _target_matrix(graph: Graph, k: int, tasks: list[Task]) -> Tensor:
    """The start matrix (1, T, *shape) of node k: row t is ``side_t`` at neuron ``j_t``."""
    T, shape = len(tasks), graph.nodes[k].shape
    n = math.prod(shape)
    A = torch.zeros(1, T, n)
    A[0, torch.arange(T), torch.tensor([j for j, _ in tasks])] = torch.tensor([s for _, s in tasks])
    return A.view(1, T, *shape)


def _split_choice(
    graph: Graph,
    k: int,
    A: Tensor,
    bounds: Bounds,
    box: Box,
    relus: list[int],
    ins: list[int],
    sizes: list[int],
    depth: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The flat bounds ``lo``, ``hi`` (N,) of the neurons ``ins`` before k (``sizes`` each) and, per
    target of ``A``, the ``d = min(depth, unstable)`` unstable ones that matter most to its CROWN
    bound (BaBSR's score), most useful first: (T, d)."""
    T = A.shape[1]
    record: dict[int, Tensor] = {}
    with torch.no_grad():  # which earlier neurons each target's CROWN bound depends on
        tb = {q: (_expand(bounds[q][0], T), _expand(bounds[q][1], T)) for q in ins}
        back_substitute(graph, k, A, tb, (_expand(box[0], T), _expand(box[1], T)), record=record)
    lo = torch.cat([bounds[q][0].reshape(-1) for q in ins]) if ins else torch.zeros(0)
    hi = torch.cat([bounds[q][1].reshape(-1) for q in ins]) if ins else torch.zeros(0)
    unstable = (lo < 0) & (hi > 0)
    reach = [
        record[r][0].reshape(T, -1).abs() if r in record else torch.zeros(T, m)
        for r, m in zip(relus, sizes, strict=True)
    ]
    score = Relu.split_score(torch.cat(reach, 1), lo, hi) if ins else torch.zeros(T, 0)
    d = min(depth, int(unstable.sum()))
    return lo, hi, score.topk(d, 1).indices


def _pattern_bounds(lo: Tensor, hi: Tensor, top: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For each target and each of the ``L = 2^d`` sign patterns of its split neurons ``top`` (T, d),
    in that order (B = T L): the flat bounds with the splits applied, (B, N) each, and the split
    signs (B, N): +1 active, -1 inactive, 0 not split."""
    T, d = top.shape
    L = 1 << d
    B = T * L
    pattern = ((torch.arange(L)[:, None] >> torch.arange(d)) & 1).bool()  # (L, d): True = active
    cols, act = top.repeat_interleave(L, 0), pattern.repeat(T, 1)  # (B, d) each
    rows = torch.arange(B)[:, None].expand(B, d)
    lo_b, hi_b = lo.expand(B, -1).clone(), hi.expand(B, -1).clone()
    split = torch.zeros(B, lo.numel())
    lo_b[rows[act], cols[act]] = 0.0  # z >= 0: the neuron is active (exact)
    hi_b[rows[~act], cols[~act]] = 0.0  # z <= 0: inactive
    split[rows[act], cols[act]], split[rows[~act], cols[~act]] = 1.0, -1.0
    return lo_b, hi_b, split


def _per_node(t: Tensor, graph: Graph, ins: list[int], sizes: list[int]) -> dict[int, Tensor]:
    """(B, N) -> every earlier node's (B, *shape)."""
    B = t.shape[0]
    return {
        q: v.reshape(B, *graph.nodes[q].shape) for q, v in zip(ins, torch.split(t, sizes, 1), strict=True)
    }


def _best_split_bound(
    graph: Graph,
    k: int,
    A_b: Tensor,
    bb: Bounds,
    box_b: Box,
    relus: list[int],
    ins: list[int],
    split_q: dict[int, Tensor],
    opts: SplitOptions,
    deadline: float,
) -> Tensor:
    """The best lower bound (B,) of any step of the joint α, β optimisation over the patterns ``bb``
    (the splits ``split_q``, β >= 0 on them) of the rows ``A_b``; ``ins[i]`` is the input of ReLU
    ``relus[i]``."""
    B = A_b.shape[1]
    alpha = {
        r: Relu.relaxation(*bb[q])[2].unsqueeze(0).clone().requires_grad_(True)
        for r, q in zip(relus, ins, strict=True)
    }
    beta = {q: torch.zeros(1, B, *graph.nodes[q].shape, requires_grad=True) for q in ins}
    best = torch.full((B,), -torch.inf)

    def bound() -> Tensor:
        nonlocal best
        lb = split_bound(graph, k, A_b, bb, box_b, alpha, split_q, beta)[0]  # (B,)
        best = torch.maximum(best, lb.detach())
        return lb

    o = opts
    optimise_alpha_beta(
        alpha,
        beta,
        o.lr_alpha,
        o.lr_beta,
        o.lr_decay,
        o.iteration,
        bound,
        lambda: time.monotonic() > deadline,
    )
    return best


def bound_targets(
    graph: Graph,
    k: int,
    tasks: list[Task],
    bounds: Bounds,
    box: Box,
    opts: SplitOptions,
    deadline: float = np.inf,
) -> Tensor:
    """Lower bounds (T,) of ``side * z_j`` for every task (j, side) of node k, given sound ``bounds``
    ((1, *shape) each) of every pre-activation node before k.  Past ``deadline`` the optimisation
    stops after its first step (the bounds so far are sound)."""
    A = _target_matrix(graph, k, tasks)
    T = A.shape[1]
    relus = ancestors_relus(graph, k)
    ins = [graph.nodes[r].inputs[0] for r in relus]
    sizes = [math.prod(graph.nodes[q].shape) for q in ins]
    lo, hi, top = _split_choice(graph, k, A, bounds, box, relus, ins, sizes, opts.depth)
    L = 1 << top.shape[1]
    B = T * L
    lo_q, hi_q, split_q = (_per_node(t, graph, ins, sizes) for t in _pattern_bounds(lo, hi, top))
    bb = {q: (lo_q[q], hi_q[q]) for q in ins}
    A_b, box_b = A.repeat_interleave(L, 1), (_expand(box[0], B), _expand(box[1], B))
    best = _best_split_bound(graph, k, A_b, bb, box_b, relus, ins, split_q, opts, deadline)
    return best.view(T, L).min(1).values


def refine_bounds(
    graph: Graph,
    box: Box,
    bounds: Bounds,
    opts: SplitOptions,
    deadline: float,
    log: Callable[[str], None] = lambda s: None,
    weight: dict[int, np.ndarray] | None = None,
) -> tuple[Bounds, dict[str, int]]:
    """Tighter bounds of every pre-activation node (batch of one) that IBP does not bound exactly,
    and counts of what was done; arguments as ``mip.refine_bounds``.  Collective (see the module).

    Up to ``opts.passes`` passes: each further one splits 2 more neurons per target, from the bounds
    of the pass before, and starts only if every rank expects it to end before ``deadline`` (4 times
    the patterns, so 4 times the time of the pass before)."""
    total = {"passes": 0}
    for p in range(opts.passes):
        depth = min(16, opts.depth + 2 * p)
        if p:
            log(f"  split pass {p + 1}, depth {depth}")
        start = time.monotonic()
        bounds, stats = _one_pass(graph, box, bounds, replace(opts, depth=depth), deadline, log, weight)
        total = {k: total.get(k, 0) + v for k, v in stats.items()} | {"passes": p + 1}
        took = time.monotonic() - start
        if p + 1 < opts.passes and not comm.all_reduce_flag(time.monotonic() + 4 * took < deadline, "and"):
            break
    return bounds, total


def _one_pass(
    graph: Graph,
    box: Box,
    bounds: Bounds,
    opts: SplitOptions,
    deadline: float,
    log: Callable[[str], None],
    weight: dict[int, np.ndarray] | None,
) -> tuple[Bounds, dict[str, int]]:
    pre = pre_activation_nodes(graph)
    nodes = [k for k in pre if not exact_by_ibp(graph, k)]
    nodes = nodes[: opts.layers] if opts.layers > 0 else nodes
    like = {k: bounds[k][0] for k in pre}

    def solve(k: int, tasks: list[Task], cur: FlatBounds, deadline: float) -> np.ndarray:
        now = {  # the current bounds are float32 values (or the originals): exact in the engine's dtype
            q: tuple(torch.tensor(v, dtype=like[q].dtype).view(like[q].shape) for v in cur[q]) for q in pre
        }
        earlier = sum(
            math.prod(graph.nodes[graph.nodes[r].inputs[0]].shape) for r in ancestors_relus(graph, k)
        )
        domains = max(1, min(opts.max_domains, MAX_ELEMENTS // max(1, earlier)))
        per = max(1, domains >> opts.depth)  # targets per batch
        found = np.full(len(tasks), -np.inf)
        for t0 in range(0, len(tasks), per):
            if time.monotonic() > deadline:
                break
            found[t0 : t0 + per] = (
                bound_targets(graph, k, tasks[t0 : t0 + per], now, box, opts, deadline).double().cpu().numpy()
            )
        return found

    return refine_in_order(
        nodes,
        {k: bounds[k] for k in pre},
        solve,
        deadline,
        weight,
        log=log,
        names={k: graph.nodes[k].name for k in nodes},
    )
