"""Branch-and-bound throughput and per-rank memory vs ranks and batch size (domain-parallel BaB).

    python benchmarks/bab_scaling.py [--rounds 12] [--batches 128,512,2048] [--ranks 1,2,4]
                                     [--weights sharded,replicated]

For mnist_fc instances that α-CROWN alone cannot decide, every measurement is its own process
(``EXACT_MEMORY_ENV`` set): load, run α-CROWN, take the worst open clause, then start the
per-rank peak and run ``--rounds`` BaB rounds with a *total* batch of B domains per round (B / P
per rank), FSDP weights (``--weights``: gathered per use, or gathered once for the whole search as
``parallel.bab_weights: replicated`` does; the replica counts in the peak).  Reports domains bounded
per second and the per-rank peak; writes ``bab_scaling.json`` and ``bab_scaling.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from measure import provenance, spawn_json

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "benchmarks" / "mnist_fc"
INSTANCES = [
    ("mnist-net_256x4.onnx", "prop_8_0.03.vnnlib"),
    ("mnist-net_256x6.onnx", "prop_7_0.03.vnnlib"),
    ("mnist-net_256x4.onnx", "prop_0_0.05.vnnlib"),  # its queue grows by ~200 domains per second
]


def _rank_job(onnx: str, vnnlib: str, batch: int, rounds: int, weights: str) -> dict:
    from complete_verifier_ext.bab.common import BabOptions
    from complete_verifier_ext.bab.relu_split import relu_split_bab
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.parallel import comm
    from complete_verifier_ext.parallel.memory import PeakMemory
    from complete_verifier_ext.spec import Clauses, Region
    from complete_verifier_ext.verify import Clock, RegionRun, bound_region, input_box, load_instance

    P = comm.world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    cfg, _ = load_config(
        str(REPO / "configs" / "mnist_fc.yaml"),
        [
            "--general.csv_name",
            "null",
            "--parallel.mode",
            "fsdp" if P > 1 else "none",
            "--parallel.world_size",
            str(P),
            "--general.complete_verifier",
            "skip",
        ],
    )
    inst = load_instance(cfg, str(MNIST / "onnx" / onnx), str(MNIST / "vnnlib" / vnnlib))
    graph, spec = inst.graph, inst.spec
    region = spec.regions[0]
    run = RegionRun(graph, region, cfg, Clock(time.monotonic() + 600), {})
    bound_region(run)
    region = Region(
        region.lower, region.upper, (region.clauses[int(run.cb.argmin())],)
    )  # as the pipeline does
    problem = Clauses.of(region.clauses)
    opts = BabOptions(batch_size=max(2, batch // P), branching="kfsb", candidates=3, iteration=20)
    done = [0]

    def on_round(r: int, left: int, worst: float, bounded: int) -> None:
        done[0] = r

    pm = PeakMemory(comm.device())
    comm.barrier()
    pm.start()
    t0 = time.perf_counter()
    with graph.replicated() if weights == "replicated" else contextlib.nullcontext():
        res = relu_split_bab(
            graph,
            input_box(region, graph),
            problem,
            run.state,
            opts,
            lambda: comm.all_reduce_flag(done[0] >= rounds, "or"),
            region.lower,
            region.upper,
            on_round,
        )
    elapsed = time.perf_counter() - t0
    peak = comm.all_gather_cat(torch.tensor([pm.peak_mb()], dtype=torch.float64)).tolist()
    return {
        "verdict": res.verdict,
        "domains": res.domains,
        "rounds": res.rounds,
        "time_s": elapsed,
        "peak_mb": peak,
        "max_queue": res.max_queue,
    }


def run_one(onnx: str, vnnlib: str, P: int, batch: int, rounds: int, weights: str) -> dict:
    from complete_verifier_ext.parallel import launch

    res = launch.run(_rank_job, P, (onnx, vnnlib, batch, rounds, weights))
    return {"instance": f"{onnx[10:-5]} {vnnlib[:-7]}", "P": P, "batch": batch, "weights": weights, **res}


def table(rows: list[dict]) -> str:
    base = {(r["instance"], r["batch"]): r for r in rows if r["P"] == 1}
    lines = [
        "| instance | total batch | P | weights | verdict | rounds | domains | domains/s | peak MB per rank |"
        " × P=1 | max queue per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get((r["instance"], r["batch"]))
        ratio = f"{max(r['peak_mb']) / max(b['peak_mb']):.2f}" if b else "-"
        weights = r.get("weights", "sharded") if r["P"] > 1 else "-"
        lines.append(
            f"| {r['instance']} | {r['batch']} | {r['P']} | {weights} | "
            f"{r['verdict']} | {r['rounds']} | "
            f"{r['domains']} | {r['domains'] / max(r['time_s'], 1e-9):.0f} | "
            f"{'/'.join(f'{p:.0f}' for p in r['peak_mb'])} | {ratio} | "
            f"{'/'.join(str(q) for q in r['max_queue'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batches", default="128,512,2048")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--weights", default="sharded", help="sharded and/or replicated, comma-separated")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--only", default="", help="run only instances whose onnx or vnnlib name contains this")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bab_scaling"))
    args = ap.parse_args()
    if args.one:
        onnx, vnnlib, P, batch, rounds, weights = args.one
        print(json.dumps(run_one(onnx, vnnlib, int(P), int(batch), int(rounds), weights)))
        return
    if not MNIST.exists():
        sys.exit(f"{MNIST} not found: the benchmark needs ../shared/benchmarks/mnist_fc")
    rows = []
    for onnx, vnnlib in [i for i in INSTANCES if args.only in i[0] or args.only in i[1]]:
        for batch in (int(b) for b in args.batches.split(",")):
            for P in (int(p) for p in args.ranks.split(",")):
                for weights in args.weights.split(",") if P > 1 else ["sharded"]:
                    t0 = time.time()
                    job = [onnx, vnnlib, str(P), str(batch), str(args.rounds), weights]
                    r = spawn_json(__file__, job, args.timeout)
                    print(f"{' '.join(job)}: {r and r['peak_mb']} [{time.time() - t0:.0f}s]", flush=True)
                    if r:
                        rows.append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bab_scaling{args.tag}.json").write_text(json.dumps({**provenance(), "rows": rows}, indent=1))
    md = table(rows)
    (out / f"bab_scaling{args.tag}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
