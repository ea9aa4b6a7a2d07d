"""VNN-LIB 2.0 and multi-network instances (``../shared/benchmarks/vnnlib2``, the VNN-COMP 2026 formats)
through ``vnncomp_scripts/run_instance.sh``, both engines, P = 1 and 2, each verdict set beside one
established independently:

* ``acasxu/`` (ACAS properties 1 and 2 written in 2.0): the verdict of the 1.x form of the same
  property on the same net (``../acasxu/verdicts.csv``, α,β-CROWN's published answers), and the 1.x
  file run through the same engine;
* ``acasxu_isomorphic/`` (a net and its pruned copy, outputs within ±0.05): a ``sat`` stands when its
  2.0 witness passes :func:`complete_verifier_ext.testing.check_vnnlib2_witness` (the assignment read
  as the 2026 checker reads it, every network re-run on onnxruntime, the assertions evaluated on the
  reference parser's syntax tree: code that shares nothing with the verifier's reading of the spec);
* ``acasxu_equal/`` (its spec's infix ``(Y_f[1] < Y_g[1])`` is outside the grammar): ``error``.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/vnnlib2.py [--timeout 100]

Writes ``results/vnnlib2/vnnlib2.{json,md}`` with the commit and command.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, REPO, checkout
from measure import provenance

from complete_verifier_ext.testing import check_vnnlib2_witness

FOLDER = BENCH / "vnnlib2"
CATEGORIES = {"acasxu": "acas_xu_vnnlib2", "acasxu_isomorphic": "isomorphic_acasxu_2026",
              "acasxu_equal": "monotonic_acasxu_2026"}  # fmt: skip


def instances() -> list[dict]:
    """Every instance: folder, category, ONNX argument (full paths), spec, networks, expected."""
    one_x = {
        (r["onnx"], r["vnnlib"]): r["expected"]
        for r in csv.DictReader((BENCH / "acasxu" / "verdicts.csv").open())
    }
    rows = []
    for folder, category in CATEGORIES.items():
        root = FOLDER / folder
        for onnx, vnnlib, _ in csv.reader((root / "instances.csv").open()):
            if onnx.startswith("["):
                nets = {n: str(root / p) for n, p in ast.literal_eval(onnx)}
                arg = repr(list(nets.items()))
            else:
                nets, arg = {}, str(root / onnx)
            row = {
                "folder": folder,
                "category": category,
                "onnx": arg,
                "vnnlib": str(root / vnnlib),
                "nets": nets,
            }
            if folder == "acasxu":
                row["one_x"] = str(BENCH / "acasxu" / "vnnlib" / Path(vnnlib).name)
                row["expected"] = one_x[(onnx, "vnnlib/" + Path(vnnlib).name)]
            else:
                row["expected"] = "error" if folder == "acasxu_equal" else "by witness"
            rows.append(row)
    return rows


def label(row: dict) -> str:
    if row["nets"]:
        nets = "+".join(
            Path(p).stem.replace("ACASXU_run2a_", "").replace("_batch_2000", "") for p in row["nets"].values()
        )
    else:
        nets = Path(row["onnx"]).stem.replace("ACASXU_run2a_", "").replace("_batch_2000", "")
    return f"{row['folder']} {nets} {Path(row['vnnlib']).stem}"


def run(row: dict, engine: str, world: int, timeout: float, vnnlib: str | None = None) -> dict:
    """One run of run_instance.sh: verdict, wall time and, for a sat, the independent witness check."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "out.txt"
        env = {**os.environ, "CVE_ENGINE": engine, "ABCROWN_PATH": str(checkout())}
        if world > 1:
            env["ABCROWN_EXTRA_ARGS"] = f"--parallel.world_size {world} --parallel.mode fsdp"
        cmd = ["bash", str(REPO / "vnncomp_scripts" / "run_instance.sh"), "v1", row["category"], row["onnx"],
               vnnlib or row["vnnlib"], str(results), str(timeout)]  # fmt: skip
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120, env=env, cwd=tmp)
        wall = round(time.monotonic() - t0, 1)
        text = results.read_text() if results.exists() else ""
    verdict = text.split("\n", 1)[0].strip() or "none"
    rec = {"verdict": verdict, "wall_s": wall, "rc": out.returncode}
    if verdict == "error":
        rec["message"] = (out.stderr.strip().splitlines() or [""])[-1][:240]
    if verdict == "sat" and row["nets"]:
        rec["witness"] = check_vnnlib2_witness(text, vnnlib or row["vnnlib"], row["nets"])
    return rec


def wrong(row: dict, rec: dict) -> bool:
    v, e = rec.get("verdict"), row["expected"]
    if e in ("sat", "unsat"):
        return {v, e} == {"sat", "unsat"}
    if e == "error":
        return v in ("sat", "unsat")
    return v == "sat" and not rec.get("witness", "").startswith("correct")


def table(data: dict, rows: list[dict], keys: list[str]) -> str:
    lines = [
        "| instance | expected | 1.x form (native) | " + " | ".join(keys) + " |",
        "|" + "---|" * (3 + len(keys)),
    ]
    n_wrong = 0
    for row in rows:
        name = label(row)
        cells = [name, row["expected"], data["one_x"].get(name, {}).get("verdict", "")]
        for k in keys:
            rec = data["runs"].get(k, {}).get(name)
            if rec is None:
                cells.append("")
                continue
            bad = wrong(row, rec)
            n_wrong += bad
            extra = f" ({rec['witness']})" if "witness" in rec else ""
            cells.append(f"{rec['verdict']}{extra} {rec['wall_s']} s" + (" **WRONG**" if bad else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return (
        f"**{n_wrong} wrong** of {sum(len(v) for v in data['runs'].values())} runs\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=100.0)
    ap.add_argument("--engines", nargs="+", default=["native", "abcrown"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vnnlib2"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"runs": {}, "one_x": {}}
    rows = instances()
    for row in rows:
        if "one_x" in row:
            data["one_x"][label(row)] = run(row, "native", 1, args.timeout, vnnlib=row["one_x"])
    keys = [f"{e} P={w}" for e in args.engines for w in args.worlds]
    for engine in args.engines:
        for world in args.worlds:
            done = data["runs"].setdefault(f"{engine} P={world}", {})
            for row in rows:
                rec = done[label(row)] = run(row, engine, world, args.timeout)
                flag = "  WRONG" if wrong(row, rec) else ""
                print(f"{engine:8s} P={world} {label(row):55s} {rec['verdict']:8s} {rec['wall_s']:6.1f} s "
                      f"{rec.get('witness', '')}{flag}", flush=True)  # fmt: skip
    data["provenance"] = {**provenance(), "timeout_s": args.timeout}
    (out / "vnnlib2.json").write_text(json.dumps(data, indent=1))
    prov = data["provenance"]
    text = table(data, rows, keys)
    (out / "vnnlib2.md").write_text(
        f"# VNN-LIB 2.0 and two-network instances through run_instance.sh, {args.timeout:.0f} s each\n\n"
        f"commit {prov['commit']}, `{prov['command']}`, {prov['machine']}; P = 2 is fsdp; the 1.x "
        "column runs "
        "the 1.x file of the same property (native, P = 1); `expected` for `acasxu` is α,β-CROWN's published "
        "verdict of that 1.x form; a two-network sat is judged by an independent witness check "
        "(`correct_up_to_tolerance`: an input pinned to a value float32 cannot hold, read as the nearest "
        "float32, as the 2026 checker accepts)\n\n" + text
    )
    print(text)


if __name__ == "__main__":
    main()
