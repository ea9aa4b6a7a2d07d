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


def two_network_query(folder: Path, threshold: float = 6.0) -> tuple[dict[str, Path], Path]:
    """A VNN-LIB 2.0 query on two networks of one input, tied element by element: f (12-20-20-3, a
    batch axis) and g (12-16-3, ``W @ x`` on a 1-D input); ``Yf[0] − Yg[1] >= threshold`` over
    [-1, 1]¹² is unsat at 6.0, though neither CROWN nor α-CROWN proves it without branching."""
    from complete_verifier_ext import testing

    nets = {
        "f": Path(testing.mlp_onnx(folder / "f.onnx", [12, 20, 20, 3], 3)),
        "g": Path(testing.wx_onnx(folder / "g.onnx", [12, 16, 3], 4)),
    }
    box = " ".join(f"(>= Xf[{i}] -1.0) (<= Xf[{i}] 1.0)" for i in range(12))
    ties = "".join(f"(assert (== Xg[{i}] Xf[{i}]))\n" for i in range(12))
    spec = folder / "two.vnnlib"
    spec.write_text(
        "(vnnlib-version <2.0>)\n"
        "(declare-network f (declare-input Xf real [12]) (declare-output Yf real [3]))\n"
        "(declare-network g (declare-input Xg real [12]) (declare-output Yg real [3]))\n"
        f"(assert (and {box}))\n{ties}(assert (>= (- Yf[0] Yg[1]) {threshold}))\n"
    )
    return nets, spec
