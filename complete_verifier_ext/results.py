"""Writing the results file: atomically, and ``error`` with one line on stderr for a user's mistake
(shared by the command line and the α,β-CROWN plugin)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``: a reader (or a
    kill) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report_error(results_file: str | None, writer: bool, msg: str) -> int:
    """One line on stderr, ``error`` in the results file (when one is known), exit 1."""
    print(f"error: {msg}", file=sys.stderr)
    if results_file and writer:
        try:
            write_atomic(results_file, "error\n")
        except OSError:
            pass
    return 1
