"""β-CROWN BaB inside α,β-CROWN: per-rank peak memory of the BaB phase against the batch of domains
bounded per round, unpatched (P = 1) and with each round's domains split over P ranks.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_plugin_bab.py \
        [--batches 512 2048] [--worlds 2 4] [--rounds 10] [--out benchmarks/results/abcrown_plugin_bab]

The TP/FSDP paper's authors measured α,β-CROWN's BaB peak on mnist-net_256x6 (ε = 0.05, 10 rounds,
one GPU) at ≈ 21 MB + 0.373 MB per domain of the batch. Here: mnist-net_256x6 on prop_2_0.05 (open at
VNN-COMP 2022, so BaB runs its 10 rounds), kFSB, ``solver.batch_size`` B, ``bab.max_iterations``
rounds, PGD off, each measurement its own process with ``EXACT_MEMORY_ENV``. The peak is
each rank's RSS high-water mark during ``general_bab`` above the RSS when it starts (the summary's
``peak_mb_bab``). A least-squares fit peak = a + b·B/P over all runs is printed beside the paper's.
Writes ``abcrown_plugin_bab.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from abcrown_common import BENCH, REPO, checkout, run_abcrown, threads, vendor_config
from abcrown_resnet_large import CIFAR100
from measure import provenance

from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

MNIST = BENCH / "mnist_fc"
PAPER = "21 MB + 0.373 MB × B (one GPU, P = 1)"

YAML = """general:
  device: cpu
  complete_verifier: bab
solver:
  batch_size: {batch}
  alpha-crown:
    iteration: 20
  beta-crown:
    iteration: 10
bab:
  timeout: 100000
  max_iterations: {rounds}
attack:
  pgd_order: skip
"""


# how the weights are held during BaB at P > 1: (parallel.mode, parallel.bab_weights)
WEIGHTS = {
    "fsdp-replicated": ("fsdp", "replicated"),
    "fsdp-sharded": ("fsdp", "sharded"),
    "tp": ("tp", "sharded"),
}


# --wide H: the paper's wide MLP 784 -> H^4 -> 10 (random weights, every neuron open), where the weights
# are a large part of the BaB peak; α-CROWN and β-CROWN shortened so that a run takes minutes here
YAML_ITERATIONS = "  alpha-crown:\n    iteration: 20\n  beta-crown:\n    iteration: 10\n"
WIDE_ITERATIONS = "  alpha-crown:\n    iteration: 2\n  beta-crown:\n    iteration: 5\n"


def conv_config(batch: int, rounds: int, alpha_iterations: int | None) -> str:
    """α,β-CROWN's own ``vnncomp24/cifar100.yaml`` (kFSB, β-CROWN 10 iterations) as a user runs it here
    (``root_path`` / ``csv_name`` dropped, ``device: cpu``), with B domains a round, ``rounds`` BaB rounds,
    PGD off and, if given, fewer α-CROWN iterations (the search's peak does not depend on them)."""
    import yaml

    data = vendor_config(checkout(), CIFAR100)
    data["general"]["complete_verifier"] = "bab"
    data["solver"]["batch_size"] = batch
    if alpha_iterations:
        data["solver"]["alpha-crown"]["iteration"] = alpha_iterations
    data["bab"].update(timeout=100000, max_iterations=rounds)
    data["attack"] = {"pgd_order": "skip"}
    return yaml.safe_dump(data, sort_keys=False)


def run_one(
    batch: int,
    world: int,
    rounds: int,
    tmp: Path,
    timeout: float,
    weights: str,
    wide: int | None,
    conv: tuple[str, str] | None = None,
    alpha_iterations: int | None = None,
) -> dict:
    cfg = tmp / "bab.yaml"
    text = YAML.format(batch=batch, rounds=rounds)
    if conv:
        from conv_scale import instance

        path, where, layer_mb = instance(*conv)
        onnx, spec = str(path), str(where)
        text = conv_config(batch, rounds, alpha_iterations)
    elif wide:
        from abcrown_plugin_memory import make_instance

        onnx, spec = make_instance(tmp, wide)
        text = text.replace(YAML_ITERATIONS, WIDE_ITERATIONS)
    else:
        onnx = str(MNIST / "onnx" / "mnist-net_256x6.onnx")
        spec = str(MNIST / "vnnlib" / "prop_2_0.05.vnnlib")
    cfg.write_text(text)
    args = ["--config", str(cfg), "--onnx_path", onnx, "--vnnlib_path", spec]
    args += ["--results_file", str(tmp / "out.txt")]
    mode, held = WEIGHTS.get(weights, ("none", "auto"))
    args += ["--parallel.bab_weights", held] if world > 1 else []
    if conv:  # every run on the whole machine (the plugin's default leaves a core free)
        args += ["--parallel.threads", str(threads(world))]
    env = dict(EXACT_MEMORY_ENV)
    s = run_abcrown(args, tmp, timeout, world=world, env=env, mode=mode)
    if "error" in s:
        return s
    bab = s["bab"]
    return {
        "verdict": s["verdict"],
        "peak_mb_bab": s["peak_mb_bab"],
        "peak_mb": s["peak_mb"],
        "domains": bab["domains"],
        "bab_s": bab["time_s"],
        "domains_per_s": round(bab["domains"] / bab["time_s"], 1) if bab["time_s"] else None,
        "wall_s": s["wall_s"],
        "bab_weight_fetches": s.get("bab_weight_fetches"),
        **({"layer_mb": layer_mb} if conv else {}),
    }


def fit(rows: list[dict]) -> tuple[float, float] | None:
    """peak = a + b·B/P over the unpatched and fsdp-replicated runs."""
    fitted = [r for r in rows if "peak_mb_bab" in r and r["weights"] in ("unpatched", "fsdp-replicated")]
    pts = [(r["B"] / r["P"], max(r["peak_mb_bab"])) for r in fitted]
    if len({x for x, _ in pts}) < 2:
        return None
    x, y = np.array(pts).T
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    ap.add_argument("--wide", type=int, default=None, help="the MLP 784 -> H^4 -> 10 instead of mnist")
    ap.add_argument("--conv", help="a conv_scale.py shape (e.g. cnn7-c16-cifar) with vnncomp24/cifar100.yaml")
    ap.add_argument("--regime", default="certified", choices=["random", "certified", "certified-open"],
                    help="with --conv: a regime of conv_scale.py")  # fmt: skip
    ap.add_argument("--alpha-iterations", type=int, help="with --conv: α-CROWN's iterations before BaB")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_plugin_bab"))
    a = ap.parse_args()
    checkout()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    conv = (a.conv, a.regime) if a.conv else None
    name = f"abcrown_plugin_bab_wide{a.wide}" if a.wide else "abcrown_plugin_bab"
    model = f"the MLP 784-{a.wide}x4 (random weights, ε = 0.02)" if a.wide else "mnist-net_256x6, prop_2_0.05"
    if conv:
        name = f"abcrown_plugin_bab_{a.conv}_{a.regime}"
        model = (
            f"{a.conv} ({a.regime} regime of `conv_scale.py`), α,β-CROWN's `vnncomp24/cifar100.yaml` "
            f"(α-CROWN {a.alpha_iterations or 20} iterations), threads = cores / P"
        )
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for B in a.batches:
            runs = [(1, "unpatched")] + [(P, w) for P in a.worlds for w in a.weights]
            for P, w in runs:
                r = {
                    "B": B,
                    "P": P,
                    "weights": w,
                    **run_one(B, P, a.rounds, Path(d), a.timeout, w, a.wide, conv, a.alpha_iterations),
                }
                rows.append(r)
                print(json.dumps(r), flush=True)
                (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    base = {r["B"]: r for r in rows if r["P"] == 1 and "peak_mb_bab" in r}
    lines = [
        "| B (domains a round) | P | BaB weights | verdict | BaB peak MB per rank (max) | × P=1 "
        "| run peak MB per rank (max) | domains | domains/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['P']} | {r['weights']} | error: {r['error']} | | | | | | |")
            continue
        peak = max(r["peak_mb_bab"])
        ref = base.get(r["B"])
        ratio = f"{peak / max(ref['peak_mb_bab']):.2f}" if ref and max(ref["peak_mb_bab"]) > 0 else ""
        if ratio and "layer_mb" in r and r["P"] > 1:  # the floor: P = 1's peak / P + one layer (a shard: tp)
            floor = max(ref["peak_mb_bab"]) / r["P"] + r["layer_mb"] / (r["P"] if r["weights"] == "tp" else 1)
            ratio += f" ({peak / floor:.2f}× floor {floor:.0f} MB)"
        lines.append(
            f"| {r['B']} | {r['P']} | {r['weights']} | {r['verdict']} | {peak:.0f} | {ratio} | "
            f"{max(r['peak_mb']):.0f} | {r['domains']} | {r['domains_per_s']} | {r['wall_s']} |"
        )
    ab = None if a.wide or conv else fit(rows)  # one batch size on the wide MLP: nothing to fit
    md = [
        "# BaB inside alpha-beta-CROWN: peak per rank vs the batch of domains, domains split over ranks",
        "",
        f"Commit `{meta['commit']}`; command `{meta['command']}`; {meta['machine']}, gloo; "
        f"α,β-CROWN 8250d5f / auto_LiRPA 0.7.0 from `$ABCROWN_PATH`. "
        f"{model}, kFSB, {a.rounds} BaB rounds, "
        + ("α-CROWN 2 and β-CROWN 5 iterations, " if a.wide else "")
        + "PGD off; P = 1 is α,β-CROWN unpatched. Peak: RSS high-water mark of `general_bab` above its "
        "start, per rank; run peak: the whole run's. BaB weights: `fsdp-replicated` gathers every layer "
        "once when BaB starts; "
        "`fsdp-sharded` (whole layers) and `tp` (single shards) fetch them per use (`parallel.serve`).",
        "",
        *lines,
        "",
        (
            f"Fit over the unpatched and fsdp-replicated runs: peak ≈ {ab[0]:.1f} MB + {ab[1]:.3f} MB × B/P; "
            if ab
            else ""
        )
        + (
            "Floor: P = 1's BaB peak / P + the largest weight (a shard of it under tp)."
            if conv
            else f"The paper's authors: {PAPER}."
        )
        + (
            " On this MLP the weights are 57 MB whole: the unpatched run holds them before BaB starts, "
            "`fsdp-replicated` gathers them for the search (inside the BaB peak)."
            if a.wide
            else ""
        ),
    ]
    (out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
