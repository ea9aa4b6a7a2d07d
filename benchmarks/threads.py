"""Torch threads per rank, with and without another CPU-bound job on the machine.

Plain BaB (``--general.complete_verifier bab``) on one mnist_fc instance at P = 1, for every thread
count in ``--threads`` (``parallel.threads``), alone and beside one busy-looping process, one run per
process.  Prints a markdown table and writes it, with the commit and the commands, to
``benchmarks/results/threads/threads.md`` (raw rows in ``threads.json``).

    python benchmarks/threads.py [--instance mnist-net_256x4.onnx:prop_3_0.05.vnnlib] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import provenance

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "benchmarks" / "mnist_fc"
RESULTS = REPO / "benchmarks" / "results" / "threads"


def one(onnx: Path, vnnlib: Path, threads: int, timeout: float, load: bool) -> dict:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load else None
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "s.json"
        config = str(REPO / "configs" / "mnist_fc.yaml")
        cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", config,
               "--general.csv_name", "null", "--general.complete_verifier", "bab",
               "--model.onnx_path", str(onnx), "--specification.vnnlib_path", str(vnnlib),
               "--bab.timeout", str(timeout), "--parallel.threads", str(threads),
               "--general.results_file", str(Path(tmp) / "r.txt"), "--summary", str(summary),
               "--quiet"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        t0 = time.monotonic()
        subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 120)
        wall = time.monotonic() - t0
        data = json.loads(summary.read_text())
    if busy is not None:
        busy.kill()
        busy.wait()
    bab = data.get("bab", {})
    return {"threads": threads, "load": load, "verdict": data["verdict"], "time_s": data["time_s"],
            "wall_s": round(wall, 2), "rounds": bab.get("rounds", 0), "domains": bab.get("domains", 0),
            "cmd": " ".join(cmd)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--instance", default="mnist-net_256x4.onnx:prop_3_0.05.vnnlib")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"{SHARED} not found: the benchmark needs the mnist_fc files")
    net, prop = args.instance.split(":")
    rows = []
    for load in (False, True):
        for t in [int(x) for x in args.threads.split(",")]:
            rows.append(one(SHARED / "onnx" / net, SHARED / "vnnlib" / prop, t, args.timeout, load))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "cmd"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    lines = [
        f"# Threads per rank: plain BaB on {net} {prop}, P = 1, timeout {args.timeout:g} s",
        "",
        f"commit {commit.stdout.strip()}, {os.cpu_count()} cores; command: `python benchmarks/threads.py "
        f"--instance {args.instance} --threads {args.threads} --timeout {args.timeout:g}`; each run:",
        f"`{rows[0]['cmd']}` (with the thread count of the row);",
        "'busy' = one `while True: pass` process beside it.",
        "",
        "| threads | other job | verdict | time s | wall s | BaB rounds | domains |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = "busy" if r["load"] else "none"
        lines.append(f"| {r['threads']} | {other} | {r['verdict']} | {r['time_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['rounds']} | {r['domains']} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "threads.md").write_text(table)
    (RESULTS / "threads.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
