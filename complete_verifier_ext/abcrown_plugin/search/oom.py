"""Out of memory in a BaB round: the round again with half its domains (activation BaB) or boxes
(input-split BaB).

α,β-CROWN's round (``bab.act_split_round``) picks a batch of domains off the list (``pick_out``: popped
from the list's storages, copied to the device), then ``split_domain`` scores the branching candidates
(kFSB, FSB: memory that grows with the batch), splits each domain and bounds the children with
β-CROWN (``net.update_bounds``), and only at its end adds the unverified children back. On a GPU,
``torch.OutOfMemoryError`` anywhere in there ended the whole run. Here (each retry through
:func:`~complete_verifier_ext.parallel.oom.halve_until_fits`, the one loop of every retry, its lines
through its ``say``):

* :func:`pick_out` records, before it pops, what the pick changes in the list (each storage's count and
  start, the per-domain lists, the domain count: an :class:`Undo`). Popping only moves a storage's
  count; the popped entries stay in its buffer until something is appended;
* :func:`split_domain`, on ``torch.OutOfMemoryError``, checks that nothing was added to or taken from
  the list since the pick, puts the picked domains back (:meth:`Undo.restore`: the counts as they
  were), drops the failed batch, picks half as many and runs the round's ``split_domain`` on them; one
  warning line each time, down to one domain, below which the error is raised after one line saying so;
* the later rounds pick at most the number that fitted (``Rounds.fits``): :func:`act_split_round` at
  P = 1, the domain-split round of :mod:`.activation` at P > 1;
* where the pick itself runs out, copying the picked domains to the device (its record then has no
  ``after``: some storages popped, others not), the pick is undone and half as many are picked, one
  warning line, down to one domain (:func:`pick`; at P = 1 the round's own pick inside
  ``act_split_round``), and the later rounds pick at most that many.

At P > 1 a round's work is rank-local (each rank bounds its own share, the weights replicated or served
on request), so a rank that runs out retries on its own: the round's collectives, before and after the
share, are the same on every rank. Nothing a retried domain carries is taken from the failed attempt:
its children are built again from the domain as it was stored (branching is decided per domain, so
they are the children it would have had); any α and β that the failed bounding wrote into a picked
domain's tensors (on the CPU the picked tensors are the list's own) only move the starting point of
the next optimisation, and every α in [0, 1] and β ≥ 0 gives a sound bound.

Input-split BaB (``batch_verification_input_split``) is the same: its round pops a batch of boxes off
the box list (``pick_out_batch``: the storages of :func:`input_storages`, and the list's volume),
splits each box, bounds the halves and adds the unverified ones back at its end. How many boxes a round
bounds is set twice: a round picks at most ``solver.batch_size`` boxes, and splits a box on several
dimensions at once where the pick is below ``min_batch_size_ratio`` of that (``get_split_depth``). So
after running out, :func:`batch_verification_input_split` keeps half the number of boxes the failed
round bounded (``Rounds.fits``; ``get_bounds`` counts them in ``stats.visited``): the round runs again,
and so do the later ones, picking at most half that many boxes (each is split at least once; with
``use_reordered_bab`` the picks themselves are bounded, and split after) and splitting them no deeper
than that many (:func:`get_split_depth`), down to one box split once. Where the pick itself runs out,
the round runs again picking half as many (split once each, unless reordered), down to one box. The
boxes are the list's own, as above: what the failed attempt wrote into them (its α) only moves a
starting point.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...parallel.oom import halve_until_fits, say
from ..run import Run

# the per-domain lists of a BatchedDomainList (beside its TensorStorages)
LISTS = ("all_betas", "all_intermediate_betas", "histories", "split_histories", "depths")


def storages(dl) -> dict[tuple, Any]:
    """Every per-domain ``TensorStorage`` of a ``BatchedDomainList`` (the ones ``pick_out`` pops), by key.
    The other layers' bounds are static (one entry, rebuilt from each domain's history)."""
    out: dict[tuple, Any] = {("lA", k): s for k, s in dl.all_lAs.items()}
    final = dl.final_name
    out[("global_lb",)], out[("global_ub",)] = dl.all_global_lbs, dl.all_global_ubs
    out[("thresholds",)], out[("c",)] = dl.all_thresholds, dl.Cs
    out[("lb", final)], out[("ub", final)] = dl.all_lb_alls[final], dl.all_ub_alls[final]
    for name in ("all_x_Ls", "all_x_Us", "all_input_split_idx"):
        if getattr(dl, name) is not None:
            out[(name,)] = getattr(dl, name)
    for k, v in dl.all_alphas.items():
        for kk, s in v.items():
            out[("alpha", k, kk)] = s
    for k, pair in (dl.unstable_interm_bounds or {}).items():
        if pair is not None:
            out[("unstable", k, 0)], out[("unstable", k, 1)] = pair
    return out


@dataclass
class Undo:
    """What one pick changed in a domain (or box) list, to undo it: each per-domain storage's (count,
    start) before the pick and its count after, and the attributes the pick rebinds, as they were (a
    breadth-first deque copied: ``pick_out`` pops from it). ``stores(list)``: the list's storages by
    key (:func:`storages`, :func:`input_storages`)."""

    dl: weakref.ref
    stores: Callable[[Any], dict[tuple, Any]]
    used: dict[tuple, tuple[int, int | None]]
    attrs: list[tuple[Any, str, Any]]  # (object, attribute, value before the pick)
    after: dict[tuple, int] | None = None  # each storage's count after the pick

    @classmethod
    def of(cls, dl, stores: Callable[[Any], dict[tuple, Any]], attrs: list[tuple[Any, str]]) -> Undo:
        used = {k: (s.num_used, getattr(s, "_usage_start", None)) for k, s in stores(dl).items()}
        kept = []
        for obj, name in attrs:
            value = getattr(obj, name)
            kept.append((obj, name, deque(value) if isinstance(value, deque) else value))  # a slice rebinds
        return cls(weakref.ref(dl), stores, used, kept)

    def picked(self, dl) -> None:
        self.after = {k: len(s) for k, s in self.stores(dl).items()}

    def intact(self, dl) -> bool:
        """Nothing added to or taken from ``dl`` since the pick: every storage holds what the pick left
        (an append moves some count; the popped entries stay in their buffers until one)."""
        return self.dl() is dl and self.after == {k: len(s) for k, s in self.stores(dl).items()}

    def restore(self, dl) -> None:
        for key, s in self.stores(dl).items():
            s.num_used, start = self.used[key]
            if start is not None:
                s._usage_start = start
        for obj, name, value in self.attrs:
            setattr(obj, name, value)


def count(d: dict) -> int:
    """The domains of a picked batch."""
    return int(next(iter(d["lower_bounds"].values())).shape[0])


def _rebound(dl) -> list[tuple[Any, str]]:
    """What ``BatchedDomainList.pick_out`` rebinds besides its storages."""
    return [(dl, name) for name in LISTS] + [(dl, "num_domains")]


def _recorded(run: Run, orig, stores, rebound):
    """A list's pick method ``orig`` that records the :class:`Undo` of each pick in ``run.rounds.undo``:
    ``stores(list)`` the storages it pops, ``rebound(list)`` what else it rebinds."""

    def pick(self, *args, **kwargs):
        undo = Undo.of(self, stores, rebound(self))
        try:
            ret = orig(self, *args, **kwargs)
        except torch.OutOfMemoryError:
            run.rounds.undo = undo  # the pick ran out midway (``after`` None): a list's record, not its
            raise  # lists' (a list of lists calls its lists' picks)
        undo.picked(self)
        run.rounds.undo = undo
        return ret

    return pick


def _undone_pick(run: Run, dl, batch: int) -> int | None:
    """In a handler of ``torch.OutOfMemoryError``: where it came from a pick of ``batch`` off ``dl`` (which
    then took some of its storages' entries and not the others), that pick undone and the number of
    domains it picked; else None. A pick of one domain is the last: one line saying so, and None."""
    undo = run.rounds.undo
    if undo is None or undo.after is not None or undo.dl() is not dl:
        return None
    undo.restore(dl)
    run.rounds.undo = None
    n = min(batch, dl.num_domains)
    if n <= 1:
        say("picking 1 domain off the list: giving up")
        return None
    return n


def _fewer(run: Run, n: int, fits: int) -> int:
    """After a pick of ``n`` domains ran out of memory: ``fits`` a round from now on (``Rounds.fits``),
    one warning line."""
    run.rounds.fits = fits
    say(f"picking {n} domain(s) off the list; retrying with {fits} a round")
    return fits


def _picking_fewer(run: Run, domains, batch: int, attempt: Callable[[int], Any]) -> Any:
    """``attempt(batch)``, whose pick off ``domains`` takes ``batch`` domains, again with half as many
    where that pick runs out of memory copying them (:func:`_undone_pick`, :func:`_fewer`)."""
    return halve_until_fits(
        attempt, batch, lambda b, _: _undone_pick(run, domains, b), lambda n, fits: _fewer(run, n, fits)
    )[0]


def pick(run: Run, domains, batch: int, device) -> dict:
    """A round's ``domains.pick_out(batch)``, again with half as many where copying the picked domains
    runs out of memory."""
    return _picking_fewer(run, domains, batch, lambda b: domains.pick_out(batch=b, device=device))


def pick_out(run: Run, orig):
    """``BatchedDomainList.pick_out``: records the :class:`Undo` of the pick."""
    return _recorded(run, orig, storages, _rebound)


def split_domain(run: Run, orig):
    """``bab.split_domain``: on ``torch.OutOfMemoryError``, the round's domains back on the list and the
    round again with half of them (see the module docstring)."""

    def split_domain(net, domains, d, batch, stats=None, **kwargs):
        import arguments

        visited = stats.visited if stats is not None else None
        now = {"d": d, "batch": batch}  # the round's batch of domains, and its size

        def failed(n: int, _) -> int | None:
            undo, cut = run.rounds.undo, arguments.Config["bab"]["cut"]
            cplex = cut["enabled"] and cut["cplex_cuts"]  # the round rewrites a pick's β for them
            if (n <= 1 and now["batch"] <= 1) or cplex or undo is None or not undo.intact(domains):
                why = ("one domain a round" if n <= 1 and now["batch"] <= 1 else "CPLEX cuts" if cplex
                       else "the domain list changed since the pick")  # fmt: skip
                say(f"in a BaB round of {n} domain(s) ({why}): giving up")
                return None
            return n

        def again(n: int, fits: int) -> int:
            now["d"].clear()  # the failed batch freed (the caller's reference to it, too)
            run.rounds.undo.restore(domains)
            if stats is not None:
                stats.visited = visited
            # the round's batch is the smaller one: split no deeper than it (a lone domain split to
            # fill a batch of children runs again split once)
            now["batch"] = run.rounds.fits = fits
            run.rounds.picked = None  # (at P > 1: the split depth from this rank's batch)
            say(f"in a BaB round of {n} domain(s); retrying with {fits} a round")
            now["d"] = pick(run, domains, fits, net.device)
            if arguments.Config["bab"]["vanilla_crown"]:
                now["d"]["history"] = None
            return count(now["d"])

        def attempt(_: int):
            return orig(net, domains, now["d"], now["batch"], stats=stats, **kwargs)

        return halve_until_fits(attempt, count(d), failed, again)[0]

    return split_domain


def act_split_round(run: Run, orig):
    """``bab.act_split_round`` at P = 1: a round picks at most the domains that fitted after running
    out of memory (at P > 1 :mod:`.activation`'s round caps each rank's share)."""

    def act_split_round(domains, net, batch, iter_idx, stats=None, branching_heuristic=None):
        if run.rounds.fits is not None:
            batch = min(batch, run.rounds.fits)
        # where the round's own pick runs out (split_domain's picks use pick())
        return _picking_fewer(
            run, domains, batch, lambda b: orig(domains, net, b, iter_idx, stats, branching_heuristic)
        )

    return act_split_round


# ----------------------------------------------------------------------------------------------------------
# Input-split BaB
# ----------------------------------------------------------------------------------------------------------

_PER_BOX = ("lb", "dm_l", "dm_u", "cs", "threshold", "constraint_A", "constraint_b", "split_idx")


def _box_lists(dl) -> list:
    """An input-split box list's own lists: one per number of ANDs (``UnsortedMultiSpecInputDomainList``),
    or the list itself."""
    return list(getattr(dl, "spec_domain_lists", None) or [dl])


def input_storages(dl) -> dict[tuple, Any]:
    """Every per-box ``TensorStorage`` of an input-split box list (the ones ``pick_out_batch`` pops), by
    key."""
    out: dict[tuple, Any] = {}
    for i, sub in enumerate(_box_lists(dl)):
        for name in _PER_BOX:
            if getattr(sub, name, None) is not None:
                out[(i, name)] = getattr(sub, name)
        for k0, per_start in sub.alpha.items():
            for k1, s in per_start.items():
                out[(i, "alpha", k0, k1)] = s
    return out


def _volumes(dl) -> list[tuple[Any, str]]:
    """What ``pick_out_batch`` rebinds besides its storages: each box list's volume."""
    return [(sub, name) for sub in _box_lists(dl) for name in ("volume", "all_volume")]


def pick_out_batch(run: Run, orig):
    """An input-split list's ``pick_out_batch``: records the :class:`Undo` of the pick (a list of lists
    calls its lists' own: its record, of all of them, is the last)."""
    return _recorded(run, orig, input_storages, _volumes)


def batch_verification_input_split(run: Run, orig):
    """α,β-CROWN's input-split round (at P > 1 the rank's own share): on ``torch.OutOfMemoryError`` the
    boxes back on the list and the round again bounding at most half as many (see the module
    docstring)."""

    def batch_verification_input_split(d, net, batch, *args, **kwargs):
        stats = kwargs.get("stats")
        reordered = bool(kwargs.get("use_reordered_bab", False))  # bounds the picks, splits after
        visited = stats.visited if stats is not None else 0
        now = {"batch": batch}

        def attempt(_: int):
            if run.rounds.fits is not None:  # the picks, each split at least once (unless reordered)
                now["batch"] = min(
                    now["batch"], run.rounds.fits if reordered else max(1, run.rounds.fits // 2)
                )
            run.rounds.undo = None
            return orig(d, net, now["batch"], *args, **kwargs)

        def failed(_: int, __) -> int | None:
            counted = stats.visited - visited if stats is not None else 0  # what get_bounds bounded
            now["what"], bounded, why = _failed_round(run.rounds.undo, d, now["batch"], counted, reordered)
            if why:
                say(f"in an input-split BaB round {now['what']} ({why}): giving up")
                return None
            return bounded

        def again(_: int, fits: int) -> int:
            run.rounds.undo.restore(d)
            if stats is not None:
                stats.visited = visited
            run.rounds.fits = fits
            unit = "bounded" if now["what"].startswith("bounding") else "picked"
            then = fits if unit == "bounded" or reordered else max(1, fits // 2)
            say(f"in an input-split BaB round {now['what']}; retrying with at most {then} {unit} a round")
            return fits

        return halve_until_fits(attempt, batch, failed, again)[0]

    return batch_verification_input_split


def _failed_round(undo: Undo | None, d, batch: int, counted: int, reordered: bool) -> tuple[str, int, str]:
    """What an input-split round that ran out of memory was doing (``picking N box(es) off the list`` or
    ``bounding N box(es)``), the boxes it would have bounded, and why it cannot run again ("" where it
    can)."""
    if undo is not None and undo.after is None:  # the pick itself ran out, copying the boxes
        picked = min(batch, _picked(undo, before=True))
        bounded = picked * (1 if reordered else 2)  # as if each pick were split once (half as many a round)
        changed = undo.dl() is not d
        why = "the box list changed since the pick" if changed else "one box" if picked <= 1 else ""
        return f"picking {picked} box(es) off the list", bounded, why
    picked = _picked(undo)
    bounded = counted or picked
    least = picked <= 1 and bounded <= (1 if reordered else 2)  # one box, split once
    changed = undo is None or not undo.intact(d)
    why = "the box list changed since the pick" if changed else "one box split once" if least else ""
    return f"bounding {bounded} box(es)", bounded, why


def _picked(undo: Undo | None, before: bool = False) -> int:
    """The boxes a pick took off the list; ``before``: the boxes the list held before it."""
    if undo is None or (undo.after is None and not before):
        return 0
    return sum(undo.used[k][0] - (0 if before else undo.after[k]) for k in undo.used if k[1] == "dm_l")


def get_split_depth(run: Run, orig):
    """``input_split.split.get_split_depth`` after running out of memory: no deeper than a round of at
    most ``Rounds.fits`` boxes bounded (at least 1: each box split once)."""

    def get_split_depth(current_domain_num, split_partitions=2):
        depth = orig(current_domain_num, split_partitions)
        fits = run.rounds.fits
        if fits is not None and current_domain_num > 0:
            while depth > 1 and current_domain_num * split_partitions**depth > fits:
                depth -= 1
        return depth

    return get_split_depth
