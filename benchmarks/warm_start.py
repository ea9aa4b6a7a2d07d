"""The fixed cost of an instance, cold against the resident worker: ``run_instance.sh`` on ACAS Xu
instances, both engines, P = 1 and 2. The fixed cost is the time from the script's start to the moment
the engine begins work on the instance (the summary's ``started_at``: imports, ranks, config read);
the wall time is the script's, as the harness counts it. Warm runs go through the worker that
``prepare_instance.sh`` starts (``complete_verifier_ext/worker.py``); cold ones set ``CVE_WORKER=off``.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/warm_start.py [--instances 20] \
        [--engines native abcrown] [--worlds 1 2] [--out benchmarks/results/warm_start] [--reuse]

``--reuse`` keeps the rows of an earlier ``warm_start.json`` in ``--out`` (each with its own commit)
and runs only the engines not in it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, REPO
from measure import provenance

SCRIPTS = REPO / "vnncomp_scripts"


def instances(n: int) -> list[tuple[str, str]]:
    """The first ``n`` ACAS Xu instances of the shared verdicts file that configs/acasxu.yaml answers
    within seconds (properties 1 and 2)."""
    rows = list(csv.DictReader(open(BENCH / "acasxu" / "verdicts.csv")))
    easy = [r for r in rows if Path(r["vnnlib"]).stem in ("prop_1", "prop_2")]
    return [(str(BENCH / "acasxu" / r["onnx"]), str(BENCH / "acasxu" / r["vnnlib"])) for r in easy[:n]]


def one(engine: str, world: int, warm: bool, onnx: str, vnnlib: str, tmp: Path) -> dict:
    results, summary = tmp / "out.txt", tmp / "s.json"
    summary.unlink(missing_ok=True)
    extra = f"--summary {summary} --parallel.mode fsdp --parallel.world_size {world}"
    env = {**os.environ, "CVE_ENGINE": engine, "OMP_NUM_THREADS": "1", "CVE_WORKER_DIR": str(tmp),
           "CVE_WORKER": "on" if warm else "off", "ABCROWN_EXTRA_ARGS": extra}  # fmt: skip
    env.pop("CVE_CLOCK_START", None)
    cmd = ["bash", str(SCRIPTS / "run_instance.sh"), "v1", "acasxu", onnx, vnnlib, str(results), "60"]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=400)
    wall = time.time() - t0
    record = json.loads(summary.read_text()) if summary.exists() else {}
    record = record[0] if isinstance(record, list) else record  # the plugin's is a list
    return {"engine": engine, "P": world, "warm": warm, "instance": f"{Path(onnx).stem} {Path(vnnlib).stem}",
            "wall_s": round(wall, 3), "fixed_s": round(record.get("started_at", t0) - t0, 3),
            "verdict": results.read_text().split("\n")[0] if results.exists() else None,
            "rc": out.returncode}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--engines", nargs="+", default=["native", "abcrown"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "warm_start"))
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args()
    todo = instances(args.instances)
    prov = provenance()
    earlier = Path(args.out) / "warm_start.json"
    rows = json.loads(earlier.read_text())["runs"] if args.reuse and earlier.exists() else []
    args.engines = [e for e in args.engines if all(r["engine"] != e for r in rows)]
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            env = {**os.environ, "CVE_ENGINE": engine, "CVE_WORKER_DIR": tmp}
            prep = subprocess.run(["bash", str(SCRIPTS / "prepare_instance.sh"), "v1", "acasxu", *todo[0]],
                                  env=env, capture_output=True, text=True)  # fmt: skip
            assert prep.returncode == 0, prep.stderr
            for world in args.worlds:
                for warm in (False, True):
                    for onnx, vnnlib in todo:
                        rows.append(
                            {**one(engine, world, warm, onnx, vnnlib, Path(tmp)), "commit": prov["commit"]}
                        )
                        print(rows[-1], flush=True)
            subprocess.run([sys.executable, "-m", "complete_verifier_ext.worker", "stop", engine], env=env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm_start.json").write_text(json.dumps({"runs": rows, "provenance": prov}, indent=1))
    lines = ["| engine | P | start | instances | fixed cost s (median, max) | wall s (median) | "
             "verdicts equal to cold |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["engine"], r["P"], r["warm"]), []).append(r)
    for (engine, world, warm), rs in groups.items():
        cold = {r["instance"]: r["verdict"] for r in groups.get((engine, world, False), [])}
        same = sum(cold.get(r["instance"]) == r["verdict"] for r in rs)
        fixed = [r["fixed_s"] for r in rs]
        lines.append(f"| {engine} | {world} | {'warm' if warm else 'cold'} | {len(rs)} | "
                     f"{statistics.median(fixed):.2f}, {max(fixed):.2f} | "
                     f"{statistics.median(r['wall_s'] for r in rs):.2f} | {same}/{len(rs)} |")  # fmt: skip
    head = "# The fixed cost per instance: cold start against the resident worker (ACAS Xu)"
    text = f"{head}\n\ncommit {prov['commit']}, `{prov['command']}`, {prov['machine']}\n\n"
    text += "\n".join(lines) + "\n"
    (out / "warm_start.md").write_text(text)
    _plot(groups, out / "warm_start.png")
    print(text)


def _plot(groups: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels, data = [], []
    for (engine, world, warm), rs in groups.items():
        labels.append(f"{engine}\nP={world} {'warm' if warm else 'cold'}")
        data.append([r["fixed_s"] for r in rs])
    ax.boxplot(data, tick_labels=labels)
    ax.set_ylabel("fixed cost per instance (s)")
    ax.set_yscale("log")
    ax.axhline(0.5, ls="--", c="gray", lw=0.8)
    ax.axhline(1.0, ls=":", c="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
