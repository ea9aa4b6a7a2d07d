"""Reading VNN-LIB files (1.x or 2.0, plain or gzip-compressed) into a :class:`~.model.Spec`, with
parsed specs cached in-process and on disk (:func:`load_vnnlib`).

The in-process cache (``_MEMORY``) is the package's one process-wide store of specs: keyed by a file's
absolute path, modification time and size, it never hands one file's spec to another, and a process
that verifies many instances (a csv run, a resident worker's forks) reads each file once.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import zlib
from pathlib import Path

import numpy as np

from . import v1, v2
from .common import Source, SpecError
from .model import Clause, Spec, freeze, make_spec

_CACHE_FORMAT_VERSION = 2  # 2: VNN-LIB 2.0 specs (with a layout) are not stored on disk
_MEMORY_CACHE_SIZE = 128


def build_spec(text: str, file: str, path: str) -> Spec:
    """Parse a VNN-LIB ``text`` (1.x: :mod:`.v1`, or 2.x: :mod:`.v2`); ``file``: its name in messages,
    ``path``: absolute."""
    src = Source(file, text)
    if v2.is_vnnlib2(text):
        q = v2.read(src)
        return v1.assemble(src, path, q.n_inputs, q.n_outputs, q.asserts, q.where, q.layout)
    return v1.parse(src, path)


def read_text(path: str) -> str:
    """The text of a VNN-LIB file (gzip-compressed or not); a file that is not UTF-8 text, or a broken
    gzip, is a :class:`SpecError` naming it."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        if path.endswith(".gz") or data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        return data.decode("utf-8")
    except (OSError, EOFError, zlib.error) as e:
        raise SpecError(f"{path}: not a readable gzip file ({e})") from None
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not a UTF-8 text file (byte {e.start}: {data[e.start : e.start + 1]!r})"
        ) from None


def cache_root() -> Path:
    """This package's cache folder: ``$XDG_CACHE_HOME/complete_verifier_ext`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "complete_verifier_ext"


def _cache_dir() -> Path:
    return cache_root() / "specs"


def _disk_key(key: tuple[str, int, int]) -> str:
    text = f"v{_CACHE_FORMAT_VERSION}\0{key[0]}\0{key[1]}\0{key[2]}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _save_disk(spec: Spec, file: Path) -> None:
    """Store ``spec`` as an ``.npz`` file (no pickle); any failure is silently ignored."""
    regions = spec.regions
    clauses = [c for r in regions for c in r.clauses]
    arrays = {
        "meta": np.array([_CACHE_FORMAT_VERSION, spec.n_inputs, spec.n_outputs], dtype=np.int64),
        "path": np.array(spec.path),
        "lower": np.stack([r.lower for r in regions]),
        "upper": np.stack([r.upper for r in regions]),
        "clauses_per_region": np.array([len(r.clauses) for r in regions], dtype=np.int64),
        "rows_per_clause": np.array([len(c.d) for c in clauses], dtype=np.int64),
        "C": np.concatenate([c.C for c in clauses]).reshape(-1, spec.n_outputs),
        "d": np.concatenate([c.d for c in clauses]),
    }
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, file)
    except Exception:
        with contextlib.suppress(Exception):
            tmp.unlink(missing_ok=True)


def _load_disk(file: Path) -> Spec | None:
    """Read a spec written by :func:`_save_disk`; ``None`` if absent or unreadable."""
    try:
        with np.load(file, allow_pickle=False) as data:
            version, n_inputs, n_outputs = (int(v) for v in data["meta"])
            if version != _CACHE_FORMAT_VERSION:
                return None
            row_ends = np.cumsum(data["rows_per_clause"])
            C, d = data["C"], data["d"]
            clauses = [
                freeze(Clause(C[end - k : end], d[end - k : end]))
                for k, end in zip(data["rows_per_clause"], row_ends, strict=True)
            ]
            clause_ends = np.cumsum(data["clauses_per_region"])
            regions = [
                (data["lower"][i], data["upper"][i], clauses[end - k : end])
                for i, (k, end) in enumerate(zip(data["clauses_per_region"], clause_ends, strict=True))
            ]
            return make_spec(str(data["path"]), n_inputs, n_outputs, regions)
    except Exception:
        return None


class _MemoryCache:
    """Small bounded in-process cache of parsed specs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple[str, int, int], Spec] = {}

    def get(self, key: tuple[str, int, int]) -> Spec | None:
        return self.entries.get(key)

    def put(self, key: tuple[str, int, int], spec: Spec) -> None:
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = spec


_MEMORY = _MemoryCache(_MEMORY_CACHE_SIZE)


def load_vnnlib(path: str | os.PathLike, cache: bool = True) -> Spec:
    """Load a VNN-LIB 1.0 file (optionally gzip-compressed) into a :class:`Spec`.

    With ``cache=True`` results are memoised in-process and on disk under
    ``$XDG_CACHE_HOME/complete_verifier_ext/specs`` (default ``~/.cache/...``), keyed by the absolute
    path, modification time and size of the file. Arrays in the returned spec are read-only.

    Raises:
        SpecError: the file is malformed or outside the supported fragment; the message starts with
            ``"<file>:<line>: "``.
        OSError: the file cannot be read.
    """
    file = os.fspath(path)
    abs_path = os.path.abspath(file)
    if not cache:
        return build_spec(read_text(file), file, abs_path)
    stat = os.stat(abs_path)
    key = (abs_path, stat.st_mtime_ns, stat.st_size)
    spec = _MEMORY.get(key)
    if spec is not None:
        return spec
    disk_file = _cache_dir() / f"{_disk_key(key)}.npz"
    spec = _load_disk(disk_file)
    if spec is None:
        spec = build_spec(read_text(file), file, abs_path)
        if spec.layout is None:  # a 2.0 spec is parsed again (the reference parser is fast)
            _save_disk(spec, disk_file)
    _MEMORY.put(key, spec)
    return spec
