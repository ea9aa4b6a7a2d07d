"""Out of memory, in one place: how a bound pass, a BaB round or a pick of domains that runs out of
device memory (``torch.OutOfMemoryError``, what CUDA raises) runs again smaller, at P = 1 and in
lockstep at P > 1, with one format for every warning line (:func:`say`).

* :func:`halve_until_fits`: the one retry loop (an attempt, how many ran out or giving up, what is put
  back before the next attempt), under every retry below and the plugin's BaB rounds and picks;
* :func:`halving_on_oom`: a pass over some count of items (rows, domains, boxes) again with half as
  many, down to one; at P > 1 where the ranks stopped together (:class:`LockstepOutOfMemoryError`),
  every rank again with at most half the most any rank had;
* :func:`lockstep_on_oom` / :func:`passes_in_lockstep`: one rank's pass that runs out midway while the
  others run theirs: it replays the rest of the pass over a dummy row without issuing again the
  collectives it issued (the replay bookkeeping lives with the collectives themselves,
  :func:`.comm.issued` / :func:`.comm.replaying`: a helper that was issued returns its kept decision or
  a stand-in of its shape), the ranks vote, and every rank runs that pass again in halves.

Who uses it: the native engine's CROWN passes (``bounds/crown.py``) and input-split rounds
(``bab/input_split.py``), the plugin's row passes (``abcrown_plugin/rows/``) and its BaB rounds and
picks (``abcrown_plugin/search/oom.py``, which records and undoes what a pick took off the domain list).
"""

from __future__ import annotations

__all__ = [
    "LockstepOutOfMemoryError",
    "halve_until_fits",
    "halving_on_oom",
    "lockstep_on_oom",
    "passes_in_lockstep",
    "say",
]

import sys
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
Part = TypeVar("Part")


def say(line: str) -> None:
    """One warning line about running out of memory: ``warning: out of memory LINE``."""
    print(f"warning: out of memory {line}", file=sys.stderr, flush=True)


class LockstepOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory that every rank raises at the same point of its collectives (some rank ran out on
    a pass of one row and the ranks voted, :func:`lockstep_on_oom`): the ranks are still in lockstep,
    so callers that catch it on every rank may run their work again, smaller, on every rank."""


def halve_until_fits(
    attempt: Callable[[int], T],
    size: int,
    failed: Callable[[int, torch.OutOfMemoryError], int | None],
    on_halve: Callable[[int, int], int],
) -> tuple[T, int]:
    """The one loop of every retry after running out of memory: ``attempt(size)`` until it fits. On
    ``torch.OutOfMemoryError``, ``failed(size, error)`` (inside the handler) says how many items ran out
    (rows, domains, boxes), or None to give up (the error is raised, after the caller's one line);
    then, outside the handler (the failed attempt's tensors freed, the device's cache emptied),
    ``on_halve(n, max(1, n // 2))`` puts back what the attempt took, says one line and returns the
    size of the next attempt. Returns the result and the size that worked."""
    while True:
        try:
            return attempt(size), size
        except torch.OutOfMemoryError as e:
            n = failed(size, e)
            if n is None:
                raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        size = on_halve(n, max(1, n // 2))


def halving_on_oom(
    attempt: Callable[[int], T],
    size: int,
    where: str,
    retry: bool = True,
    what: str = "rows",
    lockstep: bool = False,
    on_halve: Callable[[int], None] | None = None,
) -> tuple[T, int]:
    """``attempt(size)``: a bound pass over rows (``what``: what it counts) in sub-passes of at most
    ``size`` of them. When the device runs out of memory (``torch.OutOfMemoryError``, what CUDA
    raises), the pass runs again with half as many per sub-pass, one warning line on stderr each time,
    down to one; below that, or where no retry is possible (``retry`` False: at P > 1 a rank that left
    a pass midway no longer issues the collectives the others do), the error is raised after one line
    saying so. Returns the pass's result and the size that worked (the caller's next passes take it);
    ``on_halve(n)`` is told each new size.

    ``lockstep`` (at P > 1, where ``attempt`` issues collectives and every rank calls this together):
    only a :class:`LockstepOutOfMemoryError` (raised on every rank at the same point) is retried. The
    ranks agree on the largest size among them (one ``all_reduce``), every rank runs again with at
    most half of it (``on_halve`` is told that cap, the same on every rank; one line, from rank 0), and
    they give up together where that largest size was one. Any other out of memory is raised after
    one line."""
    from . import comm

    def tell(line: str) -> None:
        if not lockstep or comm.rank() == 0:
            say(f"in a pass of {line}")

    one = what.removesuffix("s")

    def failed(size: int, e: torch.OutOfMemoryError) -> int | None:
        if not retry or (lockstep and not isinstance(e, LockstepOutOfMemoryError)):
            why = "at P > 1 the ranks cannot retry a pass in lockstep"
            say(f"in a pass of {size} {one}(s) of {where} ({why}): giving up")
            return None
        most = size
        if lockstep:  # every rank is here: agree on the largest size
            most = int(comm.all_reduce(torch.tensor([size], device=comm.device()), "max"))
        if most <= 1:
            per = "rank" if lockstep else "pass"
            tell(f"{most} {one}(s) of {where} (one {one} per {per}): giving up")
            return None
        state["size"] = size
        return most

    def halved(most: int, cap: int) -> int:
        size = min(state["size"], cap)
        if lockstep:
            tell(f"up to {most} {what} per rank of {where} (every rank stopped together); retrying with at "
                 f"most {cap} per rank")  # fmt: skip
        else:
            tell(f"{most} {what} of {where}; retrying in passes of {size}")
        if on_halve is not None:
            on_halve(cap)
        return size

    state = {"size": size}
    return halve_until_fits(attempt, size, failed, halved)


def lockstep_on_oom(
    attempt: Callable[[], T], shadow: Callable[[], object], rows: int, where: str, what: str = "rows"
) -> tuple[T | None, int]:
    """One pass of this rank's ``rows`` rows (``attempt()``; ``what``: what it counts, e.g. channels of
    dense rows, the smallest pass one of them) where the other ranks run theirs, in
    lockstep. Where this rank runs out of memory midway (``torch.OutOfMemoryError``, what CUDA raises),
    it runs ``shadow()``, the same pass over one dummy row, without issuing again the collectives it
    issued before it stopped (:func:`.comm.replaying`): every rank then ends the pass having issued
    the same ones. Then the ranks vote (one ``all_reduce``). Returns ``(result, 0)``, or ``(None, n)``
    on every rank where some rank ran out, ``n`` the most rows of a pass that did: the caller runs each
    rank's pass again as two passes of half its rows. Where a rank ran out on a pass of one row, every
    rank raises :class:`LockstepOutOfMemoryError` (one line on the rank that ran out); where even
    ``shadow()`` runs out, that rank raises, and the launcher ends the others."""
    from . import comm

    before = comm.issued()
    result, failed = None, False
    try:
        result = attempt()
    except torch.OutOfMemoryError:
        failed = True
    if failed:  # outside the handler: the failed pass's tensors are freed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            with comm.replaying(comm.issued() - before):
                shadow()
        except torch.OutOfMemoryError:
            say(f"on rank {comm.rank()} in a dummy pass of {where}: giving up")
            raise
    rows = max(1, rows)  # a dummy pass is one row
    vote = torch.tensor([rows if failed else 0, int(failed and rows == 1)], device=comm.device())
    most, stuck = (int(v) for v in comm.all_reduce(vote, "max").tolist())
    me = f"rank {comm.rank()}"
    if stuck:
        if failed and rows == 1:
            say(f"on {me} in a pass of 1 of {where}'s {what} (the smallest pass): every rank stops there")
        raise LockstepOutOfMemoryError(f"out of memory in a pass of 1 of {where}'s {what} (a rank at P > 1)")
    if failed:
        say(f"on {me} in a pass of {rows} {what} of {where}; every rank runs that pass again in two halves")
    return (None, most) if most else (result, 0)


def passes_in_lockstep(
    parts: list[Part],
    attempt: Callable[[Part], T],
    shadow: Callable[[], object],
    real: Callable[[Part], int],
    halve: Callable[[Part], list[Part]],
    where: str,
    what: str = "rows",
    on_failure: Callable[[int], None] | None = None,
) -> list[T]:
    """``attempt(part)`` for this rank's passes ``parts`` (``real(part)`` rows each; every rank has as many
    passes, run in lockstep with theirs), each under :func:`lockstep_on_oom` (``shadow()``: a pass over
    one dummy row). A pass that runs out of memory on any rank runs again on every rank as two passes
    (``halve(part)``: the two halves of its rows, a dummy into two dummies: every rank splits as many),
    and so does each pass after it; ``on_failure(n)`` is told the most rows of the pass that failed.
    Returns every pass's result, in ``parts``' order."""
    queue, done = list(parts), []
    while queue:
        part = queue.pop(0)
        out, failed = lockstep_on_oom(lambda part=part: attempt(part), shadow, real(part), where, what)
        if out is None:
            if on_failure is not None:
                on_failure(failed)
            queue = [half for p in (part, *queue) for half in halve(p)]
            continue
        done.append(out)
    return done
