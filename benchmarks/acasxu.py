"""ACAS Xu (the 96 instances of ``../shared/benchmarks/acasxu``): the native engine beside α,β-CROWN run
through the plugin at P = 1, each instance with the same time limit, against α,β-CROWN's published
verdicts.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/acasxu.py \
        [--engines native abcrown] [--timeout 60] [--out benchmarks/results/acasxu]

native: ``abcrown --config configs/acasxu.yaml`` (input-split BaB with CROWN bounds, PGD after);
abcrown: α,β-CROWN's own ``exp_configs/vnncomp21/acasxu.yaml`` (the config its ``vnncomp_main.py`` uses
for ``acasxu_2023``) with ``--device cpu`` through ``general.engine: abcrown``. Both are separate
processes per instance, timed from outside (start-up included). ``wrong``: a verdict that contradicts
the expected one (sat against unsat). Writes ``acasxu.json`` (every run, with provenance) and
``acasxu.md``; a rerun keeps the runs already there (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

from abcrown_common import BENCH, REPO, checkout, run_abcrown
from measure import provenance, run_summarized

FOLDER = BENCH / "acasxu"


def instances() -> list[dict]:
    return list(csv.DictReader((FOLDER / "verdicts.csv").open()))


def run_native(row: dict, tmp: Path, timeout: float) -> dict:
    """One instance on the native engine: verdict, its own time and the wall time."""
    summary = tmp / "summary.json"
    config = REPO / "configs" / "acasxu.yaml"
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(config),
           "--general.csv_name", "null", "--model.onnx_path", str(FOLDER / row["onnx"]),
           "--specification.vnnlib_path", str(FOLDER / row["vnnlib"]), "--bab.timeout", str(timeout),
           "--general.results_file", str(tmp / "out.txt"), "--summary", str(summary), "--quiet"]  # fmt: skip
    r = run_summarized(cmd, tmp, summary, timeout + 60)
    r.pop("stderr", None)
    return r | ({"wall_s": round(r["wall_s"], 1)} if "wall_s" in r else {})


def run_plugin(row: dict, tmp: Path, timeout: float) -> dict:
    config = checkout() / "complete_verifier" / "exp_configs" / "vnncomp21" / "acasxu.yaml"
    args = ["--config", str(config), "--device", "cpu", "--onnx_path", str(FOLDER / row["onnx"]),
            "--vnnlib_path", str(FOLDER / row["vnnlib"]), "--timeout", str(timeout),
            "--results_file", str(tmp / "out.txt")]  # fmt: skip
    return run_abcrown(args, tmp, timeout + 60)


def label(row: dict) -> str:
    net = Path(row["onnx"]).stem.replace("ACASXU_run2a_", "").replace("_batch_2000", "")
    return f"{net} {Path(row['vnnlib']).stem}"


def wrong(verdict: str | None, expected: str) -> bool:
    return {verdict, expected} == {"sat", "unsat"}


def table(runs: dict, rows: list[dict], engines: list[str]) -> str:
    head = "| instance | expected | α,β-CROWN published (s) | " + " | ".join(
        f"{e} verdict | {e} wall (s)" for e in engines
    )
    lines = [head + " |", "|" + "---|" * (3 + 2 * len(engines))]
    counts = {e: {"sat": 0, "unsat": 0, "other": 0, "wrong": 0, "wall": 0.0} for e in engines}
    for row in rows:
        key = label(row)
        cells = [key, row["expected"], row["abcrown_time_s"]]
        for e in engines:
            r = runs.get(e, {}).get(key)
            v = None if r is None else r.get("verdict", "error")
            if r is not None:
                c = counts[e]
                c[v if v in ("sat", "unsat") else "other"] += 1
                c["wrong"] += wrong(v, row["expected"])
                c["wall"] += r.get("wall_s", 0.0)
            cells += ["" if r is None else (v + (" **WRONG**" if wrong(v, row["expected"]) else "")),
                      "" if r is None else str(r.get("wall_s", ""))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    summary = [f"* **{e}**: {c['sat']} sat, {c['unsat']} unsat, {c['other']} other, **{c['wrong']} wrong**, "
               f"{c['wall']:.0f} s of wall time in all" for e, c in counts.items()]  # fmt: skip
    return "\n".join(summary) + "\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["native", "abcrown"], choices=["native", "abcrown"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "acasxu"))
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--limit", type=int, default=0, help="only the first N instances")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "acasxu.json"
    data = json.loads(path.read_text()) if path.exists() and not args.fresh else {"runs": {}}
    rows = instances()[: args.limit or None]
    run = {"native": run_native, "abcrown": run_plugin}
    for engine in args.engines:
        done = data["runs"].setdefault(engine, {})
        for row in rows:
            key = label(row)
            if key in done:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                res = run[engine](row, Path(tmp), args.timeout)
            done[key] = {k: res.get(k) for k in ("verdict", "time_s", "wall_s", "error") if k in res}
            flag = "  WRONG" if wrong(res.get("verdict"), row["expected"]) else ""
            print(f"{engine:8s} {key:12s} {res.get('verdict', 'error'):8s} {res.get('wall_s', '')} s "
                  f"(expected {row['expected']}){flag}", flush=True)  # fmt: skip
            data["provenance"] = {**provenance(), "timeout_s": args.timeout}
            path.write_text(json.dumps(data, indent=1))
    text = table(data["runs"], instances(), [e for e in ("native", "abcrown") if e in data["runs"]])
    prov = data.get("provenance", {})
    (out / "acasxu.md").write_text(
        f"# ACAS Xu: native engine and α,β-CROWN (plugin, P = 1), {prov.get('timeout_s')} s per instance\n\n"
        f"commit {prov.get('commit')}, `{prov.get('command')}`, {prov.get('machine')}\n\n{text}"
    )
    print(text)


if __name__ == "__main__":
    main()
