"""α,β-CROWN's ``sat`` re-checked before it stands: rank 0 reads the counterexample α,β-CROWN wrote into
the results file, rounds it into the float32 points of the spec's input box (α,β-CROWN clamps its
attack in float32, which may round a coordinate just outside a real bound), and runs the ONNX model on
it with onnxruntime. If some clause holds there, the results file gets that point and its output; if
not, the verdict becomes ``unknown`` (never a wrong ``sat``), with one line saying why.
"""

from __future__ import annotations

import re

import numpy as np

from ..attack import _ort_output, clause_margins, format_counterexample
from ..results import write_atomic
from ..spec import float32_box, load_vnnlib

_X = re.compile(r"\(\s*X_(\d+)\s+([^\s()]+)\s*\)")


def read_inputs(text: str) -> np.ndarray | None:
    """The ``X_i`` values of a VNN-COMP results file, in index order (None if there are none)."""
    found = {int(i): float(v) for i, v in _X.findall(text)}
    if not found or sorted(found) != list(range(len(found))):
        return None
    return np.array([found[i] for i in range(len(found))], dtype=np.float64)


def recheck(results_file: str, onnx_path: str, vnnlib_path: str) -> str | None:
    """Re-check a ``sat`` results file in place. Returns a warning when the verdict was changed."""
    with open(results_file) as f:
        text = f.read()
    if text.split("\n", 1)[0].strip() != "sat":
        return None
    x = read_inputs(text)
    if x is None:
        write_atomic(results_file, "unknown\n")
        return "alpha-beta-CROWN said sat without a counterexample: unknown"
    spec = load_vnnlib(vnnlib_path)
    for region in spec.regions:
        if x.size != region.lower.size:
            continue
        lo, hi = float32_box(region.lower, region.upper, inward=True)
        x32 = np.clip(x.astype(np.float32), lo, hi)
        if np.abs(x32.astype(np.float64) - x).max() > 1e-6 * max(1.0, float(np.abs(x).max())):
            continue  # not a rounding of this region's box: another region's point
        y = _ort_output(onnx_path, x32, (x32.size,))
        if (clause_margins(y, region.clauses) <= 0.0).any():
            write_atomic(results_file, f"sat\n{format_counterexample(x32, y)}\n")
            return None
    write_atomic(results_file, "unknown\n")
    return "alpha-beta-CROWN's counterexample does not check on onnxruntime in the spec's box: unknown"
