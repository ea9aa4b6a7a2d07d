"""The replay bookkeeping of the collectives: how many lockstep collectives this process issued
(:func:`issued`), and a pass that a rank left midway (out of memory, :mod:`.oom`) run again over a dummy
row without issuing again the ones it issued (:func:`replaying`): each skipped helper returns a
stand-in of its result's shape, or, for a decision (an ``all_reduce_flag``, an ``all_reduce`` of at most
:data:`DECISION_NUMEL` elements: a vote, a stop), the very result it had, so that the replay takes the
branches the pass took. :mod:`.comm` decorates each of its public helpers with :func:`counted`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

DECISION_NUMEL = 16  # an all_reduce this small is taken for a decision: its result is kept for a replay
KEPT_DECISIONS = 4096  # the decisions of at least this many of the last collectives are kept


@dataclass
class _Issued:
    """The lockstep collectives this process issued (outermost helper calls; a helper that calls another
    is one), the results of the recent decisions among them (by their position in that count), and,
    while it replays a pass it left midway (:func:`replaying`), how many of the next ones it issued
    already and the position of the next."""

    count: int = 0
    skip: int = 0
    at: int = 0
    depth: int = 0
    decisions: dict[int, Any] = field(default_factory=dict)

    def keep(self, out: Any) -> None:
        self.decisions[self.count] = out.clone() if isinstance(out, Tensor) else out
        if len(self.decisions) > 2 * KEPT_DECISIONS:
            self.decisions = {i: v for i, v in self.decisions.items() if i >= self.count - KEPT_DECISIONS}


_ISSUED = _Issued()


class NotReplayable(RuntimeError):
    """A collective whose result a rank cannot stand in for (it depends on the other ranks' data)."""


def counted(
    stand_in: Callable[..., Any],
    decision: Callable[..., bool] = lambda *_, **__: False,
    *,
    parallel: Callable[[Any], bool],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Count a public collective helper in :func:`issued` (where ``parallel(group)``: it communicates);
    inside :func:`replaying` it is not issued again while calls are left to skip: the result it had
    when ``decision`` (same arguments) says it was a decision and that result is still kept, else
    ``stand_in`` (same arguments), a result of its shape."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def helper(*args: Any, **kwargs: Any) -> Any:
            if _ISSUED.depth or not parallel(kwargs.get("group")):
                return fn(*args, **kwargs)
            if _ISSUED.skip:
                _ISSUED.skip, _ISSUED.at = _ISSUED.skip - 1, _ISSUED.at + 1
                if decision(*args, **kwargs) and _ISSUED.at - 1 in _ISSUED.decisions:
                    had = _ISSUED.decisions[_ISSUED.at - 1]
                    return had.clone() if isinstance(had, Tensor) else had
                return stand_in(*args, **kwargs)
            _ISSUED.depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                _ISSUED.depth -= 1
            if decision(*args, **kwargs):
                _ISSUED.keep(out)
            _ISSUED.count += 1
            return out

        return helper

    return wrap


def issued() -> int:
    """How many lockstep collectives this process has issued (every rank the same at the same point)."""
    return _ISSUED.count


@contextmanager
def replaying(n: int) -> Iterator[None]:
    """The next ``n`` collectives were issued already, by a pass this rank left midway (out of memory):
    inside, the same pass runs again (over fewer rows) without issuing them again, so that it ends
    having issued what the other ranks' passes issue. Each skipped helper returns a stand-in of its
    result's shape (values undefined: the pass's result is dropped). Raises where the pass issued
    fewer than ``n`` or one whose result cannot be stood in for (:class:`NotReplayable`). A decision
    among them returns the result it had (see the module docstring)."""
    _ISSUED.skip, _ISSUED.at = n, _ISSUED.count - n
    try:
        yield
    finally:
        left, _ISSUED.skip = _ISSUED.skip, 0
    if left:
        raise RuntimeError(f"a replayed pass issued {n - left} of the {n} collectives of the pass it replays")
