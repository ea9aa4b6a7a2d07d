"""One GPU, P = 1: both engines' CUDA path against the CPU and against auto_LiRPA on the same GPU.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/gpu_check.py \\
        [--sizes 1024 2048] [--commit SHA] [--out benchmarks/results/gpu_check]

Made to run as one short script on a lent GPU machine (no network there: ``../shared`` and the wheels
that α,β-CROWN imports travel with it). Three parts, each of which records an error instead of
stopping the others:

1. **Bounds and memory** on the TP/FSDP paper's MLPs 784 -> h^4 -> 10 (``measure.wide_mlp``,
   ε = 0.02, 9 clauses): our CROWN and α-CROWN (20 iterations, lr 0.1, no early stop) on ``cuda`` and
   on the CPU, and auto_LiRPA (the copy α,β-CROWN pins) on the same GPU with the same weights, box,
   rows and iterations. Peak: ``torch.cuda.max_memory_allocated`` above the level after loading
   (``PeakMemory``: exact for live tensors), one engine at a time. Soundness: 100000 random points of
   the box through the model on the GPU, no clause below its lower bound.
2. **The CLI on cuda**, native engine: the bundled example (also with two ranks on the one GPU) and two
   mnist_fc instances (one ``unsat``, one ``sat``), verdicts against α,β-CROWN's.
3. **The plugin on cuda** (``general.engine: abcrown``, α-CROWN then BaB) on the same two instances,
   and on the CPU: verdicts; CROWN and α-CROWN alone on mnist-net_256x4 prop_0_0.05, bounds against
   the CPU's.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from measure import REPO, max_rel_diff, provenance

SHARED = Path(os.environ.get("CVE_SHARED", REPO.parent / "shared"))
ITERS, LR = 20, 0.1
PARTS = ["bounds", "cli", "search"]
INSTANCES = [("mnist-net_256x2", "prop_0_0.03", "unsat"), ("mnist-net_256x2", "prop_1_0.03", "sat")]
# the native engine's complete phase on cuda: (config, benchmark, model, spec, α,β-CROWN's verdict)
SEARCHES = [
    ("mnist_fc.yaml", "mnist_fc", "mnist-net_256x6.onnx", "prop_7_0.03.vnnlib", "unsat"),  # ReLU BaB
    ("mnist_fc.yaml", "mnist_fc", "mnist-net_256x4.onnx", "prop_3_0.05.vnnlib", "unsat"),  # + refinement
    ("acasxu.yaml", "acasxu", "ACASXU_run2a_1_1_batch_2000.onnx", "prop_5.vnnlib", "unsat"),  # input split
    ("acasxu.yaml", "acasxu", "ACASXU_run2a_1_5_batch_2000.onnx", "prop_2.vnnlib", "sat"),
]
BOUNDS_YAML = """general:
  device: {device}
  complete_verifier: skip
solver:
  alpha-crown:
    iteration: 20
attack:
  pgd_order: skip
"""
PLUGIN_YAML = """general:
  device: {device}
  complete_verifier: bab
solver:
  batch_size: 64
  alpha-crown:
    iteration: 20
  beta-crown:
    iteration: 10
bab:
  timeout: 120
attack:
  pgd_order: middle
"""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def ours(h: int, method: str, device: str) -> dict:
    from measure import wide_mlp

    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown
    from complete_verifier_ext.parallel.memory import PeakMemory

    g, box, C = wide_mlp(h, 4)
    g.to(device)
    box, C = (box[0].to(device), box[1].to(device)), C.to(device)
    pm = PeakMemory(device)
    pm.start()

    def run():
        lb, state = crown(g, box, C)
        if method == "alpha":
            lb, _ = alpha_crown(
                g, box, C, state, AlphaOptions(iteration=ITERS, lr_alpha=LR, early_stop=False)
            )
        return lb

    lb, wall = _timed(run)
    return {"peak_mb": pm.peak_mb(), "time_s": wall, "lb": lb[0].tolist()}


def auto_lirpa(h: int, method: str, device: str) -> dict:
    from complete_verifier_ext.abcrown_plugin import locate

    if "auto_LiRPA" not in sys.modules:
        locate.activate(locate.find())
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm
    from measure import wide_mlp
    from scale import torch_model

    from complete_verifier_ext.parallel.memory import PeakMemory

    g, box, C = wide_mlp(h, 4)
    model = torch_model(g, None).to(device)
    box, C = (box[0].to(device), box[1].to(device)), C.to(device)
    opts = {"optimize_bound_args": {"iteration": ITERS, "lr_alpha": LR, "early_stop_patience": ITERS + 1}}
    bm = BoundedModule(model, torch.zeros_like(box[0]), bound_opts={**opts, "verbosity": 0}, device=device)
    x = BoundedTensor((box[0] + box[1]) / 2, PerturbationLpNorm(x_L=box[0], x_U=box[1]))
    pm = PeakMemory(device)
    pm.start()
    name = "CROWN-Optimized" if method == "alpha" else "CROWN"
    (lb, _), wall = _timed(lambda: bm.compute_bounds(x=(x,), C=C[None], method=name, bound_upper=False))
    return {"peak_mb": pm.peak_mb(), "time_s": wall, "lb": lb[0].tolist()}


def sampled_violations(h: int, lb: list[float], device: str, n: int = 100_000) -> dict:
    """Random points of the box through the model on the GPU: the smallest value of each clause, and
    how many clauses fall below their lower bound."""
    from measure import wide_mlp
    from scale import torch_model

    g, box, C = wide_mlp(h, 4)
    model = torch_model(g, None).to(device)
    lo, hi = box[0].to(device), box[1].to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        x = lo + (hi - lo) * torch.rand(n, lo.shape[-1], generator=gen, device=device)
        values = model(x) @ C.to(device).T  # (n, clauses)
    least = values.min(0).values.tolist()
    return {"min_sampled": least, "violations": sum(v < b for v, b in zip(least, lb, strict=True))}


def bounds_part(sizes: list[int], device: str) -> list[dict]:
    rows = []
    for h in sizes:
        for method in ("crown", "alpha"):
            row: dict = {"model": f"{h}x4", "method": method}
            for key, fn, args in (
                ("ours_cuda", ours, (h, method, device)),
                ("ours_cpu", ours, (h, method, "cpu")),
                ("auto_lirpa_cuda", auto_lirpa, (h, method, device)),
            ):
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                row[key] = _attempt(fn, *args)
            if "lb" in row["ours_cuda"]:
                row["sampling"] = _attempt(sampled_violations, h, row["ours_cuda"]["lb"], device)
            print(json.dumps(row)[:400], flush=True)
            rows.append(row)
    return rows


def _attempt(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # a benchmark records what failed and goes on
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}


def cli(tmp: Path, args: list[str], env: dict | None = None) -> dict:
    out = tmp / f"run{len(list(tmp.glob('run*')))}"
    out.mkdir()
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", *args]
    cmd += ["--summary", str(out / "s.json"), "--general.results_file", str(out / "out.txt")]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=out)
    wall = time.perf_counter() - t0
    res = {"rc": p.returncode, "wall_s": round(wall, 1)}
    if (out / "s.json").exists():
        s = json.loads((out / "s.json").read_text())
        res.update(verdict=s.get("verdict"), bounds=s.get("bounds"), peak_mb=s.get("peak_mb"))
    if p.returncode != 0:
        res["stderr"] = p.stderr[-1500:]
    return res


def cli_part(tmp: Path, device: str) -> list[dict]:
    mnist = SHARED / "benchmarks" / "mnist_fc"
    example = ["--config", str(REPO / "configs" / "example.yaml"), "--general.device", device]
    rows = [{"run": f"native example.yaml {device}", "expected": "unsat", **cli(tmp, example)}]
    # two ranks on one GPU: what a user with fewer GPUs than ranks gets
    two = ["--parallel.mode", "fsdp", "--parallel.world_size", "2"]
    rows.append(
        {"run": f"native example.yaml P=2 {device}", "expected": "unsat", **cli(tmp, [*example, *two])}
    )
    plugin_env = {
        **os.environ,
        "ABCROWN_PATH": os.environ.get("ABCROWN_PATH", str(SHARED / "vendor/alpha-beta-CROWN")),
    }
    for net, prop, expected in INSTANCES:
        spec = [
            "--model.onnx_path",
            str(mnist / "onnx" / f"{net}.onnx"),
            "--specification.vnnlib_path",
            str(mnist / "vnnlib" / f"{prop}.vnnlib"),
        ]
        native = cli(
            tmp, ["--config", str(REPO / "configs" / "mnist_fc.yaml"), *spec, "--general.device", device]
        )
        rows.append({"run": f"native {net} {prop} {device}", "expected": expected, **native})
        for where in (device, "cpu"):
            cfg = tmp / f"plugin_{where}.yaml"
            cfg.write_text(PLUGIN_YAML.format(device=where))
            r = cli(tmp, ["--config", str(cfg), "--general.engine", "abcrown", *spec], env=plugin_env)
            rows.append({"run": f"plugin {net} {prop} {where}", "expected": expected, **r})
        for row in rows[-3:]:
            print(json.dumps(row)[:400], flush=True)
    spec = ["--model.onnx_path", str(mnist / "onnx" / "mnist-net_256x4.onnx")]
    spec += ["--specification.vnnlib_path", str(mnist / "vnnlib" / "prop_0_0.05.vnnlib")]
    for where in (device, "cpu"):  # CROWN and α-CROWN alone, on cuda and on the CPU
        cfg = tmp / f"bounds_{where}.yaml"
        cfg.write_text(BOUNDS_YAML.format(device=where))
        r = cli(tmp, ["--config", str(cfg), "--general.engine", "abcrown", *spec], env=plugin_env)
        rows.append({"run": f"plugin bounds 256x4 prop_0_0.05 {where}", "expected": "-", **r})
        print(json.dumps(rows[-1])[:400], flush=True)
    return rows


def search_part(tmp: Path, device: str) -> list[dict]:
    """The native engine's BaB, refinement and input split on ``device`` and on the CPU."""
    rows = []
    for config, bench, model, spec, expected in SEARCHES:
        args = ["--config", str(REPO / "configs" / config)]
        args += ["--model.onnx_path", str(SHARED / "benchmarks" / bench / "onnx" / model)]
        args += ["--specification.vnnlib_path", str(SHARED / "benchmarks" / bench / "vnnlib" / spec)]
        args += ["--general.csv_name", "null", "--bab.timeout", "120"]
        for where in (device, "cpu"):
            r = cli(tmp, [*args, "--general.device", where])
            name = f"native {Path(model).stem} {Path(spec).stem} {where}"
            rows.append({"run": name, "expected": expected, **r})
            print(json.dumps(rows[-1])[:400], flush=True)
    return rows


def _diff(a: dict, b: dict) -> str:
    return f"{max_rel_diff(a['lb'], b['lb']):.1e}" if "lb" in a and "lb" in b else "–"


def tables(bounds: list[dict], runs: list[dict]) -> str:
    out = [
        "| model | method | ours cuda MB | auto_LiRPA cuda MB | ours × auto_LiRPA | ours s | auto_LiRPA s | "
        "ours cuda vs cpu (rel) | ours vs auto_LiRPA (rel) | sampled clauses below bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bounds:
        o, a, c = r["ours_cuda"], r["auto_lirpa_cuda"], r["ours_cpu"]
        if "error" in o or "error" in a:
            out.append(
                f"| {r['model']} | {r['method']} | {o.get('error', '')} | {a.get('error', '')} |||||||"
            )
            continue
        viol = r.get("sampling", {}).get("violations", r.get("sampling", {}).get("error"))
        out.append(
            f"| {r['model']} | {r['method']} | {o['peak_mb']:.1f} | {a['peak_mb']:.1f} | "
            f"{o['peak_mb'] / a['peak_mb']:.2f} | {o['time_s']:.3f} | {a['time_s']:.3f} | {_diff(o, c)} | "
            f"{_diff(o, a)} | {viol} |"
        )
    out += [
        "",
        "| run | expected | verdict | rc | wall s | peak MB | bounds vs the CPU run (rel) |",
        "|---|---|---|---|---|---|---|",
    ]
    cpu = {r["run"].rsplit(" ", 1)[0]: r for r in runs if r["run"].endswith(" cpu")}
    for r in runs:
        diff = ""
        ref = cpu.get(r["run"].rsplit(" ", 1)[0]) if r["run"].endswith(" cuda") else None
        if ref and r.get("bounds") and ref.get("bounds"):
            diff = ", ".join(
                f"{k} {max_rel_diff(r['bounds'][k], ref['bounds'][k]):.1e}"
                for k in ("crown", "alpha_crown")
                if r["bounds"].get(k) and ref["bounds"].get(k)
            )
        verdict = r.get("verdict") or r.get("stderr", "").strip().splitlines()[-1:]
        out.append(
            f"| {r['run']} | {r['expected']} | {verdict} | {r['rc']} | {r['wall_s']} | "
            f"{r.get('peak_mb')} | {diff} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    ap.add_argument("--commit", help="the commit (where the tree travelled without .git)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check"))
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    meta["commit"] = a.commit or meta["commit"]
    meta["gpu"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "no GPU (dry run)"
    meta["torch"] = torch.__version__
    torch.manual_seed(0)
    bounds = bounds_part(a.sizes, a.device) if "bounds" in a.parts else []
    (out / "gpu_check.json").write_text(json.dumps({**meta, "bounds": bounds}, indent=1))
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for part, fn in (("cli", cli_part), ("search", search_part)):
            if part in a.parts:
                runs += fn(Path(d), a.device)
                record = {**meta, "bounds": bounds, "runs": runs}
                (out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    md = [
        f"# Both engines on one GPU ({meta['gpu']}, torch {meta['torch']}), P = 1",
        "",
        f"Commit `{meta['commit']}`; command `{meta['command']}`; {meta['machine']}. See the script's "
        f"docstring: MLPs 784 -> h^4 -> 10, ε = 0.02, 9 clauses, α-CROWN {ITERS} iterations at lr {LR}; "
        "peak = `torch.cuda.max_memory_allocated` above the level after loading.",
        "",
        tables(bounds, runs),
    ]
    (out / "gpu_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
