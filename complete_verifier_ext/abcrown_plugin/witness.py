"""α,β-CROWN's ``sat`` re-checked before it stands: rank 0 reads the counterexample α,β-CROWN wrote into
the results file, rounds it into the float32 points of the spec's input box (α,β-CROWN clamps its
attack in float32, which may round a coordinate just outside a real bound), and runs the ONNX model on
it with onnxruntime. If some clause holds there, the results file gets that point and its output (for a
VNN-LIB 2.0 spec: the 2.0 witness, every network run on its own file); if not, the verdict becomes
``unknown`` (never a wrong ``sat``), with one line saying why.
"""

from __future__ import annotations

import numpy as np

from .. import joint
from ..attack import _ort_output, clause_margins, format_counterexample
from ..results import write_atomic
from ..spec import Region, float32_box, load_vnnlib
from ..witness import read_inputs, vnnlib2_witness


def _in_box(x: np.ndarray, region: Region) -> np.ndarray | None:
    """``x`` rounded into the region's inward float32 box, or None when it is not a rounding of it."""
    if x.size != region.lower.size:
        return None
    lo, hi = float32_box(region.lower, region.upper, inward=True)
    x32 = np.clip(x.astype(np.float32), lo, hi)
    if np.abs(x32.astype(np.float64) - x).max() > 1e-6 * max(1.0, float(np.abs(x).max())):
        return None  # not a rounding of this region's box: another region's point
    return x32


def recheck(results_file: str, onnx_arg: str, vnnlib_path: str) -> str | None:
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
    onnx_path, networks = joint.model_for(onnx_arg, spec)
    for region in spec.regions:
        x32 = _in_box(x, region)
        if x32 is None:
            continue
        if networks is not None:  # VNN-LIB 2.0: every network on its own file
            witness = vnnlib2_witness(x32, spec, networks)
            if witness is not None:
                write_atomic(results_file, f"sat\n{witness}\n")
                return None
            continue
        y = _ort_output(onnx_path, x32, (x32.size,))
        if (clause_margins(y, region.clauses) <= 0.0).any():
            write_atomic(results_file, f"sat\n{format_counterexample(x32, y)}\n")
            return None
    write_atomic(results_file, "unknown\n")
    return "alpha-beta-CROWN's counterexample does not check on onnxruntime in the spec's box: unknown"
