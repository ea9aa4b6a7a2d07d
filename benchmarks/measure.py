"""Run one measurement in a fresh process (one mode per process, DESIGN.md) and read its JSON line;
the provenance every results file records."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
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


def warm_up(method: str, mode: str, world: int) -> None:
    """Our ``method`` (``crown`` / ``alpha``) once on a small MLP sharded like the measured model, so
    that torch's code pages for it are resident before the measurement starts (``PeakMemory`` leaves out
    code paged in during it, which reads low only for code paged in after the peak)."""
    import torch
    from memory_scaling import wide_mlp

    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.bounds.crown import crown

    g, box, C = wide_mlp(64, 4)
    if world > 1:
        g.shard(mode)
    lb, state = crown(g, box, C)
    if method == "alpha":
        alpha_crown(g, box, C, state, AlphaOptions(iteration=2, early_stop=False))
    del g, lb, state, torch
