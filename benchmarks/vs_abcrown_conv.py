"""Whole runs on the conv instances of ``scale.py`` (the first two of oval21 and of sri_resnet_a): ours
against α,β-CROWN itself on this machine, one after the other, same time limit.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/vs_abcrown_conv.py [--timeout 180]

* α,β-CROWN: ``abcrown --config <its exp_configs/vnncomp22/{oval22,resnet_A}.yaml> --general.engine
  abcrown --device cpu --timeout T`` (P = 1: α,β-CROWN unpatched; oval22.yaml's CPLEX cuts are off, this
  machine has no CPLEX);
* ours: ``abcrown --config configs/{oval21,sri_resnet_a}.yaml`` on the same instance with
  ``--bab.timeout T``.

Each run is its own process; the table has the verdict, α,β-CROWN's / our own time, the wall time of
the process (start-up and model loading included) and the peak RSS of the run above the RSS after
loading (an upper bound: both run without ``MALLOC_MMAP_THRESHOLD_``, as a user runs them). Writes
``vs_abcrown_conv.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from abcrown_common import CONFIGS, checkout, run_abcrown
from measure import REPO, provenance

BENCH = REPO.parent / "shared" / "benchmarks"
CATEGORIES = {
    "oval21": ("oval22.yaml", ["--bab.cut.enabled", "false"]),
    "sri_resnet_a": ("resnet_A.yaml", []),
}


def instances(category: str, n: int = 2) -> list[tuple[str, str]]:
    rows = [line.split(",")[:2] for line in (BENCH / category / "instances.csv").read_text().splitlines()]
    return [(o, v) for o, v in rows[:n]]


def ours(category: str, onnx: str, vnnlib: str, timeout: float, tmp: Path) -> dict:
    summary = tmp / "ours.json"
    summary.unlink(missing_ok=True)
    cmd = ["abcrown", "--config", str(REPO / "configs" / f"{category}.yaml"), "--general.csv_name", "null"]
    cmd += ["--model.onnx_path", str(BENCH / category / onnx), "--specification.vnnlib_path"]
    cmd += [str(BENCH / category / vnnlib), "--bab.timeout", str(timeout), "--summary", str(summary)]
    t0 = time.monotonic()
    out = subprocess.run(
        [*cmd, "--quiet"], capture_output=True, text=True, timeout=3 * timeout + 120, cwd=tmp
    )
    if out.returncode != 0 or not summary.exists():
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {**json.loads(summary.read_text()), "wall_s": round(time.monotonic() - t0, 1)}


def theirs(path: Path, category: str, onnx: str, vnnlib: str, timeout: float, tmp: Path) -> dict:
    config, extra = CATEGORIES[category]
    args = ["--config", str(path / CONFIGS / config), "--device", "cpu", "--timeout", str(int(timeout))]
    args += ["--onnx_path", str(BENCH / category / onnx), "--vnnlib_path", str(BENCH / category / vnnlib)]
    return run_abcrown([*args, *extra], tmp, timeout=3 * timeout + 120)


def table(rows: list[dict], prov: dict) -> str:
    lines = [
        "# Whole runs on the conv instances: ours against α,β-CROWN on this machine",
        "",
        f"`{prov['command']}` at {prov['commit']} ({prov['machine']}). Time: each tool's own; wall: the "
        "process, start-up included; peak: RSS of the run above the RSS after loading (upper bounds).",
        "",
        "| instance | α,β-CROWN verdict | time s | wall s | peak MB | ours verdict | time s | wall s | "
        "peak MB | time × | peak × |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, o = r["abcrown"], r["ours"]
        if "error" in a or "error" in o:
            lines.append(
                f"| {r['instance']} | {a.get('error', a.get('verdict'))} | | | | "
                f"{o.get('error', o.get('verdict'))} | | | | | |"
            )
            continue
        pa, po = max(a.get("peak_mb", [0])), max(o.get("peak_mb", [0]))
        ta, to = a["time_s"], o["time_s"]
        lines.append(
            f"| {r['instance']} | {a['verdict']} | {ta:.1f} | {a['wall_s']:.1f} | {pa:.0f} | "
            f"{o['verdict']} | {to:.1f} | {o['wall_s']:.1f} | {po:.0f} | {to / max(ta, 1e-9):.2f} | "
            f"{po / max(pa, 1e-9):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vs_abcrown_conv"))
    args = ap.parse_args()
    path = checkout()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for category in CATEGORIES:
            for onnx, vnnlib in instances(category):
                label = f"{category} {Path(vnnlib).stem[:40]}"
                a = theirs(path, category, onnx, vnnlib, args.timeout, Path(tmp))
                o = ours(category, onnx, vnnlib, args.timeout, Path(tmp))
                rows.append({"instance": label, "abcrown": a, "ours": o})
                print(
                    label,
                    a.get("verdict", a.get("error")),
                    a.get("time_s"),
                    "|",
                    o.get("verdict", o.get("error")),
                    o.get("time_s"),
                    flush=True,
                )
    prov = provenance()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_abcrown_conv.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    (out / "vs_abcrown_conv.md").write_text(table(rows, prov))
    print(table(rows, prov))


if __name__ == "__main__":
    main()
