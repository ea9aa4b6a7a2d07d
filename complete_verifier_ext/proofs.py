"""Writing the proof of an ``unsat`` (``general.proof``): the format is ``docs/proofs.md``'s
``cve-proof-1``, checked by :mod:`complete_verifier_ext.check`, which shares none of this code.

A proof is a list of obligations (an input box, rounded outward, and one clause: output rows ``C y <=
d``, a conjunction), each with a tree whose leaves cover the box. The searches record their leaves as
they verify them, each rank its own; the trees are built here from every rank's records in a canonical
order, so that P = 1 and P > 1 runs of the same search give the same proof:

* :func:`input_tree`: the boxes of an input-split search's verified domains, tiled by bisections, back
  into the tree of cuts (each cut at the midpoint of its box, in float32, as the search bisects);
* :func:`phase_tree`: the split histories of a ReLU-split search's verified domains (each an ordered
  tuple of ``(layer, neuron, sign)``) into the tree of phase splits;
* :func:`with_bounds`: claimed intermediate bounds (α-CROWN's at a BaB root) over a subtree.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .results import write_atomic
from .spec import ROUNDING

FORMAT = "cve-proof-1"


@dataclass(frozen=True)
class Obligation:
    """One (input box, clause) of the query and the tree that proves it: ``lower``/``upper`` the box
    rounded outward (float64 holding float32 values), ``C`` (k, n_out) and ``d`` (k,) the clause."""

    lower: np.ndarray
    upper: np.ndarray
    C: np.ndarray
    d: np.ndarray
    tree: dict

    def to_json(self) -> dict:
        return {
            "box": {"lower": self.lower.tolist(), "upper": self.upper.tolist()},
            "rows": {"C": np.asarray(self.C, dtype=np.float64).tolist(), "d": np.asarray(self.d).tolist()},
            "tree": self.tree,
        }


def leaf(**evidence: Any) -> dict:
    """A leaf node; ``evidence``: ``lambda``, ``alpha``, ``beta``, ``bound`` (docs/proofs.md)."""
    return {"leaf": {k: v for k, v in evidence.items() if v is not None}}


def with_bounds(claims: dict[int, tuple[np.ndarray, np.ndarray]], child: dict) -> dict:
    """``child`` under claimed pre-activation bounds ``{relu layer id: (lower, upper)}`` (flat)."""
    table = {
        str(k): {"lower": np.asarray(lo, dtype=np.float64).reshape(-1).tolist(),
                 "upper": np.asarray(hi, dtype=np.float64).reshape(-1).tolist()}
        for k, (lo, hi) in sorted(claims.items())
    }  # fmt: skip
    return {"bounds": table, "children": [child]}


def input_tree(lower: np.ndarray, upper: np.ndarray, leaves: np.ndarray) -> dict:
    """The tree of bisections whose leaves are the boxes ``leaves`` ((N, 2, n) float32: lower, upper),
    which tile ``[lower, upper]``: at each node the cut is at the float32 midpoint of one dimension
    with every leaf on one side of it (the first such dimension). Raises ``ValueError`` where the
    leaves are not such a tiling (a domain missing: no proof)."""
    lo, hi = np.asarray(lower, dtype=np.float32), np.asarray(upper, dtype=np.float32)
    if len(leaves) == 1 and np.array_equal(leaves[0, 0], lo) and np.array_equal(leaves[0, 1], hi):
        return leaf()
    for dim in np.nonzero(hi > lo)[0]:
        mid = np.float32((lo[dim] + hi[dim]) / np.float32(2))
        left, right = leaves[:, 1, dim] <= mid, leaves[:, 0, dim] >= mid
        if left.any() and right.any() and bool((left | right).all()):
            left_hi, right_lo = hi.copy(), lo.copy()
            left_hi[dim], right_lo[dim] = mid, mid
            kids = [input_tree(lo, left_hi, leaves[left]), input_tree(right_lo, hi, leaves[right & ~left])]
            return {"input": {"dim": int(dim), "at": [float(mid)]}, "children": kids}
    raise ValueError(f"{len(leaves)} leaf box(es) do not tile their box by bisections")


def phase_tree(histories: list[tuple[tuple[int, int, int], ...]], depth: int = 0) -> dict:
    """The tree of phase splits whose leaves are the split histories ``histories`` (each the ordered
    ``(relu layer id, flat neuron, +1 active / -1 inactive)`` of a verified domain). Raises
    ``ValueError`` where they are not a complete case split."""
    if len(histories) == 1 and len(histories[0]) == depth:
        return leaf()
    heads = {h[depth][:2] for h in histories if len(h) > depth}
    if len(heads) != 1 or any(len(h) <= depth for h in histories):
        raise ValueError(f"the split histories branch inconsistently at depth {depth}")
    layer, neuron = heads.pop()
    sides = [[h for h in histories if h[depth][2] == sign] for sign in (-1, 1)]
    if not all(sides):
        raise ValueError(f"neuron {neuron} of layer {layer} is split on one side only")
    return {"relu": {"layer": layer, "neuron": neuron}, "children": [phase_tree(s, depth + 1) for s in sides]}


def _digest(path: str) -> str:
    data = Path(path).read_bytes()
    return hashlib.sha256(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).hexdigest()


def write(
    path: str,
    vnnlib: str,
    networks: dict[str, str],
    relu_layers: list[dict],
    obligations: list[Obligation],
    producer: dict,
) -> None:
    """The proof file (gzipped where ``path`` ends in ``.gz``), written atomically."""
    doc = {
        "format": FORMAT,
        "query": {
            "vnnlib": {"path": vnnlib, "sha256": _digest(vnnlib)},
            "networks": [{"name": n, "path": p, "sha256": _digest(p)} for n, p in networks.items()],
        },
        "producer": producer,
        "relu_layers": relu_layers,
        "obligations": [o.to_json() for o in obligations],
    }
    text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    if path.endswith(".gz"):
        tmp = f"{path}.tmp"
        Path(tmp).write_bytes(gzip.compress(text.encode()))
        Path(tmp).replace(path)
    else:
        write_atomic(path, text)


# ----------------------------------------------------------------------------------------------------------
# The native engine's trees (its graph's ReLU nodes are the ONNX graph's Relu nodes, in order)
# ----------------------------------------------------------------------------------------------------------


def relu_layers(graph) -> list[dict]:
    """The proof's ``relu_layers``: every ReLU of the native graph, in the ONNX graph's order."""
    return [
        {"id": i, "output": graph.nodes[j].name, "size": int(np.prod(graph.nodes[j].shape))}
        for i, j in enumerate(graph.relu_nodes())
    ]


def _layer_of(graph) -> dict[int, int]:
    """Pre-activation node -> the id of the ReLU that reads it."""
    return {graph.nodes[j].inputs[0]: i for i, j in enumerate(graph.relu_nodes())}


def claims(graph, state) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The intermediate bounds of a CROWN-type sweep (``CrownState``) as claims, by ReLU layer id,
    widened by the float32 rounding the sweep's sums carry (``spec.ROUNDING`` of their size, as the
    engine's margins are): a claim must hold in real arithmetic, a float32 bound only to rounding."""
    out = {}
    for k, i in _layer_of(graph).items():
        if k in state.bounds:
            lo, hi = (t.detach().double().cpu().numpy() for t in state.bounds[k])
            slack = ROUNDING * (np.abs(lo) + np.abs(hi)) + 1e-30
            out[i] = (lo - slack, hi + slack)
    return out


def root_tree(graph, state) -> dict:
    """A clause proved by the incomplete bounds over the whole box: one leaf, under the sweep's
    intermediate bounds as claims where there is a sweep (α-CROWN may have tightened them)."""
    return with_bounds(claims(graph, state), leaf()) if state is not None else leaf()


def search_tree(graph, state, lower: np.ndarray, upper: np.ndarray, leaves: list) -> dict:
    """A clause proved by branch and bound: input splits (``leaves``: boxes) tile the box; ReLU splits
    (``leaves``: split histories of pre-activation nodes) form a case split under the root's bounds."""
    if leaves and isinstance(leaves[0], np.ndarray):
        return input_tree(lower, upper, np.stack(leaves))
    layer = _layer_of(graph)
    histories = [tuple((layer[k], int(i), int(sign)) for k, i, sign in h) for h in leaves]
    return with_bounds(claims(graph, state), phase_tree(sorted(histories)))
