"""What a run writes, the same on both engines (the command line and the α,β-CROWN plugin): the results
file (atomically; ``error`` with one line on stderr for a user's mistake) and the ``--summary`` record
of an instance (:func:`summary_record`)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any


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


def check_writable(path: str | os.PathLike | None, key: str) -> None:
    """A ``UserError`` unless a file can be written at ``path`` (its folder exists and takes a new
    file): checked before any verification, so that a verdict is never lost to a bad path."""
    import tempfile

    from .errors import UserError

    if not path:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UserError(f"{key}: {path} is a folder, not a file")
    if not folder.exists():
        raise UserError(f"{key}: {path}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise UserError(f"{key}: {path}: {folder} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".check"):
            pass
    except OSError as e:
        raise UserError(f"{key}: {path}: cannot write in {folder} ({e.strerror or e})") from None


def bab_record(
    domains: int, rounds: int | None = None, max_queue: list[int] | None = None, time_s: float | None = None
) -> dict:
    """The ``bab`` object of a ``--summary``, the same keys on both engines (null where an engine does
    not know the number): domains bounded (all ranks), rounds, the largest queue per rank, BaB time."""
    return {
        "domains": int(domains),
        "rounds": rounds,
        "max_queue": max_queue,
        "time_s": None if time_s is None else round(time_s, 3),
    }


def json_number(v: float) -> float | str:
    """A float for strict JSON: a value that is not finite is the string ``"-inf"``, ``"inf"`` or
    ``"nan"`` (``float()`` reads each back)."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def summary_record(
    *,
    engine: str,
    verdict: str,
    time_s: float,
    bounds: dict[str, list[float]],
    peak_mb: list[float],
    peak_mb_exact: bool,
    crown_batch_size: int,
    message: str = "",
    bab: dict | None = None,
    started_at: float = 0.0,
    **extra: Any,
) -> dict:
    """The ``--summary`` record of one instance, one schema for both engines: the engine, the verdict,
    its time, the output bounds of each method (strict JSON numbers), the per-rank peak memory (MiB)
    and whether it was measured exactly, the CROWN pass size, a message, the :func:`bab_record`
    where BaB ran, when the engine began work on the instance (``started_at``, seconds since the
    epoch: what came before it is the run's fixed cost), then what only this engine knows (``extra``)."""
    return {
        "engine": engine,
        "verdict": verdict,
        "time_s": round(time_s, 4),
        "bounds": {k: [json_number(v) for v in vals] for k, vals in bounds.items()},
        "peak_mb": [round(p, 2) for p in peak_mb],
        "peak_mb_exact": peak_mb_exact,
        "crown_batch_size": crown_batch_size,
        "message": message,
        **({"bab": bab} if bab else {}),
        "started_at": round(started_at, 3),
        **extra,
    }
