"""Per-rank peak memory of α,β-CROWN's α-CROWN stage on conv nets through the plugin, against its floor.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/conv_scale.py \
        [--shapes cnn7-c16-cifar ...] [--regimes random certified] [--modes fsdp tp] [--worlds 2 4] \
        [--iterations 20] [--unpatched] [--out benchmarks/results/conv_scale] [--reuse] [--budget-gb 12] \
        [--repeat 1]

Shapes (``complete_verifier_ext.examples``; fixed-seed random weights, BatchNorm folded): CNN7 (five 3x3
convs with c, c, 2c (stride 2), 2c, 2c channels, a 512-unit linear layer, the classifier) at a given
``c`` on CIFAR (3x32x32, 10 classes) or TinyImageNet (3x64x64, 200 classes): ``cnn7-c64-cifar`` is
VNN-COMP 2026's ``cnn7``, ``cnn7-c128-cifar`` its ``wide_cnn7``; ``resnet16`` is the CIFAR-100
ResNet-large shape at 1/16 of its channels (``benchmarks/resnet_large.py``). Regimes: ``random``, an L∞
ball of ε = 2/255 around a random image (most neurons unstable), and ``certified``, a ball small enough
that every layer has fewer unstable neurons than ``crown.batch_size`` (512), as certified training leaves
them (the ε per shape is in ``CERTIFIED_EPS``; the counts per layer, α,β-CROWN's own, are in the table),
and ``certified-open``, the same ball with the runner-up class as the label: where CROWN proves every
spec row of ``certified`` α,β-CROWN never starts α-CROWN, here the row against the predicted class
stays unproven, so α-CROWN runs on the same few unstable neurons.

Each run is its own ``abcrown --general.engine abcrown`` process (one mode per process, every rank
under ``MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1``), with α,β-CROWN's default config plus
``complete_verifier: skip``, ``pgd_order: skip``, α-CROWN's ``iteration`` (lr as configured:
``--lr``), ``parallel.threads`` = cores / P (every run on the whole machine, as unpatched
α,β-CROWN with torch's default threads; the plugin's default leaves a core free) and α-CROWN's
``max_time`` lifted: α,β-CROWN stops α-CROWN after ``max_time`` × ``bab.timeout``
(1 × 360 s by default) of wall time, which a CNN7 at c = 16 reaches on this CPU, so the runs would do
different numbers of iterations at each P (the "Early stop" lines of each run's log are in its row).
Peak: each rank's RSS high-water mark during ``LiRPANet.build`` (CROWN and α-CROWN) above the
RSS at its start (the plugin's ``peak_mb_bounds``). Floor: P = 1's peak / P + one layer in flight (the
largest weight under fsdp, gathered; a shard of it under tp). Bounds: the α-CROWN lower bounds of every
spec row against P = 1's (largest difference, relative; absolute below 1). With ``--unpatched``,
α,β-CROWN's own ``abcrown.py`` (nothing patched) runs beside the plugin at P = 1: wall time and the
process's peak RSS, both measured from outside, for each.

Writes ``conv_scale.{json,md,png}`` into ``--out`` with the commit and command; ``--reuse`` keeps the
rows of an earlier ``conv_scale.json`` there (each with the commit that made it) and runs only what it
lacks; ``--budget-gb B`` also plots GB per rank against P with B and B / 2 (``conv_scale_budget.png``);
``--repeat N`` runs the whole plan N times in turns (wall times on this machine vary by 10% from run to
run): a row's wall time is the median of its runs, each listed; its memory and bounds are the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from abcrown_common import checkout, threads
from abcrown_overhead import UNPATCHED
from measure import REPO, provenance

from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

GENERATED = REPO / "benchmarks" / "generated" / "conv_scale"
SHAPES = {  # name -> (kind, channels, side, classes)
    "cnn7-c8-cifar": ("cnn7", 8, 32, 10),
    "cnn7-c16-cifar": ("cnn7", 16, 32, 10),
    "cnn7-c32-cifar": ("cnn7", 32, 32, 10),
    "cnn7-c40-cifar": ("cnn7", 40, 32, 10),
    "cnn7-c48-cifar": ("cnn7", 48, 32, 10),
    "cnn7-c64-cifar": ("cnn7", 64, 32, 10),
    "cnn7-c128-cifar": ("cnn7", 128, 32, 10),
    "cnn7-c8-tiny": ("cnn7", 8, 64, 200),
    "cnn7-c16-tiny": ("cnn7", 16, 64, 200),
    "resnet16": ("resnet", 4, 32, 100),
}
CERTIFIED_EPS = {  # ε of the certified regime: every layer below 512 unstable neurons (checked: the table)
    "cnn7-c8-cifar": 0.001,
    "cnn7-c16-cifar": 0.0005,
    "cnn7-c32-cifar": 0.00025,
    "cnn7-c64-cifar": 0.000125,
    "cnn7-c128-cifar": 0.00006,
    "cnn7-c8-tiny": 0.00025,
    "cnn7-c16-tiny": 0.000125,
    "resnet16": 0.0005,
}
RANDOM_EPS = 2 / 255
REGIMES = ("random", "certified", "certified-open")
YAML = """general:
  device: cpu
  complete_verifier: skip
solver:
  alpha-crown:
    iteration: {iterations}
    lr_alpha: {lr}
    full_conv_alpha: {full}
    max_time: 1000
attack:
  pgd_order: skip
"""


def instance(shape: str, regime: str) -> tuple[Path, Path, float]:
    """The shape's ONNX file and the regime's spec (generated once), and the largest weight's MB."""
    import onnx
    import onnxruntime as ort
    import torch

    from complete_verifier_ext.testing import write_vnnlib

    kind, c, side, classes = SHAPES[shape]
    GENERATED.mkdir(parents=True, exist_ok=True)
    path = GENERATED / f"{shape}.onnx"
    if not path.exists():
        if kind == "cnn7":
            from complete_verifier_ext.examples.cnn7 import build

            build(path, width=c, shape=(3, side, side), classes=classes)
        else:
            from complete_verifier_ext.examples.resnet import build as build_resnet

            stages = (c, 2 * c, 4 * c, 8 * c)  # no normalisation nodes: α,β-CROWN stops on them (patches)
            build_resnet(path, stages=stages, side=side, fc=512 // 16, classes=classes, normalise=False)
    eps = RANDOM_EPS if regime == "random" else CERTIFIED_EPS[shape]
    spec = GENERATED / f"{shape}-{regime}.vnnlib"
    if not spec.exists():
        x = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(3)).numpy()
        logits = ort.InferenceSession(str(path)).run(None, {"x": x})[0][0]
        label = int(logits.argsort()[-2 if regime == "certified-open" else -1])
        write_vnnlib(spec, np.clip(x - eps, 0, 1).ravel(), np.clip(x + eps, 0, 1).ravel(), label, classes)
    largest = max(int(np.prod(t.dims)) for t in onnx.load(str(path)).graph.initializer)
    return path, spec, largest * 4 / 2**20


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """Wait for ``proc``; its exit status and its own peak RSS (MiB, ``ru_maxrss``)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 1024
        if time.monotonic() > deadline:
            proc.kill()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.2)


def run_plugin(cfg: Path, onnx: Path, spec: Path, P: int, mode: str, tmp: Path, timeout: float) -> dict:
    summary = tmp / "s.json"
    summary.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(cfg), "--general.engine"]
    cmd += ["abcrown", "--onnx_path", str(onnx), "--vnnlib_path", str(spec), "--results_file"]
    cmd += [str(tmp / "out.txt"), "--summary", str(summary)]
    cmd += ["--parallel.threads", str(threads(P))]
    if P > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(P)]
    env = {**os.environ, **EXACT_MEMORY_ENV}
    t0 = time.monotonic()
    log = tmp / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            rc, rss = _wait(proc, timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:.0f} s"}
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    if rc != 0 or not summary.exists():
        return {"error": (text.strip().splitlines() or ["failed"])[-1][:200]}
    s = json.loads(summary.read_text())
    return {
        "iterations_run": ran_iterations(text),
        "early_stop": [
            line.strip() for line in text.splitlines() if "Early stop" in line or "verified at" in line
        ],
        "peak_mb": s["peak_mb_bounds"],
        "wall_s": round(wall, 1),
        "rss_mb": round(rss, 1),
        "lb": s["bounds"].get("alpha_crown") or s["bounds"].get("crown"),
        "crown": s["bounds"].get("crown"),
        "rows_dealt": s.get("rows_dealt"),
        "alpha_elements": s.get("alpha_elements"),
        "unstable": s.get("unstable_per_layer") if P == 1 else None,
    }


def run_unpatched(cfg: Path, onnx: Path, spec: Path, tmp: Path, timeout: float) -> dict:
    """α,β-CROWN's own ``abcrown.py``: wall time and the process's peak RSS, from outside."""
    cmd = [sys.executable, "-c", UNPATCHED, "--config", str(cfg), "--onnx_path", str(onnx)]
    cmd += ["--vnnlib_path", str(spec), "--results_file", str(tmp / "unpatched.txt")]
    env = {**os.environ, **EXACT_MEMORY_ENV}
    t0 = time.monotonic()
    with open(tmp / "unpatched.log", "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            rc, rss = _wait(proc, timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:.0f} s"}
    if rc != 0:
        return {"error": (tmp / "unpatched.log").read_text(errors="replace").strip().splitlines()[-1][:200]}
    return {"wall_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss, 1)}


def ran_iterations(log: str) -> int | None:
    """α-CROWN's ``iteration`` as the run printed its configuration (the config the rank read)."""
    m = re.search(r"^  alpha-crown:\n(?:    .*\n)*?    iteration: (\d+)$", log, re.M)
    return int(m.group(1)) if m else None


def rel_diff(a: list, b: list) -> float:
    """The largest difference of two runs' bounds, relative (absolute below 1), over the rows both
    bound (α,β-CROWN reports a row CROWN verified, which α-CROWN then skips, as ``inf``)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    both = np.isfinite(a) & np.isfinite(b)
    if not both.any():
        return 0.0
    return float(np.max(np.abs(a[both] - b[both]) / np.maximum(np.abs(a[both]), 1.0)))


def _again(first: dict, r: dict) -> dict:
    """A row measured once more (``--repeat``): the first run's row with every run's wall time
    (``walls``) and their median as ``wall_s``; an error in either is the row's."""
    if "error" in first or "error" in r:
        return first if "error" in first else r
    walls = first.get("walls", [first["wall_s"]]) + [r["wall_s"]]
    return {**first, "walls": walls, "wall_s": round(float(np.median(walls)), 1)}


def _floor(base: dict, row: dict) -> float | None:
    if "peak_mb" not in base or row["P"] == 1:
        return None
    layer = row["layer_mb"] / row["P"] if row["mode"] == "tp" else row["layer_mb"]
    return max(base["peak_mb"]) / row["P"] + layer


def table(rows: list[dict]) -> str:
    out = [
        "| shape | regime | mode | P | peak MB per rank (max) | floor MB | × floor | × P = 1 | wall s "
        "| α-CROWN vs P = 1 (rel.) | CROWN vs P = 1 (rel.) | α-CROWN stopped early |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bases = {(r["shape"], r["regime"]): r for r in rows if r["P"] == 1 and r["mode"] == "plugin"}
    for r in rows:
        base = bases.get((r["shape"], r["regime"]), {})
        head = f"| {r['shape']} | {r['regime']} | {r['mode']} | {r['P']} "
        if "error" in r:
            out.append(head + f"| {r['error']} | | | | | | | |")
            continue
        if r["mode"] == "unpatched":
            ratio = f"{r['wall_s'] / base['wall_s']:.2f}" if base.get("wall_s") else ""
            out.append(head + f"| process RSS {r['rss_mb']:.0f} (plugin {base.get('rss_mb', 0):.0f}) | | | "
                       f"| {_wall(r)} (plugin ×{ratio}) | | | |")  # fmt: skip
            continue
        peak = max(r["peak_mb"])
        f = _floor(base, r)
        fl = f"{f:.0f} | {peak / f:.2f}" if f else " | "
        times = f"{peak / max(base['peak_mb']):.2f}" if base.get("peak_mb") else ""
        diff = f"{rel_diff(base['lb'], r['lb']):.1e}" if base.get("lb") and r["P"] > 1 else ""
        cdiff = f"{rel_diff(base['crown'], r['crown']):.1e}" if base.get("crown") and r["P"] > 1 else ""
        stops = "; ".join(sorted(set(r.get("early_stop") or []))) or ("no" if "early_stop" in r else "")
        out.append(head + f"| {peak:.0f} | {fl} | {times} | {_wall(r)} | {diff} | {cdiff} | {stops} |")
    return "\n".join(out)


def _wall(r: dict) -> str:
    """A row's wall time; with ``--repeat``, the median and every run's."""
    walls = r.get("walls")
    return f"{r['wall_s']:.1f}" + (f" ({', '.join(f'{w:.1f}' for w in walls)})" if walls else "")


def counts_table(rows: list[dict]) -> str:
    out = ["| shape | regime | unstable neurons before each ReLU, after CROWN |", "|---|---|---|"]
    for r in rows:
        if r["P"] == 1 and r["mode"] == "plugin" and r.get("unstable"):
            cells = ", ".join(str(u) for u in r["unstable"])
            out.append(f"| {r['shape']} | {r['regime']} | {cells} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bases = {(r["shape"], r["regime"]): r for r in rows if r["P"] == 1 and r["mode"] == "plugin"}
    for key, base in bases.items():
        for mode in ("fsdp", "tp"):
            pts = [
                (r["P"], max(r["peak_mb"]) / _floor(base, r))
                for r in rows
                if (r["shape"], r["regime"]) == key and r["mode"] == mode and "peak_mb" in r and r["P"] > 1
            ]
            if pts:
                ps, ys = zip(*sorted(pts), strict=True)
                ax.plot(ps, ys, marker="o", label=f"{key[0]} {key[1]} {mode}")
    ax.axhline(1.15, color="k", linestyle="--", label="1.15 × floor")
    ax.axhline(1.0, color="grey", linestyle=":")
    _save(
        fig,
        ax,
        "peak per rank / floor",
        "alpha-CROWN stage through the plugin, per rank against its floor",
        path,
    )


def _save(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """The labels, legend and file of a plot against P."""
    ax.set_xlabel("ranks P")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def budget_plot(rows: list[dict], budget_mb: float, path: Path) -> None:
    """Peak per rank against P for each shape and mode, with the budget B and B / 2: P = 1 is the
    plugin's peak and unpatched α,β-CROWN's process RSS (the budget's measure: all its memory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["shape"], r["regime"]) for r in rows}):
        same = [r for r in rows if (r["shape"], r["regime"]) == key and "error" not in r]
        for mode in ("fsdp", "tp"):
            pts = [(r["P"], max(r["peak_mb"]) / 1024) for r in same if r["mode"] in (mode, "plugin")]
            if len(pts) > 1:
                ps, ys = zip(*sorted(pts), strict=True)
                ax.plot(ps, ys, marker="o", label=f"{key[0]} {key[1]} {mode} (peak of the bounds)")
        for r in same:
            if r["mode"] == "unpatched":
                ax.scatter(
                    [1], [r["rss_mb"] / 1024], marker="x", color="r", label="unpatched α,β-CROWN, process RSS"
                )
    ax.axhline(budget_mb / 1024, color="k", linestyle="--", label=f"budget B = {budget_mb / 1024:.0f} GB")
    ax.axhline(budget_mb / 2048, color="grey", linestyle=":", label="B / 2")
    _save(fig, ax, "GB per rank", "alpha-CROWN stage through the plugin: peak per rank", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["cnn7-c16-cifar"])
    ap.add_argument("--regimes", nargs="+", default=["random", "certified"], choices=REGIMES)
    ap.add_argument("--modes", nargs="+", default=["fsdp", "tp"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--full-conv-alpha", default="true", choices=["true", "false"])
    ap.add_argument("--unpatched", action="store_true", help="also α,β-CROWN's own abcrown.py at P = 1")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "conv_scale"))
    ap.add_argument("--reuse", action="store_true", help="keep the rows of an earlier run in --out")
    ap.add_argument("--budget-gb", type=float, help="also plot GB per rank against P with this budget")
    ap.add_argument("--repeat", type=int, default=1, help="the plan this many times in turns")
    a = ap.parse_args()
    if not os.environ.get("ABCROWN_PATH"):
        os.environ["ABCROWN_PATH"] = str(checkout())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "conv_scale.json"
    meta = provenance()
    config = {"iterations": a.iterations, "lr": a.lr, "full_conv_alpha": a.full_conv_alpha}
    rows: list[dict] = []
    if a.reuse and results.exists():
        earlier = json.loads(results.read_text())
        rows = [{"commit": earlier["commit"], **r} for r in earlier["rows"]]  # each row keeps its commit
        other = [r for r in rows if r.get("config") != config]
        if other:  # rows of another α-CROWN config are not compared with these: dropped
            print(f"dropping {len(other)} earlier rows of another config than {config}", flush=True)
            rows = [r for r in rows if r.get("config") == config]
    done = {(r["shape"], r["regime"], r["mode"], r["P"]) for r in rows if "error" not in r}
    GENERATED.mkdir(parents=True, exist_ok=True)
    # this invocation's own config and run files: another invocation beside it cannot change them
    tmp = Path(tempfile.mkdtemp(prefix="runs-", dir=GENERATED))
    cfg = tmp / "alpha.yaml"
    cfg.write_text(YAML.format(iterations=a.iterations, lr=a.lr, full=a.full_conv_alpha))
    for shape in a.shapes:
        for regime in a.regimes:
            onnx, spec, layer_mb = instance(shape, regime)
            plan = [("plugin", 1)] + [(m, P) for m in a.modes for P in a.worlds]
            if a.unpatched:
                plan.append(("unpatched", 1))
            for rep, (mode, P) in [(rep, step) for rep in range(a.repeat) for step in plan]:
                if (shape, regime, mode, P) in done:
                    continue
                if mode == "unpatched":
                    r = run_unpatched(cfg, onnx, spec, tmp, a.timeout)
                else:
                    r = run_plugin(cfg, onnx, spec, P, mode if P > 1 else "fsdp", tmp, a.timeout)
                if r.get("iterations_run", a.iterations) != a.iterations:  # the printed config says otherwise
                    r = {"error": f"ran {r['iterations_run']} α-CROWN iterations, not {a.iterations}"}
                r.update(shape=shape, regime=regime, mode=mode, P=P, layer_mb=layer_mb, commit=meta["commit"])
                r["config"] = config
                if rep > 0:  # the same run again, in turn with the others: its wall times, the median
                    first = next(x for x in rows if (x["shape"], x["regime"], x["mode"], x["P"]) == (shape,
                                 regime, mode, P))  # fmt: skip
                    r = _again(first, r)
                rows = [
                    x
                    for x in rows
                    if (x["shape"], x["regime"], x["mode"], x["P"]) != (shape, regime, mode, P)
                ]
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("lb", "crown", "unstable")})[:400],
                      flush=True)  # fmt: skip
                results.write_text(json.dumps({**meta, "config": cfg.read_text(), "rows": rows}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    order = {s: i for i, s in enumerate(SHAPES)}
    rows.sort(
        key=lambda r: (order.get(r["shape"], 99), r["regime"], r["mode"] != "plugin", r["mode"], r["P"])
    )
    md = [
        "# α-CROWN on conv nets through the plugin: per-rank peak against the floor",
        "",
        f"Commit `{meta['commit']}` (each row's own in `conv_scale.json`: "
        f"{', '.join(sorted({r['commit'] for r in rows}))}); last command `{meta['command']}`; "
        f"{meta['machine']}, gloo; α,β-CROWN "
        "8250d5f / auto_LiRPA 0.7.0 from `$ABCROWN_PATH`. One process per run, every rank under "
        "`MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`. Config (α,β-CROWN's defaults otherwise):",
        "",
        "```yaml",
        YAML.format(iterations=a.iterations, lr=a.lr, full=a.full_conv_alpha).rstrip(),
        "```",
        "",
        "Peak: per-rank RSS high-water mark of α,β-CROWN's incomplete phase (`LiRPANet.build`: CROWN, "
        "α-CROWN) above the RSS at its start. Floor: P = 1 / P + the largest weight (a shard of it under "
        "tp). Bounds: the largest difference of the spec rows' lower bounds from P = 1, relative (absolute "
        "below 1; `inf`: a row CROWN verified, not compared).",
        "",
        table(rows),
        "",
        "Unstable neurons before each ReLU after α,β-CROWN's initial CROWN at P = 1:",
        "",
        counts_table(rows),
    ]
    (out / "conv_scale.md").write_text("\n".join(md) + "\n")
    plot(rows, out / "conv_scale.png")
    if a.budget_gb:
        budget_plot(rows, a.budget_gb * 1024, out / "conv_scale_budget.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()
