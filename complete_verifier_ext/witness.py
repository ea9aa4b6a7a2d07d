"""The counterexample a ``sat`` result carries, checked the way the VNN-COMP scorer checks it.

VNN-LIB 1.x results list ``(X_i v)`` then ``(Y_j v)`` (:func:`~complete_verifier_ext.attack.
format_counterexample`). A VNN-LIB 2.0 result is the textual assignment of the 2.0 standard: for each
network in declaration order, each input then each output as a line ``NAME TYPE [d1,d2]`` followed by
its values, one per line, row-major. :func:`vnnlib2_witness` builds it from a point of the joint input
by running every network on its own ONNX file with onnxruntime (not the joint model the bounds were
computed on), and returns it only if the spec holds at those outputs, without tolerance.

:func:`recheck_results_file` re-checks a ``sat`` that another verifier wrote (α,β-CROWN, through the
plugin) before it stands: its counterexample is rounded into the float32 points of the spec's input box
(α,β-CROWN clamps its attack in float32, which may round a coordinate just outside a real bound) and
run on onnxruntime; if some clause holds there, the results file gets that point and its output (for a
VNN-LIB 2.0 spec: the 2.0 witness, every network run on its own file); if not, the verdict becomes
``unknown`` (never a wrong ``sat``), with one line saying why.
"""

from __future__ import annotations

import re

import numpy as np

from .attack import clause_margins, format_counterexample, ort_output, ort_session
from .results import write_atomic
from .spec import Region, Slot, Spec, float32_box

__all__ = ["read_inputs", "recheck_results_file", "vnnlib2_witness"]

_X = re.compile(r"\(\s*X_(\d+)\s+([^\s()]+)\s*\)")


def read_inputs(text: str) -> np.ndarray | None:
    """The ``X_i`` values of a VNN-COMP 1.x counterexample, in index order (None if there are none)."""
    found = {int(i): float(v) for i, v in _X.findall(text)}
    if not found or sorted(found) != list(range(len(found))):
        return None
    return np.array([found[i] for i in range(len(found))], dtype=np.float64)


def _feed_shape(value, n: int) -> list[int]:
    dims = [d if isinstance(d, int) and d > 0 else 1 for d in value.shape]
    return dims if int(np.prod(dims)) == n else [1, n]


def _ordered(slots: tuple[Slot, ...], values: list) -> list:
    by_name = {v.name: v for v in values}
    return [by_name[s.onnx_name] if s.onnx_name else v for s, v in zip(slots, values, strict=True)]


def run_networks(x: np.ndarray, spec: Spec, networks: dict[str, str]) -> np.ndarray:
    """The joint output at the joint input ``x`` (float32), each network run on its own file."""
    y = np.zeros(spec.n_outputs, dtype=np.float64)
    for net in spec.layout.networks:
        session = ort_session(networks[net.name])
        inputs = _ordered(net.inputs, session.get_inputs())
        feeds = {
            v.name: x[list(s.index)].astype(np.float32).reshape(_feed_shape(v, len(s.index)))
            for s, v in zip(net.inputs, inputs, strict=True)
        }
        outputs = _ordered(net.outputs, session.get_outputs())
        values = session.run([v.name for v in outputs], feeds)
        for s, value in zip(net.outputs, values, strict=True):
            y[list(s.index)] = np.asarray(value, dtype=np.float64).reshape(-1)
    return y


def _block(slot: Slot, values: np.ndarray) -> list[str]:
    head = f"{slot.name} {slot.dtype} [{','.join(str(d) for d in slot.shape)}]"
    return [head, *(repr(float(v)) for v in values)]


def _holds(region: Region, x: np.ndarray, y: np.ndarray) -> bool:
    """``x`` (float32) in the region's box as the network reads it (:func:`float32_box`, inward) and
    some clause holding at ``y``."""
    lo, hi = float32_box(region.lower, region.upper, inward=True)
    inside = bool(np.all(lo <= x) and np.all(x <= hi))
    return inside and bool((clause_margins(y, region.clauses) <= 0.0).any())


def vnnlib2_witness(x: np.ndarray, spec: Spec, networks: dict[str, str]) -> str | None:
    """The 2.0 witness of the joint input ``x`` (cast to float32, as the networks read it), or None
    when no region of ``spec`` holds at the outputs of the networks' own files."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    y = run_networks(x, spec, networks)
    if not any(_holds(r, x, y) for r in spec.regions):
        return None
    x64 = x.astype(np.float64)
    lines: list[str] = []
    for net in spec.layout.networks:
        for s in net.inputs:
            lines += _block(s, x64[list(s.index)])
        for s in net.outputs:
            lines += _block(s, y[list(s.index)])
    return "\n".join(lines)


def _in_box(x: np.ndarray, region: Region) -> np.ndarray | None:
    """``x`` rounded into the region's inward float32 box, or None when it is not a rounding of it."""
    if x.size != region.lower.size:
        return None
    lo, hi = float32_box(region.lower, region.upper, inward=True)
    x32 = np.clip(x.astype(np.float32), lo, hi)
    if np.abs(x32.astype(np.float64) - x).max() > 1e-6 * max(1.0, float(np.abs(x).max())):
        return None  # not a rounding of this region's box: another region's point
    return x32


def recheck_results_file(results_file: str, onnx_arg: str, vnnlib_path: str, who: str) -> str | None:
    """Re-check a ``sat`` results file (written by ``who``) in place; ``onnx_arg``: a path or a network
    list. Returns a warning when the verdict was changed."""
    from .model import joint
    from .spec import load_vnnlib

    with open(results_file) as f:
        text = f.read()
    if text.split("\n", 1)[0].strip() != "sat":
        return None
    x = read_inputs(text)
    if x is None:
        write_atomic(results_file, "unknown\n")
        return f"{who} said sat without a counterexample: unknown"
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
        y = ort_output(onnx_path, x32, (x32.size,))
        if (clause_margins(y, region.clauses) <= 0.0).any():
            write_atomic(results_file, f"sat\n{format_counterexample(x32, y)}\n")
            return None
    write_atomic(results_file, "unknown\n")
    return f"{who}'s counterexample does not check on onnxruntime in the spec's box: unknown"
