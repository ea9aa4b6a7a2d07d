"""Answers inside the VNN-COMP timeout: ``run_instance.sh`` on instances that the search cannot finish
in time, both engines, P = 1 and 2, timed from outside as the 2026 scorer counts it (from the script's
start to its exit, results file written). A run whose wall time exceeds ``TIMEOUT`` is a timeout there
whatever it answered: the table counts them.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/timeout_line.py \
        [--engines native abcrown] [--worlds 1 2] [--repeat 1] [--out benchmarks/results/timeout_line]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, REPO
from measure import provenance

# (category, onnx, vnnlib, TIMEOUT): instances no engine finishes within TIMEOUT here
INSTANCES = [
    ("acasxu", "acasxu/onnx/ACASXU_run2a_3_3_batch_2000.onnx", "acasxu/vnnlib/prop_2.vnnlib", 8),
    ("mnist_fc", "mnist_fc/onnx/mnist-net_256x6.onnx", "mnist_fc/vnnlib/prop_2_0.05.vnnlib", 20),
]


def one(engine: str, world: int, category: str, onnx: str, vnnlib: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "out.txt"
        env = {**os.environ, "CVE_ENGINE": engine, "OMP_NUM_THREADS": "1"}
        env.pop("CVE_CLOCK_START", None)
        if world > 1:
            env["ABCROWN_EXTRA_ARGS"] = f"--parallel.mode fsdp --parallel.world_size {world}"
        cmd = ["bash", str(REPO / "vnncomp_scripts" / "run_instance.sh"), "v1", category, str(BENCH / onnx),
               str(BENCH / vnnlib), str(results), f"{timeout:g}"]  # fmt: skip
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout + 300)
        wall = time.monotonic() - t0
        verdict = results.read_text().split("\n")[0].strip() if results.exists() else None
    return {"engine": engine, "P": world, "instance": f"{Path(onnx).stem} {Path(vnnlib).stem}",
            "timeout_s": timeout, "wall_s": round(wall, 2), "over_s": round(wall - timeout, 2),
            "rc": out.returncode, "verdict": verdict}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["native", "abcrown"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "timeout_line"))
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeat):
        for category, onnx, vnnlib, timeout in INSTANCES:
            for engine in args.engines:
                for world in args.worlds:
                    rows.append(one(engine, world, category, onnx, vnnlib, timeout))
                    print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    (out / "timeout_line.json").write_text(json.dumps({"runs": rows, "provenance": prov}, indent=1))
    lines = ["| engine | P | instance | TIMEOUT s | wall s | wall − TIMEOUT s | verdict |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['engine']} | {r['P']} | {r['instance']} | {r['timeout_s']:g} | {r['wall_s']} | "
              f"{r['over_s']:+.2f} | {r['verdict']} |" for r in rows]  # fmt: skip
    late = sum(r["over_s"] > 0 for r in rows)
    head = "# Wall time of run_instance.sh against its TIMEOUT (instances that time out)"
    text = f"{head}\n\ncommit {prov['commit']}, `{prov['command']}`, {prov['machine']}\n\n"
    text += "\n".join(lines) + f"\n\n**{late} of {len(rows)} runs past their TIMEOUT.**\n"
    (out / "timeout_line.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
