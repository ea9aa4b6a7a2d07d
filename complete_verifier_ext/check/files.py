"""Files as the proof names them: their bytes (a ``.gz`` file's decompressed) and the sha256 of those;
:class:`Unsupported`, what the checker cannot read in them."""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path


class Unsupported(Exception):
    """What the checker cannot read; the message names the node and op, or the query's construct
    (the answer ``unsupported: ...``)."""


def read_bytes(path: str) -> bytes:
    """The file's bytes, decompressed when the name ends in ``.gz``; ``OSError`` when it cannot be read
    (a damaged gzip stream included)."""
    data = Path(path).read_bytes()
    if not str(path).endswith(".gz"):
        return data
    try:
        return gzip.decompress(data)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise OSError(f"{path}: {e}") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
