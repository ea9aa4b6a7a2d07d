"""Where α,β-CROWN iterates a ``set`` of graph nodes while the ranks must issue the same collectives.

A set of auto_LiRPA nodes iterates in the order of their hashes, which are their ids: addresses that
differ from rank to rank. Where the loop body bounds each node (``heuristics.nonlinear.utils.precompute_A``:
one CROWN pass per node whose A-matrix the nonlinear branching needs, before BaB starts, in lockstep:
each pass gathers the layers it crosses), the ranks would bound the nodes in different orders and their
collectives would not match (gloo: "Received data size doesn't match expected size"). There the module's
``set`` is :class:`InsertionOrdered`: the order the nodes were added in, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .run import Run


class InsertionOrdered(dict):
    """A set that iterates in insertion order (what the loops above use of ``set``)."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__((x, None) for x in items)

    def add(self, x: Any) -> None:
        self[x] = None

    def discard(self, x: Any) -> None:
        self.pop(x, None)

    def update(self, *others: Iterable[Any]) -> None:  # type: ignore[override]
        for other in others:
            for x in other:
                self[x] = None


def insertion_ordered(run: Run, orig: type) -> type:
    """The ``set`` of a module whose loops over nodes must run in the same order on every rank."""
    return InsertionOrdered
