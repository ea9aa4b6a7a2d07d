"""Scale: per-rank peak and wall time of CROWN and α-CROWN on wide MLPs, conv nets and the CIFAR-100
ResNet-large shape, ours at P = 1, 2, 4 (fsdp, tp) against auto_LiRPA itself in the same run.

    python benchmarks/scale.py [--models mlp1024x4,mlp2048x4,mlp4096x4,oval21,sri_resnet_a,resnet_large]
        [--methods crown,alpha] [--ranks 1,2,4] [--modes fsdp,tp] [--chunk 0] [--timeout 900] [--threads 1]
        [--engines auto_LiRPA,ours]

Every measurement is its own process (``EXACT_MEMORY_ENV``, so RSS follows live tensors), one
mode per process; per-rank peak RSS of the bound computation above the RSS after loading, on both
engines without the 70-80 MB of library code torch loads on its first optimizer
(``memory.load_optimizer_libraries``: ours leaves it out of ``PeakMemory``, auto_LiRPA's run loads it
before its baseline), and without the code pages torch pages in during the run (``PeakMemory.code_mb``;
ours runs a warm-up pass on a 64-wide MLP first, so that on the MLPs none comes in). auto_LiRPA is
the one α,β-CROWN pins (``$ABCROWN_PATH/auto_LiRPA``, default ``../shared/vendor/alpha-beta-CROWN``),
``BoundedModule(model).compute_bounds(method=CROWN | CROWN-Optimized)`` on the same weights (our graph's
weights for the MLPs, onnx2pytorch's conversion of the same ONNX file otherwise, as α,β-CROWN loads it),
the same box and spec rows, the same thread count, 20 α iterations at lr 0.1 with early stop off, and
``crown_batch_size`` = our chunk. Ours: ``crown`` then ``alpha_crown`` (the same 20 iterations).
``--chunk 0`` is one pass per layer for the MLPs (auto_LiRPA's default); conv models always get the chunk
that ``solver.crown.batch_size: 0`` picks from the memory available (recorded). A configuration that
runs past ``--timeout`` is in the table as such. Writes ``scale.json``, ``scale.md`` (commit, command,
machine) and ``scale.png`` into ``--out``.

Models: ``mlpHxD`` is 784 -> H^D -> 10 (``measure.wide_mlp``, the TP/FSDP paper's shape, ε = 0.02);
``oval21`` and ``sri_resnet_a`` are the first two instances of each folder in ``../shared/benchmarks``;
``resnet_large`` is ``resnet_large.py``'s model with its first spec (ε = 1/255).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from measure import REPO, max_rel_diff, provenance, spawn_json, warm_up

SHARED = REPO.parent / "shared"
ITERS, LR = 20, 0.1


def _instances(folder: str, n: int = 2) -> list[tuple[str, str]]:
    root = SHARED / "benchmarks" / folder
    rows = [line.split(",")[:2] for line in (root / "instances.csv").read_text().splitlines() if line.strip()]
    return [(str(root / o), str(root / v)) for o, v in rows[:n]]


def model_names(spec: str) -> list[str]:
    """``oval21`` / ``sri_resnet_a`` expand to ``folder#0`` and ``folder#1``."""
    out = []
    for m in spec.split(","):
        out += [f"{m}#0", f"{m}#1"] if m in ("oval21", "sri_resnet_a") else [m]
    return out


def onnx_problem(name: str) -> tuple[str, str]:
    if name == "resnet_large":
        from resnet_large import ensure

        path, specs = ensure(n_specs=1)
        return str(path), str(specs[0])
    folder, i = name.split("#")
    return _instances(folder)[int(i)]


def problem(name: str):
    """(our graph, box (1, *in), C (S, n_out), onnx path or None)."""
    import numpy as np

    if name.startswith("mlp"):
        from measure import wide_mlp

        h, d = map(int, name[3:].split("x"))
        g, box, C = wide_mlp(h, d)
        return g, box, C, None
    from complete_verifier_ext.model.onnx_loader import load_onnx
    from complete_verifier_ext.spec import load_vnnlib

    onnx_path, vnnlib = onnx_problem(name)
    g = load_onnx(onnx_path)
    region = load_vnnlib(vnnlib).regions[0]
    C = torch.tensor(np.concatenate([c.C for c in region.clauses]), dtype=torch.float32)
    lo = torch.tensor(region.lower, dtype=torch.float32).view(1, *g.input_shape)
    hi = torch.tensor(region.upper, dtype=torch.float32).view(1, *g.input_shape)
    return g, (lo, hi), C, onnx_path


def _chunk(g, onnx_path: str | None, chunk: int) -> int:
    """``chunk``, or for a conv model given 0 what ``solver.crown.batch_size: 0`` picks (the MLPs keep 0:
    one pass per layer, auto_LiRPA's default)."""
    if onnx_path is None or chunk:
        return chunk
    from complete_verifier_ext.config import Config
    from complete_verifier_ext.options import crown_chunk

    return crown_chunk(Config(), g)


def _ours(name: str, method: str, chunk: int, mode: str, threads: int) -> dict:
    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown
    from complete_verifier_ext.parallel import comm
    from complete_verifier_ext.parallel.memory import PeakMemory

    torch.set_num_threads(threads)
    g, box, C, onnx_path = problem(name)
    if comm.world_size() > 1:
        g.shard(mode)
    chunk = _chunk(g, onnx_path, chunk)
    warm_up(method, mode, comm.world_size())
    pm = PeakMemory(comm.device())
    comm.barrier()
    pm.start()
    t0 = time.perf_counter()
    lb, state = crown(g, box, C, chunk=chunk or None)
    if method == "alpha":
        opts = AlphaOptions(iteration=ITERS, lr_alpha=LR, early_stop=False, chunk=chunk or None)
        lb, _ = alpha_crown(g, box, C, state, opts)
    elapsed = time.perf_counter() - t0
    peak = comm.all_gather_cat(torch.tensor([pm.peak_mb()], dtype=torch.float64)).tolist()
    return {"peak_mb": peak, "time_s": elapsed, "lb": lb[0].tolist(), "chunk": chunk}


def _auto_lirpa(name: str, method: str, chunk: int, threads: int) -> dict:
    """auto_LiRPA on the same model, box and rows (see the module docstring)."""
    from complete_verifier_ext.abcrown_plugin import locate

    locate.activate(locate.find())  # auto_LiRPA and onnx2pytorch importable (as the plugin finds them)
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    from complete_verifier_ext.parallel.memory import PeakMemory, load_optimizer_libraries

    torch.set_num_threads(threads)
    g, box, C, onnx_path = problem(name)
    model = torch_model(g, onnx_path)
    chunk = _chunk(g, onnx_path, chunk)
    del g
    x0 = (box[0] + box[1]) / 2
    opts = {
        "crown_batch_size": chunk or float("inf"),
        "batched_crown_max_vram_ratio": 0.9,  # alpha-beta-CROWN's default (read once chunks are used)
        "optimize_bound_args": {"iteration": ITERS, "lr_alpha": LR, "early_stop_patience": ITERS + 1},
        "verbosity": 0,
    }
    bm = BoundedModule(model, torch.zeros_like(x0), bound_opts=opts, device="cpu")
    x = BoundedTensor(x0, PerturbationLpNorm(x_L=box[0], x_U=box[1]))
    load_optimizer_libraries()  # as for ours: torch's lazily loaded optimizer code is not bound memory
    pm = PeakMemory(torch.device("cpu"))
    pm.start()
    t0 = time.perf_counter()
    lirpa_method = "CROWN-Optimized" if method == "alpha" else "CROWN"
    lb, _ = bm.compute_bounds(x=(x,), C=C[None], method=lirpa_method, bound_upper=False)
    elapsed = time.perf_counter() - t0
    return {"peak_mb": [pm.peak_mb()], "time_s": elapsed, "lb": lb[0].tolist(), "chunk": chunk}


def torch_model(g, onnx_path: str | None) -> torch.nn.Module:
    if onnx_path is not None:
        import onnx
        import onnx2pytorch

        return onnx2pytorch.ConvertModel(onnx.load(onnx_path), experimental=True).eval()
    layers: list[torch.nn.Module] = []
    for node in g.nodes[1:]:
        if node.op.is_relu:
            layers.append(torch.nn.ReLU())
            continue
        W = node.op.weight.gathered()
        lin = torch.nn.Linear(W.shape[1], W.shape[0])
        lin.weight.data.copy_(W)
        lin.bias.data.copy_(node.op.bias)
        layers.append(lin)
    return torch.nn.Sequential(*layers).eval()


def run_one(engine: str, name: str, method: str, P: int, mode: str, chunk: int, threads: int) -> dict:
    if engine == "auto_LiRPA":
        res = _auto_lirpa(name, method, chunk, threads)
    else:
        from complete_verifier_ext.parallel import launch

        res = launch.run(_ours, P, (name, method, chunk, mode, threads), backend="gloo", timeout_s=3600)
    return {"engine": engine, "model": name, "method": method, "P": P, "mode": mode, **res}


def _ratio(x: float, ref: dict | None, key: str) -> str:
    if ref is None:
        return "-"
    base = max(ref[key]) if isinstance(ref[key], list) else ref[key]
    return f"{x / base:.2f}"


def table(rows: list[dict]) -> str:
    done = [r for r in rows if "peak_mb" in r]
    ref = {(r["model"], r["method"]): r for r in done if r["engine"] == "auto_LiRPA"}
    one = {(r["model"], r["method"]): r for r in done if r["engine"] == "ours" and r["P"] == 1}
    lines = [
        "| model | method | engine | P | mode | chunk | peak MB per rank | × auto_LiRPA | × ours P=1 |"
        " time s | × auto_LiRPA | worst lb | max rel. diff to auto_LiRPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['method']} | {r['engine']} | {r['P']} | {r['mode']} |"
        if "peak_mb" not in r:
            lines.append(f"{head} - | {r['error']} | | | | | | |")
            continue
        a, o = ref.get((r["model"], r["method"])), one.get((r["model"], r["method"]))
        peak = max(r["peak_mb"])
        diff = "-"
        if a is not None:
            diff = f"{max_rel_diff(r['lb'], a['lb']):.1e}"
        per_rank = "/".join(f"{p:.0f}" for p in r["peak_mb"])
        lines.append(
            f"{head} {r['chunk'] or 'one pass'} | {per_rank} | {_ratio(peak, a, 'peak_mb')} | "
            f"{_ratio(peak, o, 'peak_mb')} | {r['time_s']:.1f} | {_ratio(r['time_s'], a, 'time_s')} | "
            f"{min(r['lb']):.4g} | {diff} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "peak_mb" in r]
    fig, ax = plt.subplots(figsize=(max(7, 0.35 * len(done)), 4.5))
    labels = [f"{r['model']} {r['method']}\n{r['engine']} P={r['P']} {r['mode']}" for r in done]
    colours = ["tab:grey" if r["engine"] == "auto_LiRPA" else "tab:blue" for r in done]
    ax.bar(range(len(done)), [max(r["peak_mb"]) for r in done], color=colours)
    ax.set_xticks(range(len(done)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("peak MB per rank (grey: auto_LiRPA)")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def jobs(args) -> list[tuple]:
    out = []
    for name in model_names(args.models):
        for method in args.methods.split(","):
            if "auto_LiRPA" in args.engines:
                out.append(("auto_LiRPA", name, method, 1, "-"))
            if "ours" not in args.engines:
                continue
            out.append(("ours", name, method, 1, "-"))
            for P in (int(p) for p in args.ranks.split(",") if int(p) > 1):
                out += [("ours", name, method, P, mode) for mode in args.modes.split(",")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--models", default="mlp1024x4,mlp2048x4,mlp4096x4,oval21,sri_resnet_a,resnet_large")
    ap.add_argument("--methods", default="crown,alpha")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--modes", default="fsdp,tp")
    ap.add_argument("--engines", default="auto_LiRPA,ours")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "scale"))
    args = ap.parse_args()
    if args.one:
        engine, name, method, P, mode, chunk, threads = args.one
        print(json.dumps(run_one(engine, name, method, int(P), mode, int(chunk), int(threads))))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for engine, name, method, P, mode in jobs(args):
        t0 = time.time()
        job = [engine, name, method, str(P), mode, str(args.chunk), str(args.threads)]
        r = spawn_json(__file__, job, args.timeout)
        if r is None:
            r = {"engine": engine, "model": name, "method": method, "P": P, "mode": mode}
            r["error"] = f"failed or over {args.timeout:.0f} s"
        print(
            f"{engine} {name} {method} P={P} {mode}: {r.get('peak_mb', r.get('error'))}"
            f" [{time.time() - t0:.0f}s]"
        )
        rows.append(r)
        data = {"provenance": provenance(), "rows": rows}
        (out / "scale.json").write_text(json.dumps(data, indent=1))
    md = f"# Scale\n\n`{provenance()['command']}` at {provenance()['commit']} ({provenance()['machine']})\n\n"
    (out / "scale.md").write_text(md + table(rows) + "\n")
    plot(rows, out / "scale.png")
    print(table(rows))


if __name__ == "__main__":
    os.environ.setdefault("ABCROWN_PATH", str(SHARED / "vendor" / "alpha-beta-CROWN"))
    main()
