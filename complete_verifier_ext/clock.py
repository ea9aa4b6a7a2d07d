"""When the verifier started: the origin of every instance's wall-clock timeout.

The clock of a single instance counts from the moment the verifier itself started — this package's
first import, a few milliseconds after the interpreter's start — not from the kernel's start time of
the process, which is its *fork* time: a shell execs the last command of a list in the process it
forked, so ``pip install ... && abcrown ...`` would otherwise count the install against the timeout.

The VNN-COMP scripts count from their own start, as the harness does: ``run_instance.sh`` exports
``CVE_CLOCK_START`` (seconds since the epoch, ``date +%s.%N``), which wins when it lies in the past.
Ranks that a launcher spawns are handed the launcher's start; they never read the environment.
"""

from __future__ import annotations

import os
import time

ENV = "CVE_CLOCK_START"
END_RESERVE_S = 2.0
"""Seconds of a single instance's wall-clock timeout that the search leaves unused, on both engines:
for writing the results and the witness and ending the ranks and the interpreter, so that the
answer is complete before the harness's ``TIMEOUT`` (``benchmarks/timeout_line.py`` measures it)."""

_IMPORTED_WALL = time.time()
_IMPORTED_MONO = time.monotonic()


def _from_env() -> float | None:
    """``CVE_CLOCK_START`` as epoch seconds, if it is a number no later than now."""
    text = os.environ.get(ENV, "").strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= time.time() else None


def restart() -> None:
    """The verifier starts now (``CVE_CLOCK_START`` still wins when set and in the past): for an
    instance forked from the resident worker (``worker.py``), which imported this module long before."""
    global _IMPORTED_WALL, _IMPORTED_MONO
    _IMPORTED_WALL, _IMPORTED_MONO = time.time(), time.monotonic()


def started_wall() -> float:
    """``time.time()`` at the verifier's start (``CVE_CLOCK_START`` when set and in the past)."""
    env = _from_env()
    return min(env, _IMPORTED_WALL) if env is not None else _IMPORTED_WALL


def started_monotonic() -> float:
    """The same moment on ``time.monotonic()``'s scale (shared by every process of the host)."""
    return _IMPORTED_MONO - (_IMPORTED_WALL - started_wall())


def wall_to_monotonic(wall: float) -> float:
    """A ``time.time()`` instant on ``time.monotonic()``'s scale, as seen from now."""
    return time.monotonic() - (time.time() - wall)
