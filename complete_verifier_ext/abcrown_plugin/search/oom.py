"""Out of memory in a round of β-CROWN (activation) BaB: the round again with half its domains.

α,β-CROWN's round (``bab.act_split_round``) picks a batch of domains off the list (``pick_out``: popped
from the list's storages, copied to the device), then ``split_domain`` scores the branching candidates
(kFSB, FSB: memory that grows with the batch), splits each domain and bounds the children with
β-CROWN (``net.update_bounds``), and only at its end adds the unverified children back. On a GPU,
``torch.OutOfMemoryError`` anywhere in there ended the whole run. Here:

* :func:`pick_out` records, before it pops, what the pick changes in the list (each storage's count and
  start, the per-domain lists, the domain count: an :class:`Undo`). Popping only moves a storage's
  count; the popped entries stay in its buffer until something is appended;
* :func:`split_domain`, on ``torch.OutOfMemoryError``, checks that nothing was added to or taken from
  the list since the pick, puts the picked domains back (:meth:`Undo.restore`: the counts as they
  were), drops the failed batch, picks half as many and runs the round's ``split_domain`` on them; one
  warning line each time, down to one domain, below which the error is raised after one line saying so;
* the later rounds pick at most the number that fitted (``Rounds.fits``): :func:`act_split_round` at
  P = 1, the domain-split round of :mod:`.activation` at P > 1.

At P > 1 a round's work is rank-local (each rank bounds its own share, the weights replicated or served
on request), so a rank that runs out retries on its own: the round's collectives, before and after the
share, are the same on every rank. Nothing a retried domain carries is taken from the failed attempt:
its children are built again from the domain as it was stored (branching is decided per domain, so
they are the children it would have had); any α and β that the failed bounding wrote into a picked
domain's tensors (on the CPU the picked tensors are the list's own) only move the starting point of
the next optimisation, and every α in [0, 1] and β ≥ 0 gives a sound bound.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..run import Run
from .activation import LISTS, storages


@dataclass
class Undo:
    """What one ``pick_out`` changed in a domain list, to undo it: each storage's (count, start), the
    per-domain lists as they were (a breadth-first deque copied: ``pick_out`` pops from it), and the
    domain count before and after the pick."""

    dl: weakref.ref
    used: dict[tuple, tuple[int, int | None]]
    lists: dict[str, Any]
    before: int
    after: int = -1

    @classmethod
    def of(cls, dl) -> Undo:
        used = {k: (s.num_used, getattr(s, "_usage_start", None)) for k, s in storages(dl).items()}
        lists = {}
        for name in LISTS:
            items = getattr(dl, name)
            lists[name] = deque(items) if isinstance(items, deque) else items  # a slice rebinds a list
        return cls(weakref.ref(dl), used, lists, dl.num_domains)

    def intact(self, dl) -> bool:
        """Nothing added to or taken from ``dl`` since the pick (every popped entry still in its buffer)."""
        if self.dl() is not dl or dl.num_domains != self.after:
            return False
        now = storages(dl)
        return now.keys() == self.used.keys() and all(len(s) <= self.used[k][0] for k, s in now.items())

    def restore(self, dl) -> None:
        for key, s in storages(dl).items():
            s.num_used, start = self.used[key]
            if start is not None:
                s._usage_start = start
        for name, items in self.lists.items():
            setattr(dl, name, items)
        dl.num_domains = self.before


def count(d: dict) -> int:
    """The domains of a picked batch."""
    return int(next(iter(d["lower_bounds"].values())).shape[0])


def pick_out(run: Run, orig):
    """``BatchedDomainList.pick_out``: records the :class:`Undo` of the pick first."""

    def pick_out(self, batch, device="cpu"):
        undo = Undo.of(self)
        ret = orig(self, batch, device)
        undo.after = self.num_domains
        run.rounds.undo = undo
        return ret

    return pick_out


def split_domain(run: Run, orig):
    """``bab.split_domain``: on ``torch.OutOfMemoryError``, the round's domains back on the list and the
    round again with half of them (see the module docstring)."""

    def split_domain(net, domains, d, batch, stats=None, **kwargs):
        import arguments

        visited = stats.visited if stats is not None else None
        while True:
            n = count(d)
            try:
                return orig(net, domains, d, batch, stats=stats, **kwargs)
            except torch.OutOfMemoryError:
                undo = run.rounds.undo
                cut = arguments.Config["bab"]["cut"]
                cplex = cut["enabled"] and cut["cplex_cuts"]  # the round rewrites a pick's β for them
                if (n <= 1 and batch <= 1) or cplex or undo is None or not undo.intact(domains):
                    why = ("one domain a round" if n <= 1 and batch <= 1 else "CPLEX cuts" if cplex
                           else "the domain list changed since the pick")  # fmt: skip
                    print(f"warning: out of memory in a BaB round of {n} domain(s) ({why}): giving up",
                          file=sys.stderr, flush=True)  # fmt: skip
                    raise
            # outside the handler: the failed attempt's tensors are freed, and so are the batch's
            d.clear()  # (the caller's reference to the batch, too)
            undo.restore(domains)
            if stats is not None:
                stats.visited = visited
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            # the round's batch is the smaller one: split no deeper than it (a lone domain split to
            # fill a batch of children runs again split once)
            batch = run.rounds.fits = max(1, n // 2)
            run.rounds.picked = None  # (at P > 1: the split depth from this rank's batch)
            print(f"warning: out of memory in a BaB round of {n} domain(s); retrying with {batch} a round",
                  file=sys.stderr, flush=True)  # fmt: skip
            d = domains.pick_out(batch=batch, device=net.device)
            if arguments.Config["bab"]["vanilla_crown"]:
                d["history"] = None

    return split_domain


def act_split_round(run: Run, orig):
    """``bab.act_split_round`` at P = 1: a round picks at most the domains that fitted after running
    out of memory (at P > 1 :mod:`.activation`'s round caps each rank's share)."""

    def act_split_round(domains, net, batch, iter_idx, stats=None, branching_heuristic=None):
        if run.rounds.fits is not None:
            batch = min(batch, run.rounds.fits)
        return orig(domains, net, batch, iter_idx, stats, branching_heuristic)

    return act_split_round
