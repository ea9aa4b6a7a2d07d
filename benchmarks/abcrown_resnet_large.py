"""The plugin at the TP/FSDP paper's scale: α,β-CROWN's own ``vnncomp24/cifar100.yaml`` on the CIFAR-100
ResNet-large shape, unpatched against ``engine: abcrown`` at P = 1 and with fsdp and tp at P = 2 and 4.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_resnet_large.py \\
        [--divide 8] [--worlds 2 4] [--modes fsdp tp] [--out benchmarks/results/abcrown_resnet_large]

The model is ``resnet_large.py``'s shape (a CIFAR ResNet18: 16 + 1 convolutions in four stages, a
512-wide fully connected layer, 100 classes, BatchNorm folded) with its channels and the fully connected
width divided by ``--divide``: the same depth and operators. On this machine's 2 cores the full width
does not fit the time of a benchmark (our own CROWN sweep of it alone takes 3000 s at P = 1,
``resnet_large.py``), so the table says which width it ran. The config is α,β-CROWN's
``exp_configs/vnncomp24/cifar100.yaml`` as a user would run it here: ``root_path`` / ``csv_name`` dropped,
``device: cpu``, and only the incomplete phase (``complete_verifier: skip``, ``pgd_order: skip``: the BaB of
a random ResNet and the attack are not what sharding changes); its α-CROWN settings (20 iterations,
lr 0.25, ``full_conv_alpha: false``, ``merge_bn``), patches mode and batch size kept, and
``solver.bound_prop_method`` = ``--method``. What fits this machine (24 GB, 2 cores): with ``--method
alpha-crown`` unpatched α,β-CROWN is killed for memory (24 GB) on the model of 1/8 the width, so the
default is the stage before it, CROWN over every layer (``crown``). The model has no normalisation
nodes: with the ``Sub`` / ``Div`` of ``resnet_large.py``'s model first, unpatched α,β-CROWN stops in
patches mode (auto_LiRPA's ``concretize_bounds.add_b``: "The size of tensor a (8192) must match the
size of tensor b (32)"). Spec: ε = 1/255
around a random image, the model's label against the other 99 (``resnet_large.specs``).

Runs: unpatched α,β-CROWN (its own ``abcrown.py``, as ``abcrown_overhead.py`` runs it: wall time and
verdict), then the plugin at P = 1 on the config as it is (α,β-CROWN with no sharding patch: the base
of the floor, the × P = 1 and the bounds columns) and at every P and mode, each its own ``abcrown``
process (``abcrown_plugin_memory.run_one``) with ``parallel.threads`` = cores / P (every run on the
whole machine, as unpatched α,β-CROWN): per-rank peak of the incomplete phase, wall time, and the bounds
against P = 1. Floor: P = 1's peak / P + the largest layer (a shard of it under tp): the ranks deal each
layer's rows (a conv layer or residual sum bounded with dense patches: whole channels, one pass per
rank where P = 1 makes one). Writes ``abcrown_resnet_large.{json,md,png}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml
from abcrown_common import checkout, threads, vendor_config
from abcrown_overhead import run_unpatched
from abcrown_plugin_memory import rel_diff, run_one
from measure import REPO, provenance

from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

CIFAR100 = "vnncomp24/cifar100.yaml"
TIMEOUT_S = 100000  # bab.timeout: α-CROWN runs all its iterations (see config)


def config(checkout: Path, plugin: bool, method: str, double: bool = False) -> str:
    """α,β-CROWN's cifar100 config, made runnable here (see the module docstring); ``double``: in
    float64 (α,β-CROWN's ``general.double_fp``)."""
    cfg = vendor_config(checkout, CIFAR100)
    cfg["general"].update(complete_verifier="skip", **({"engine": "abcrown"} if plugin else {}))
    if double:
        cfg["general"]["double_fp"] = True
    cfg.setdefault("attack", {})["pgd_order"] = "skip"
    cfg.setdefault("solver", {})["bound_prop_method"] = method
    # α-CROWN stops after solver.alpha-crown.max_time (1.0) x bab.timeout (360 s by default) of
    # optimisation: on this machine a stage near 360 s would end after fewer iterations in the slower
    # runs, and the bounds would compare unequal stages
    cfg.setdefault("bab", {})["timeout"] = TIMEOUT_S
    return yaml.safe_dump(cfg, sort_keys=False)


ROUNDING = "plugin, oneDNN off"


@contextlib.contextmanager
def onednn_off(tmp: Path):
    """Every Python process started inside runs with ``torch.backends.mkldnn.enabled = False`` (a
    ``sitecustomize`` on ``PYTHONPATH``): convolutions by torch's own kernels, the same sums in another
    order, so the run differs from P = 1 by float rounding alone."""
    site = tmp / "onednn_off"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import torch\ntorch.backends.mkldnn.enabled = False\n")
    was = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *([was] if was else [])])
    try:
        yield
    finally:
        if was is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = was


def table(rows: list[dict], against: dict | None = None) -> str:
    """The table; ``against``: the plugin's P = 1 row of another run (``--against``), a last column."""
    last = " bounds vs `--against` P = 1 (rel) |" if against else ""
    out = [
        "| run | P | peak MB per rank (max) | × P = 1 | floor MB | × floor | wall s | × unpatched | "
        f"bounds vs P = 1 (rel) |{last}",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if against else ""),
    ]
    p1 = next((r for r in rows if r["run"] == "plugin" and r["P"] == 1 and "peak_mb" in r), None)
    unpatched = next((r for r in rows if r["run"] == "unpatched abcrown.py" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            out.append(f"| {r['run']} | {r['P']} | {r['error']} | | | | | | |")
            continue
        wall = f"{r['wall_s']:.1f} | " + (f"{r['wall_s'] / unpatched['wall_s']:.2f}" if unpatched else "")
        if "peak_mb" not in r:  # unpatched abcrown.py: its time and verdict only
            out.append(f"| {r['run']} | 1 | – | | | | {wall} | verdict {r['verdict']} |")
            continue
        peak, floor, ratio, diff = max(r["peak_mb"]), "| ", "", ""
        if p1 is not None and r["P"] > 1:
            block = r["layer_mb"] / (r["P"] if r["mode"] == "tp" else 1)
            f = max(p1["peak_mb"]) / r["P"] + block
            floor = f"{f:.0f} | {peak / f:.2f}"
        if p1 is not None:
            ratio = f"{peak / max(p1['peak_mb']):.2f}"
            diff = f"{rel_diff(p1['lb'], r['lb']):.1e}" if r.get("lb") else ""
        name = f"{r['run']} {r['mode']}".strip()
        other = ""
        if against:
            other = f" {rel_diff(against['lb'], r['lb']):.1e} |" if r.get("lb") else " |"
        out.append(f"| {name} | {r['P']} | {peak:.0f} | {ratio} | {floor} | {wall} | {diff} |{other}")
    return "\n".join(out)


def instance(folder: Path, divide: int) -> tuple[str, str, float]:
    """The width-reduced model, its first spec, and its largest weight in MB (the fsdp block)."""
    import onnx
    import resnet_large
    from onnx import numpy_helper

    from complete_verifier_ext.examples.resnet import STAGES, build

    path = folder / f"resnet_large_div{divide}.onnx"
    build(path, stages=tuple(c // divide for c in STAGES), fc=512 // divide, normalise=False)
    spec = resnet_large.specs(path, folder, 1)[0]
    largest = max(numpy_helper.to_array(t).nbytes for t in onnx.load(str(path)).graph.initializer)
    return str(path), str(spec), largest / 2**20


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = next((r for r in rows if r["run"] == "plugin" and r["P"] == 1 and "peak_mb" in r), None)
    unpatched = next((r for r in rows if r["run"] == "unpatched abcrown.py" and "error" not in r), None)
    for mode in ("fsdp", "tp"):
        pts = sorted(
            (r["P"], max(r["peak_mb"]), r["wall_s"])
            for r in rows
            if "peak_mb" in r and r["mode"] in (mode, "") and r["run"] == "plugin"
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"plugin {mode}")
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"plugin {mode}")
    ps = sorted({r["P"] for r in rows})
    if base is not None:
        b = max(base["peak_mb"])
        ax.plot(ps, [b / p + (base["layer_mb"] if p > 1 else 0) for p in ps], "k--", label="floor (fsdp)")
    if unpatched is not None:
        ax2.axhline(unpatched["wall_s"], color="grey", linestyle=":", label="unpatched abcrown.py")
    ax.set_ylabel("peak MB per rank (incomplete phase)")
    ax2.set_ylabel("wall s (whole run)")
    for a in (ax, ax2):
        a.set_xlabel("ranks P")
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def reused(path: str | None, text: str, divide: int) -> tuple[list[dict], str]:
    """The rows of an earlier run of the same config and shape, each marked with its commit, and a
    sentence for the table's header saying which they are."""
    if not path:
        return [], ""
    earlier = json.loads(Path(path).read_text())
    if earlier.get("config") != text or earlier.get("divide", divide) != divide:
        sys.exit(f"--reuse {path}: that run had another config or --divide")
    rows = [{**r, "commit": earlier["commit"]} for r in earlier["rows"]]
    names = ", ".join(f"{r['run']} {r['mode']} P = {r['P']}".replace("  ", " ") for r in rows)
    return rows, f" Rows from the run of commit `{earlier['commit']}` (`--reuse`): {names}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--divide", type=int, default=8, help="channels and fc width divided by this")
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--modes", nargs="+", default=["fsdp", "tp"])
    ap.add_argument("--method", choices=["crown", "alpha-crown"], default="crown")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_resnet_large"))
    ap.add_argument("--double", action="store_true", help="every run in float64 (general.double_fp)")
    ap.add_argument("--no-unpatched", action="store_true", help="leave out the unpatched abcrown.py run")
    ap.add_argument("--against", help="this script's JSON of another run (e.g. float32 against --double): "
                    "a column of every row's bounds against its plugin P = 1 row")  # fmt: skip
    ap.add_argument("--rounding", action="store_true", help="one more P = 1 run with oneDNN off in every "
                    "process: the same arithmetic summed in another order (rounding alone)")  # fmt: skip
    ap.add_argument("--reuse", help="this script's JSON of an earlier run (same config and --divide): its "
                    "rows are kept and only the runs it lacks are run")  # fmt: skip
    a = ap.parse_args()
    root = checkout()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    text = config(root, plugin=True, method=a.method, double=a.double)
    against = None
    if a.against:
        other = json.loads(Path(a.against).read_text())
        against = next(r for r in other["rows"] if r["run"] == "plugin" and r["P"] == 1 and r.get("lb"))
    rows, note = reused(a.reuse, text, a.divide)
    have = {(r["run"], r["P"], r["mode"]) for r in rows}

    def save() -> None:  # after every run: the JSON holds each row the table shows
        record = {**meta, "config": text, "divide": a.divide, "rows": rows}
        (out / "abcrown_resnet_large.json").write_text(json.dumps(record))

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx_path, spec, layer_mb = instance(tmp, a.divide)
        plain = tmp / "cifar100_unpatched.yaml"
        plain.write_text(config(root, plugin=False, method=a.method, double=a.double))
        if ("unpatched abcrown.py", 1, "") not in have and not a.no_unpatched:
            inst = {"config": str(plain), "onnx": onnx_path, "vnnlib": spec}
            r = run_unpatched(inst, tmp, EXACT_MEMORY_ENV, a.timeout, TIMEOUT_S)  # as the plugin's runs
            rows.append({**r, "run": "unpatched abcrown.py", "P": 1, "mode": ""})
            print(json.dumps(rows[-1]), flush=True)
            save()
        runs = [("plugin", 1, "", text)] + ([(ROUNDING, 1, "", text)] if a.rounding else [])
        runs += [("plugin", P, m, text) for m in a.modes for P in a.worlds]
        for name, P, mode, cfg in (r for r in runs if r[:3] not in have):
            method = "alpha" if a.method == "alpha-crown" else "crown"
            with onednn_off(tmp) if name == ROUNDING else contextlib.nullcontext():
                r = run_one(
                    "abcrown",
                    method,
                    onnx_path,
                    spec,
                    P,
                    None,
                    tmp,
                    a.timeout,
                    mode or "fsdp",
                    cfg,
                    threads(P),
                )
            rows.append({**r, "run": name, "P": P, "mode": mode, "layer_mb": layer_mb})
            print(json.dumps(rows[-1])[:300], flush=True)
            save()
    save()  # (also when every row came from --reuse)
    md = [
        f"# α,β-CROWN's vnncomp24/cifar100.yaml ({a.method}), ResNet-large shape (channels / {a.divide})",
        "",
        f"Commit `{meta['commit']}`; command `{meta['command']}`; {meta['machine']}, gloo; α,β-CROWN from "
        "`$ABCROWN_PATH`. One process per measurement, `MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`. "
        "Config: the vendor "
        "file less `root_path` / `csv_name`, with `device: cpu`, `complete_verifier: skip`, `pgd_order: "
        "skip` (the JSON has it whole). Peak: per-rank high-water mark of the incomplete phase above its "
        "start, code pages and torch's optimizer libraries left out. × P = 1 and the bounds: against the "
        "plugin at P = 1 on the config as it is (no patch: unpatched α,β-CROWN's memory), which bounds each "
        "conv layer in one pass. Floor: that peak / P + the largest layer "
        f"({layer_mb:.2f} MB; a shard of it under tp). Threads: cores / P per rank (unpatched: torch's "
        "default, the cores). Wall: the whole process, unpatched α,β-CROWN under the same malloc "
        f"settings. `bab.timeout: {TIMEOUT_S}`: α-CROWN's time limit (1.0 × it) never cuts its iterations "
        f"short.{note}"
        + (" Every run in float64 (`general.double_fp`)." if a.double else "")
        + (f" Last column: against the plugin's P = 1 row of `{a.against}`." if a.against else "")
        + (
            f" `{ROUNDING}`: P = 1 with `torch.backends.mkldnn.enabled = False` in every process (torch's "
            "own convolution kernels: the same arithmetic, summed in another order)."
            if a.rounding
            else ""
        ),
        "",
        table(rows, against),
    ]
    (out / "abcrown_resnet_large.md").write_text("\n".join(md) + "\n")
    plot(rows, out / "abcrown_resnet_large.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()
