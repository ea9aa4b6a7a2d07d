"""ReLU-split branch and bound with β-CROWN, domain-parallel across ranks.

A *domain* is a set of split decisions (``z_i >= 0`` or ``z_i <= 0`` for pre-activation neurons),
the intermediate bounds valid under them, and its α/β.  Each round every rank takes up to
``batch_size // 2`` of its worst domains, splits each on the neuron the branching heuristic picked, and
bounds all children in one batched β-CROWN call (the batch axis of the engine is the domain axis; in
passes of fewer children once a pass ran out of memory):

* the split fixes the neuron's bounds (``l = max(l, 0)`` or ``u = min(u, 0)``), making it exact;
* β adds ``-β z`` (active split) or ``+β z`` (inactive) to the objective, ``β >= 0``, which is
  <= 0 on the domain, so every (α, β) gives a sound lower bound; Adam maximises it jointly with α;
* intermediate bounds are inherited from the parent (valid on the smaller domain).

Children whose every clause margin is positive are dropped (verified); the input point that
minimises the worst row's linear bound is evaluated on the model, and the lowest-bound ones take a
few sign-gradient steps (falsification, interior points included).  Lockstep: each
rank bounds its own (possibly empty) batch with the same sequence of collectives; the round loop
(:func:`bab.search.run_search`) decides, for everyone, on counterexamples, domains left and the time,
and rebalances the queues.  α and β of queued domains are stored in half
precision: they are only a warm start, every bound is recomputed in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from ..attack import sign_step
from ..bounds.crown import CrownState, Fits, in_passes
from ..bounds.graph import Graph
from ..bounds.ops import Relu
from ..bounds.walk import Box
from ..parallel import comm
from ..spec import Clauses, float32_box
from .branching import babsr, babsr_scores, fsb
from .common import BabOptions, BabResult, spread_positions
from .domain import MAX_RETRIES, BetaCrown, Domain
from .search import run_search


class ReluSplitBab:
    """ReLU-split domains of one rank, as a :class:`bab.search.Search`: ``batch_size`` children (the
    ``batch_size // 2`` worst parents, split in two) are bounded per rank per round."""

    def __init__(
        self,
        graph: Graph,
        box: Box,
        problem: Clauses,
        opts: BabOptions,
        lower: np.ndarray,
        upper: np.ndarray,
        state: CrownState,
        expired: Callable[[], bool] = lambda: False,
    ):
        self.graph, self.problem, self.opts, self.state = graph, problem, opts, state
        self.bc = BetaCrown(graph, box, problem, opts)
        self.expired = expired  # asked within a round (before every β-CROWN step)
        self.queue: list[Domain] = []
        self.per_round = opts.batch_size // 2 or 1
        self.fits: Fits = {}  # the most domains of a pass, once a larger one ran out of memory
        self.bounds_own_batch = True
        self.stuck = False
        self.proven = np.inf  # the least margin bound of a verified leaf on this rank
        self.leaves: list[tuple] = []  # with ``opts.record``: the split history of every verified domain
        inner = float32_box(lower, upper, inward=True)
        self.inner = tuple(torch.tensor(t).view(box[0].shape) for t in inner)

    # ---- domains ---------------------------------------------------------------------------------------
    def root(self, state: CrownState) -> Domain:
        g, S = self.graph, self.problem.C.shape[0]
        bounds = {
            k: (state.bounds[k][0].detach().clone(), state.bounds[k][1].detach().clone()) for k in self.bc.pre
        }
        alpha = {}
        for j in self.bc.relus:  # α-CROWN's best slopes when it ran, else CROWN's adaptive ones
            start = state.out_alpha.get(j) if state.out_alpha else None
            if start is not None and start.shape[0] == S:
                alpha[j] = start.detach().to(self.opts.store_dtype).clone()
            else:
                lo, hi = bounds[self.bc.relu_in[j]]
                slope = Relu.relaxation(lo, hi)[2]
                alpha[j] = slope.unsqueeze(0).expand(S, *lo.shape).to(self.opts.store_dtype).clone()
        beta = {k: torch.zeros(S, 1, *g.nodes[k].shape, dtype=self.opts.store_dtype) for k in self.bc.pre}
        splits = {k: torch.zeros(1, *g.nodes[k].shape, dtype=torch.int8) for k in self.bc.pre}
        return Domain(-np.inf, bounds, splits, alpha, beta, None)

    def children(self, d: Domain) -> list[Domain]:
        if d.branch is None:  # nothing to split: bound it again, warm-started, so that β converges
            return [d]
        k, i = d.branch
        kids = []
        for sign in (1, -1):
            lo, hi = (t.clone() for t in d.bounds[k])
            if sign > 0:
                lo.view(-1)[i] = 0.0
            else:
                hi.view(-1)[i] = 0.0
            sp = d.splits[k].clone()
            sp.view(-1)[i] = sign
            bounds = dict(d.bounds)
            bounds[k] = (lo, hi)
            splits = dict(d.splits)
            splits[k] = sp
            beta = dict(d.beta)
            beta[k] = d.beta[k].clone()
            beta[k].view(beta[k].shape[0], -1)[:, i] = 0
            history = (*d.history, (k, i, sign))
            kids.append(Domain(d.worst, bounds, splits, dict(d.alpha), beta, None, d.depth + 1, 0, history))
        return kids

    def evaluate(self, doms: list[Domain]) -> tuple[list[Domain], np.ndarray | None, int]:
        """Bound a batch; return the unverified domains (with their next branch), a counterexample
        candidate that really violates the spec, and how many were bounded. The batch is bounded and
        branched in passes (:func:`.crown.in_passes`): one pass of all of it unless a pass ran out of
        memory before (``fits``); a pass that runs out runs again in halves, at P > 1 on every rank."""
        B = end = len(doms)
        if comm.world_size() > 1:  # the passes run over the positions of the longest batch
            end = int(comm.all_reduce(torch.tensor([B], device=comm.device()), "max"))

        def run(c0: int, c1: int, size: int) -> list[tuple]:
            return [self.bound_and_branch(doms[c : min(c + size, c1)]) for c in range(c0, c1, size)]

        parts = in_passes(run, max(end, 1), max(end, 1), B, "a BaB round", self.fits, "domains", True)
        lb = torch.cat([p[0] for p in parts])
        alpha = {j: torch.cat([p[1][j] for p in parts], 1) for j in parts[0][1]}
        beta = {k: torch.cat([p[2][k] for p in parts], 1) for k in parts[0][2]}
        x = torch.cat([p[3] for p in parts])
        choice = [c for p in parts for c in p[4]]
        kept = None  # with a proof: each row's best α and β (the leaves' evidence)
        if self.opts.record and parts[0][5] is not None:
            kept = {
                w: {n: torch.cat([p[5][w][n] for p in parts], 1) for n in parts[0][5][w]}
                for w in ("alpha", "beta")
            }
        margins = self.problem.margins(lb)  # (B, n_clauses)
        worst = margins.min(1).values
        # candidates lie in the real box (its inward float32 form), not the outward-rounded one
        x = torch.minimum(torch.maximum(x, self.inner[0]), self.inner[1])
        cex = self.falsify(x, lb)
        keep = []
        for b, d in enumerate(doms):
            if float(worst[b]) > 0:
                self.proven = min(self.proven, float(worst[b]))
                if self.opts.record:
                    self.leaves.append((d.history, self.evidence(d, kept, b, lb[b]) if kept else {}))
                continue
            if choice[b] is None:  # nothing left to split: never drop an unproven domain
                d.retries += 1
                self.stuck = self.stuck or d.retries > MAX_RETRIES
            d.worst = float(worst[b])
            d.alpha = {j: a[:, b : b + 1].to(self.opts.store_dtype) for j, a in alpha.items()}
            d.beta = {k: t[:, b : b + 1].to(self.opts.store_dtype) for k, t in beta.items()}
            d.branch = choice[b]
            keep.append(d)
        return keep, cex, B

    def bound_and_branch(self, doms: list[Domain]) -> tuple:
        """β-CROWN bounds of a batch (possibly empty: lockstep) and each domain's next branch: (lb (B, S),
        α, β, the worst rows' minimisers, the branches)."""
        lb, alpha, beta, record, x, kept = self.bc.bound(doms, self.expired)
        B = len(doms)
        open_rows = self.problem.row_margins(lb) <= 0  # (B, S): rows not yet proven
        bounds = (
            {
                k: (torch.cat([d.bounds[k][0] for d in doms]), torch.cat([d.bounds[k][1] for d in doms]))
                for k in self.bc.pre
            }
            if B
            else {}
        )
        split = {k: torch.cat([d.splits[k] for d in doms]) for k in self.bc.pre} if B else {}
        scores = babsr_scores(self.bc, record, bounds, split, open_rows.float()) if B else ({}, {})
        if self.opts.branching in ("fsb", "kfsb"):
            choice = fsb(self.bc, self.problem, self.opts, bounds, split, alpha, beta, scores, B)
        else:
            choice = babsr(scores, B)
        return lb, alpha, beta, x, choice, kept

    def evidence(self, d: Domain, kept: dict, b: int, lb: Tensor) -> dict:
        """A verified domain's evidence for its proof's leaf (docs/proofs.md), by node: its proving row
        (``lambda``), that row's lower slopes at the neurons the domain has unstable (``alpha``) and the
        β of its splits (``beta``), from the iteration of that row's best bound; ``kept``: those of the
        batch (:meth:`BetaCrown.bound`), ``lb``: the domain's row bounds."""
        row = int(self.problem.row_margins(lb[None])[0].argmax())
        alpha = {}
        for j in self.bc.relus:
            lo, hi = (t.reshape(-1) for t in d.bounds[self.bc.relu_in[j]])
            idx = torch.nonzero((lo < 0) & (hi > 0)).flatten()
            slopes = kept["alpha"][j][row, b].reshape(-1)[idx].tolist()
            alpha[self.bc.relu_in[j]] = dict(zip(idx.tolist(), slopes, strict=True))
        beta: dict[int, dict[int, float]] = {}
        for k, i, _ in d.history:
            beta.setdefault(k, {})[int(i)] = float(kept["beta"][k][row, b].reshape(-1)[i])
        lam = [1.0 if r == row else 0.0 for r in range(self.problem.C.shape[0])]
        return {"lambda": lam, "alpha": alpha, "beta": beta}

    def falsify(self, x: Tensor, lb: Tensor) -> np.ndarray | None:
        """Look for a counterexample near every rank's candidate points (B_r, *in), identical on every
        rank.  The candidates are all-gathered first and the forward is replicated (the sharded
        forward needs the same batch on every rank).  The ``pgd_points`` candidates of the lowest
        bounds then take ``pgd_steps`` sign-gradient steps on their worst clause margin inside the
        (inward-rounded) box, split over the ranks when the weights are whole: corners of the linear
        relaxation are seldom counterexamples themselves, but a counterexample is often near the
        corner of a domain with a low bound."""
        xs = comm.all_gather_cat(x, 0)  # (sum_r B_r, *in)
        worst = comm.all_gather_cat(self.problem.margins(lb).min(1).values, 0)
        with torch.no_grad():
            bad = self.problem.violated(self.graph.forward(xs).reshape(xs.shape[0], -1))
        if not bool(bad.any()) and self.inner is not None and self.opts.pgd_steps > 0 and len(xs):
            xs = xs[worst.argsort()[: self.opts.pgd_points]]
            if self.graph.sharded or comm.world_size() == 1:
                xs = self.pgd(xs)  # the sharded forward needs the same batch on every rank
            else:  # whole weights everywhere: each rank moves its block of the points, then all gather
                s0, s1 = comm.shard_range(len(xs))  # them, in the order of P = 1
                mine = self.pgd(xs[s0:s1]) if s1 > s0 else xs[s0:s1]
                xs = comm.all_gather_cat(mine, 0, sizes=comm.shard_sizes(len(xs)))
            with torch.no_grad():
                bad = self.problem.violated(self.graph.forward(xs).reshape(xs.shape[0], -1))
        bad = bad.nonzero().flatten()
        return xs[int(bad[0])].reshape(-1).cpu().numpy().astype(np.float32) if len(bad) else None

    def pgd(self, xs: Tensor) -> Tensor:
        """``pgd_steps`` sign-gradient steps of every point on its worst clause margin, inside the
        inward-rounded box (each point's steps depend on that point only)."""
        lo, hi = self.inner
        step = (hi - lo) / 8
        for _ in range(self.opts.pgd_steps):
            with torch.enable_grad():
                xg = xs.detach().requires_grad_(True)
                xin = comm.reduce_grad(xg) if self.graph.sharded else xg  # full gradient everywhere
                y = self.graph(xin).reshape(xs.shape[0], -1)
                m = self.problem.point_margins(y).min(1).values
                (grad,) = torch.autograd.grad(m.sum(), xg)
            xs = sign_step(xs, grad, step, lo, hi)  # a NaN output gives no direction, never a NaN point
            step = step * 0.7
        return xs

    # ---- the queue (bab.search.Search) -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.queue)

    def worst(self) -> float:
        return min((d.worst for d in self.queue), default=np.inf)

    def start(self) -> tuple[int, np.ndarray | None]:
        kept, cex, n = self.evaluate([self.root(self.state)] if comm.rank() == 0 else [])
        self.queue.extend(kept)
        return n, cex

    def expand(self, k: int) -> tuple[int, np.ndarray | None]:
        self.queue.sort(key=lambda d: d.worst)
        kept, cex, n = self.evaluate([c for d in self.queue[:k] for c in self.children(d)])
        self.queue = self.queue[k:] + kept  # (popped only now: a round that raises leaves the queue)
        return n, cex

    def take_spread(self, count: int) -> list[Domain]:
        if not count:
            return []
        self.queue.sort(key=lambda d: d.worst)
        pos = set(spread_positions(len(self.queue), count))
        sent = [d for i, d in enumerate(self.queue) if i in pos]
        self.queue = [d for i, d in enumerate(self.queue) if i not in pos]
        return sent

    def exchange(self, part: list[Domain], sizes: list[int]) -> list[list[Domain]]:
        return comm.all_gather_object(part)

    def put(self, part: list[Domain]) -> None:
        self.queue.extend(part)


def relu_split_bab(
    graph: Graph,
    box: Box,
    problem: Clauses,
    state: CrownState,
    opts: BabOptions,
    expired: Callable[[], bool],
    lower: np.ndarray,
    upper: np.ndarray,
    on_round: Callable | None = None,
    round_expired: Callable[[], bool] | None = None,
) -> BabResult:
    """Complete verification of one region by ReLU splitting, from the incomplete run's ``state``.

    ``box`` is the outward-rounded float32 box used for bounds; ``lower``/``upper`` the real box
    (counterexample candidates are moved into its inward-rounded float32 version).  ``on_round(rounds,
    domains left, worst bound, domains bounded)`` is called after every round on every rank;
    ``round_expired`` (default ``expired``), asked before each round, decides whether one starts (a
    wall-clock limit asks whether a round would still fit)."""
    search = ReluSplitBab(graph, box, problem, opts, lower, upper, state, expired)
    result = run_search(search, opts, round_expired or expired, on_round)
    if opts.record:  # every rank's leaves, in one order whatever P (collective)
        every = (leaf for part in comm.all_gather_object(search.leaves) for leaf in part)
        result.leaves = sorted(every, key=lambda leaf: leaf[0])  # (history, evidence by node)
    return result
