"""Bounds and verdicts of the plugin against unpatched α,β-CROWN, each category with α,β-CROWN's own
VNN-COMP 2022 config: ``engine: abcrown`` at P = 1 (α,β-CROWN as its user runs it, plus our read-only
probe), and ``fsdp`` at P = 2 and 3 (gloo).

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_plugin_bounds.py \
        [--worlds 2 3] [--out benchmarks/results/abcrown_plugin_bounds]

Instances (``../shared/benchmarks``): five mnist_fc (256x2/4/6, ``mnistfc.yaml``), two oval21
(``oval22.yaml``, conv), two sri_resnet_a (``resnet_A.yaml``, residual + BatchNorm). Each config runs
unchanged except for ``--device cpu`` and ``--complete_verifier skip`` (the incomplete phase: PGD, CROWN,
α-CROWN), and for oval21 ``--bab.cut.enabled false``: ``oval22.yaml`` asks for CPLEX cuts, whose
executable this machine lacks (α,β-CROWN stops with "CPLEX cutting planes are needed" at every P).
The configs leave ``solver.crown.batch_size`` at its
default, so the plugin deals 512 rows a pass at P > 1; mnist_fc layers have at most 256 unstable
neurons, so the mnist_fc instances also run with ``--crown_batch_size 64`` (at every P), which splits
their rows and their α.

Compared per clause with the P = 1 run of the same row setting: CROWN and α-CROWN lower bounds (max
relative difference; "bitwise" where equal), and the verdict. Writes
``abcrown_plugin_bounds.{json,md}`` into ``--out``.
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

from abcrown_common import instance_label
from measure import provenance

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO.parent / "shared" / "benchmarks"
CONFIGS = "complete_verifier/exp_configs/vnncomp22"

INSTANCES = [  # (category, α,β-CROWN config, onnx, vnnlib)
    ("mnist_fc", "mnistfc.yaml", "mnist-net_256x2.onnx", "prop_0_0.03.vnnlib"),
    ("mnist_fc", "mnistfc.yaml", "mnist-net_256x2.onnx", "prop_1_0.05.vnnlib"),
    ("mnist_fc", "mnistfc.yaml", "mnist-net_256x4.onnx", "prop_3_0.03.vnnlib"),
    ("mnist_fc", "mnistfc.yaml", "mnist-net_256x4.onnx", "prop_0_0.05.vnnlib"),
    ("mnist_fc", "mnistfc.yaml", "mnist-net_256x6.onnx", "prop_0_0.05.vnnlib"),
    ("oval21", "oval22.yaml", "cifar_base_kw.onnx", "cifar_base_kw-img8194-eps0.018300653594771243.vnnlib"),
    ("oval21", "oval22.yaml", "cifar_deep_kw.onnx", "cifar_deep_kw-img7878-eps0.009934640522875817.vnnlib"),
    (
        "sri_resnet_a",
        "resnet_A.yaml",
        "resnet_3b2_bn_mixup_adv_4.0_bs128_lr-1.onnx",
        "cifar10_spec_idx_4711_eps_0.00350.vnnlib",
    ),
    (
        "sri_resnet_a",
        "resnet_A.yaml",
        "resnet_3b2_bn_mixup_adv_4.0_bs128_lr-1.onnx",
        "cifar10_spec_idx_1876_eps_0.00350.vnnlib",
    ),
]


def run_one(
    checkout: Path, inst: tuple, world: int, chunk: int | None, tmp: Path, timeout: float, mode: str = "fsdp"
) -> dict:
    category, config, onnx, spec = inst
    summary = tmp / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = [
        "abcrown",
        "--config",
        str(checkout / CONFIGS / config),
        "--general.engine",
        "abcrown",
        "--device",
        "cpu",
        "--complete_verifier",
        "skip",
        "--onnx_path",
        str(BENCH / category / "onnx" / onnx),
        "--vnnlib_path",
        str(BENCH / category / "vnnlib" / spec),
        "--results_file",
        str(tmp / "out.txt"),
        "--summary",
        str(summary),
        "--quiet",
    ]
    if category == "oval21":
        cmd += ["--bab.cut.enabled", "false"]  # no CPLEX here
    if chunk:
        cmd += ["--crown_batch_size", str(chunk)]
    if world > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(world)]
    if mode == "tp" and world > 1:
        cmd += ["--conv_mode", "matrix"]  # tp shards convs in matrix mode only
    env = {**os.environ, "CVE_ABCROWN_AUDIT": "1"} if mode == "tp" and world > 1 else None
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    wall = time.monotonic() - t0
    if out.returncode != 0 or not summary.exists():
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    s = json.loads(summary.read_text())
    return {
        "verdict": s["verdict"],
        "crown": s["bounds"].get("crown"),
        "alpha_crown": s["bounds"].get("alpha_crown"),
        "peak_mb": s["peak_mb"],
        "alpha_elements": s.get("alpha_elements"),
        "crown_batch_size": s.get("crown_batch_size"),
        "wall_s": round(wall, 1),
        **({"full_weights_live": s["full_weights_live"]} if "full_weights_live" in s else {}),
    }


def compare(ref: list | None, got: list | None) -> str:
    if not ref and not got:
        return "-"
    if not ref or not got or len(ref) != len(got):
        return "missing"
    if ref == got:
        return "bitwise"
    pairs = [(float(a), float(b)) for a, b in zip(ref, got, strict=True)]  # "inf": a verified clause
    return f"{max(0.0 if a == b else abs(a - b) / max(abs(a), 1e-12) for a, b in pairs):.1e}"


def table(rows: list[dict]) -> str:
    out = [
        "| category | instance | rows a pass | P | verdict | CROWN vs P=1 | α-CROWN vs P=1 | α elements "
        "per rank (max) | peak MB per rank (max) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = {(r["instance"], r["chunk"]): r for r in rows if r["P"] == 1 and "error" not in r}
    for r in rows:
        head = f"| {r['category']} | {instance_label(r)} | {r['rows']} | {r['P']} |"
        if "error" in r:
            out.append(f"{head} error: {r['error']} | | | | | |")
            continue
        b = ref.get((r["instance"], r["chunk"]))
        same = "" if b is None or b["verdict"] == r["verdict"] else " (differs)"
        out.append(
            f"{head} {r['verdict']}{same} | {compare(b and b['crown'], r['crown'])} | "
            f"{compare(b and b['alpha_crown'], r['alpha_crown'])} | {max(r['alpha_elements'] or [0])} | "
            f"{max(r['peak_mb']):.0f} | {r['wall_s']} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--only", nargs="*", default=None, help="categories to run (default: all)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_plugin_bounds"))
    ap.add_argument("--merge", action="store_true", help="keep the rows of other categories in --out's JSON")
    ap.add_argument("--report", action="store_true", help="only write the table from --out's JSON")
    ap.add_argument("--mode", default="fsdp", choices=["fsdp", "tp"], help="parallel.mode at P > 1")
    a = ap.parse_args()
    checkout = Path(os.environ.get("ABCROWN_PATH", ""))
    if not (checkout / CONFIGS).is_dir():
        sys.exit("set ABCROWN_PATH to an alpha-beta-CROWN checkout (../shared/vendor/alpha-beta-CROWN)")
    if not BENCH.is_dir():
        sys.exit(f"{BENCH} not found (the shared VNN-COMP benchmarks)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    commit, command, machine = meta["commit"], meta["command"], meta["machine"]
    rows: list[dict] = []
    earlier = out / "abcrown_plugin_bounds.json"
    if a.report:
        old = json.loads(earlier.read_text())
        commit, command, rows, INSTANCES[:] = old["commit"], old["command"], old["rows"], []
    elif a.merge and earlier.exists():
        old = json.loads(earlier.read_text())
        rows = [r for r in old["rows"] if not a.only or r["category"] not in a.only]
        command = f"{old['command']} (commit {old['commit']}); then {command}"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for inst in INSTANCES:
            if a.only and inst[0] not in a.only:
                continue
            chunks = [None, 64] if inst[0] == "mnist_fc" else [None]
            for chunk in chunks:
                for P in [1, *a.worlds]:
                    r = run_one(checkout, inst, P, chunk, tmp, a.timeout, a.mode)
                    rows.append(
                        {
                            "category": inst[0],
                            "config": inst[1],
                            "onnx": inst[2],
                            "vnnlib": inst[3],
                            "instance": f"{inst[2]}:{inst[3]}",
                            "chunk": chunk,
                            "rows": chunk or ("1e9 (config)" if P == 1 else "512 (plugin)"),
                            "P": P,
                            **r,
                        }
                    )
                    print(json.dumps(rows[-1])[:300], flush=True)
                    (out / "abcrown_plugin_bounds.json").write_text(
                        json.dumps(
                            {"commit": commit, "command": command, "machine": machine, "rows": rows}, indent=1
                        )
                    )
    md = [
        "# The plugin against unpatched alpha-beta-CROWN: bounds and verdicts, its own VNN-COMP 2022 configs",
        "",
        f"Commit `{commit}`; command `{command}`; {machine}, gloo; α,β-CROWN 8250d5f / "
        "auto_LiRPA 0.7.0 from `$ABCROWN_PATH`. Each run: `abcrown --config <α,β-CROWN's "
        "exp_configs/vnncomp22/X.yaml> --general.engine abcrown --device cpu --complete_verifier skip` "
        f"(+ `--parallel.mode {a.mode} --parallel.world_size P`"
        + (", `--conv_mode matrix`; the live-tensor audit on" if a.mode == "tp" else "")
        + "). P = 1 is α,β-CROWN unpatched. Bounds: "
        "the CROWN and α-CROWN lower bound of every clause as α,β-CROWN computed them, compared with the "
        "P = 1 run of the same row setting (max relative difference). A `sat` verdict comes from α,β-CROWN's "
        "PGD before any bound is computed.",
        "",
        table(rows),
    ]
    audited = [r for r in rows if "full_weights_live" in r]
    if audited:
        found = sum(len(x) for r in audited for rank in r["full_weights_live"] for x in rank)
        md += [
            "",
            f"Live-tensor audit (start and end of every build, every rank): {found} whole weights "
            f"found in {len(audited)} runs.",
        ]
    (out / "abcrown_plugin_bounds.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
