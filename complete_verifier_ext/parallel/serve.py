"""Sharded weights on demand while the ranks do different work.

Every other collective of the project needs lockstep: each rank calls the same helpers in the same
order. A BaB round breaks that on purpose when its domains are split over the ranks: each rank bounds
its own batch, and how many bound passes that takes (β-CROWN's early stop, pruning, a rank with no
domain at all) is the rank's own business. Weights that stay sharded through the search
(``parallel.bab_weights: sharded``, and always under ``tp``) are then fetched through this module,
which needs no agreement on what comes next:

* inside :func:`serving`, a rank that needs a weight posts a request, and every rank takes part in one
  *tick*: an all-gather of every rank's request (or "done"), then the point-to-point messages the
  requests name, derived identically on every rank from that list: a whole weight (``full``: every
  other rank sends the requester its rows, assembled in place, bitwise the weight; no other rank
  builds it) or one rank's shard (``shard``, for ``tp``, which never builds a whole weight);
* a rank with nothing (more) to compute serves: it posts "done" and takes part in ticks until every
  rank has posted "done" in the same tick, which is how :func:`serving` ends, on every rank at once.

Ranks may therefore run any number of bound passes on any batch, including none. A rank that raises
inside keeps serving the others before its error propagates, so it never strands them in a tick. Any
other collective called inside (which could pair up with another rank's tick) raises at once.

A weight holder (``ShardedWeight``, in both engines) registers itself at construction
(:func:`register`); keys come from one counter, so they agree over the ranks as long as every rank
constructs its holders in the same order (replicated model building does). Holders have ``local``
(this rank's rows), ``sizes`` (the rows of every rank) and ``shape`` (the whole weight's shape).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from . import comm

__all__ = ["active", "full", "register", "serving", "shard", "stats"]

_DONE, _FULL, _SHARD = 0, 1, 2

_HOLDERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()
_serving = False
_counts = {"full": 0, "shard": 0, "ticks": 0}


def register(holder: Any) -> None:
    """Give ``holder`` its key (``holder.serve_key``)."""
    holder.serve_key = next(_KEYS)
    _HOLDERS[holder.serve_key] = holder


def active() -> bool:
    """Inside :func:`serving` with more than one rank: fetch weights with :func:`full` / :func:`shard`."""
    return _serving


def stats() -> dict[str, int]:
    """Whole weights and shards this rank requested, and ticks it took part in (since the process
    started)."""
    return dict(_counts)


def _tick(kind: int, key: int = -1, src: int = -1) -> tuple[Tensor | None, bool]:
    """One request round: returns what this rank asked for and whether every rank posted "done"."""
    me = comm.rank()
    mine = torch.tensor([[kind, key, src]], dtype=torch.int64, device=comm.device())
    with comm.lockstep(True):
        every = comm.all_gather_cat(mine, 0, sizes=[1] * comm.world_size()).tolist()
    _counts["ticks"] += 1
    got = None
    sends, recvs = [], []
    for r, (kd, k, q) in enumerate(every):
        if kd == _DONE:
            continue
        h = _HOLDERS[k]
        if kd == _SHARD:
            if q == me:
                sends.append((r, h.local))
            if r == me:
                got = h.local.new_empty((h.sizes[q], *h.shape[1:]))
                recvs.append((q, got))
        elif r != me:  # a whole weight for rank r: every other rank sends it its rows
            if h.sizes[me] > 0:
                sends.append((r, h.local))
        else:  # assembled here, each rank's rows into their place (bitwise the weight)
            got = h.local.new_empty(h.shape)
            start = 0
            for owner, n in enumerate(h.sizes):
                block = got.narrow(0, start, n)
                if owner == me:
                    block.copy_(h.local)
                elif n > 0:
                    recvs.append((owner, block))
                start += n
    with comm.lockstep(True):
        comm.exchange(sends, recvs)
    return got, all(kd == _DONE for kd, _, _ in every)


def full(holder: Any) -> Tensor:
    """The whole weight of ``holder`` (a fresh tensor), fetched in one tick."""
    _counts["full"] += 1
    got, _ = _tick(_FULL, holder.serve_key)
    assert got is not None
    return got


def shard(holder: Any, q: int) -> Tensor:
    """Rank ``q``'s rows of ``holder`` (this rank's own without communication)."""
    if q == comm.rank():
        return holder.local
    _counts["shard"] += 1
    got, _ = _tick(_SHARD, holder.serve_key, q)
    assert got is not None
    return got


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """Weights on demand inside; on exit, serve the others until every rank is done. Collective (every
    rank enters and leaves it together). Nested use is the outer one; one rank: nothing to serve."""
    global _serving
    if _serving or comm.world_size() == 1:
        yield
        return
    _serving = True
    try:
        with comm.lockstep(False):
            yield
    finally:
        try:
            while not _tick(_DONE)[1]:
                pass
        finally:
            _serving = False
