"""Helpers shared by several test files (imported as ``support``: pytest puts ``tests/`` on the path)."""

from __future__ import annotations

from pathlib import Path


def rank_processes(parent: int) -> list[int]:
    """The live ranks that ``parent`` spawned or forked (named ``cve-rankN`` by the launcher), in rank
    order; not the resource tracker, not zombies."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            comm = (p / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z" and comm.startswith("cve-rank"):
            found.append((int(comm[len("cve-rank") :] or 0), int(p.name)))
    return [pid for _, pid in sorted(found)]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def relative_error(a: list[float], b: list[float]) -> float:
    """The largest ``|a - b| / |a|`` over two equally long, non-empty lists."""
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


DATA = Path(__file__).resolve().parent / "data"


def exact_ranges(sizes, seed: int, lower, upper) -> list:
    """``testing.exact_mlp_ranges`` (every hidden neuron's exact range, by enumerating activation
    patterns: 20-30 s per net here), stored once in ``tests/data`` under a key of all its arguments:
    the ground truth of several tests, computed by the same function when the file is missing."""
    import hashlib

    import numpy as np

    from complete_verifier_ext import testing

    lo, hi = (np.asarray(b, dtype=np.float64).reshape(-1) for b in (lower, upper))
    key = hashlib.sha256(repr((tuple(sizes), seed, lo.tolist(), hi.tolist())).encode()).hexdigest()[:16]
    path = DATA / f"exact_ranges_{'x'.join(map(str, sizes))}_seed{seed}_{key}.npz"
    if path.is_file():
        with np.load(path) as f:
            return [(f[f"lo{i}"], f[f"hi{i}"]) for i in range(len(f.files) // 2)]
    ranges = testing.exact_mlp_ranges(sizes, seed, lo, hi)
    DATA.mkdir(exist_ok=True)
    arrays = {f"{side}{i}": r[j] for i, r in enumerate(ranges) for j, side in enumerate(("lo", "hi"))}
    np.savez(path, **arrays)
    return ranges
