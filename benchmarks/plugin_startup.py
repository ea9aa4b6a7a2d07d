"""Wall time of a plugin run against its timeout: α,β-CROWN with ``bab.timeout: T`` on an instance that
BaB cannot finish (mnist-net_256x6 prop_2_0.05), at P = 1, 2, 3, timed from outside the process, as a
VNN-COMP harness counts it. The instance clock counts from the verifier's start (docs/usage.md), so the
wall time should stay within T plus a few seconds of shutdown wherever start-up fits in T.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/plugin_startup.py [--timeouts 5 20] \
        [--worlds 1 2 3] [--out benchmarks/results/plugin_startup]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, REPO
from measure import provenance

CONFIG = "general:\n  device: cpu\nbab:\n  timeout: {timeout}\n"
NET = BENCH / "mnist_fc" / "onnx" / "mnist-net_256x6.onnx"
PROP = BENCH / "mnist_fc" / "vnnlib" / "prop_2_0.05.vnnlib"


def one(timeout: float, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "exp.yaml"
        cfg.write_text(CONFIG.format(timeout=timeout))
        cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(cfg), "--general.engine",
               "abcrown", "--onnx_path", str(NET), "--vnnlib_path", str(PROP), "--quiet",
               "--results_file", str(Path(tmp) / "out.txt"),
               "--summary", str(Path(tmp) / "s.json")]  # fmt: skip
        if world > 1:
            cmd += ["--parallel.mode", "fsdp", "--parallel.world_size", str(world)]
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 300, cwd=tmp)
        wall = time.monotonic() - t0
        summary = json.loads((Path(tmp) / "s.json").read_text()) if (Path(tmp) / "s.json").exists() else {}
        return {"timeout_s": timeout, "P": world, "wall_s": round(wall, 2), "rc": out.returncode,
                "verdict": summary.get("verdict"), "reported_s": summary.get("time_s")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeouts", type=float, nargs="+", default=[5.0, 20.0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "plugin_startup"))
    args = ap.parse_args()
    rows = []
    for timeout in args.timeouts:
        for world in args.worlds:
            rows.append(one(timeout, world))
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    (out / "plugin_startup.json").write_text(json.dumps({"runs": rows, "provenance": prov}, indent=1))
    lines = ["| bab.timeout (s) | P | wall (s) | α,β-CROWN's time (s) | verdict |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['timeout_s']:g} | {r['P']} | {r['wall_s']} | {r['reported_s']} | {r['verdict']} |"
        for r in rows
    ]
    head = "# Plugin wall time against bab.timeout (mnist-net_256x6 prop_2_0.05)"
    text = f"{head}\n\ncommit {prov['commit']}, `{prov['command']}`, {prov['machine']}\n\n"
    text += "\n".join(lines) + "\n"
    (out / "plugin_startup.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
