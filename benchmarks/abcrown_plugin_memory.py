"""Per-rank peak memory and wall time inside real α,β-CROWN: unpatched (P = 1) vs ``engine: abcrown``
with ``parallel.mode: fsdp`` and ``tp`` at P = 2 and 4, beside the native engine on the same models.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_plugin_memory.py \
        [--sizes 1024 2048 4096] [--methods crown alpha] [--out benchmarks/results]

Every measurement is its own ``abcrown`` process (one mode per process) with
``MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1``, so that RSS follows live tensors. The table's
peak is each rank's RSS high-water mark during α,β-CROWN's incomplete phase (``LiRPANet.build``: CROWN,
α-CROWN) above the RSS when it starts (the model loaded and sharded), as auto_LiRPA's reference numbers
are taken; the JSON also has ``peak_mb_run``, the peak of the whole run above the RSS before
``ABCROWN(args).main()`` (loading the ONNX model included). The native engine reports its own per-rank
peak of the bound computation (see docs/configuration.md).

Models: the TP/FSDP paper's wide MLPs 784 -> h^4 -> 10 (He-normal weights, seed 0; the first layer an
ONNX MatMul, the others Gemm), L∞ box ε = 0.02 around a random input in [0, 1] (seed 0), 9 clauses;
with ``--mnist`` also VNN-COMP's mnist-net_256x6 on prop_0_0.05 (``../shared/benchmarks``);
CROWN, and α-CROWN with 20 iterations (lr 0.1). "unpatched" is α,β-CROWN as a user runs it (its default
``solver.crown.batch_size`` 1e9: a layer's rows in one pass); "P=1 chunked" is the same with 512 rows a
pass, what the plugin uses at P > 1 unless the config says otherwise. Writes
``abcrown_plugin_memory.{json,md,png}`` into ``--out``.
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

import numpy as np
from measure import REPO, provenance

from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

PAPER = (
    "the paper's FSDP (its fork, one GPU per rank): peak +26% to +34% above one GPU (h = 1024 to 8192, d = 4)"
)


def make_instance(folder: Path, h: int) -> tuple[str, str]:
    import torch

    from complete_verifier_ext.testing import mlp_onnx, write_vnnlib

    onnx_path = folder / f"mlp784-{h}x4.onnx"
    if not onnx_path.exists():
        mlp_onnx(onnx_path, [784, h, h, h, h, 10], seed=0)
    x0 = torch.rand(784, generator=torch.Generator().manual_seed(0)).numpy()
    spec = folder / "eps0.02.vnnlib"
    write_vnnlib(spec, np.clip(x0 - 0.02, 0, 1), np.clip(x0 + 0.02, 0, 1), label=0, n_outputs=10)
    return str(onnx_path), str(spec)


YAML = """general:
  device: cpu
  complete_verifier: skip
{engine}solver:
  bound_prop_method: {method}
  alpha-crown:
    iteration: 20
    lr_alpha: 0.1
attack:
  pgd_order: skip
"""


def run_one(
    engine: str,
    method: str,
    onnx: str,
    spec: str,
    world: int,
    chunk: int | None,
    tmp: Path,
    timeout: float,
    mode: str = "fsdp",
    config: str | None = None,
    threads: int | None = None,
) -> dict:
    """One measurement in its own process; ``config`` replaces this benchmark's YAML (the plugin only);
    ``threads``: torch threads per rank (``parallel.threads``; else the engine's default)."""
    m = {"crown": "crown", "alpha": "alpha-crown"}[method]
    cfg = tmp / f"{engine}-{method}.yaml"
    text = YAML.format(method=m, engine="  engine: abcrown\n" if engine == "abcrown" else "")
    cfg.write_text(config if config is not None else text)
    summary = tmp / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = ["abcrown", "--config", str(cfg), "--summary", str(summary), "--quiet"]
    if engine == "abcrown":
        cmd += ["--onnx_path", onnx, "--vnnlib_path", spec, "--results_file", str(tmp / "out.txt")]
        if chunk:
            cmd += ["--crown_batch_size", str(chunk)]
    else:
        cmd += [
            "--model.onnx_path",
            onnx,
            "--specification.vnnlib_path",
            spec,
            "--general.results_file",
            str(tmp / "out.txt"),
        ]
    if world > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(world)]
    if threads:
        cmd += ["--parallel.threads", str(threads)]
    env = {**os.environ, **EXACT_MEMORY_ENV}
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    wall = time.monotonic() - t0
    if out.returncode != 0 or not summary.exists():
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    s = json.loads(summary.read_text())
    key = "alpha_crown" if method == "alpha" else "crown"
    lb = s["bounds"].get(key) or s["bounds"].get("crown")
    return {
        "peak_mb": s.get("peak_mb_bounds") or s["peak_mb"],
        "peak_mb_run": s["peak_mb"],
        "wall_s": round(wall, 2),
        "lb": lb,
        "crown_batch_size": s.get("crown_batch_size"),
    }


def rel_diff(a: list, b: list) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-12)))


def table(rows: list[dict]) -> str:
    out = [
        "| model | method | run | P | peak MB per rank (max) | × unpatched | floor MB | × floor | wall s "
        "| bounds vs unpatched (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["model"], r["method"]): r for r in rows if r["run"] == "unpatched" and "peak_mb" in r}
    for r in rows:
        b = base.get((r["model"], r["method"]))
        if "error" in r:
            out.append(f"| {r['model']} | {r['method']} | {r['run']} | {r['P']} | {r['error']} | | | | | |")
            continue
        peak = max(r["peak_mb"])
        ratio = f"{peak / max(b['peak_mb']):.2f}" if b else ""
        diff = f"{rel_diff(b['lb'], r['lb']):.1e}" if b and r["engine"] == "abcrown" else ""
        floor = "| "
        if b and r["P"] > 1 and (r["h"] or r.get("layer_mb")):  # unpatched / P + the block in flight
            layer = r.get("layer_mb") or r["h"] * r["h"] * 4 / 2**20  # a whole layer; a shard under tp
            f = max(b["peak_mb"]) / r["P"] + (layer / r["P"] if r["run"].endswith("tp") else layer)
            floor = f"{f:.0f} | {peak / f:.2f}"
        out.append(
            f"| {r['model']} | {r['method']} | {r['run']} | {r['P']} | {peak:.0f} | {ratio} | {floor} | "
            f"{r['wall_s']:.1f} | {diff} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for run in ("unpatched", "P=1 chunked", "plugin fsdp", "plugin tp", "native fsdp", "native"):
            pts = sorted(
                (r["h"], max(r["peak_mb"]), r["P"])
                for r in rows
                if r["method"] == method and r["run"] == run and "peak_mb" in r and r["h"]
            )
            for P in sorted({p[2] for p in pts}):
                xs = [p[0] for p in pts if p[2] == P]
                ys = [p[1] for p in pts if p[2] == P]
                ax.plot(xs, ys, marker="o", label=f"{run} P={P}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hidden width h (784 -> h^4 -> 10)")
        ax.set_ylabel("peak MB per rank")
        ax.set_title(f"{method} inside alpha-beta-CROWN")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096])
    ap.add_argument("--methods", nargs="+", default=["crown", "alpha"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=["fsdp", "tp"], help="the plugin's parallel.mode runs")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--mnist", action="store_true", help="also mnist-net_256x6 prop_0_0.05 (../shared)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = ap.parse_args()
    if not os.environ.get("ABCROWN_PATH"):
        sys.exit("set ABCROWN_PATH to an alpha-beta-CROWN checkout (../shared/vendor/alpha-beta-CROWN)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    commit = meta["commit"]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        models = [(f"784-{h}x4", h, *make_instance(tmp, h)) for h in a.sizes]
        if a.mnist:
            mnist = REPO.parent / "shared" / "benchmarks" / "mnist_fc"
            net, spec = mnist / "onnx/mnist-net_256x6.onnx", mnist / "vnnlib/prop_0_0.05.vnnlib"
            models.append(("mnist-net_256x6", None, str(net), str(spec)))
        for model, h, onnx, spec in models:
            for method in a.methods:
                plan = [("abcrown", "unpatched", 1, None, ""), ("abcrown", "P=1 chunked", 1, 512, "")]
                plan += [("abcrown", f"plugin {m}", P, None, m) for m in a.modes for P in a.worlds]
                if not a.no_native:
                    plan += [("native", "native", 1, None, "")]
                    plan += [("native", "native fsdp", P, None, "fsdp") for P in a.worlds]
                for engine, run, P, chunk, mode in plan:
                    r = run_one(engine, method, onnx, spec, P, chunk, tmp, a.timeout, mode or "fsdp")
                    r.update(model=model, h=h, method=method, run=run, P=P, engine=engine)
                    rows.append(r)
                    print(json.dumps(r)[:300], flush=True)
                    (out / "abcrown_plugin_memory.json").write_text(
                        json.dumps({**meta, "rows": rows}, indent=1)
                    )
    md = [
        "# Peak memory inside alpha-beta-CROWN: unpatched vs the plugin's FSDP / TP + row-sharded A",
        "",
        f"Commit `{commit}`; command `{meta['command']}`; {meta['machine']}, gloo; "
        "α,β-CROWN 8250d5f / auto_LiRPA 0.7.0 from `$ABCROWN_PATH`. One process per measurement, "
        "`MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`. Config: `device cpu`, "
        "`complete_verifier skip`, `pgd_order skip`, "
        "α-CROWN 20 iterations, lr 0.1. Peak: per-rank RSS high-water mark of α,β-CROWN's incomplete phase "
        "(`LiRPANet.build`) above the RSS at its start (plugin; torch's code pages and optimizer libraries "
        "left out), or the native engine's own per-rank peak. Floor: unpatched / P + the largest layer "
        "(a shard of it under tp).",
        "",
        table(rows),
        "",
        f"Beside them, {PAPER}.",
    ]
    (out / "abcrown_plugin_memory.md").write_text("\n".join(md) + "\n")
    plot(rows, out / "abcrown_plugin_memory.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()
