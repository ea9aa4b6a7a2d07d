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


def relative_error(a: list[float], b: list[float]) -> float:
    """The largest ``|a - b| / |a|`` over two equally long, non-empty lists."""
    assert len(a) == len(b) and a
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))
