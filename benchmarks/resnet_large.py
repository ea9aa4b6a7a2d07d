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
    python benchmarks/resnet_large.py --crown [--limit 1500] [--threads 2] [--results DIR]

``--crown`` runs our CROWN sweep (intermediate bounds of every layer, then the output) at P = 1 on the
first spec, one process (without ``MALLOC_MMAP_THRESHOLD_``, whose page faults double the time here: the peak
RSS is then an upper bound of the live tensors), and records per layer the neurons bounded, the
time and the peak RSS so far; it stops at ``--limit`` seconds (then the table says how far it got).
``benchmarks/scale.py --models resnet_large`` measures auto_LiRPA on the same files.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from complete_verifier_ext.examples.resnet import CLASSES, build

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


class _OutOfTime(Exception):
    pass


def crown_layers(limit: float, threads: int) -> dict:
    """Our CROWN sweep on the first spec with a progress record per layer (see the module docstring)."""
    from complete_verifier_ext.bounds.crown import final_bounds, sweep
    from complete_verifier_ext.config import Config
    from complete_verifier_ext.model.onnx_loader import load_onnx
    from complete_verifier_ext.parallel.memory import PeakMemory
    from complete_verifier_ext.spec import load_vnnlib
    from complete_verifier_ext.verify import crown_chunk

    torch.set_num_threads(threads)
    path, specs = ensure(n_specs=1)
    g = load_onnx(path)
    region = load_vnnlib(specs[0]).regions[0]
    box = tuple(torch.tensor(b, dtype=torch.float32).view(1, *SHAPE) for b in (region.lower, region.upper))
    C = torch.tensor(np.concatenate([c.C for c in region.clauses]), dtype=torch.float32)
    chunk = crown_chunk(Config(), g)
    pm = PeakMemory(torch.device("cpu"))
    pm.start()
    t0 = time.perf_counter()
    layers: list[dict] = []

    def on_layer(k: int, rows: int) -> None:
        n = int(np.prod(g.nodes[k].shape))
        t = time.perf_counter() - t0
        layers.append(
            {"node": g.nodes[k].name, "neurons": n, "bounded": rows, "s": t, "peak_mb": pm.peak_mb()}
        )
        print(f"{g.nodes[k].name}: {rows}/{n} neurons, {t:.0f} s, peak {pm.peak_mb():.0f} MB", flush=True)
        if t > limit:
            raise _OutOfTime

    out = {"chunk": chunk, "threads": threads, "limit_s": limit, "layers": layers}
    with torch.no_grad():
        try:
            state = sweep(g, box, chunk=chunk, on_layer=on_layer)
            lb, _ = final_bounds(g, state, box, C)
            out.update(done=True, lb_worst=float(lb.min()), time_s=time.perf_counter() - t0)
        except _OutOfTime:
            out.update(done=False, time_s=time.perf_counter() - t0)
    out["peak_mb"] = pm.peak_mb()
    out["pre_activation_layers"] = sum(1 for i in range(1, len(g.nodes)) if g.nodes[i].op.is_relu)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--specs", type=int, default=2)
    ap.add_argument("--crown", action="store_true")
    ap.add_argument("--limit", type=float, default=1500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "scale" / "resnet_large"))
    args = ap.parse_args()
    if args.crown:
        import json

        from measure import provenance

        res = {"provenance": provenance(), **crown_layers(args.limit, args.threads)}
        folder = Path(args.results)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "crown_layers.json").write_text(json.dumps(res, indent=1))
        return
    folder = Path(args.out)
    path, n_params = build(folder / "cifar100_resnet_large_shape.onnx")
    paths = specs(path, folder, args.specs)
    print(f"{path}: {n_params / 1e6:.1f}M parameters; specs: {', '.join(p.name for p in paths)}")


if __name__ == "__main__":
    main()
