"""Run one measurement in a fresh process (one mode per process, DESIGN.md) and read its JSON line;
the provenance every results file records."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from complete_verifier_ext.parallel.memory import EXACT_MEMORY_ENV

REPO = Path(__file__).resolve().parents[1]


def provenance() -> dict:
    """Commit, command and machine, recorded in every results file (the config is in the command, or
    the script's own constants)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "commit": commit.stdout.strip(),
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
    }


def max_rel_diff(lb: list[float], ref: list[float]) -> float:
    """Largest ``|lb - ref| / max(|ref|, 1e-9)`` over the rows: how far a bound list is from a reference."""
    return max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(lb, ref, strict=True))


def add_provenance(path: Path) -> None:
    """Add the provenance to a results JSON that another program wrote (an ``abcrown --summary``)."""
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "provenance": provenance()}, indent=1))


def spawn_json(script: str, args: list[str], timeout: float) -> dict | None:
    """``python SCRIPT --one ARGS...`` with ``EXACT_MEMORY_ENV`` set, so that RSS follows live
    tensors; returns the JSON object on its last stdout line, or None if it failed or timed out."""
    env = {**os.environ, **EXACT_MEMORY_ENV}
    cmd = [sys.executable, script, "--one", *args]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_summarized(cmd: list[str], cwd: Path, summary: Path, limit: float) -> dict:
    """A verifier command that writes ``--summary SUMMARY``, killed after ``limit`` s: its summary plus
    ``wall_s`` and ``stderr``, or ``{"error": ...}`` (the last line of its stderr)."""
    summary.unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"over {limit:.0f} s"}
    if out.returncode != 0 or not summary.exists():
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {**json.loads(summary.read_text()), "wall_s": time.monotonic() - t0, "stderr": out.stderr}


def warm_up(method: str, mode: str, world: int) -> None:
    """Our ``method`` (``crown`` / ``alpha``) once on a small MLP sharded like the measured model, so
    that torch's code pages for it are resident before the measurement starts (``PeakMemory`` leaves out
    code paged in during it, which reads low only for code paged in after the peak)."""
    import torch

    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown

    g, box, C = wide_mlp(64, 4)
    if world > 1:
        g.shard(mode)
    lb, state = crown(g, box, C)
    if method == "alpha":
        alpha_crown(g, box, C, state, AlphaOptions(iteration=2, early_stop=False))
    del g, lb, state, torch


def wide_mlp(h: int, d: int):
    """The TP/FSDP paper's MLP 784 -> h^d -> 10 (He-normal weights, seed 0), an input box of
    half-width 0.02 and the 9 margins of label 0: ``(graph, (lower, upper), C)``."""
    import torch

    from complete_verifier_ext.bounds.graph import Graph
    from complete_verifier_ext.bounds.ops import Input, Linear, Relu

    gen = torch.Generator().manual_seed(0)
    g = Graph(source=f"mlp784-{h}x{d}")
    g.add("input", Input(), (), (784,))
    sizes = [784] + [h] * d + [10]
    for i in range(len(sizes) - 1):
        W = torch.randn(sizes[i + 1], sizes[i], generator=gen) * (2.0 / sizes[i]) ** 0.5
        g.add(f"fc{i}", Linear(W, torch.zeros(sizes[i + 1])), (len(g.nodes) - 1,), (sizes[i + 1],))
        del W
        if i < len(sizes) - 2:
            g.add(f"relu{i}", Relu(), (len(g.nodes) - 1,), (sizes[i + 1],))
    x0 = torch.rand(1, 784, generator=gen)
    box = (x0 - 0.02, x0 + 0.02)
    C = torch.stack([torch.eye(10)[0] - torch.eye(10)[j] for j in range(1, 10)])
    return g, box, C
