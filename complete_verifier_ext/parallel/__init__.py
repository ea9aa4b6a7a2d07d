"""Parallel machinery: collectives, launcher, sharded weights, memory measurement.

Knows nothing about bounds; ``bounds`` and ``bab`` use it. ``comm`` is the only module of the project
that calls ``torch.distributed``; every helper is a no-op at world size 1.

Gradient convention under autograd (α-CROWN, β-CROWN): the objective is the SUM over ranks of each
rank's loss. A tensor owned by one rank (a block of rows, its α) receives that objective's gradient;
a replicated tensor receives, on each rank, a partial gradient, and the partials sum (over ranks) to
the objective's gradient. ``all_gather_cat_grad`` (and the column-parallel ``ShardedWeight.linear`` /
``conv2d`` built on it) implement this; a replicated leaf that needs its full gradient must
``comm.all_reduce`` its ``.grad``; a loss replicated on every rank must be counted once (e.g. scaled by
``1 / world_size``). Every rank must run backward through the same collective nodes in the same order,
except inside ``serve.serving()``, where sharded weights are fetched on demand and the ranks may run
different work.
"""

from . import comm, serve
from .launch import RankFailure, run
from .memory import EXACT_MEMORY_ENV, PeakMemory, exact_memory_env_ok
from .sharded import MODES, ShardedWeight, release_gather_buffers

__all__ = [
    "comm",
    "serve",
    "run",
    "RankFailure",
    "ShardedWeight",
    "MODES",
    "release_gather_buffers",
    "PeakMemory",
    "exact_memory_env_ok",
    "EXACT_MEMORY_ENV",
]
