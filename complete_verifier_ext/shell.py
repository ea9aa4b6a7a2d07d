"""The command shell both engines run inside (``cli.main`` for the native engine,
``abcrown_plugin.parent.main`` for α,β-CROWN): the ranks started by ``launch.run`` from the
``parallel`` settings, warnings printed by the reporting rank only, and one error ladder:

* a user mistake (:data:`USER_ERRORS`: config, model, spec, a missing path), raised here or re-raised
  from a rank: one line on stderr, ``error`` in the results file (where one instance runs), exit 1;
* a rank that failed (:class:`~complete_verifier_ext.parallel.launch.RankFailure`): its first line,
  after the traceback when it was a bug, ``error``, exit 1; a bug in this process likewise (its
  traceback, then one line, ``error``, exit 1): the harness is never left without an answer;
* Ctrl-C, SIGTERM or SIGHUP: a note, exit 130 / 143 / 129 (the ranks are stopped by ``launch``);
* ``CVE_DEADLINE`` (``run_instance.sh``): at that moment ``timeout``, the ranks killed, exit 0, unless
  an answer was written (``deadline.py``).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import deadline
from .errors import UserError, interrupted_exit_code
from .results import report_error

if TYPE_CHECKING:
    from .config import ParallelConfig

USER_ERRORS = (UserError, FileNotFoundError)
"""The user's mistakes (config, model, spec, a path that does not exist): one line, ``error``, exit 1.
Anything else is a bug and keeps its traceback."""


def backend(par: ParallelConfig, device: str) -> str:
    """``parallel.backend``; ``auto`` is gloo for a CPU run (even on a GPU host), else launch's choice."""
    if par.backend != "auto":
        return par.backend
    return "gloo" if device == "cpu" else "auto"


class Shell:
    """One run of the command: which process reports, where a failure writes ``error``, what an
    interruption says. The engine's body updates ``results_file`` and ``interrupted`` as it learns."""

    def __init__(self) -> None:
        from .parallel import launch

        self.writer = launch.is_rank0()  # decided before any group exists (under torchrun every rank)
        self.results_file: str | None = None  # None: a failure writes no result line
        self.interrupted = "interrupted"

    def warn(self, warnings: Iterable[str]) -> None:
        """Each warning on its own line of stderr, by the reporting rank."""
        for w in warnings:
            if self.writer:
                print(f"warning: {w}", file=sys.stderr)

    def launch(
        self, fn: Callable[..., Any], par: ParallelConfig, args: tuple, device: str, fork: bool = False
    ) -> Any:
        """``fn(*args)`` on ``par.world_size`` ranks (``launch.run`` with the backend, exact-memory
        and collective-timeout settings), after the world-size warnings; returns rank 0's result."""
        from .parallel import launch

        self.warn(launch.check_world_size(par.world_size))
        self.warn(launch.check_gpus(par.world_size, device, backend(par, device)))
        return launch.run(
            fn,
            par.world_size,
            args,
            backend=backend(par, device),
            exact_memory=par.exact_memory,
            timeout_s=par.collective_timeout,
            fork=fork,
        )


def run(body: Callable[[Shell], int]) -> int:
    """``body(shell)`` inside the error ladder; returns the exit code."""
    from .parallel import launch

    shell = Shell()
    at = deadline.from_env()  # run_instance.sh's hard end (deadline.py)
    guard = (
        deadline.arm(at, deadline.timeout_answer(lambda: shell.results_file)) if at and shell.writer else None
    )
    try:
        return body(shell)
    except USER_ERRORS as e:
        return report_error(shell.results_file, shell.writer, str(e))
    except launch.RankFailure as e:
        if e.details and shell.writer:  # a bug: keep its traceback
            print(e.details.rstrip(), file=sys.stderr)
        return report_error(shell.results_file, shell.writer, str(e).splitlines()[0])
    except KeyboardInterrupt as e:
        if shell.writer:
            print(shell.interrupted, file=sys.stderr)
        return interrupted_exit_code(e)
    except Exception as e:  # a bug in this process (P = 1): its traceback, and still an answer
        traceback.print_exc()
        first = (str(e).splitlines() or [""])[0]
        return report_error(shell.results_file, shell.writer, f"{type(e).__name__}: {first}")
    finally:
        if guard is not None:
            guard.cancel()
