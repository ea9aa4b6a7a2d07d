"""Run one measurement in a fresh process (one mode per process, DESIGN.md) and read its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def spawn_json(script: str, args: list[str], timeout: float) -> dict | None:
    """``python SCRIPT --one ARGS...`` with ``MALLOC_MMAP_THRESHOLD_`` set, so that RSS follows live
    tensors; returns the JSON object on its last stdout line, or None if it failed or timed out."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, script, "--one", *args]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])
