"""The one exception type that is the user's mistake.

A :class:`UserError` (a bad config, model, spec or command line) ends a run with one line naming the
file and the key, line or node, ``error`` in the results file and exit code 1.  Every other exception
is a bug of the verifier and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in what the user gave the verifier; the message names where it is."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into an interrupt so that a run ends as after Ctrl-C: ranks stopped,
    scratch files removed, what was finished kept. ``signum`` gives the exit code 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def end_cleanly_on_signals() -> None:
    """In a command's main process: Ctrl-C (SIGINT, even where a script started the command with it
    ignored), SIGTERM and SIGHUP raise in the main thread, so that every ``finally`` runs."""
    import signal

    def raise_terminated(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_terminated)


def interrupted_exit_code(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 128 + the signal for SIGTERM / SIGHUP."""
    return 128 + e.signum if isinstance(e, Terminated) else 130
