"""Per-rank peak memory and wall time of sharded CROWN / α-CROWN vs the number of ranks.

    python benchmarks/memory_scaling.py [--quick] [--out benchmarks/results/memory_scaling]

Every measurement is its own process (one mode per process, DESIGN.md) started with
``MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`` so that RSS follows live tensors (MKL keeps
3-5 MB of GEMM buffers per process otherwise); each rank reports the peak of
the bound computation above its RSS after loading (and sharding) the model.  Models: the TP/FSDP
paper's wide MLPs 784 -> h^d -> 10 (He-normal weights, seed 0, ε = 0.02 around a random input in
[0, 1], 9 clauses ``Y_0 - Y_j``) and ``mnist-net_256x6`` with its prop_2_0.05 spec from ../shared.
Each row's floor is P = 1's peak / P plus the one block in flight (a whole layer under ``fsdp``, one
shard under ``tp``). torch's lazily loaded optimizer code and code pages are left out
(``memory.PeakMemory``; a warm-up pass on a 64-wide MLP first, so that no code page comes in during
the measurement: ``code_mb`` in the JSON says how much still did).
Writes ``memory_scaling.json`` (raw rows), ``memory_scaling.md`` (the table, peak beside floor) and
``memory_scaling.png`` (peak per rank vs P with the ideal 1/P line; peak / floor vs P) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from measure import max_rel_diff, provenance, spawn_json, warm_up, wide_mlp

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def mnist_256x6():
    import numpy as np

    from complete_verifier_ext.model.onnx_loader import load_onnx
    from complete_verifier_ext.spec import load_vnnlib

    root = SHARED / "benchmarks" / "mnist_fc"
    g = load_onnx(root / "onnx" / "mnist-net_256x6.onnx")
    region = load_vnnlib(root / "vnnlib" / "prop_2_0.05.vnnlib").regions[0]
    C = torch.tensor(np.concatenate([c.C for c in region.clauses]), dtype=torch.float32)
    lo = torch.tensor(region.lower, dtype=torch.float32).view(1, *g.input_shape)
    hi = torch.tensor(region.upper, dtype=torch.float32).view(1, *g.input_shape)
    return g, (lo, hi), C


def _rank_job(model: str, method: str, mode: str, iters: int) -> dict:
    """One rank: build, shard, measure.  Module level so that spawned ranks can run it."""
    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown
    from complete_verifier_ext.parallel import comm
    from complete_verifier_ext.parallel.memory import PeakMemory

    world = comm.world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g, box, C = mnist_256x6() if model == "mnist-net_256x6" else wide_mlp(*map(int, model.split("x")))
    layer_mb = max(n.op.weight.local.numel() * 4 / 2**20 for n in g.nodes if n.op.weight is not None)
    if world > 1:
        g.shard(mode)
    warm_up(method, mode, world)
    pm = PeakMemory(comm.device())
    comm.barrier()
    pm.start()
    comm.reset_stats()
    t0 = time.perf_counter()
    lb, state = crown(g, box, C)
    if method == "alpha":
        lb, _ = alpha_crown(g, box, C, state, AlphaOptions(iteration=iters, early_stop=False))
    elapsed = time.perf_counter() - t0
    peak, code = pm.peak_mb(), pm.code_mb()
    sent = sum(v["bytes"] for v in comm.stats().values())
    return {
        "peak_mb": comm.all_gather_cat(torch.tensor([peak], dtype=torch.float64)).tolist(),
        "code_mb": comm.all_gather_cat(torch.tensor([code], dtype=torch.float64)).tolist(),
        "bytes": int(comm.all_reduce(torch.tensor([float(sent)], dtype=torch.float64))[0]),
        "time_s": elapsed,
        "lb": lb[0].tolist(),
        # the one block in flight beside a rank's 1/P: a whole layer under fsdp, one shard under tp
        "block_mb": layer_mb / world if mode == "tp" else (layer_mb if world > 1 else 0.0),
    }


def run_one(model: str, method: str, P: int, mode: str, iters: int) -> dict:
    """In a fresh process: this process is the (only) parent of its ranks."""
    from complete_verifier_ext.parallel import launch

    res = launch.run(_rank_job, P, (model, method, mode, iters))
    return {"model": model, "method": method, "P": P, "mode": mode, "iters": iters, **res}


def plan(quick: bool) -> list[tuple[str, str, int]]:
    """(model, method, α iterations) — sized for ~20 minutes on 2 cores."""
    if quick:
        return [("1024x4", "crown", 0)]
    jobs = [(f"{h}x4", "crown", 0) for h in (1024, 2048, 4096)]
    jobs += [(f"{h}x8", "crown", 0) for h in (1024, 2048)]
    jobs += [("1024x4", "alpha", 20), ("2048x4", "alpha", 5), ("1024x8", "alpha", 5)]
    if (SHARED / "benchmarks").exists():
        jobs += [("mnist-net_256x6", "crown", 0), ("mnist-net_256x6", "alpha", 20)]
    return jobs


def table(rows: list[dict]) -> str:
    base = {(r["model"], r["method"]): r for r in rows if r["P"] == 1}
    lines = [
        "| model | method | α iters | P | mode | peak MB per rank (max) | floor MB | × floor | × P=1 |"
        " ideal | time s | × P=1 | MB sent | max rel. bound diff vs P=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["model"], r["method"]))
        peak = max(r["peak_mb"])
        ratio = f"{peak / max(b['peak_mb']):.2f}" if b else "-"
        tratio = f"{r['time_s'] / b['time_s']:.2f}" if b else "-"
        diff = "-"
        if b:
            diff = f"{max_rel_diff(r['lb'], b['lb']):.1e}"
        per_rank = "/".join(f"{p:.0f}" for p in r["peak_mb"])
        floor = max(b["peak_mb"]) / r["P"] + r.get("block_mb", 0.0) if b else None
        fl = f"{floor:.0f} | {peak / floor:.2f}" if floor else "- | -"
        lines.append(
            f"| {r['model']} | {r['method']} | {r['iters'] or '-'} | {r['P']} | {r['mode']} | "
            f"{per_rank} | {fl} | {ratio} | {1 / r['P']:.2f} | {r['time_s']:.2f} | {tratio} | "
            f"{r['bytes'] / 2**20:.1f} | {diff} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Left: peak per rank / peak at P = 1 against P, with the ideal 1/P. Right: peak per rank / its
    floor (P = 1's peak / P + the block in flight), with the 1.15 target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["model"], r["method"], r["mode"] if r["P"] > 1 else "fsdp"), []).append(r)
    base = {(r["model"], r["method"]): max(r["peak_mb"]) for r in rows if r["P"] == 1}
    colors = plt.get_cmap("tab20").colors
    for n, ((model, method, mode), rs) in enumerate(series.items()):
        rs = sorted(rs, key=lambda r: r["P"])
        if (model, method) not in base or len(rs) < 2:
            continue
        b = base[(model, method)]
        style = {
            "color": colors[(n // 2) % len(colors)],
            "linestyle": "-" if mode == "fsdp" else ":",
            "marker": "o" if method == "crown" else "s",
            "label": f"{model} {method} {mode}",
        }
        ps = [r["P"] for r in rs]
        ax.plot(ps, [max(r["peak_mb"]) / b for r in rs], **style)
        ax2.plot(ps, [max(r["peak_mb"]) / (b / r["P"] + r.get("block_mb", 0.0)) for r in rs], **style)
    ps = sorted({r["P"] for r in rows})
    ax.plot(ps, [1 / p for p in ps], "k--", label="ideal 1/P")
    ax2.axhline(1.15, color="k", linestyle="--", label="1.15 × floor")
    ax.set_ylabel("peak per rank / peak at P = 1")
    ax2.set_ylabel("peak per rank / floor (P = 1 / P + block in flight)")
    for a in (ax, ax2):
        a.set_xlabel("ranks P")
        a.set_xticks(ps)
        a.legend(fontsize=6)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--one", nargs=5, metavar=("MODEL", "METHOD", "P", "MODE", "ITERS"), help=argparse.SUPPRESS
    )
    ap.add_argument("--quick", action="store_true", help="one small configuration (smoke test)")
    ap.add_argument("--only", default="", help="comma-separated MODEL:METHOD:ITERS jobs instead of the plan")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default="fsdp,tp")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "memory_scaling"))
    args = ap.parse_args()
    if args.one:
        model, method, P, mode, iters = args.one
        print(json.dumps(run_one(model, method, int(P), mode, int(iters))))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    ranks = [int(p) for p in args.ranks.split(",")]
    jobs = [(m, k, int(i)) for m, k, i in (j.split(":") for j in args.only.split(","))] if args.only else None
    for model, method, iters in jobs or plan(args.quick):
        for P in ranks:
            for mode in ["none"] if P == 1 else args.modes.split(","):
                t0 = time.time()
                r = spawn_json(__file__, [model, method, str(P), mode, str(iters)], args.timeout)
                status = "skipped (failed or over the time limit)" if r is None else f"peak {r['peak_mb']}"
                print(f"{model} {method} P={P} {mode}: {status} [{time.time() - t0:.0f}s]", flush=True)
                if r is not None:
                    rows.append(r)
    (out / "memory_scaling.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))
    prov = provenance()
    md = f"commit {prov['commit']}, `{prov['command']}`, {prov['machine']}\n\n" + table(rows)
    (out / "memory_scaling.md").write_text(md + "\n")
    plot(rows, out / "memory_scaling.png")
    print(md)
    print(f"plot: {out / 'memory_scaling.png'}")


if __name__ == "__main__":
    main()
