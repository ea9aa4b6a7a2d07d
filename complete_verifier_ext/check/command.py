"""``complete-verifier-ext check QUERY --network NAME=FILE --proof PATH [--workers P]``: one line on
stdout (``valid``, ``invalid: …``, ``unsupported: …``, ``undecided: …`` where an LP stopped at its
time limit), the counts on stderr; exit 0 (valid), 1 (invalid), 2 (unsupported, undecided, a bad
command line, a file that cannot be read: one line on stderr)."""

from __future__ import annotations

import argparse
import ctypes
import sys
from types import MappingProxyType

from . import UsageError, check_proof

EXIT = MappingProxyType({"valid": 0, "invalid": 1, "unsupported": 2, "undecided": 2})
M_TOP_PAD = -2  # glibc's mallopt parameter


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(message)


def main(argv: list[str]) -> int:
    p = _Parser(prog="complete-verifier-ext check", add_help=False)
    p.add_argument("query")
    p.add_argument("--network", action="append", default=[], metavar="NAME=FILE")
    p.add_argument("--proof", required=True)
    p.add_argument("--workers", type=int, default=1)
    _keep_freed_memory()
    try:
        a = p.parse_args(argv)
        networks = dict(pair.split("=", 1) for pair in a.network if "=" in pair)
        if len(networks) != len(a.network) or a.workers < 1:
            raise UsageError("expected --network NAME=FILE and --workers P >= 1")
        result = check_proof(a.query, networks, a.proof, a.workers)
    except (UsageError, OSError) as e:
        print(f"complete-verifier-ext check: {e}", file=sys.stderr)
        return 2
    print(result.line())
    sys.stdout.flush()
    print(
        f"complete-verifier-ext check: {result.leaves} leaves, {result.by_bounds} closed by their bounds, "
        f"{result.by_halves} in halves, {result.by_lp} by the LP fallback, {result.seconds:.2f} s",
        file=sys.stderr,
    )
    return EXIT[result.status]


def _keep_freed_memory() -> None:
    """Ask glibc to keep 64 MiB of freed memory at the top of the heap rather than hand it back at once.
    The bound passes allocate and free arrays of a few MB thousands of times, and without this each
    one is page-faulted in afresh: ACAS Xu 2_6 property 1, an α,β-CROWN proof of 9,680 leaves, checked
    in 13.1 s (4.3 s of it in the kernel) and in 8.5 s with it. The forked workers inherit it. Other C
    libraries: nothing."""
    try:
        ctypes.CDLL(None).mallopt(M_TOP_PAD, 64 << 20)
    except (AttributeError, OSError, TypeError):
        pass
