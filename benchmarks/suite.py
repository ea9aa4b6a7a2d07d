"""Run a whole VNN-COMP benchmark folder and compare the verdicts with α,β-CROWN's.

    python benchmarks/suite.py mnist_fc --ranks 1 [--extra "--solver.batch_size 512"]
    python benchmarks/suite.py mnist_fc --report           # table from the stored results only
    python benchmarks/suite.py mnist_fc --csv benchmarks/mnist_fc_hard.csv --tag=-hard --ranks 2
    python benchmarks/suite.py mnist_fc --csv benchmarks/mnist_fc_bab.csv --tag=-split --ranks 2

(``mnist_fc_hard.csv``: the 12 instances only α,β-CROWN solved in our first full runs;
``mnist_fc_bab.csv``: those 12, then the 3 that plain BaB took over 80 s for at P = 2, then the 5
that neither tool solved; every other instance falls to PGD or to BaB within 10 s.
``mnist_fc_quick.csv``: the 43 that the configs solve within 30 s at P = 1, for checking that the
verdicts do not depend on P: ``--csv benchmarks/mnist_fc_quick.csv --tag=-quick --ranks 1,2,3``.)

Runs ``abcrown --config configs/<name>.yaml --parallel.world_size P --summary ...`` over the folder's
``instances.csv`` (each instance with its csv timeout) and stores the raw summary under
``benchmarks/results/<name>/<name>_P<P>.json``.  The report counts verified / falsified / timeout / unknown
/ error and, most importantly, WRONG verdicts against ``verdicts.csv`` (α,β-CROWN, VNN-COMP 2022,
GPU) and lists the instances either tool solved alone.  ``--csv`` runs (and reports) only the
instances of another csv, whose paths are relative to the benchmark folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

from measure import add_provenance

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "benchmarks"
RESULTS = REPO / "benchmarks" / "results"


def run(name: str, P: int, extra: str, tag: str = "", subset: Path | None = None) -> Path:
    out = RESULTS / name / f"{name}{tag}_P{P}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = ["--parallel.mode", "fsdp", "--parallel.world_size", str(P)] if P > 1 else []
    cmd = [
        "abcrown",
        "--config",
        str(REPO / "configs" / f"{name}.yaml"),
        "--summary",
        str(out),
        "--general.results_file",
        str(RESULTS / name / f"{name}{tag}_P{P}.txt"),
        *mode,
        *(["--general.root_path", str(SHARED / name), "--general.csv_name", str(subset)] if subset else []),
        *shlex.split(extra),
    ]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    add_provenance(out)
    return out


def key(onnx: str, vnnlib: str) -> tuple[str, str]:
    return Path(onnx).name, Path(vnnlib).name


def report(name: str, tag: str = "", subset: Path | None = None) -> str:
    expected = {key(r["onnx"], r["vnnlib"]): r for r in csv.DictReader(open(SHARED / name / "verdicts.csv"))}
    if subset is not None:
        keep = {key(row[0], row[1]) for row in csv.reader(open(subset)) if row}
        expected = {k: v for k, v in expected.items() if k in keep}
    lines = [
        f"### {name}",
        "",
        "| P | verified (unsat) | falsified (sat) | timeout | unknown | error | WRONG | total time s |"
        " α,β-CROWN 2022 (GPU) solved | we alone | they alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    theirs = sum(r["expected"] in ("sat", "unsat") for r in expected.values())
    first: dict | None = None
    notes: list[str] = []
    for P in sorted(
        {int(p.name.split("_P")[1].split(".")[0]) for p in (RESULTS / name).glob(f"{name}{tag}_P*.json*")}
    ):
        path = RESULTS / name / f"{name}{tag}_P{P}.json"
        partial = Path(str(path) + ".partial.jsonl")
        if path.exists():
            data = json.loads(path.read_text())
            rows = data["instances"] if "instances" in data else [data]
        else:  # an unfinished run: the instances done so far
            rows = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        count = {v: 0 for v in ("unsat", "sat", "timeout", "unknown", "error")}
        wrong, ours_only, theirs_only, total = [], [], [], 0.0
        for r in rows:
            count[r["verdict"]] = count.get(r["verdict"], 0) + 1
            total += r["time_s"]
            exp = expected.get(key(r["onnx"], r["vnnlib"]), {}).get("expected")
            solved = r["verdict"] in ("sat", "unsat")
            if solved and exp in ("sat", "unsat") and r["verdict"] != exp:
                wrong.append(key(r["onnx"], r["vnnlib"]))
            if solved and exp not in ("sat", "unsat"):
                ours_only.append(key(r["onnx"], r["vnnlib"]))
            if not solved and exp in ("sat", "unsat"):
                theirs_only.append(key(r["onnx"], r["vnnlib"]))
        done = "" if path.exists() else f" ({len(rows)} of {len(expected)} done)"
        lines.append(
            f"| {P}{done} | {count['unsat']} | {count['sat']} | {count['timeout']} | {count['unknown']} | "
            f"{count['error']} | {len(wrong)} | {total:.0f} | {theirs} of {len(expected)} | "
            f"{len(ours_only)} | {len(theirs_only)} |"
        )
        if wrong:
            lines.append(f"\nWRONG at P={P}: {wrong}\n")
        by_key = {key(r["onnx"], r["vnnlib"]): r for r in rows}
        if first is None:
            first = by_key
        else:
            notes.append(consistency(P, first, by_key))
    return "\n".join(lines + [""] + notes)


DETERMINISTIC = ("ibp", "crown", "alpha_crown")  # bounds that do not depend on how much time a search had


def consistency(P: int, base: dict, other: dict) -> str:
    """Verdicts and bounds of world size P against the smallest world size run. Only the bounds of
    :data:`DETERMINISTIC` methods are compared: a search's bounds (``quick_bab``, ``refined``, ...)
    depend on the domains it reached in its time."""
    common = [k for k in other if k in base]
    differ = [k for k in common if base[k]["verdict"] != other[k]["verdict"]]
    rel = 0.0
    for k in common:
        for method in DETERMINISTIC:
            vals, ref = other[k]["bounds"].get(method, []), base[k]["bounds"].get(method, [])
            pairs = [(a, b) for a, b in zip(vals, ref, strict=False) if not isinstance(a, str)]
            rel = max([rel] + [abs(a - b) / max(abs(b), 1e-6) for a, b in pairs if not isinstance(b, str)])
    return (
        f"P = {P} against the smallest P, {len(common)} instances: {len(differ)} different verdicts"
        f"{' ' + str(differ) if differ else ''} (time-limited ones may differ), largest relative "
        f"difference of the {'/'.join(DETERMINISTIC)} bounds {rel:.1e}."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="benchmark folder in ../shared/benchmarks (mnist_fc, oval21, sri_resnet_a)")
    ap.add_argument("--ranks", default="1", help="comma-separated world sizes to run")
    ap.add_argument("--extra", default="", help="extra abcrown arguments")
    ap.add_argument("--report", action="store_true", help="only print the table of stored results")
    ap.add_argument("--tag", default="", help="suffix of the result files, e.g. -incomplete")
    ap.add_argument("--csv", type=Path, help="run only these instances (paths relative to the folder)")
    args = ap.parse_args()
    subset = args.csv.resolve() if args.csv else None
    if not (SHARED / args.name).exists():
        sys.exit(f"{SHARED / args.name} does not exist")
    if not args.report:
        for P in (int(p) for p in args.ranks.split(",")):
            run(args.name, P, args.extra, args.tag, subset)
    table = report(args.name, args.tag, subset)
    (RESULTS / args.name / f"{args.name}{args.tag}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
