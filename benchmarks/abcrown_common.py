"""What the α,β-CROWN plugin benchmarks share: where things are, the provenance of a results file, and
one ``abcrown --general.engine abcrown`` run read back through its ``--summary``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from measure import REPO

BENCH = REPO.parent / "shared" / "benchmarks"
CONFIGS = "complete_verifier/exp_configs/vnncomp22"  # α,β-CROWN's own VNN-COMP 2022 configs


def instance_label(row: dict) -> str:
    """A results row's instance as the plugin tables print it: the model and the spec, shortened."""
    return f"{row['onnx'].removesuffix('.onnx')} {row['vnnlib'].removesuffix('.vnnlib')[:40]}"


def checkout() -> Path:
    """``$ABCROWN_PATH`` (exits with one line when unset or not a checkout, or without the benchmarks)."""
    path = Path(os.environ.get("ABCROWN_PATH", ""))
    if not (path / CONFIGS).is_dir():
        sys.exit("set ABCROWN_PATH to an alpha-beta-CROWN checkout (../shared/vendor/alpha-beta-CROWN)")
    if not BENCH.is_dir():
        sys.exit(f"{BENCH} not found (the shared VNN-COMP benchmarks)")
    return path


def vendor_config(root: Path, rel: str) -> dict:
    """α,β-CROWN's own ``exp_configs/REL`` as a user runs it here: ``root_path`` / ``csv_name`` dropped
    (the instance comes on the command line), ``device: cpu``."""
    import yaml

    data = yaml.safe_load((root / "complete_verifier" / "exp_configs" / rel).read_text())
    general = {k: v for k, v in (data.get("general") or {}).items() if k not in ("root_path", "csv_name")}
    data["general"] = {**general, "device": "cpu"}
    return data


def threads(P: int) -> int:
    """Torch threads per rank: every run uses the whole machine, like unpatched α,β-CROWN (torch's
    default, one per core), not the plugin's default of the cores less one."""
    return max(1, (os.cpu_count() or 1) // P)


def run_abcrown(
    args: list[str], tmp: Path, timeout: float, world: int = 1, env: dict | None = None, mode: str = "fsdp"
) -> dict:
    """``abcrown --general.engine abcrown ARGS`` in ``tmp`` (``mode`` over ``world`` gloo ranks when
    above 1): its summary plus ``wall_s``, or ``{"error": ...}``."""
    summary = tmp / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = ["abcrown", *args, "--general.engine", "abcrown", "--summary", str(summary), "--quiet"]
    if world > 1:
        cmd += ["--parallel.mode", mode, "--parallel.world_size", str(world)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=tmp
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if out.returncode != 0 or not summary.exists():
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {**json.loads(summary.read_text()), "wall_s": round(time.monotonic() - t0, 1)}
