"""Input-split branch and bound: complete verification of low-dimensional inputs by bisecting the box.

A *domain* is a sub-box of the input box together with its per-clause margins (lower bounds of the
amount by which each clause fails, see :meth:`Clauses.margins`) and the input coefficients ``a`` of the
linear lower bound ``a·x + c`` of its worst spec row. Each round:

1. every rank pops up to ``opts.batch_size`` of its own domains with the lowest margin and bisects each
   along one input dimension (the *branching heuristic*, below);
2. the children of all ranks are bounded in ONE batched call (``crown``, then ``alpha_crown`` when
   ``method == "alpha-crown"``); children whose every clause margin is > 0 are verified and dropped;
3. counterexample candidates are evaluated on the model: the centre of every unverified child and the
   vertex that minimises its worst row's linear bound, both clamped into the original box;
4. the round loop of :func:`bab.search.run_search` agrees on the verdict and rebalances the queues.

Verdicts: a counterexample -> ``sat`` (a flat float32 numpy input inside the original box, which the
caller re-checks); the queues of all ranks together above ``opts.max_domains`` -> ``unknown``; no
domain left on any rank -> ``unsat``; ``expired()`` -> ``timeout``, all from collectively agreed
numbers, so every rank returns the same result.

Branching heuristic: bisect dimension ``argmax_j width_j · (|a_j| + 0.01·max_k |a_k|)``, where ``a`` is
the input coefficient vector of the domain's worst row's CROWN linear lower bound (computed once per
child, right after it is bounded; one extra one-row back-substitution per round). ``width · |a|`` is how
much dimension j costs the bound through the concretisation ``a·mid − |a|·rad``; the small floor keeps a
dimension with a vanishing coefficient from never being split (its width still shrinks the
relaxations). A domain with ``a = 0`` falls back to its widest dimension.

Domain parallelism and lockstep. Domains (the queue) are owned by ranks: the root starts on rank 0,
the other ranks start empty, and rebalancing moves domains from long to short queues by a plan that
every rank derives from the same gathered sizes. The *bounding*, however, is done on the concatenation
of every rank's children (one small all-gather of the boxes): the engine shards the A-matrix rows over
the ranks on the assumption that the box is replicated, and with a different box per rank it silently
mixes the rows of different boxes (unsound bounds), while its column-parallel forward/IBP needs the same
batch size on every rank. Bounding the gathered batch keeps the big tensors sharded (rows over ranks,
``(rows/P, B_total, n)`` per rank, i.e. the same memory as ``(rows, B_total/P, n)``), every intermediate
bound exactly as in one process, and every collective of the engine identical on all ranks, whatever
each rank holds (an empty own batch included). The gathered batch is empty only when every rank's is;
then the bounding is skipped on every rank alike. Each rank then keeps its own slice of the results.

Collectives per round at P > 1: 2 all-gathers for the children (sizes, boxes), the engine's (crown /
alpha-crown, the coefficient pass and one forward of the candidates; none when no rank has a child),
``agree_round`` (2 all-reduces + whatever ``expired`` does), ``share_counterexample`` when found
(1 all-gather, 1 broadcast_object), and, when the search goes on, 1 all-gather of the queue sizes plus
1 all-gather when rebalancing. World size 1 runs the same code with every collective a no-op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..bounds.alpha import AlphaOptions, alpha_crown
from ..bounds.crown import CrownState, crown
from ..bounds.graph import Graph
from ..bounds.walk import back_substitute
from ..parallel import comm, oom
from ..proofs import leaves_bounded_alone
from ..spec import Clauses
from .common import BabOptions, BabResult, spread_positions
from .search import run_search

__all__ = ["METHODS", "input_split_bab"]

METHODS = ("crown", "alpha-crown")
SENSITIVITY_FLOOR = 0.01  # share of the largest |a_j| added to every |a_j| in the branching score


# ----------------------------------------------------------------------------------------------------------
# A set of domains (one rank's queue, a batch, a message)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Domains:
    """Sub-boxes with their clause margins and worst-row input coefficients (on the compute device)."""

    lo: Tensor  # (N, n) float32
    hi: Tensor  # (N, n) float32
    margins: Tensor  # (N, n_clauses) float64: lower bounds of (C y - d), max over each clause's rows
    coef: Tensor  # (N, n) float32: input coefficients of the worst row's linear lower bound

    @staticmethod
    def empty(n: int, n_clauses: int) -> Domains:
        return Domains(
            torch.zeros(0, n),
            torch.zeros(0, n),
            torch.zeros(0, n_clauses, dtype=torch.float64),
            torch.zeros(0, n),
        )

    def __len__(self) -> int:
        return self.lo.shape[0]

    def key(self) -> Tensor:
        """Worst clause margin of every domain (N,): the priority, lowest first."""
        return self.margins.min(1).values

    def take(self, idx: Tensor | slice) -> Domains:
        return Domains(self.lo[idx], self.hi[idx], self.margins[idx], self.coef[idx])

    def __getitem__(self, s: slice) -> Domains:
        return self.take(s)

    def without(self, idx: Tensor) -> Domains:
        keep = torch.ones(len(self), dtype=torch.bool)
        keep[idx] = False
        return self.take(keep)

    @staticmethod
    def cat(parts: list[Domains]) -> Domains:
        return Domains(*(torch.cat([getattr(p, f) for p in parts]) for f in ("lo", "hi", "margins", "coef")))

    def pack(self) -> Tensor:
        """(N, 3n + n_clauses) float64, exact (float32 values are representable in float64)."""
        return torch.cat([self.lo.double(), self.hi.double(), self.margins, self.coef.double()], 1)

    @staticmethod
    def unpack(t: Tensor, n: int) -> Domains:
        return Domains(
            t[:, :n].float(),
            t[:, n : 2 * n].float(),
            t[:, 2 * n : t.shape[1] - n].clone(),
            t[:, t.shape[1] - n :].float(),
        )


def pop_worst(queue: Domains, k: int) -> tuple[Domains, Domains]:
    """The (up to) ``k`` domains with the lowest margin, and the rest of the queue."""
    idx = torch.argsort(queue.key(), stable=True)[:k]
    return queue.take(idx), queue.without(idx)


def branch_dims(d: Domains) -> Tensor:
    """The dimension to bisect for every domain (N,): see the module docstring."""
    width = d.hi - d.lo
    a = d.coef.abs()
    top = a.amax(1, keepdim=True)
    score = width * (a + SENSITIVITY_FLOOR * top)
    score = torch.where(top > 0, score, width)  # no coefficient information: widest dimension
    return score.argmax(1)


def split(d: Domains) -> tuple[Tensor, Tensor, Tensor]:
    """Bisect every domain: children (lo, hi) (2N, n) — all left halves, then all right halves — and the
    parents' margins (2N, n_clauses), which stay valid lower bounds on the children."""
    dim = branch_dims(d)
    rows = torch.arange(len(d))
    mid = (d.lo[rows, dim] + d.hi[rows, dim]) / 2
    left_hi, right_lo = d.hi.clone(), d.lo.clone()
    left_hi[rows, dim] = mid
    right_lo[rows, dim] = mid
    return torch.cat([d.lo, right_lo]), torch.cat([left_hi, d.hi]), d.margins.repeat(2, 1)


# ----------------------------------------------------------------------------------------------------------
# Bounding a (replicated) batch of boxes
# ----------------------------------------------------------------------------------------------------------


def bound_batch(
    graph: Graph, lo: Tensor, hi: Tensor, problem: Clauses, method: str, opts: BabOptions
) -> tuple[Tensor, CrownState]:
    """Lower bounds (B, S) of ``C y`` on every box (B, n), and the sweep's state. Collective.

    ``alpha-crown``: ``opts.iteration`` Adam steps with ``opts.lr_alpha`` / ``opts.lr_decay`` from the
    CROWN slopes (early stop once every row of every box is positive); never below CROWN. With a proof
    asked for (``opts.record``) on a network where the checker's LP over LP bounds does not reach
    (:func:`proofs.leaves_bounded_alone`), every box is bounded as if alone and α-CROWN optimises the
    output's slopes only, over those intermediate bounds: what the checker re-derives per leaf (its LP
    over the same intermediate bounds is at least as tight as any slopes).
    """
    shape = (lo.shape[0], *graph.input_shape)
    box = (lo.reshape(shape), hi.reshape(shape))
    alone = opts.record and leaves_bounded_alone(graph)
    lb, state = crown(graph, box, problem.C, per_box=alone)
    if method == "alpha-crown":
        a_opts = AlphaOptions(iteration=opts.iteration, lr_alpha=opts.lr_alpha, lr_decay=opts.lr_decay,
                              output_only=alone)  # fmt: skip
        with torch.enable_grad():
            lb_alpha, state = alpha_crown(graph, box, problem.C, state, a_opts)
        lb = torch.maximum(lb, lb_alpha.detach())
    return lb, state


def worst_rows(problem: Clauses, lb: Tensor, margins: Tensor) -> Tensor:
    """For every domain, the spec row that gives the margin of its worst clause (B,)."""
    clause = margins.argmin(1)  # (B,)
    m = lb.double() - problem.d.to(lb.device)  # (B, S)
    mine = problem.owner.to(lb.device)[None, :] == clause[:, None]
    return torch.where(mine, m, torch.full_like(m, -torch.inf)).argmax(1)


def input_coefficients(graph: Graph, state: CrownState, lo: Tensor, hi: Tensor, rows_C: Tensor) -> Tensor:
    """Input coefficients (B, n) of the CROWN linear lower bound of row ``rows_C[b]`` (B, n_out) of every
    box, from the intermediate bounds in ``state``. Collective (one back-substitution, one row).

    The coefficients are the gradient, wrt a point x, of the bound concretised on the degenerate box
    ``[x, x]`` (the intermediate bounds are constants): ``concretize(A, (x, x)) = A·x``.
    """
    B = lo.shape[0]
    out = len(graph.nodes) - 1
    A = rows_C.to(torch.float32).reshape(1, B, *graph.nodes[out].shape)
    x = ((lo + hi) / 2).reshape(B, *graph.input_shape).clone().requires_grad_(True)
    with torch.enable_grad():
        lb = back_substitute(graph, out, A, state.bounds, (x, x))  # (1, B)
        if not lb.requires_grad:  # the output does not depend on the input
            return torch.zeros_like(lo)
        (grad,) = torch.autograd.grad(lb.sum(), x)
    return grad.reshape(B, -1).detach()


@torch.no_grad()
def evaluate(graph: Graph, x: Tensor) -> Tensor:
    """Model outputs (N, n_out) at flat inputs (N, n); also for N = 0. Collective."""
    return graph.forward(x.reshape(x.shape[0], *graph.input_shape)).reshape(x.shape[0], graph.output_size)


# ----------------------------------------------------------------------------------------------------------
# Rebalancing
# ----------------------------------------------------------------------------------------------------------


def spread_pick(queue: Domains, count: int) -> Tensor:
    """``count`` indices spread evenly over the queue sorted by margin (the sender keeps a fair share of
    its hard domains and gives one away)."""
    order = torch.argsort(queue.key(), stable=True)
    return order[torch.tensor(spread_positions(len(queue), count), dtype=torch.long)]


# ----------------------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------------------


def _bound_children(
    graph: Graph,
    problem: Clauses,
    method: str,
    opts: BabOptions,
    lo: Tensor,
    hi: Tensor,
    parent_margins: Tensor,
    inner: tuple[Tensor, Tensor] | None,
    leaves: list | None = None,
) -> tuple[Domains, np.ndarray | None, int]:
    """Bound every rank's children together; return this rank's unverified children, the first
    counterexample among its children (or None) and the number of its children. Candidates are
    clamped into ``inner``, the float32 points of the real box (``float32_box``, inward):
    the outward-rounded box that is bounded may stick out of the real one by half an ulp. ``leaves``
    (for a proof): this rank's children that every clause now holds for and their parent did not get
    appended, ``(N, 2, n)`` (lower, upper)."""
    n = lo.shape[1]
    sizes = [int(s) for s in comm.all_gather_cat(torch.tensor([lo.shape[0]], dtype=torch.int64), 0).tolist()]
    me = comm.rank()
    first, k = sum(sizes[:me]), sizes[me]
    every = comm.all_gather_cat(torch.cat([lo.double(), hi.double(), parent_margins], 1), 0, sizes=sizes)
    if sum(sizes) == 0:  # every rank sees the same sizes: nothing bounded anywhere
        return Domains.empty(n, problem.n_clauses), None, 0
    lo_all, hi_all = every[:, :n].float(), every[:, n : 2 * n].float()
    lb, state = bound_batch(graph, lo_all, hi_all, problem, method, opts)  # (B, S), replicated
    margins = torch.maximum(problem.margins(lb), every[:, 2 * n :])  # parents' bounds hold on the children
    rows = worst_rows(problem, lb, margins)
    coef = input_coefficients(graph, state, lo_all, hi_all, problem.C[rows])
    open_ = (margins <= 0).any(1).nonzero().flatten()  # unverified children, global indices
    cex = None
    if len(open_) > 0 and inner is not None:
        lo0, hi0 = inner
        centre = (lo_all[open_] + hi_all[open_]) / 2
        vertex = torch.where(coef[open_] > 0, lo_all[open_], hi_all[open_])  # minimises a·x on the box
        cand = torch.cat([centre, vertex]).clamp(min=lo0, max=hi0)
        bad = problem.violated(evaluate(graph, cand))  # (2U,)
        owner = torch.cat([open_, open_])
        hit = (bad & (owner >= first) & (owner < first + k)).nonzero().flatten()
        if len(hit) > 0:
            cex = cand[hit[0]].cpu().numpy().astype(np.float32).copy()
    own = open_[(open_ >= first) & (open_ < first + k)]
    kept = Domains(lo_all[own], hi_all[own], margins[own], coef[own])
    if leaves is not None:  # this rank's children proven here (for every clause, a proof's leaves)
        done = ((margins > 0).all(1) & ~(every[:, 2 * n :] > 0).all(1)).nonzero().flatten()
        done = done[(done >= first) & (done < first + k)]
        leaves.append(torch.stack([lo_all[done], hi_all[done]], 1).cpu().numpy())
    return kept, cex, k


def _flat_box(box: tuple[Tensor, Tensor], n: int) -> tuple[Tensor, Tensor]:
    """The one box of ``n`` inputs as flat float32 tensors on its device (checked)."""
    lo0 = box[0].detach().reshape(-1).to(torch.float32)
    hi0 = box[1].detach().reshape(-1).to(torch.float32)
    if lo0.numel() != n or hi0.numel() != n:
        raise ValueError(f"input split needs one box of {n} inputs, got {tuple(box[0].shape)}")
    if not bool((lo0 <= hi0).all()):
        raise ValueError("input box has lower > upper")
    return lo0, hi0


class InputSplitSearch:
    """Input-split domains of one rank, as a :class:`bab.search.Search`: the ``batch_size`` worst
    parents are bisected per rank per round."""

    def __init__(
        self,
        graph: Graph,
        box0: tuple[Tensor, Tensor],
        problem: Clauses,
        opts: BabOptions,
        method: str,
        inner: tuple[Tensor, Tensor] | None,
    ):
        self.graph, self.box0, self.problem, self.opts, self.method = graph, box0, problem, opts, method
        self.inner = inner
        self.n = box0[0].numel()
        self.queue = Domains.empty(self.n, problem.n_clauses)
        self.per_round = opts.batch_size
        self.bounds_own_batch = False  # the children of all ranks are bounded together
        self.stuck = False  # a box can always be bisected
        self.proven = np.inf  # not tracked: input split reports no margin bound
        self.leaves: list[np.ndarray] | None = [] if opts.record else None  # verified boxes (N, 2, n)

    def __len__(self) -> int:
        return len(self.queue)

    def worst(self) -> float:
        return float(self.queue.key().min()) if len(self.queue) else math.inf

    def _bound(self, lo: Tensor, hi: Tensor, parent: Tensor) -> tuple[int, np.ndarray | None]:
        kept, cex, k = _bound_children(
            self.graph, self.problem, self.method, self.opts, lo, hi, parent, self.inner, self.leaves
        )
        self.queue = Domains.cat([self.queue, kept])
        return k, cex

    def start(self) -> tuple[int, np.ndarray | None]:
        nc, root = self.problem.n_clauses, int(comm.rank() == 0)
        lo = self.box0[0][None].clone()[:root]
        hi = self.box0[1][None].clone()[:root]
        return self._bound(lo, hi, torch.full((root, nc), -torch.inf, dtype=torch.float64))

    def expand(self, k: int) -> tuple[int, np.ndarray | None]:
        """The round; where it runs out of memory, again with half as many parents as it popped
        (:func:`.oom.halving_on_oom`), down to one; ``per_round`` keeps the number that fitted. At
        P > 1 only where every rank stopped at the same point (a pass of one row of the bounding ran
        out: :class:`.oom.LockstepOutOfMemoryError`), every rank with at most half the most that any
        popped; a rank that stopped alone no longer issues the collectives of the others' round: the
        error, after one line."""

        def fewer(n: int) -> None:  # at P > 1 the same n on every rank: so are their next rounds' sizes
            self.per_round = n

        out, _ = oom.halving_on_oom(
            self.bisect, k, "a BaB round", what="parents", lockstep=comm.world_size() > 1, on_halve=fewer
        )
        return out

    def bisect(self, k: int) -> tuple[int, np.ndarray | None]:
        """Pop up to ``k`` of the worst boxes, bisect them and bound the halves; the queue as it was
        where it raises (bounding adds to it only at its end)."""
        batch, self.queue = pop_worst(self.queue, k)
        try:
            return self._bound(*split(batch))
        except torch.OutOfMemoryError:
            self.queue = Domains.cat([self.queue, batch])
            raise

    def take_spread(self, count: int) -> Domains:
        leaving = spread_pick(self.queue, count) if count else torch.zeros(0, dtype=torch.long)
        sent = self.queue.take(leaving)
        self.queue = self.queue.without(leaving)
        return sent

    def exchange(self, part: Domains, sizes: list[int]) -> list[Domains]:
        every = comm.all_gather_cat(part.pack(), 0, sizes=sizes)
        starts = np.cumsum([0, *sizes]).tolist()
        return [Domains.unpack(every[starts[r] : starts[r + 1]], self.n) for r in range(len(sizes))]

    def put(self, part: Domains) -> None:
        self.queue = Domains.cat([self.queue, part])


def input_split_bab(
    graph: Graph,
    box: tuple[Tensor, Tensor],
    problem: Clauses,
    opts: BabOptions,
    expired: Callable[[], bool],
    method: str,
    inner: tuple[Tensor, Tensor] | None,
) -> BabResult:
    """Input-split BaB over ``box`` (``(lo, hi)``, one box of ``numel == prod(input_shape)``, rounded
    outward); counterexample candidates are taken in ``inner`` (the box rounded inward, ``float32_box``;
    None: no candidate is a counterexample).

    Every rank must call it with the same arguments (lockstep); each returns the same
    :class:`BabResult` (see :func:`bab.search.run_search`). ``expired`` is called exactly once per round
    on every rank.
    """
    if method not in METHODS:
        raise ValueError(f"unknown bound method {method!r} for input split; expected one of {METHODS}")
    n = math.prod(graph.input_shape)
    box0 = _flat_box(box, n)
    inner0 = None if inner is None else _flat_box(inner, n)
    search = InputSplitSearch(graph, box0, problem, opts, method, inner0)
    result = run_search(search, opts, expired)
    if search.leaves is not None:  # every rank's verified boxes, in one order whatever P (collective)
        mine = np.concatenate(search.leaves) if search.leaves else np.zeros((0, 2, n), np.float32)
        every = np.concatenate(comm.all_gather_object(mine))
        result.leaves = list(every[np.lexsort(every.reshape(len(every), 2 * n).T[::-1])])  # none: a sat
    return result
