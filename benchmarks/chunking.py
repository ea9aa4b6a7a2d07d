"""Peak memory and time of CROWN / α-CROWN with the intermediate neurons back-substituted in chunks
(``solver.crown.batch_size``), against one pass, one configuration per process.

    python benchmarks/chunking.py [--models 2048x4,4096x4] [--chunks 0,1024,256] [--alpha-model 1024x4]

Models: the TP/FSDP paper's wide MLPs 784 -> h^d -> 10 (``measure.wide_mlp``: He-normal weights,
seed 0, ε = 0.02).  Every run is its own process with ``EXACT_MEMORY_ENV`` (RSS follows live
tensors), P = 1, plus P = 2 (fsdp) for the last model with the smallest chunk.  Chunk 0 is one pass.
Writes ``chunking.json``, ``chunking.md`` (with the commit and the command) and ``chunking.png`` into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from measure import max_rel_diff, provenance, spawn_json, wide_mlp

REPO = Path(__file__).resolve().parents[1]


def _rank_job(model: str, method: str, chunk: int, iters: int) -> dict:
    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown
    from complete_verifier_ext.parallel import comm
    from complete_verifier_ext.parallel.memory import PeakMemory

    torch.set_num_threads(1)
    g, box, C = wide_mlp(*map(int, model.split("x")))
    if comm.world_size() > 1:
        g.shard("fsdp")
    pm = PeakMemory(comm.device())
    comm.barrier()
    pm.start()
    t0 = time.perf_counter()
    lb, state = crown(g, box, C, chunk=chunk or None)
    if method == "alpha":
        lb, _ = alpha_crown(
            g, box, C, state, AlphaOptions(iteration=iters, early_stop=False, chunk=chunk or None)
        )
    elapsed = time.perf_counter() - t0
    peak = comm.all_gather_cat(torch.tensor([pm.peak_mb()], dtype=torch.float64)).tolist()
    return {"peak_mb": peak, "time_s": elapsed, "lb": lb[0].tolist()}


def run_one(model: str, method: str, chunk: int, iters: int, P: int) -> dict:
    from complete_verifier_ext.parallel import launch

    res = launch.run(_rank_job, P, (model, method, chunk, iters), backend="gloo")
    return {"model": model, "method": method, "chunk": chunk, "iters": iters, "P": P, **res}


def table(rows: list[dict]) -> str:
    base = {(r["model"], r["method"]): r for r in rows if r["chunk"] == 0 and r["P"] == 1}
    lines = [
        "| model | method | P | chunk (neurons) | peak MB per rank | × one pass | time s | × one pass |"
        " max rel. bound diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["model"], r["method"]))
        peak = max(r["peak_mb"])
        ratio = f"{peak / max(b['peak_mb']):.2f}" if b else "-"
        tratio = f"{r['time_s'] / b['time_s']:.2f}" if b else "-"
        diff = max_rel_diff(r["lb"], b["lb"]) if b else 0
        method = f"{r['method']} ({r['iters']} it.)" if r["iters"] else r["method"]
        lines.append(
            f"| {r['model']} | {method} | {r['P']} | "
            f"{r['chunk'] or 'one pass'} | {'/'.join(f'{p:.0f}' for p in r['peak_mb'])} | {ratio} | "
            f"{r['time_s']:.2f} | {tratio} | {diff:.1e} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["model"], r["method"]) for r in rows if r["P"] == 1}):
        rs = sorted(
            (r for r in rows if (r["model"], r["method"]) == key and r["P"] == 1),
            key=lambda r: -(r["chunk"] or 1e9),
        )
        ax.plot(
            [str(r["chunk"] or "one pass") for r in rs],
            [max(r["peak_mb"]) for r in rs],
            marker="o",
            label=" ".join(key),
        )
    ax.set_xlabel("solver.crown.batch_size (neurons per pass)")
    ax.set_ylabel("peak MB (P = 1)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--one", nargs=5, metavar=("MODEL", "METHOD", "CHUNK", "ITERS", "P"), help=argparse.SUPPRESS
    )
    ap.add_argument("--models", default="2048x4,4096x4")
    ap.add_argument("--chunks", default="0,1024,256")
    ap.add_argument("--alpha-model", default="1024x4")
    ap.add_argument("--alpha-iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chunking"))
    args = ap.parse_args()
    if args.one:
        model, method, chunk, iters, P = args.one
        print(json.dumps(run_one(model, method, int(chunk), int(iters), int(P))))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    jobs = [(m, "crown", c, 0, 1) for m in args.models.split(",") for c in chunks]
    jobs += [(args.alpha_model, "alpha", c, args.alpha_iters, 1) for c in chunks]
    jobs.append(
        (args.models.split(",")[-1], "crown", min(c for c in chunks if c) if any(chunks) else 0, 0, 2)
    )
    rows = []
    for model, method, chunk, iters, P in jobs:
        t0 = time.time()
        r = spawn_json(__file__, [model, method, str(chunk), str(iters), str(P)], args.timeout)
        seen = "failed" if r is None else r["peak_mb"]
        print(f"{model} {method} chunk={chunk} P={P}: {seen} [{time.time() - t0:.0f}s]", flush=True)
        if r is not None:
            rows.append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    md = (
        f"# CROWN / α-CROWN with chunked intermediate rows (`solver.crown.batch_size`)\n\ncommit {commit}; "
        f"command: `python benchmarks/chunking.py {' '.join(sys.argv[1:])}`; one process per row, "
        "`MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`, 1 torch thread per rank, peak RSS above "
        "the RSS after loading.\n\n" + table(rows) + "\n"
    )
    (out / "chunking.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))
    (out / "chunking.md").write_text(md)
    plot(rows, out / "chunking.png")
    print(md)


if __name__ == "__main__":
    main()
