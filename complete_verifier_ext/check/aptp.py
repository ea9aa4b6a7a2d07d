"""APTP proofs (Activation Pattern Tree Proofs, the format of dynaroars/aptpchecker) read as cve-proof-1.

An APTP file is a VNN-LIB text with ``(declare-pwl N_k ReLU)`` lines and one assert ``(or (and LIT
…) …)`` whose terms are the proof's leaves: phase literals ``(< N_k 0)`` / ``(>= N_k 0)`` (``<=`` and
``>`` alike) and, as NeuralSAT writes them, input bounds ``(>= X_i v)`` / ``(<= X_i v)``. ``N_k``
counts the ReLU neurons from 1, layer after layer in the network's order, row-major within a layer
(aptpchecker's numbering): ``N_k`` is neuron ``j`` of ReLU layer ``L`` where ``k - 1 = Σ_{l<L} size_l +
j``. The other asserts (the property) are left to the query, which is read as for any proof.

For each obligation of the query the leaves become a tree whose regions cover its box: a region is a
leaf as soon as an APTP leaf contains it (its box, rounded outward as the query's, around the region;
its literals among the region's phases); else it is cut at a bound of an APTP leaf that meets it,
strictly inside; else split on the neuron most of the leaves that meet it name (an APTP tree comes
back as it was). A region no APTP leaf meets means the leaves do not cover the query: the proof is
invalid (a gap narrower than a float64 step may pass unseen; the tree covers the box whatever the
leaves say, so that is no hole in the checking). The tree's leaves carry no evidence: the checker's
bounds and LP decide them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

import numpy as np

from .files import Unsupported
from .onnx_net import Net
from .query import Query, outward, sexprs
from .tree import FORMAT, Invalid

_SIGN = MappingProxyType({"<": -1, "<=": -1, ">=": 1, ">": 1})


@dataclass(frozen=True)
class _Leaf:
    lower: np.ndarray
    upper: np.ndarray
    phases: frozenset  # (layer id, neuron, sign)


def document(data: bytes, q: Query, net: Net, q_sha: str, n_sha: str) -> dict:
    """The cve-proof-1 document of an APTP file's bytes for query ``q`` on ``net`` (their sha256)."""
    leaves = _leaves(data, q.n_inputs, net)
    layers = [
        {"id": r.id, "output": r.output, "size": r.size, **({"network": r.network} if r.network else {})}
        for r in net.relu_layers
    ]
    obligations = []
    for ob in q.obligations:
        rows = {"C": ob.rows.C.tolist(), "d": ob.rows.d.tolist()}
        tree = _tree(ob.lower, ob.upper, frozenset(), leaves)
        obligations.append(
            {"box": {"lower": ob.lower.tolist(), "upper": ob.upper.tolist()}, "rows": rows, "tree": tree}
        )
    about = {"vnnlib": {"sha256": q_sha}, "networks": [{"name": "N", "sha256": n_sha}]}
    return {"format": FORMAT, "query": about, "relu_layers": layers, "obligations": obligations}


def _leaves(data: bytes, n_in: int, net: Net) -> list[_Leaf]:
    neurons = [(r.id, j) for r in sorted(net.relu_layers, key=lambda r: r.id) for j in range(r.size)]
    terms = None  # the last assert of leaves (the property's own asserts come before it)
    for cmd in sexprs(data, "APTP"):
        if isinstance(cmd, list) and cmd[:1] == ["declare-pwl"] and cmd[-1:] != ["ReLU"]:
            raise Unsupported(f"APTP: {' '.join(map(str, cmd))} (ReLU only)")
        if isinstance(cmd, list) and cmd[:1] == ["assert"] and len(cmd) == 2 and _is_proof(cmd[1]):
            terms = [t[1:] if isinstance(t, list) and t[:1] == ["and"] else [t] for t in cmd[1][1:]]
    if terms is None:
        raise Invalid("the APTP file has no assert (or (and ...) ...) of leaves")
    return [_leaf(t, n_in, neurons) for t in terms]


def _is_proof(formula) -> bool:
    """The assert of leaves: an ``or`` whose literals name ``N_k`` (or ``X_i``: NeuralSAT's input splits)."""
    atoms, stack = [], [formula]
    while stack:
        e = stack.pop()
        atoms += [e] if isinstance(e, str) else []
        stack += e if isinstance(e, list) else []
    return isinstance(formula, list) and formula[:1] == ["or"] and any(a[:2] in ("N_", "X_") for a in atoms)


def _leaf(literals: list, n_in: int, neurons: list) -> _Leaf:
    lo, hi, phases = np.full(n_in, -np.inf), np.full(n_in, np.inf), set()
    for lit in literals:
        if not (isinstance(lit, list) and len(lit) == 3 and lit[0] in _SIGN and isinstance(lit[1], str)):
            raise Unsupported(f"APTP: literal {lit} (expected (< N_k 0), (>= N_k 0), (<= X_i v), (>= X_i v))")
        op, name, value = lit
        kind, _, index = name.partition("_")
        if kind == "N" and index.isdigit() and value in ("0", "0.0"):
            if not 1 <= int(index) <= len(neurons):
                raise Invalid(f"APTP: {name}: the network has {len(neurons)} ReLU neurons")
            phases.add((*neurons[int(index) - 1], _SIGN[op]))
        elif kind == "X" and index.isdigit() and int(index) < n_in:
            i, v = int(index), Fraction(value)
            if _SIGN[op] > 0:  # outward, as the query's box: the same decimal, the same float
                lo[i] = max(lo[i], outward(v, -1))
            else:
                hi[i] = min(hi[i], outward(v, 1))
        else:
            raise Unsupported(f"APTP: literal ({op} {name} {value})")
    return _Leaf(lo, hi, frozenset(phases))


def _tree(lo: np.ndarray, hi: np.ndarray, phases: frozenset, leaves: list[_Leaf]) -> dict:
    """The tree over the box ``[lo, hi]`` with ``phases`` on its path (module docstring)."""
    flat = lo == hi
    meet = [
        leaf
        for leaf in leaves
        if np.all(
            np.where(
                flat,
                (leaf.lower <= lo) & (hi <= leaf.upper),
                np.maximum(lo, leaf.lower) < np.minimum(hi, leaf.upper),
            )
        )
        and not any((layer, j, -sign) in phases for layer, j, sign in leaf.phases)
    ]
    if not meet:
        where = f"box {lo.tolist()} .. {hi.tolist()}" + (f" with phases {sorted(phases)}" if phases else "")
        raise Invalid(f"the APTP leaves do not cover the query: nothing covers the {where}")
    if any(np.all(leaf.lower <= lo) and np.all(hi <= leaf.upper) and leaf.phases <= phases for leaf in meet):
        return {"leaf": {}}
    for leaf in meet:
        for i in range(len(lo)):
            for v in (leaf.lower[i], leaf.upper[i]):
                if lo[i] < v < hi[i]:
                    left_hi, right_lo = hi.copy(), lo.copy()
                    left_hi[i], right_lo[i] = v, v
                    kids = [_tree(lo, left_hi, phases, meet), _tree(right_lo, hi, phases, meet)]
                    return {"input": {"dim": i, "at": [float(v)]}, "children": kids}
    decided = {p[:2] for p in phases}
    count = Counter(p[:2] for leaf in meet for p in leaf.phases if p[:2] not in decided)
    layer, j = min(count, key=lambda key: (-count[key], key))  # the neuron most leaves split: a tree's root
    kids = [_tree(lo, hi, phases | {(layer, j, sign)}, meet) for sign in (-1, 1)]
    return {"relu": {"layer": layer, "neuron": j}, "children": kids}
