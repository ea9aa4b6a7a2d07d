"""The hard end of a single instance: its answer is out before the harness's ``TIMEOUT``, whatever the
engine is doing then.

The search of a single instance stops ``clock.END_RESERVE_S`` before its timeout (both engines), but
a stage that does not look at the clock (α,β-CROWN's MILP refinement, a long α-CROWN pass, a collective
waiting for a peer) can overrun it. ``run_instance.sh`` therefore exports ``CVE_DEADLINE`` (seconds since
the epoch: its start + ``TIMEOUT`` - ``MARGIN_S``), and the process that reports arms :func:`arm`: a
daemon thread that, at the deadline, if no answer has been written, writes ``timeout`` to the results
file, says so in one line, kills this process's ranks and ends the process (``os._exit(0)``). An
answer written before is kept (the results file exists: ``run_instance.sh`` removed it first); the
race of both in one millisecond can lose an answer to ``timeout``, never give a wrong one.
``complete-verifier-ext verify --timeout`` arms the same thread with its own action (``timed-out``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "CVE_DEADLINE"
MARGIN_S = 1.0  # before TIMEOUT: for ending the process and the script after the deadline


def from_env() -> float | None:
    """``CVE_DEADLINE`` as epoch seconds, if set to a number."""
    try:
        return float(os.environ.get(ENV, ""))
    except ValueError:
        return None


class Guard:
    """An armed deadline; :meth:`cancel` once the answer is out (after it, the deadline does nothing)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        with self.lock:  # waits for a firing deadline, which ends the process
            self.cancelled = True


def arm(at: float, fire: Callable[[], None]) -> Guard:
    """At ``at`` (``time.time()``), unless cancelled: ``fire()``, then the ranks are killed and the
    process ends (exit 0)."""
    guard = Guard()

    def watch() -> None:
        while (left := at - time.time()) > 0:
            time.sleep(min(left, 0.5))
            if guard.cancelled:
                return
        guard.lock.acquire()  # held until the process ends
        if guard.cancelled:
            guard.lock.release()
            return
        try:
            fire()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed stream must not keep the process alive
                    pass
            kill_descendants(os.getpid())
            os._exit(0)

    threading.Thread(target=watch, name="cve-deadline", daemon=True).start()
    return guard


def timeout_answer(results_file: Callable[[], str | None]) -> Callable[[], None]:
    """The VNN-COMP action: ``timeout`` in the results file (``results_file()``, known by then) unless
    an answer is there, and one line on stderr."""

    def fire() -> None:
        from .results import write_atomic

        path = results_file()
        if path and not os.path.exists(path):
            write_atomic(path, "timeout\n")
        print("timeout: the run had not ended at its deadline (TIMEOUT less 1 s): stopped", file=sys.stderr)

    return fire


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid`` (its ranks and what they started), deepest first."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(p.name))
    order, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            order.append(child)
            todo.append(child)
    for child in reversed(order):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
