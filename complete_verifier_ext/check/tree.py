"""The proof file (docs/proofs.md): read as strict JSON, its obligations parsed, their trees walked into
leaves, every node validated on the way.

The walk is the coverage argument: an input split cuts its box at points strictly inside it and in
increasing order (its children tile the box), a clip's child takes the clip box (intersected with the
current one) and the slabs of the current box around it become leaves of their own, a phase split's
two children add ``z_j <= 0`` and ``z_j >= 0`` for a neuron of a ReLU layer of the network, split at
most once on a path. The leaves, in depth-first order, cover the obligation's box; their regions are
their boxes and the phases on their paths. A bounds node's claims (bounds of pre-activation layers over
its region) are :class:`Claims` to verify, and knowledge for the nodes below it. A failure names the
obligation, the number of leaves before it, and the path of child positions from the root.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .files import read_bytes

FORMAT = "cve-proof-1"


class Invalid(Exception):
    """The proof does not prove the query; the message says where and why."""


@dataclass(frozen=True)
class Evidence:
    """What a leaf offers: row weights ``lam`` (``None``: the checker's choice), lower slopes ``alpha``
    (layer id -> one per neuron, clipped into [0, 1]), multipliers ``beta`` (layer id -> neuron -> β,
    negative ones read as 0)."""

    lam: np.ndarray | None = None
    alpha: dict[int, np.ndarray] = field(default_factory=dict)
    beta: dict[int, dict[int, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Leaf:
    obligation: int
    index: int  # among the obligation's leaves, depth first
    path: str
    lower: np.ndarray
    upper: np.ndarray
    phases: tuple[tuple[int, int, int], ...]  # (layer id, neuron, -1: z <= 0 | +1: z >= 0)
    evidence: Evidence
    claims: tuple = ()  # the keys of the bounds nodes above it


@dataclass(frozen=True)
class Claims:
    """A bounds node's ``claimed`` bounds (layer key -> (lower, upper) of its pre-activation: a ReLU
    layer's id, a Sigmoid layer's ``sID``) over its region, to verify with those of the bounds nodes
    above it (``claims``: their keys); ``index``: the leaves before it."""

    obligation: int
    index: int
    path: str
    lower: np.ndarray
    upper: np.ndarray
    phases: tuple[tuple[int, int, int], ...]
    claims: tuple
    claimed: dict
    # layer key -> (claimed neurons (m,), {"lower"|"upper": {ReLU layer id: (m, n) slopes, NaN: none
    # given; Sigmoid layer key: ((m, n) lower lines' points, (m, n) upper lines' points), NaN: none}})
    alpha: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, str]:
        return self.obligation, self.path


@dataclass(frozen=True)
class ProofObligation:
    lower: np.ndarray
    upper: np.ndarray
    C: np.ndarray
    d: np.ndarray
    tree: dict


def read(path: str) -> dict:
    """The proof document; :class:`Invalid` when it is not one JSON object of finite numbers."""
    data = read_bytes(path)
    try:
        if data[:2] == b"\x1f\x8b" and not str(path).endswith(".gz"):
            data = gzip.decompress(data)
        doc = json.loads(data, parse_constant=_not_finite)
    except (ValueError, RecursionError, OSError, EOFError) as e:
        raise Invalid(f"the proof is not a JSON document: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise Invalid("the proof is not a JSON object")
    return doc


def share_tables(doc: dict) -> None:
    """The shared bounds tables (``bounds_tables``) in place of the bounds nodes' ``{"table": i}``."""
    tables = doc.get("bounds_tables", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise Invalid("bounds_tables: expected a list of bounds tables")
    obligations = doc.get("obligations")
    stack = (
        [o.get("tree") for o in obligations if isinstance(o, dict)] if isinstance(obligations, list) else []
    )
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        spec = node.get("bounds")
        if isinstance(spec, dict) and "table" in spec:
            if len(spec) != 1:
                raise Invalid("a bounds node that names a table has nothing else")
            node["bounds"] = tables[integer(spec["table"], 0, len(tables), "a bounds node's table")]
        if isinstance(node.get("children"), list):
            stack.extend(node["children"])


def _not_finite(name: str):
    raise ValueError(f"{name} is not a JSON number")


def number(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Invalid(f"{what}: expected a number, got {json.dumps(x)[:60]}")
    return float(x)


def numbers(x, n: int, what: str) -> np.ndarray:
    if not isinstance(x, list) or len(x) != n:
        raise Invalid(f"{what}: expected a list of {n} numbers")
    if set(map(type, x)) <= {int, float}:  # (JSON's numbers, no bool: the usual case, at C speed)
        return np.array(x, dtype=np.float64)
    return np.array([number(v, what) for v in x], dtype=np.float64)


def integer(x, lo: int, hi: int, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x < hi:
        raise Invalid(f"{what}: expected an integer in [{lo}, {hi}), got {json.dumps(x)[:60]}")
    return x


def obligation(obj, k: int, n_in: int, n_out: int) -> ProofObligation:
    where = f"obligation {k}"
    if not isinstance(obj, dict) or not all(
        isinstance(obj.get(key), dict) for key in ("box", "rows", "tree")
    ):
        raise Invalid(f"{where}: expected an object with box, rows and tree")
    box, rows = obj["box"], obj["rows"]
    lower, upper = (
        numbers(box.get("lower"), n_in, f"{where} box"),
        numbers(box.get("upper"), n_in, f"{where} box"),
    )
    C = rows.get("C")
    if not isinstance(C, list):
        raise Invalid(f"{where} rows: C is not a list")
    C = np.array([numbers(r, n_out, f"{where} rows C") for r in C]).reshape(len(C), n_out)
    d = numbers(rows.get("d"), len(C), f"{where} rows d")
    if (lower > upper).any():
        raise Invalid(f"{where}: box lower > upper")
    return ProofObligation(lower, upper, C, d, obj["tree"])


def leaves(
    ob: ProofObligation, k: int, layers: dict[int, int], within=None, parsed: dict | None = None
) -> Iterator[Leaf | Claims]:
    """The leaves of obligation ``k``'s tree and the claims of its bounds nodes, depth first;
    ``layers``: layer key -> size (a ReLU layer's id, a Sigmoid layer's ``sID``: the latter only in
    bounds nodes). The tree is validated on the proof's boxes; the regions to
    discharge are those boxes within ``(lower, upper)``, the query's box (an empty one: nothing to do).
    ``parsed``: bounds tables read so far, by identity (a shared table is read once)."""
    parsed = {} if parsed is None else parsed
    relus = {key: n for key, n in layers.items() if isinstance(key, int)}
    w_lo, w_hi = within if within is not None else (ob.lower, ob.upper)
    stack = [(ob.tree, ob.lower, ob.upper, (), (), "root")]
    count = 0
    while stack:
        node, lo, hi, phases, known, path = stack.pop()
        r_lo, r_hi = np.maximum(lo, w_lo), np.minimum(hi, w_hi)
        try:
            if isinstance(node, dict) and "leaf" in node:
                ev = _evidence(node["leaf"], len(ob.d), relus)
                yield Leaf(k, count, path, r_lo, r_hi, phases, ev, known)
                count += 1
                continue
            kids = _children(node)
            if "input" in node:
                cut = _cut(node, kids, lo, hi)
                stack += reversed([(c, *box, phases, known, f"{path}/{i}") for i, (c, box) in enumerate(cut)])
            elif "clip" in node:
                new_lo, new_hi, slabs = _clip(node["clip"], kids, lo, hi)
                for s_lo, s_hi in slabs:
                    s_lo, s_hi = np.maximum(s_lo, w_lo), np.minimum(s_hi, w_hi)
                    yield Leaf(k, count, f"{path}/slab{count}", s_lo, s_hi, phases, Evidence(), known)
                    count += 1
                stack.append((kids[0], new_lo, new_hi, phases, known, f"{path}/0"))
            elif "relu" in node:
                split = _phase(node["relu"], kids, phases, relus)
                stack += [(kids[1], lo, hi, (*phases, (*split, 1)), known, f"{path}/1")]
                stack += [(kids[0], lo, hi, (*phases, (*split, -1)), known, f"{path}/0")]
            elif "bounds" in node:
                if len(kids) != 1:
                    raise Invalid("a bounds node needs claims {layer id: {lower, upper}} and one child")
                if id(node["bounds"]) not in parsed:
                    parsed[id(node["bounds"])] = (node["bounds"], _claims(node["bounds"], layers))
                claimed, alpha = parsed[id(node["bounds"])][1]
                yield Claims(k, count, path, r_lo, r_hi, phases, known, claimed, alpha)
                stack.append((kids[0], lo, hi, phases, (*known, (k, path)), f"{path}/0"))
            else:
                raise Invalid("a node that is none of leaf, input, clip, relu, bounds")
        except Invalid as e:
            raise Invalid(f"obligation {k} leaf {count}: at {path}: {e}") from None


def _claims(spec, layers: dict[int, int]) -> tuple[dict, dict]:
    if not isinstance(spec, dict):
        raise Invalid("a bounds node needs claims {layer id: {lower, upper}} and one child")
    out, alpha = {}, {}
    for key, value in _layer_map(spec, layers, "bounds"):
        value = value if isinstance(value, dict) else {}
        n = layers[key]
        out[key] = (
            numbers(value.get("lower"), n, f"bounds of layer {key}"),
            numbers(value.get("upper"), n, f"bounds of layer {key}"),
        )
        if value.get("alpha") is not None:
            alpha[key] = _claim_alpha(value["alpha"], n, layers, f"alpha of the bounds of layer {key}")
    return out, alpha


def _claim_alpha(obj, n: int, layers: dict, what: str) -> tuple:
    """A claim's slopes: ``{"neurons": [j…], "lower"|"upper": {layer id: {"index": [i…], "values":
    [[α per index] per neuron]}}}`` as ``(neurons, {side: {layer id: (m, size) slopes, NaN elsewhere}})``;
    a Sigmoid layer's entry ``sID: {"index": [i…], "lower_line": [[point per index] per neuron],
    "upper_line": […]}`` as its two lines' tangent points, ``((m, size), (m, size))``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("neurons"), list):
        raise Invalid(f"{what}: expected an object with a list of neurons")
    neurons = np.array([integer(j, 0, n, f"{what}: neuron") for j in obj["neurons"]], dtype=np.int64)
    sides = {}
    for side in ("lower", "upper"):
        sides[side] = {}
        for key, value in _layer_map(obj.get(side), layers, f"{what}: {side}"):
            index = value.get("index") if isinstance(value, dict) else None
            if not isinstance(index, list):
                raise Invalid(f"{what}: {side} of layer {key}: expected an index and values")
            cols = np.array([integer(i, 0, layers[key], f"{what}: index") for i in index], dtype=np.int64)
            fields = ("values",) if isinstance(key, int) else ("lower_line", "upper_line")
            where = f"{what}: {side} of layer {key}"
            parts = [_rows(value, f, len(neurons), cols, layers[key], where) for f in fields]
            sides[side][key] = np.clip(parts[0], 0.0, 1.0) if isinstance(key, int) else tuple(parts)
    return neurons, sides


def _rows(value: dict, field: str, m: int, cols: np.ndarray, size: int, what: str) -> np.ndarray:
    """``value[field]``: a row of numbers per neuron, at the columns ``cols`` of ``(m, size)`` (NaN
    elsewhere)."""
    rows = value.get(field)
    if not isinstance(rows, list) or len(rows) != m:
        raise Invalid(f"{what}: expected one row of {field} per neuron")
    a = np.full((m, size), np.nan)
    a[:, cols] = [numbers(row, len(cols), f"{what}: {field}") for row in rows] if len(rows) else 0.0
    return a


def _children(node) -> list:
    kids = node.get("children") if isinstance(node, dict) else None
    if not isinstance(kids, list):
        raise Invalid("a split without a list of children")
    return kids


def _cut(node: dict, kids: list, lo: np.ndarray, hi: np.ndarray) -> list:
    spec = node["input"] if isinstance(node["input"], dict) else {}
    dim = integer(spec.get("dim"), 0, len(lo), "input split dim")
    at = spec.get("at")
    if not isinstance(at, list) or not at:
        raise Invalid("input split: at is not a non-empty list of cut points")
    at = numbers(at, len(at), "input split at")
    cuts = np.concatenate([[lo[dim]], at, [hi[dim]]])
    if not (np.diff(cuts) > 0).all():
        raise Invalid(
            f"input split of dim {dim} at {at.tolist()}: not strictly inside "
            f"{[float(lo[dim]), float(hi[dim])]} and increasing"
        )
    if len(kids) != len(at) + 1:
        raise Invalid(f"input split at {len(at)} points has {len(kids)} children, not {len(at) + 1}")
    out = []
    for i, kid in enumerate(kids):
        k_lo, k_hi = lo.copy(), hi.copy()
        k_lo[dim], k_hi[dim] = cuts[i], cuts[i + 1]
        out.append((kid, (k_lo, k_hi)))
    return out


def _clip(spec, kids: list, lo: np.ndarray, hi: np.ndarray):
    """The clipped box (the clip box intersected with the current one) and the slabs of the current box
    outside it: along each dimension in turn, below and above the new range, the dimensions before it
    already clipped."""
    if not isinstance(spec, dict) or len(kids) != 1:
        raise Invalid("a clip needs a box and one child")
    new_lo = np.maximum(lo, numbers(spec.get("lower"), len(lo), "clip lower"))
    new_hi = np.minimum(hi, numbers(spec.get("upper"), len(lo), "clip upper"))
    if (new_lo > new_hi).any():
        raise Invalid("the clip box does not meet the current box")
    slabs, cur_lo, cur_hi = [], lo.copy(), hi.copy()
    for i in range(len(lo)):
        for a, b in ((cur_lo[i], new_lo[i]), (new_hi[i], cur_hi[i])):
            if a < b:
                s_lo, s_hi = cur_lo.copy(), cur_hi.copy()
                s_lo[i], s_hi[i] = a, b
                slabs.append((s_lo, s_hi))
        cur_lo[i], cur_hi[i] = new_lo[i], new_hi[i]
    return new_lo, new_hi, slabs


def _phase(spec, kids: list, phases: tuple, layers: dict[int, int]) -> tuple[int, int]:
    if not isinstance(spec, dict) or len(kids) != 2:
        raise Invalid("a phase split needs a neuron and two children (z <= 0, z >= 0)")
    layer = spec.get("layer")
    if layer not in layers or isinstance(layer, bool):
        raise Invalid(f"phase split of layer {json.dumps(layer)[:40]}: no such ReLU layer")
    neuron = integer(spec.get("neuron"), 0, layers[layer], f"phase split of layer {layer}: neuron")
    if any(p[:2] == (layer, neuron) for p in phases):
        raise Invalid(f"layer {layer} neuron {neuron} is split twice on one path")
    return layer, neuron


def _evidence(obj, n_rows: int, layers: dict[int, int]) -> Evidence:
    if not isinstance(obj, dict):
        raise Invalid("a leaf is not an object")
    lam = None if obj.get("lambda") is None else np.maximum(numbers(obj["lambda"], n_rows, "lambda"), 0.0)
    alpha, beta = {}, {}
    for key, value in _layer_map(obj.get("alpha"), layers, "alpha"):
        if isinstance(value, dict):  # some neurons' slopes (NaN elsewhere: the checker's own)
            a = np.full(layers[key], np.nan)
            for j, v in value.items():
                a[_key(j, layers[key], f"alpha of layer {key}: neuron")] = number(v, "alpha")
            alpha[key] = np.clip(a, 0.0, 1.0)
        else:
            alpha[key] = np.clip(numbers(value, layers[key], f"alpha of layer {key}"), 0.0, 1.0)
    for key, value in _layer_map(obj.get("beta"), layers, "beta"):
        if not isinstance(value, dict):
            raise Invalid(f"beta of layer {key}: expected an object neuron -> multiplier")
        neurons = {
            _key(j, layers[key], f"beta of layer {key}: neuron"): number(b, "beta") for j, b in value.items()
        }
        beta[key] = {j: max(b, 0.0) for j, b in neurons.items()}
    return Evidence(lam, alpha, beta)


def _layer_map(obj, layers: dict, what: str) -> list:
    """``obj``'s entries by the layer keys of ``layers`` (a ReLU layer's id, ``sID`` a Sigmoid layer's)."""
    if obj is None:
        return []
    if not isinstance(obj, dict):
        raise Invalid(f"{what}: expected an object layer id -> values")
    out = []
    for key, v in obj.items():
        if key in layers:  # a Sigmoid layer's
            out.append((key, v))
        else:
            relus = [k for k in layers if isinstance(k, int)]
            k = _key(key, max(relus, default=-1) + 1, f"{what}: layer")
            if k not in layers:
                raise Invalid(f"{what}: layer {key!r}: no such layer")
            out.append((k, v))
    return out


def _key(text: str, n: int, what: str) -> int:
    """A JSON object key naming an integer in [0, n)."""
    if not (text.isdigit() and int(text) < n):
        raise Invalid(f"{what} {text!r}: not an integer in [0, {n})")
    return int(text)
