"""The counterexample a ``sat`` result carries, checked the way the VNN-COMP scorer checks it.

VNN-LIB 1.x results list ``(X_i v)`` then ``(Y_j v)`` (:func:`~complete_verifier_ext.attack.
format_counterexample`). A VNN-LIB 2.0 result is the textual assignment of the 2.0 standard: for each
network in declaration order, each input then each output as a line ``NAME TYPE [d1,d2]`` followed by
its values, one per line, row-major. :func:`vnnlib2_witness` builds it from a point of the joint input
by running every network on its own ONNX file with onnxruntime (not the joint model the bounds were
computed on), and returns it only if the spec holds at those outputs, without tolerance.
"""

from __future__ import annotations

import gzip
import re

import numpy as np

from .attack import clause_margins
from .spec import Region, Slot, Spec, float32_box

__all__ = ["read_inputs", "vnnlib2_witness"]

_X = re.compile(r"\(\s*X_(\d+)\s+([^\s()]+)\s*\)")


def read_inputs(text: str) -> np.ndarray | None:
    """The ``X_i`` values of a VNN-COMP 1.x counterexample, in index order (None if there are none)."""
    found = {int(i): float(v) for i, v in _X.findall(text)}
    if not found or sorted(found) != list(range(len(found))):
        return None
    return np.array([found[i] for i in range(len(found))], dtype=np.float64)


def _session(path: str):
    import onnxruntime as ort

    source: str | bytes = path
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            source = f.read()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


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
        session = _session(networks[net.name])
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
