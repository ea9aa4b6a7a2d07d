"""A CIFAR-100 ResNet-large-shaped model and its robustness specs, generated (never committed).

VNN-COMP 2024's cifar100 benchmark (the TP/FSDP paper's headline complete result) has a ResNet-large
of about 15.2M parameters and 19 layers; its files are not available here, so this script builds the
shape (``complete_verifier_ext.examples.resnet``): a CIFAR ResNet18 (3x3 stem with 64 channels at
32x32, four stages of two BasicBlocks with 64/128/256/512 channels, 1x1 projection shortcuts where the
shape changes) followed by a 512-wide fully connected layer and 100 outputs: 16 + 1 convolutions and 2
fully connected layers, 15.4M parameters, BatchNorm folded, fixed-seed random weights.

Specs are what the benchmark's ``generate_properties.py`` writes: an L∞ ball of ε = 1/255 around an image
in [0, 1] (clipped to it), the correct class (here: the model's prediction) against each of the other 99.

    python benchmarks/resnet_large.py [--out benchmarks/generated/resnet_large] [--specs 2]
    python benchmarks/resnet_large.py --crown [--ranks 1,2,4] [--mode fsdp] [--layers K] [--limit 1500]
        [--threads 2] [--exact] [--name crown_layers] [--results DIR] [--against EARLIER.json ...]

``--crown`` runs our CROWN sweep (intermediate bounds of every layer, then the output) on the first
spec, at each P of ``--ranks`` in its own process, and records per layer the neurons bounded, the time
and every rank's peak RSS so far; it stops after ``--layers`` layers or at ``--limit`` seconds (checked
after each layer; the table says how far it got) and writes ``NAME.json`` and ``NAME.md`` (commit,
command, machine). ``--exact`` sets ``EXACT_MEMORY_ENV`` so that RSS follows the live tensors
(its page faults make the run slower); without it the peak is an upper bound. ``--against`` puts the
runs of earlier results files first (once each, their provenance kept), so a P = 1 run of an hour
need not be repeated to compare P = 2 and 4 with it.
``benchmarks/scale.py --models resnet_large`` measures auto_LiRPA on the same files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from complete_verifier_ext.examples.resnet import CLASSES, build
from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "generated" / "resnet_large"
SHAPE = (3, 32, 32)
EPSILON = 1 / 255


def specs(onnx_path: Path, folder: Path, n: int, seed: int = 2) -> list[Path]:
    """``n`` VNN-LIB robustness specs at ε = 1/255 around random images, labelled by the model."""
    import onnxruntime as ort

    from complete_verifier_ext.testing import write_vnnlib

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.rand(1, *SHAPE, generator=gen).numpy()
        label = int(sess.run(None, {"x": x})[0].argmax())
        lo, hi = np.clip(x - EPSILON, 0, 1), np.clip(x + EPSILON, 0, 1)
        out.append(Path(write_vnnlib(folder / f"img{i}_eps1_255.vnnlib", lo, hi, label, CLASSES)))
    return out


def ensure(folder: Path = DEFAULT_OUT, n_specs: int = 2) -> tuple[Path, list[Path]]:
    """The model and specs under ``folder``, generated once (the same files for every seed-0 run)."""
    path = folder / "cifar100_resnet_large_shape.onnx"
    if not path.exists():
        build(path)
    spec_paths = sorted(folder.glob("img*_eps1_255.vnnlib"))
    if len(spec_paths) < n_specs:
        spec_paths = specs(path, folder, n_specs)
    return path, spec_paths[:n_specs]


class _Stop(Exception):
    pass


def crown_job(limit: float, threads: int, max_layers: int, mode: str) -> dict:
    """Our CROWN sweep on the first spec, on every rank (P = ``comm.world_size()``), with a progress
    record per layer; stops after ``max_layers`` layers or once ``limit`` seconds have passed (decided
    collectively after each layer). Returns rank 0's record with every rank's peak."""
    from complete_verifier_ext.bounds.crown import final_bounds, sweep
    from complete_verifier_ext.config import Config
    from complete_verifier_ext.model.onnx_loader import load_onnx
    from complete_verifier_ext.options import crown_chunk
    from complete_verifier_ext.parallel import comm
    from complete_verifier_ext.parallel.memory import PeakMemory
    from complete_verifier_ext.spec import load_vnnlib

    torch.set_num_threads(threads)
    path, specs = ensure(n_specs=1)
    g = load_onnx(path)
    if comm.world_size() > 1:
        g.shard(mode)
    region = load_vnnlib(specs[0]).regions[0]
    box = tuple(torch.tensor(b, dtype=torch.float32).view(1, *SHAPE) for b in (region.lower, region.upper))
    C = torch.tensor(np.concatenate([c.C for c in region.clauses]), dtype=torch.float32)
    chunk = crown_chunk(Config(), g)
    pm = PeakMemory(torch.device("cpu"))
    comm.barrier()
    pm.start()
    t0 = time.perf_counter()
    layers: list[dict] = []
    last: list = []

    def on_layer(k: int, rows: int, bounds) -> None:
        n = int(np.prod(g.nodes[k].shape))
        t = time.perf_counter() - t0
        peaks = comm.all_gather_cat(torch.tensor([pm.peak_mb()], dtype=torch.float64)).tolist()
        layers.append({"node": g.nodes[k].name, "neurons": n, "bounded": rows, "s": t, "peak_mb": peaks})
        last[:] = [g.nodes[k].name, bounds[0].flatten().tolist(), bounds[1].flatten().tolist()]
        if comm.rank() == 0:
            print(f"{g.nodes[k].name}: {rows}/{n} neurons, {t:.0f} s, peak {max(peaks):.0f} MB", flush=True)
        if comm.all_reduce_flag(t > limit or len(layers) >= max_layers, "or"):
            raise _Stop

    out = {"P": comm.world_size(), "mode": mode if comm.world_size() > 1 else "-", "chunk": chunk}
    out.update(threads=threads, limit_s=limit, max_layers=max_layers, layers=layers)
    with torch.no_grad():
        try:
            state = sweep(g, box, chunk=chunk, on_layer=on_layer)
            lb, _ = final_bounds(g, state, box, C)
            out.update(done=True, lb_worst=float(lb.min()))
        except _Stop:
            out.update(done=False)
    out["time_s"] = time.perf_counter() - t0
    out["peak_mb"] = comm.all_gather_cat(torch.tensor([pm.peak_mb()], dtype=torch.float64)).tolist()
    out["last_layer"] = last
    out["pre_activation_layers"] = sum(1 for i in range(1, len(g.nodes)) if g.nodes[i].op.is_relu)
    return out


def one(P: int, mode: str, limit: float, threads: int, max_layers: int) -> dict:
    """``crown_job`` on P ranks (this process is rank 0 at P = 1)."""
    from complete_verifier_ext.parallel import launch

    return launch.run(crown_job, P, (limit, threads, max_layers, mode), backend="gloo", timeout_s=7200)


def table(runs: list[dict], command: str, prov: dict) -> str:
    """The markdown table of ``runs`` (one per P and mode), against the first P = 1 run."""
    base = next((r for r in runs if r["P"] == 1), None)
    lines = [
        "# CROWN on the CIFAR-100 ResNet-large shape (15.4M parameters)",
        "",
        f"`{command}` at {prov.get('commit', '?')}; chunk picked from the memory available "
        "(`solver.crown.batch_size: 0`).",
        "",
    ]
    for e in prov.get("earlier", []):
        lines += [f"Runs from `{e['file']}`: `{e['command']}` at {e['commit']}.", ""]
    lines += [
        "| P | mode | threads/rank | layers done | time s | peak MB per rank | × P=1 | last layer "
        "| max rel. diff to P=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        peak = max(r["peak_mb"])
        ratio = f"{peak / max(base['peak_mb']):.2f}" if base and base is not r else "-"
        diff = "-"
        if base and base is not r and base["last_layer"][0] == r["last_layer"][0]:
            ref = np.array(base["last_layer"][1] + base["last_layer"][2])
            val = np.array(r["last_layer"][1] + r["last_layer"][2])
            diff = f"{float(np.max(np.abs(val - ref) / np.maximum(np.abs(ref), 1e-9))):.1e}"
        done = f"{len(r['layers'])}/{r['pre_activation_layers']}" + (" + output" if r.get("done") else "")
        per_rank = "/".join(f"{p:.0f}" for p in r["peak_mb"])
        lines.append(
            f"| {r['P']} | {r['mode']} | {r['threads']} | {done} | {r['time_s']:.0f} | {per_rank} | "
            f"{ratio} | {r['last_layer'][0]} | {diff} |"
        )
    lines += ["", "Per layer (first run):", "", "| layer | neurons | bounded | done at s | peak MB so far |"]
    lines += ["|---|---|---|---|---|"]
    for row in runs[0]["layers"]:
        lines.append(
            f"| {row['node']} | {row['neurons']} | {row['bounded']} | {row['s']:.0f} | "
            f"{max(row['peak_mb']):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--specs", type=int, default=2)
    ap.add_argument("--crown", action="store_true")
    ap.add_argument("--ranks", default="1")
    ap.add_argument("--mode", default="fsdp")
    ap.add_argument("--layers", type=int, default=10**6, help="stop after this many layers")
    ap.add_argument("--limit", type=float, default=1500)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per rank")
    ap.add_argument("--exact", action="store_true", help="EXACT_MEMORY_ENV (exact peaks, slower)")
    ap.add_argument("--name", default="crown_layers")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "scale" / "resnet_large"))
    ap.add_argument("--against", nargs="*", default=[], help="earlier NAME.json files whose runs come first")
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import json

        P, mode, limit, threads, layers = args.one
        print(json.dumps(one(int(P), mode, float(limit), int(threads), int(layers))))
        return
    if args.crown:
        import json
        import os
        import subprocess
        import sys

        from measure import provenance

        ensure(n_specs=1)
        env = {**os.environ, **(EXACT_MEMORY_ENV if args.exact else {})}
        earlier = [json.loads(Path(f).read_text()) for f in args.against]
        runs = []
        for r in (r for e in earlier for r in e["runs"]):  # a file may repeat an earlier file's runs
            runs += [r] if r not in runs else []
        for P in (int(p) for p in args.ranks.split(",")):
            cmd = [sys.executable, __file__, "--one", str(P), args.mode, str(args.limit), str(args.threads)]
            out = subprocess.run([*cmd, str(args.layers)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                continue
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[-1]
            print(f"P={P}: {len(r['layers'])} layers, {r['time_s']:.0f} s, peak {r['peak_mb']}")
        prov = provenance()
        if earlier:
            pairs = zip(args.against, earlier, strict=True)
            prov["earlier"] = [{"file": Path(f).name, **e["provenance"]} for f, e in pairs]
        folder = Path(args.results)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{args.name}.json").write_text(json.dumps({"provenance": prov, "runs": runs}, indent=1))
        command = "python resnet_large.py " + " ".join(sys.argv[1:])
        (folder / f"{args.name}.md").write_text(table(runs, command, prov))
        return
    folder = Path(args.out)
    path, n_params = build(folder / "cifar100_resnet_large_shape.onnx")
    paths = specs(path, folder, args.specs)
    print(f"{path}: {n_params / 1e6:.1f}M parameters; specs: {', '.join(p.name for p in paths)}")


if __name__ == "__main__":
    main()
