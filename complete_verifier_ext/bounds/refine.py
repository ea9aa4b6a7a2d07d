"""Layer-by-layer tightening of intermediate bounds (``general.complete_verifier: bab-refine``).

The driver shared by the two refinement methods (``solver.mip.refine_method``): ``split`` (batched
β-CROWN over splits of earlier neurons, ``split_refine``) and ``milp`` (HiGHS, ``mip``).  Pre-activation
nodes are refined in order, so each one is bounded with the tightened bounds of the ones before it.
Within a node the (neuron, side) tasks, most promising first (|A| of the output bound at the neuron's
ReLU times the gap of its triangle relaxation), are dealt round-robin over the ranks; one all-gather
per node gives everyone the results, and every new bound is intersected with the old one (never
looser).  Whether to start a node is agreed collectively, so every rank issues the same collectives;
within a node each rank works alone (the methods need no collective) until the common deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from ..parallel import comm
from .ops import Relu
from .walk import Bounds

Task = tuple[int, float]  # (flat neuron j, side s): a lower bound of s * z_j is wanted
FlatBounds = dict[int, tuple[np.ndarray, np.ndarray]]  # node -> (lo, hi), flat float64
# solve(node, this rank's tasks, current bounds, deadline) -> lower bounds of s * z_j, -inf: not done
Solver = Callable[[int, list[Task], FlatBounds, float], np.ndarray]


def _tightened(l: np.ndarray, u: np.ndarray, tasks, values, margin) -> tuple[np.ndarray, np.ndarray]:
    """``(l, u)`` with every solved task ``(j, side)``'s value (a lower bound of ``side * z_j``, moved
    ``margin`` outward) applied; an unsolved one (not finite) changes nothing."""
    new_l, new_u = l.copy(), u.copy()
    for (j, side), v in zip(tasks, values, strict=True):
        if not np.isfinite(v):
            continue
        v = v - margin(v)  # a lower bound of side * z_j
        if side > 0:
            new_l[j] = max(new_l[j], v)
        else:
            new_u[j] = min(new_u[j], -v)
    return new_l, new_u


def refine_in_order(
    nodes: list[int],
    bounds: Bounds,
    solve: Solver,
    deadline: float,
    weight: dict[int, np.ndarray] | None = None,
    margin: Callable[[float], float] = lambda v: 0.0,
    log: Callable[[str], None] = lambda s: None,
    names: dict[int, str] | None = None,
) -> tuple[Bounds, dict[str, int]]:
    """Tighter bounds (batch of one) of ``nodes``, in that order, and counts of what was done.

    ``bounds``: sound bounds of every pre-activation node, (1, *shape) each; ``margin(v)``: how far
    to move a solver's value ``v`` outward.  Collective: every rank calls it with the same arguments."""
    cur: FlatBounds = {
        k: tuple(t.double().cpu().reshape(-1).numpy().copy() for t in bounds[k]) for k in bounds
    }
    stats = {"solves": 0, "stabilised": 0, "layers": 0}
    for k in nodes:
        if comm.all_reduce_flag(time.monotonic() > deadline, "or"):
            break
        l, u = cur[k]
        uns = np.nonzero((l < 0) & (u > 0))[0]
        w = weight[k].reshape(-1) if weight is not None and k in weight else np.ones_like(l)
        score = Relu.split_score(*(torch.from_numpy(v) for v in (w, l, u))).numpy()
        order = uns[np.argsort(-score[uns], kind="stable")]
        tasks = [(int(j), side) for j in order for side in (1.0, -1.0)]
        P, n = comm.world_size(), len(tasks)
        mine = tasks[comm.rank() :: P]  # dealt round-robin: every rank starts with the most useful
        found = solve(k, mine, cur, deadline) if mine else np.zeros(0)
        stats["solves"] += int(np.isfinite(found).sum())
        sizes = [len(range(q, n, P)) for q in range(P)]
        allv = comm.all_gather_cat(torch.tensor(found, dtype=torch.float64), 0, sizes=sizes).cpu().numpy()
        dealt = [tasks[t] for q in range(P) for t in range(q, n, P)]  # the order of the gathered values
        new_l, new_u = _tightened(l, u, dealt, allv, margin)
        now_stable = int((((new_l >= 0) | (new_u <= 0))[uns]).sum())
        stats["stabilised"] += now_stable
        stats["layers"] += 1
        before, after = (
            float(np.mean(hi[uns] - lo[uns])) if len(uns) else 0.0 for lo, hi in ((l, u), (new_l, new_u))
        )
        name = names.get(k, k) if names else k
        log(
            f"  refine node {name}: {len(uns)} unstable, {now_stable} made stable, "
            f"mean width {before:.4f} -> {after:.4f}"
        )
        cur[k] = (new_l, new_u)
    out = dict(bounds)
    for k in nodes:
        lo, hi = bounds[k]
        nl = torch.tensor(cur[k][0], dtype=lo.dtype, device=lo.device).view(lo.shape)
        nh = torch.tensor(cur[k][1], dtype=hi.dtype, device=hi.device).view(hi.shape)
        out[k] = (torch.maximum(lo, nl), torch.minimum(hi, nh))
    return out, stats
