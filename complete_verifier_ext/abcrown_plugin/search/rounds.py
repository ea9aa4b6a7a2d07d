"""The lockstep round of a list split over the ranks, shared by activation BaB (:mod:`.activation`) and
input-split BaB (:mod:`.input_split`).

α,β-CROWN's searches run rounds: pick a batch out of a list (of domains or input boxes), branch and
bound it, add the unverified children back. Under P > 1 each rank keeps its own share of the list,
and a round becomes:

1. one ``all_gather_object`` of (held, batch size); the batch is the smallest over the ranks
   (``AutoBatchSize`` may enlarge it on one rank only), and a rank's share of it is ⌈B / P⌉
   (:func:`deal_round`);
2. a rebalance when the queues differ by more than a share, or when some rank cannot fill its share
   while another holds more than its own: the native engine's ``redistribute`` evens the counts out,
   and the items move (as the list's next pick would take them) in one ``all_gather_object``
   (:class:`ListQueue`, :func:`even_out`);
3. each rank runs α,β-CROWN's own round on its share, rank-local (the rank's own clock; with the
   weights sharded, inside :func:`fetched`);
4. one ``all_gather_object`` of what the search decides on (held, the worst lb − rhs, visited): the
   global lower bound is the worst over the ranks (:func:`worst_over_ranks`), ``len()`` of the list
   the global count (:func:`list_len`) until the next round.

Every rank therefore issues the same collectives whatever happens inside its share; what a round hands
to the patches inside it (the picks) is the run's :class:`~..run.Rounds`, and so is the count of
lockstep collectives of each round (for the summary). A whole search runs inside :func:`searching`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...bab.search import redistribute
from ...parallel import comm, serve
from ..rows import alpha
from ..run import Run
from ..weights import shards


def lockstep_calls() -> int:
    """Collectives issued so far on this rank, point-to-point messages (whose number differs per rank
    while weights are served) left out: equal on every rank at every point, or the ranks diverged."""
    return sum(v["calls"] for name, v in comm.stats().items() if name != "exchange")


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


@dataclass
class Moved:
    """Domains removed from a list by :func:`take`: each storage's tensor (its domain axis in ``dims``)
    and each per-domain list, on the CPU. A slice over the domains is a ``Moved`` too (a rebalancing
    receiver gets its slice of the sender's part)."""

    tensors: dict[tuple, torch.Tensor]
    dims: dict[tuple, int]
    lists: dict[str, list]

    def __getitem__(self, part: slice) -> Moved:
        tensors = {k: t[(slice(None),) * self.dims[k] + (part,)] for k, t in self.tensors.items()}
        return Moved(tensors, self.dims, {k: v[part] for k, v in self.lists.items()})


def needs_rebalance(counts: list[int], share: int) -> bool:
    """Queues differ by more than a share, or this round's picks would differ by more than a sixteenth
    of their mean (early in the search, when all domains fit in one rank's share, and late)."""
    picks = [min(share, n) for n in counts]
    slack = max(1, sum(picks) // (16 * len(picks)))
    return max(counts) - min(counts) > share or max(picks) - min(picks) > slack


class ListQueue:
    """One of α,β-CROWN's domain lists as a queue of :func:`~complete_verifier_ext.bab.search.redistribute`:
    ``take(dl, k)`` removes the ``k`` domains its next pick would take, ``put(dl, moved)`` adds them
    (:mod:`.activation`'s for a domain list, :mod:`.input_split`'s for a box list)."""

    def __init__(self, dl, take: Callable[[Any, int], Moved], put: Callable[[Any, Moved], None]) -> None:
        self.dl, self._take, self._put = dl, take, put

    def take_spread(self, count: int) -> Moved | None:
        return self._take(self.dl, count) if count else None

    def exchange(self, part: Moved | None, sizes: list[int]) -> list[Moved | None]:
        return comm.all_gather_object(part)

    def put(self, part: Moved) -> None:
        self._put(self.dl, part)


def even_out(q: ListQueue, counts: list[int]) -> list[int]:
    """Even the ranks' lists out (the native engine's ``redistribute``); returns the new counts."""
    new = redistribute(q, counts)
    if len(q.dl) != new[comm.rank()]:  # a domain lost here would be a domain never verified
        raise RuntimeError(
            f"rank {comm.rank()} holds {len(q.dl)} domains after rebalancing, not {new[comm.rank()]}"
        )
    return new


def deal_round(q: ListQueue, batch: int) -> tuple[list[int], int]:
    """The start of a round on a list split over the ranks (activation or input BaB): the first time,
    ranks other than 0 empty their copy; one all-gather of (held, batch size), the batch the smallest
    over the ranks; a rebalance when needed. Returns every rank's picks (up to ⌈B / P⌉ each) and the
    batch. ``len()`` of the list is this rank's own until the round's agreement."""
    dl = q.dl
    dl._global_len = None
    if not dl.__dict__.get("_split", False):
        dl._split = True
        if comm.rank() != 0 and len(dl) > 0:
            q.take_spread(len(dl))
    counts, batches = zip(*comm.all_gather_object((len(dl), int(batch))), strict=True)
    counts, batch = list(counts), min(batches)
    share = -(-batch // comm.world_size())
    if needs_rebalance(counts, share):
        counts = even_out(q, counts)
    return [min(share, n) for n in counts], batch


def worst_over_ranks(candidates: list) -> torch.Tensor:
    """α,β-CROWN's ``check_worst_domain`` over the ranks: the lb − rhs of the domain whose best spec is
    worst; 1e-7 (its value for an empty list) when no rank holds a domain."""
    held = [w for w in candidates if w is not None]
    if not held:
        return torch.tensor(1e-7)

    def margin(w: torch.Tensor) -> float:  # NaN proves nothing: the worst there is
        m = float(w.max())
        return -math.inf if math.isnan(m) else m

    return min(held, key=margin)


def list_len(run: Run, orig):
    """``len()`` of a domain or box list is the count over all ranks between rounds (what the search
    loops read: their stop test, ``bab.max_domains``)."""

    def __len__(self):
        n = self.__dict__.get("_global_len")
        return orig(self) if n is None else n

    return __len__


def fetched(run: Run):
    """Around rank-local work of a round: the weights a rank needs fetched on request when they stay
    sharded (:func:`~complete_verifier_ext.parallel.serve.serving`), nothing to do when replicated."""
    return serve.serving() if run.weights_sharded else contextlib.nullcontext()


@contextlib.contextmanager
def searching(run: Run, reference_dict: dict | None) -> Iterator[None]:
    """Around a whole BaB search (activation or input BaB): the α saved after α-CROWN whole on every
    rank, the weights replicated (unless they stay sharded), the rows of each bound not dealt (the
    domains are). Collective on entry."""
    alpha.whole_alphas(run.rows, reference_dict)
    whole = contextlib.nullcontext() if run.weights_sharded else shards.replicated(run.shards)
    with whole, alpha.inactive(run.rows):
        yield
