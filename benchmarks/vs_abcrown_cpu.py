"""Ours against α,β-CROWN on the same kind of machine (2 CPU cores, torch 2.13 CPU).

    python benchmarks/vs_abcrown_cpu.py --ranks 1,2      # run, then print and store the table
    python benchmarks/vs_abcrown_cpu.py --report         # table from the stored results only

``../shared/reference/abcrown_cpu_mnist_fc.csv`` holds α,β-CROWN's verdict and time on 13 mnist_fc
instances, with its VNN-COMP 2022 configs (MIP refinement with Gurobi) and with plain BaB.  This runs
``abcrown --config configs/mnist_fc.yaml`` on the same instances with α,β-CROWN's 120 s limit and
writes ``benchmarks/results/vs_abcrown_cpu/vs_abcrown_cpu{_P*.json,.md}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from measure import add_provenance

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
REFERENCE = SHARED / "reference" / "abcrown_cpu_mnist_fc.csv"
RESULTS = REPO / "benchmarks" / "results" / "vs_abcrown_cpu"
LIMIT_S = 120


def reference() -> dict[tuple[str, str], dict[str, str]]:
    """(onnx, vnnlib) -> {mode label: "verdict time"} for every α,β-CROWN run in the reference csv."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for r in csv.DictReader(open(REFERENCE)):
        mode = "MIP" if r["abcrown_mode"].startswith("official") else r["abcrown_mode"]
        out.setdefault((r["onnx"], r["vnnlib"]), {})[mode] = (
            f"{r['verdict']} {float(r['abcrown_time_s']):.1f}"
        )
    return out


def run(P: int, extra: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        for onnx, vnnlib in reference():
            f.write(f"{onnx},{vnnlib},{LIMIT_S}\n")
    mode = ["--parallel.mode", "fsdp", "--parallel.world_size", str(P)] if P > 1 else []
    cmd = [
        "abcrown", "--config", str(REPO / "configs" / "mnist_fc.yaml"), "--quiet",
        "--general.csv_name", f.name, "--summary", str(RESULTS / f"vs_abcrown_cpu_P{P}.json"),
        "--general.results_file", str(Path(tempfile.gettempdir()) / f"vs_abcrown_cpu_P{P}.txt"),
        *mode, *shlex.split(extra),
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    add_provenance(RESULTS / f"vs_abcrown_cpu_P{P}.json")


def report() -> str:
    ref = reference()
    runs = {}
    for path in sorted(RESULTS.glob("vs_abcrown_cpu_P*.json")):
        data = json.loads(path.read_text())
        rows = data["instances"] if "instances" in data else [data]
        runs[int(path.stem.split("_P")[1])] = {
            (str(Path(r["onnx"]).relative_to(SHARED / "benchmarks" / "mnist_fc")),
             str(Path(r["vnnlib"]).relative_to(SHARED / "benchmarks" / "mnist_fc"))): r
            for r in rows
        }  # fmt: skip
    modes = sorted({m for v in ref.values() for m in v}, key=lambda m: (m != "MIP", m))
    head = ["instance", *[f"α,β-CROWN {m}" for m in modes], *[f"ours P={P}" for P in runs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    solved = {m: 0 for m in modes} | {P: 0 for P in runs}
    for key, theirs in ref.items():
        cells = [f"{Path(key[0]).stem.removeprefix('mnist-net_')} {Path(key[1]).stem}"]
        for m in modes:
            cells.append(theirs.get(m, ""))
            v = theirs.get(m, "")
            solved[m] += v.startswith(("safe", "unsafe")) and "timed out" not in v
        for P, rows in runs.items():
            r = rows.get(key)
            cells.append(f"{r['verdict']} {r['time_s']:.1f}" if r else "")
            solved[P] += bool(r) and r["verdict"] in ("sat", "unsat")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("| solved | " + " | ".join(str(solved[k]) for k in [*modes, *runs]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1", help="comma-separated world sizes to run")
    ap.add_argument("--extra", default="", help="extra abcrown arguments")
    ap.add_argument("--report", action="store_true", help="only print the table of stored results")
    args = ap.parse_args()
    if not REFERENCE.exists():
        sys.exit(f"{REFERENCE} does not exist")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for P in (int(p) for p in args.ranks.split(",")):
            run(P, args.extra)
    table = report()
    (RESULTS / "vs_abcrown_cpu.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
