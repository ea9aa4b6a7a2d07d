"""The one round loop of branch and bound, for every kind of domain (ReLU splits, input splits).

A kind of BaB supplies a :class:`Search`: this rank's queue of domains, and ``expand``, which pops this
rank's worst parents, branches them and bounds the children (possibly none: lockstep). The loop, on
every rank, round after round:

1. ``agree_round``: one all-reduce of the counts (counterexample candidates, domains left, domains
   bounded, stuck domains) and one of the extremes (worst queued bound, least bound of a verified leaf),
   and the time, asked once per round;
2. the verdict, from those agreed numbers, in this order: ``sat`` (the counterexample of the lowest
   rank that has one, on every rank), ``unknown`` (a domain that can be neither verified nor split, or
   more than ``max_domains`` domains on all ranks together), ``unsat`` (no domain left), ``timeout``;
3. rebalancing (:func:`rebalance_plan`, one all-gather of the sizes and one of the domains moved) when
   some rank cannot fill its next batch or the queues differ by more than a batch;
4. ``expand`` on every rank (out of memory, ``torch.OutOfMemoryError`` as CUDA raises it, is the
   search's to handle: ReLU splits bound their children in passes that run again in halves, input
   splits run the round again with half as many parents, at P > 1 where every rank stopped together).

Every decision is taken from collectively agreed numbers, so every rank issues the same collectives
and returns the same :class:`BabResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..parallel import comm
from .common import BabOptions, BabResult, rebalance_plan

OnRound = Callable[[int, int, float, int], None]  # (rounds, domains left, worst bound, domains bounded)


class Search(Protocol):
    """One rank's side of a search. ``Part`` below is whatever holds some domains and slices as a
    sequence (a list of domains, a :class:`input_split.Domains`)."""

    per_round: int  # parents a rank pops per round
    # True when every rank bounds its own batch (spreading a short queue then spreads the work); False
    # when the ranks bound all their children together (only a parent left waiting is worth moving)
    bounds_own_batch: bool
    stuck: bool  # this rank holds an unproven domain that can be neither verified nor split further
    proven: float  # the least margin bound of a verified leaf on this rank (inf: none yet)

    def __len__(self) -> int: ...  # domains queued on this rank

    def worst(self) -> float: ...  # the lowest margin bound queued (inf when empty)

    def start(self) -> tuple[int, np.ndarray | None]:
        """Bound the root on rank 0 (collective); returns (domains bounded here, a counterexample)."""
        ...

    def expand(self, k: int) -> tuple[int, np.ndarray | None]:
        """Pop up to ``k`` of the worst parents, branch them, bound the children and queue the open
        ones (collective); returns (domains bounded here, a counterexample found here or None). Where
        it raises, the queue is as it was."""
        ...

    def take_spread(self, count: int) -> Any:
        """Remove ``count`` domains spread over the queue sorted by bound (a sender keeps a fair share of
        its hard ones) and return them as a Part."""
        ...

    def exchange(self, part: Any, sizes: list[int]) -> Sequence[Any]:
        """Every rank's Part (rank r sends ``sizes[r]`` domains). Collective."""
        ...

    def put(self, part: Any) -> None:
        """Queue the domains of a Part."""
        ...


@dataclass(frozen=True)
class Agreed:
    found: bool  # some rank holds a counterexample
    left: int  # domains queued on all ranks
    bounded: int  # domains bounded on all ranks since the last agreement
    stuck: bool  # some rank holds a domain that can be neither verified nor split
    worst: float  # the lowest bound queued on any rank
    proven: float  # the least bound of a verified leaf on any rank
    expired: bool


def agree_round(s: Search, found: bool, bounded: int, expired: Callable[[], bool]) -> Agreed:
    """The per-round collective decision (two all-reduces; ``expired`` asked once). Every rank calls it
    once per round, whatever its data."""
    counts = torch.tensor([float(found), float(len(s)), float(bounded), float(s.stuck)], dtype=torch.float64)
    counts = comm.all_reduce(counts, "sum")
    least = comm.all_reduce(torch.tensor([-s.worst(), -s.proven], dtype=torch.float64), "max")
    return Agreed(
        bool(counts[0] > 0),
        int(counts[1]),
        int(counts[2]),
        bool(counts[3] > 0),
        float(-least[0]),
        float(-least[1]),
        expired(),
    )


def share_counterexample(x: np.ndarray | None) -> np.ndarray | None:
    """The counterexample of the lowest rank that has one, on every rank. Collective."""
    has = comm.all_gather_cat(torch.tensor([float(x is not None)]), 0)
    owners = has.nonzero().flatten().tolist()
    if not owners:
        return None
    return comm.broadcast_object(x, src=owners[0])


def redistribute(q: Search, sizes: list[int]) -> list[int]:
    """Move domains between the ranks' queues by ``rebalance_plan(sizes)`` (``sizes``: every rank's
    queue, gathered): each sender takes all it gives away at once (``take_spread``), one ``exchange``,
    each receiver queues its slices of the senders' parts in the plan's order. Returns the new sizes.
    Used by both engines (the plugin's queue is α,β-CROWN's domain list). Collective."""
    moves, me, P = rebalance_plan(sizes), comm.rank(), len(sizes)
    out = [sum(c for src, _, c in moves if src == r) for r in range(P)]
    every = q.exchange(q.take_spread(out[me]), out)
    taken, new = [0] * P, list(sizes)
    for src, dst, count in moves:  # each sender's part is handed out in the plan's order
        if dst == me:
            q.put(every[src][taken[src] : taken[src] + count])
        taken[src] += count
        new[src] -= count
        new[dst] += count
    return new


def rebalance(s: Search, opts: BabOptions) -> int:
    """Even the queues out (to within one) when the queues differ by more than a batch, or when a rank
    cannot fill its next batch while moving domains to it would help (``Search.bounds_own_batch``);
    returns this rank's queue size. Collective."""
    P = comm.world_size()
    if P == 1:
        return len(s)
    sizes = [int(v) for v in comm.all_gather_cat(torch.tensor([len(s)], dtype=torch.int64), 0).tolist()]
    uneven = max(sizes) - min(sizes) > 1 if s.bounds_own_batch else max(sizes) > s.per_round
    starving = min(sizes) < s.per_round and uneven
    if not starving and max(sizes) - min(sizes) <= opts.batch_size:
        return len(s)
    redistribute(s, sizes)
    return len(s)


def run_search(
    s: Search, opts: BabOptions, expired: Callable[[], bool], on_round: OnRound | None = None
) -> BabResult:
    """Run ``s`` to a verdict. ``expired`` is asked exactly once per round (after it) on every rank;
    ``on_round`` is called after every round but the root's on every rank. The result's ``rounds``
    counts the bounding rounds, the root's included; ``domains`` the domains bounded on all ranks."""
    bounded, cex = s.start()
    total, rounds = 0, 1  # the root's bounding is the first round
    max_queue = len(s)
    while True:
        a = agree_round(s, cex is not None, bounded, expired)
        total += a.bounded
        if rounds > 1 and on_round is not None:
            on_round(rounds, a.left, a.worst, total)
        verdict = (
            "sat"
            if a.found
            else "unknown"
            if a.stuck or a.left > opts.max_domains
            else "unsat"
            if a.left == 0
            else "timeout"
            if a.expired
            else None
        )
        if verdict is not None:
            queues = comm.all_gather_cat(torch.tensor([max_queue], dtype=torch.int64), 0)
            result = BabResult(verdict, None, total, rounds, [int(v) for v in queues.tolist()])
            if verdict == "unknown":
                result.reason = (
                    "branch and bound stopped early: a domain with every unstable ReLU split is still not "
                    "verified (its bound is not exact); input splits (bab.branching.input_split) may "
                    "decide it"
                    if a.stuck
                    else f"branch and bound stopped early: {a.left} domains alive, more than bab.max_domains "
                    f"({opts.max_domains})"
                )
            if verdict == "sat":  # found was agreed: every rank takes part in the sharing
                result.counterexample = share_counterexample(cex)
            if verdict == "unsat":  # every leaf verified: the least leaf bound bounds the margin
                result.bound = a.proven if np.isfinite(a.proven) else -np.inf
            return result
        max_queue = max(max_queue, rebalance(s, opts))
        bounded, cex = s.expand(min(s.per_round, len(s)))
        max_queue = max(max_queue, len(s))
        rounds += 1
