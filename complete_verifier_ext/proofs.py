"""Writing the proof of an ``unsat`` (``general.proof``): the format is ``docs/proofs.md``'s
``cve-proof-1``, checked by :mod:`complete_verifier_ext.check`, which shares none of this code.

A proof is a list of obligations (an input box, rounded outward, and one clause: output rows ``C y <=
d``, a conjunction), each with a tree whose leaves cover the box. The searches record their leaves as
they verify them, each rank its own; the trees are built here from every rank's records in a canonical
order, so that P = 1 and P > 1 runs of the same search give the same proof:

* :func:`input_tree`: the boxes of an input-split search's verified domains, tiled by bisections, back
  into the tree of cuts (each cut at the midpoint of its box, in float32, as the search bisects);
* :func:`phase_tree`: the split histories of a ReLU-split search's verified domains (each a tuple of
  ``(layer, neuron, sign)``, in the order of the splits or in none) into the tree of phase splits;
* :func:`logged_tree`: an input-split search recorded as a log of boxes (each split into boxes that tile
  it, clipped to a smaller box, or verified) into the tree of input splits and clips;
* :func:`with_bounds`: claimed intermediate bounds (α-CROWN's at a BaB root) over a subtree.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
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


def with_bounds(
    claims: dict[int, tuple[np.ndarray, np.ndarray]], child: dict, alpha: dict[int, dict] | None = None
) -> dict:
    """``child`` under claimed pre-activation bounds ``{layer key: (lower, upper)}`` (flat; a ReLU
    layer's id, a Sigmoid layer's ``sID``), with the slopes that made them (``alpha``: layer key -> its
    ``alpha`` entry, docs/proofs.md)."""
    table = {
        str(k): {"lower": np.asarray(lo, dtype=np.float64).reshape(-1).tolist(),
                 "upper": np.asarray(hi, dtype=np.float64).reshape(-1).tolist(),
                 **({"alpha": alpha[k]} if alpha and k in alpha else {})}
        for k, (lo, hi) in sorted(claims.items(), key=lambda kv: str(kv[0]))
    }  # fmt: skip
    return {"bounds": table, "children": [child]}


def input_tree(lower: np.ndarray, upper: np.ndarray, leaves: np.ndarray) -> dict:
    """The tree of bisections whose leaves are the boxes ``leaves`` ((N, 2, n) float32: lower, upper),
    which tile ``[lower, upper]``: at each node the cut is at the float32 midpoint of one dimension
    with every leaf on one side of it (the first such dimension; a leaf on both, of width 0 at the cut,
    goes left). Built a level of the tree at a time, every node of the level at once. Raises
    ``ValueError`` where the leaves are not such a tiling (a domain missing: no proof)."""
    box_lo, box_hi = (np.asarray(b, dtype=np.float32)[None] for b in (lower, upper))  # (M, n) per level
    leaf_lo, leaf_hi = leaves[:, 0], leaves[:, 1]
    root: dict = {}
    nodes, owner = [root], np.zeros(len(leaves), dtype=np.int64)  # the node each leaf is under
    while nodes:
        M = len(nodes)
        count = np.bincount(owner, minlength=M)
        exact = (leaf_lo == box_lo[owner]).all(1) & (leaf_hi == box_hi[owner]).all(1)
        done = (count == 1) & (np.bincount(owner, weights=exact, minlength=M) == 1)
        dim, mid = np.full(M, -1), np.zeros(M, dtype=np.float32)
        for d in range(box_lo.shape[1]):
            at = (box_lo[:, d] + box_hi[:, d]) / np.float32(2)
            left, right = leaf_hi[:, d] <= at[owner], leaf_lo[:, d] >= at[owner]
            sides = [np.bincount(owner, weights=m, minlength=M) for m in (left, right, left | right)]
            ok = (box_hi[:, d] > box_lo[:, d]) & (sides[0] > 0) & (sides[1] > 0) & (sides[2] == count)
            ok &= (dim < 0) & ~done
            dim[ok], mid[ok] = d, at[ok]
        if ((dim < 0) & ~done).any():
            open_ = int(count[(dim < 0) & ~done].sum())
            raise ValueError(f"{open_} leaf box(es) do not tile their box by bisections")
        cut = np.flatnonzero(dim >= 0)
        first = np.full(M, -1)
        first[cut] = 2 * np.arange(len(cut))  # the left child's index in the next level
        kids = []
        for node, is_leaf, d, at in zip(nodes, done.tolist(), dim.tolist(), mid.tolist(), strict=True):
            if is_leaf:
                node["leaf"] = {}
            else:
                pair = [{}, {}]
                node["input"], node["children"] = {"dim": d, "at": [at]}, pair
                kids += pair
        keep = ~done[owner]
        go_right = leaf_hi[np.arange(len(owner)), np.maximum(dim[owner], 0)] > mid[owner]
        owner = first[owner][keep] + go_right[keep]
        leaf_lo, leaf_hi = leaf_lo[keep], leaf_hi[keep]
        box_lo, box_hi = np.repeat(box_lo[cut], 2, axis=0), np.repeat(box_hi[cut], 2, axis=0)
        pairs = 2 * np.arange(len(cut))
        box_hi[pairs, dim[cut]] = mid[cut]
        box_lo[pairs + 1, dim[cut]] = mid[cut]
        nodes = kids
    return root


def phase_tree(histories: list[tuple[tuple[int, int, int], ...]], evidence: dict | None = None) -> dict:
    """The tree of phase splits whose leaves are the split histories ``histories`` (each the
    ``(relu layer id, flat neuron, +1 active / -1 inactive)`` of a verified domain, in the order the
    splits were made, or in any order). Raises ``ValueError`` where they are not a complete case split.

    Each node splits on a neuron that every remaining history splits, with both signs among them
    (always one where the histories are the leaves of a case-split tree: its root's neuron; splitting
    first on any other such neuron leaves a case split on each side); ordered histories give back the
    tree that made them. The work is linear in the histories' total length. Each leaf's path then
    holds exactly its history: its region is the verified domain's. ``evidence``: a history -> its
    leaf's evidence (:func:`leaf`)."""
    leaves = sorted(set(map(tuple, histories)))
    signs = [{(layer, n): sign for layer, n, sign in h} for h in leaves]
    if any(len(w) != len(h) for w, h in zip(signs, leaves, strict=True)):
        raise ValueError("a split history splits one neuron twice")
    return _case_split(_Split(leaves, signs, evidence or {}), list(range(len(leaves))), frozenset())


@dataclass(frozen=True)
class _Split:
    """The histories :func:`phase_tree` builds a tree over, each also as a neuron -> sign dict."""

    histories: list[tuple]
    signs: list[dict]
    evidence: dict


def _case_split(run: _Split, at: list[int], path: frozenset) -> dict:
    """The tree over the histories ``at`` (indices into ``run``), below the splits on the neurons
    ``path``. Every history at a node holds the path's neurons (each with its side's sign), so one
    holds no other split exactly when its length is the path's."""
    done = [i for i in at if len(run.histories[i]) == len(path)]
    if done:
        if len(at) > 1:
            raise ValueError("the split histories are not a case split (a domain inside another)")
        return leaf(**run.evidence.get(run.histories[at[0]], {}))
    layer, neuron = _splitting(run, at, path)
    sides = [[i for i in at if run.signs[i][layer, neuron] == sign] for sign in (-1, 1)]
    kids = [_case_split(run, side, path | {(layer, neuron)}) for side in sides]
    return {"relu": {"layer": layer, "neuron": neuron}, "children": kids}


def _splitting(run: _Split, at: list[int], path: frozenset) -> tuple[int, int]:
    """A neuron off ``path`` that every history at this node splits, both ways among them: the next
    split of the first history if that is one (ordered histories: at every node), else the first
    such neuron of the shortest history (it holds the node's own split, in a few neurons)."""
    if not at:
        raise ValueError("the split histories are not a case split (none)")
    first = run.histories[at[0]][len(path)][:2]
    shortest = min(at, key=lambda i: len(run.histories[i]))
    for s in [first] + [x[:2] for x in run.histories[shortest] if x[:2] not in path]:
        seen = {run.signs[i].get(s) for i in at}
        if seen == {-1, 1}:
            return s
    raise ValueError(f"no neuron is split both ways in all of {len(at)} histories: not a case split")


Key = tuple  # an input-split box: (the clause it is searched for, lower bytes, upper bytes), float64


def box_of(key: Key) -> tuple[np.ndarray, np.ndarray]:
    """The (lower, upper) float64 box a :class:`BoxLog` key stands for."""
    return np.frombuffer(key[1], dtype=np.float64), np.frombuffer(key[2], dtype=np.float64)


@dataclass(frozen=True)
class BoxLog:
    """What an input-split search did with its boxes (keys: :data:`Key`): split one into boxes that
    tile it (``splits``), clipped one to a box inside it (``clips``; None: to nothing, the whole box
    verified), bounded one above the threshold (``verified``)."""

    splits: dict[Key, tuple[Key, ...]]
    clips: dict[Key, Key | None]
    verified: frozenset[Key]


def logged_tree(root: Key, log: BoxLog) -> dict:
    """The tree of input splits and clips that proves ``root`` by ``log``: a verified box (or one clipped
    to nothing) is a leaf, a clipped box a clip node over its clipped box, a split box the cuts that tile
    it. Raises ``ValueError`` where a box was left open (no proof)."""
    if root in log.verified or log.clips.get(root, root) is None:
        return leaf()
    if root in log.clips:
        to = log.clips[root]
        lo, hi = clip_box(*box_of(root), *box_of(to))
        return {"clip": {"lower": lo.tolist(), "upper": hi.tolist()}, "children": [logged_tree(to, log)]}
    if root in log.splits and root not in log.splits[root]:
        kids = log.splits[root]
        lo, hi = box_of(root)
        parts = np.stack([np.stack(box_of(k)) for k in kids])  # (N, 2, n)
        return tiling_tree(lo, hi, parts, [logged_tree(k, log) for k in kids])
    raise ValueError("a box of the search was neither verified nor split")


CLIP_SLACK = 2.0**-20  # of a clipped box's width: how far a clip's faces move out into the slabs it drops


def clip_box(lower, upper, clip_lo, clip_hi) -> tuple[np.ndarray, np.ndarray]:
    """The clip node's box for a box ``[lower, upper]`` clipped to ``[clip_lo, clip_hi]``. A face the
    clip moved is moved back out by ``CLIP_SLACK`` of the box's width (not past the box): it is where
    the clip's linear bound meets the threshold, so a slab it drops holds points with a margin of 0 (to
    rounding) on that face, which no bound proves; a little way out the slab's margin is the bound's
    slope times the distance, and the clipped box, a little larger, holds the face. A face it did not
    move is written beyond the box, so that the checker's box (the query's, which may reach past the
    float32 box the search started from) keeps it: the clip drops only what the search dropped."""
    slack, far = CLIP_SLACK * (upper - lower), np.abs(lower) + np.abs(upper) + 1.0
    lo = np.where(clip_lo > lower, np.maximum(lower, clip_lo - slack), lower - far)
    hi = np.where(clip_hi < upper, np.minimum(upper, clip_hi + slack), upper + far)
    return lo, hi


def tiling_tree(lower: np.ndarray, upper: np.ndarray, parts: np.ndarray, nodes: list[dict]) -> dict:
    """Input splits that cut ``[lower, upper]`` into the boxes ``parts`` ((N, 2, n): lower, upper), whose
    subtrees are ``nodes``: at each node one cut, at a part's upper end, with every part on one side
    of it. Raises ``ValueError`` where the parts do not tile the box exactly."""
    if len(parts) == 1:
        if not (np.array_equal(parts[0, 0], lower) and np.array_equal(parts[0, 1], upper)):
            raise ValueError("the boxes a box was split into do not tile it")
        return nodes[0]
    for dim in range(len(lower)):
        for at in np.unique(parts[:, 1, dim]):
            left, right = parts[:, 1, dim] <= at, parts[:, 0, dim] >= at
            if lower[dim] < at < upper[dim] and left.any() and right.any() and bool((left ^ right).all()):
                hi, lo = upper.copy(), lower.copy()
                hi[dim] = lo[dim] = at
                sides = ((lower, hi, left), (lo, upper, right))
                kids = [
                    tiling_tree(a, b, parts[m], [nodes[j] for j in np.flatnonzero(m)]) for a, b, m in sides
                ]
                return {"input": {"dim": dim, "at": [float(at)]}, "children": kids}
    raise ValueError("the boxes a box was split into do not tile it")


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
    sigmoid_layers: list[dict] | None = None,
) -> None:
    """The proof file (gzipped where ``path`` ends in ``.gz``), written atomically; where ``path`` is a
    folder, a new file in it named after the network and the query (:func:`in_folder`)."""
    path = in_folder(path, vnnlib, networks) if Path(path).is_dir() else path
    doc = {
        "format": FORMAT,
        "query": {
            "vnnlib": {"path": os.path.abspath(vnnlib), "sha256": _digest(vnnlib)},
            "networks": [
                {"name": n, "path": os.path.abspath(p), "sha256": _digest(p)} for n, p in networks.items()
            ],
        },
        "producer": producer,
        "relu_layers": relu_layers,
        **({"sigmoid_layers": sigmoid_layers} if sigmoid_layers else {}),
        "obligations": [o.to_json() for o in obligations],
    }
    if path.endswith((".aptp", ".aptp.gz")):
        text = aptp_text(doc, _text(vnnlib))
    else:
        doc["obligations"], doc["bounds_tables"] = shared_tables(doc["obligations"])
        text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    if path.endswith(".gz"):
        tmp = f"{path}.tmp"
        Path(tmp).write_bytes(gzip.compress(text.encode()))
        Path(tmp).replace(path)
    else:
        write_atomic(path, text)


def in_folder(folder: str, vnnlib: str, networks: dict[str, str]) -> str:
    """A new file ``NETWORK__QUERY.json`` in ``folder`` (``NETWORK__QUERY.N.json`` where that exists:
    a csv's instances, or runs again, never overwrite one another's proofs), created here."""

    def stem(p: str) -> str:
        name = Path(p).name.removesuffix(".gz")
        return name.rsplit(".", 1)[0] if name.endswith((".onnx", ".vnnlib")) else name

    base = "__".join([*(stem(p) for p in networks.values()), stem(vnnlib)])
    for n in range(10**6):
        target = Path(folder) / (f"{base}.{n}.json" if n else f"{base}.json")
        try:
            with open(target, "x"):
                return str(target)
        except FileExistsError:
            continue
    raise OSError(f"{folder}: no free name for {base}")


def _text(path: str) -> str:
    data = Path(path).read_bytes()
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode()


def aptp_text(doc: dict, query: str) -> str:
    """A proof in APTP syntax (Activation Pattern Tree Proofs, ``dynaroars/aptpchecker``): the query's
    text, a ``(declare-pwl N_k ReLU)`` per ReLU neuron (``N_k``: counted from 1, layer after layer,
    row-major) and one assert whose ``and`` terms are the tree's leaves: the phases on each path
    (``(< N_k 0)`` inactive, ``(>= N_k 0)`` active) and, for input splits, the cut bounds of the inputs
    (``(>= X_i v)``, ``(<= X_i v)``, as NeuralSAT writes them). APTP proves one property, so a proof of
    one obligation only; claims and clips have no APTP form (``ValueError``)."""
    if len(doc["obligations"]) != 1 or len(doc["query"]["networks"]) != 1:
        what = f"{len(doc['obligations'])} obligations and {len(doc['query']['networks'])} networks"
        raise ValueError(f"APTP holds one property of one network; this proof has {what}")
    sizes = [r["size"] for r in doc["relu_layers"]]  # (listed in the graph's order: APTP's numbering)
    first = {r["id"]: sum(sizes[:k]) for k, r in enumerate(doc["relu_layers"])}
    leaves: list[list[str]] = []

    def walk(node: dict, path: list[str]) -> None:
        if "leaf" in node:
            leaves.append(path or ["(>= N_1 0)"])
        elif "relu" in node:
            k = first[node["relu"]["layer"]] + node["relu"]["neuron"] + 1
            walk(node["children"][0], [*path, f"(< N_{k} 0)"])
            walk(node["children"][1], [*path, f"(>= N_{k} 0)"])
        elif "input" in node:
            i, at = node["input"]["dim"], node["input"]["at"]
            for j, child in enumerate(node["children"]):
                cut = ([f"(>= X_{i} {at[j - 1]!r})"] if j else []) + (
                    [f"(<= X_{i} {at[j]!r})"] if j < len(at) else []
                )
                walk(child, [*path, *cut])
        elif "bounds" in node:
            walk(node["children"][0], path)
        else:
            raise ValueError(f"APTP has no form for a {next(iter(node))} node")

    walk(doc["obligations"][0]["tree"], [])
    if leaves == [["(>= N_1 0)"]]:  # one leaf, the whole box: a split on N_1 with both sides leaves
        leaves = [["(< N_1 0)"], ["(>= N_1 0)"]]
    total = sum(r["size"] for r in doc["relu_layers"])
    pwl = "".join(f"(declare-pwl N_{k} ReLU)\n" for k in range(1, total + 1))
    terms = " ".join(f"(and {' '.join(path)})" for path in leaves)
    return f"{query.rstrip()}\n\n; the proof: APTP leaves\n{pwl}(assert (or {terms}))\n"


# ----------------------------------------------------------------------------------------------------------
# The native engine's trees (its graph's ReLU nodes are the ONNX graph's Relu nodes, in order)
# ----------------------------------------------------------------------------------------------------------


def named(
    spec,
    model: str,
    networks: dict[str, str] | None,
    sizes: list[int],
    order: list[int] | None = None,
    op: str = "Relu",
) -> tuple[dict, list[dict]]:
    """The proof's networks and ``relu_layers`` for the ``model`` file verified (:func:`relu_layers`;
    ``op="Sigmoid"``: its ``sigmoid_layers``): a 1.x query's one network is that file; a 2.0 query's are
    its declared networks by name, their own files (``networks``), each layer named by its network and
    its output there."""
    from .model.joint import origin

    layers = relu_layers(model, sizes, order, op)
    if spec.layout is None:
        return {"net": model}, layers
    for r in layers:
        r["network"], r["output"] = origin(r["output"], spec.layout)
    return {n.name: networks[n.name] for n in spec.layout.networks}, layers


def relu_layers(
    onnx_path: str, sizes: list[int], order: list[int] | None = None, op: str = "Relu"
) -> list[dict]:
    """The proof's ``relu_layers``: the ONNX graph's ``Relu`` nodes (``op``'s, for ``sigmoid_layers``)
    in its order, each named by its output tensor, with the size ONNX shape inference gives it (a
    leading unknown dimension is the batch), and as ``id`` the position among the verifier's ReLUs
    (``sizes``, in its order) of the one it is: node ``order[i]`` is the verifier's ReLU ``i`` (a
    verifier may order the ReLUs of parallel branches, as two networks are, otherwise than the graph),
    else node ``i``. ``ValueError`` where the sizes do not match."""
    import onnx

    data = Path(onnx_path).read_bytes()
    model = onnx.load_model_from_string(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    graph = onnx.shape_inference.infer_shapes(model).graph
    shapes = {v.name: v.type.tensor_type.shape for v in (*graph.value_info, *graph.output)}
    out = []
    for node in (n for n in graph.node if n.op_type == op):
        dims = [
            d.dim_value if d.HasField("dim_value") else None
            for d in getattr(shapes.get(node.output[0]), "dim", [])
        ]
        dims = dims[1:] if dims and dims[0] is None else dims
        size = int(np.prod(dims)) if dims and None not in dims else None
        out.append({"id": len(out), "output": node.output[0], "size": size})
    if order is not None and sorted(order) == list(range(len(out))):
        for i, j in enumerate(order):
            out[j]["id"] = i
    found = [r["size"] for r in sorted(out, key=lambda r: r["id"])]
    kind = "ReLUs" if op == "Relu" else f"{op}s"
    if found != [int(s) for s in sizes]:
        raise ValueError(
            f"the ONNX graph's {op} nodes (sizes {found}) are not the verifier's {kind} (sizes {list(sizes)})"
        )
    return out


# Values in a network (the input and every node's output) up to which a proof's input-split leaves
# may be bounded as in a search without a proof, in batches: the checker closes a leaf whose
# intermediate bounds its own pass does not reproduce by LPs over LP bounds (``check.by_lp_bounds``,
# within ``check.LP_BOUNDS_MAX``: 5000 values, 2000 unstable neurons; half of it here, since the
# checker counts the ONNX graph's nodes, which may be more than the engine's).
BATCHED_LEAVES_MAX = 2500


def leaves_bounded_alone(graph) -> bool:
    """Whether a search that records a proof bounds each input-split box as if alone (as the checker's
    bound pass does; ``crown(per_box=True)``, α-CROWN on the output's slopes only): on networks beyond
    :data:`BATCHED_LEAVES_MAX`, where the checker's LP over LP bounds does not reach."""
    return sum(int(np.prod(n.shape)) for n in graph.nodes) > BATCHED_LEAVES_MAX


def graph_relu_sizes(graph) -> list[int]:
    """The sizes of the native graph's ReLUs, in order (its ReLU nodes are the ONNX graph's, in order)."""
    return [int(np.prod(graph.nodes[j].shape)) for j in graph.relu_nodes()]


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
            out[i] = widened(*(t.detach().double().cpu().numpy() for t in state.bounds[k]))
    return out


def claim_alpha(graph, state) -> dict[int, dict]:
    """The α-CROWN slopes behind each claimed bound (``CrownState.claim_alpha``, one box), by ReLU
    layer id, as the ``alpha`` entries of docs/proofs.md: for every neuron α-CROWN bounded (a claim may
    make one stable), each side's slopes at the neurons the claims leave unstable in every ReLU below."""
    if not state.claim_alpha:
        return {}
    relu_id = {j: i for i, j in enumerate(graph.relu_nodes())}
    layer = _layer_of(graph)

    def unstable(k: int) -> np.ndarray:
        lo, hi = (t.detach().reshape(len(t), -1).cpu().numpy() for t in state.bounds[k])
        return (lo[0] < 0) & (hi[0] > 0) if len(lo) == 1 else np.zeros(lo.shape[1], dtype=bool)

    out = {}
    for k, per_relu in state.claim_alpha.items():
        idx = state.rows[k].cpu().numpy()
        if k not in layer or not len(idx):
            continue
        entry: dict = {"neurons": idx.tolist(), "lower": {}, "upper": {}}
        for j, sides in sorted(per_relu.items()):
            cols_all = sides[0].index.cpu().numpy()
            cols = np.flatnonzero(unstable(graph.nodes[j].inputs[0])[cols_all])
            for side, slopes in zip(("lower", "upper"), sides, strict=True):
                values = slopes.values[:, 0].detach().double().cpu().numpy()[:, cols]
                entry[side][str(relu_id[j])] = {"index": cols_all[cols].tolist(), "values": values.tolist()}
        out[layer[k]] = entry
    return out


def shared_tables(obligations: list[dict]) -> tuple[list[dict], list[dict]]:
    """The obligations with every bounds node's table moved to one list, each distinct table once (a
    query's obligations all stand under the root's claims and their slopes): the node keeps ``{"table":
    index}``. The trees given are not changed."""
    tables: list[dict] = []
    index: dict[bytes, int] = {}
    known: dict[int, int] = {}  # id of a table given -> its index (the trees keep it alive)

    def table(bounds: dict) -> int:
        if id(bounds) in known:
            return known[id(bounds)]
        text = json.dumps(bounds, sort_keys=True, allow_nan=False, separators=(",", ":"))
        key = hashlib.sha256(text.encode()).digest()
        if key not in index:
            index[key] = len(tables)
            tables.append(bounds)
        known[id(bounds)] = index[key]
        return index[key]

    def copy(node: dict) -> dict:  # (depth first, iteratively: BaB trees are deep)
        out: dict = {}
        stack = [(node, out)]
        while stack:
            src, dst = stack.pop()
            dst.update(src)
            if "bounds" in src:
                dst["bounds"] = {"table": table(src["bounds"])}
            if "children" in src:
                dst["children"] = [{} for _ in src["children"]]
                stack += list(zip(src["children"], dst["children"], strict=True))
        return out

    return [{**o, "tree": copy(o["tree"])} for o in obligations], tables


def widened(lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float32 intermediate bounds as claims: moved out by the rounding of the sums that made them
    (``spec.ROUNDING`` of their size, as the engines' margins are)."""
    lo, hi = np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)
    slack = ROUNDING * (np.abs(lo) + np.abs(hi)) + 1e-30
    return lo - slack, hi + slack


def root_trees(graph, state, rows: dict[int, tuple[int, int, int] | None]) -> dict[int, dict]:
    """Clauses proved by the incomplete bounds over the whole box (``rows``: clause -> its proving row
    in the spec, that row's place among the clause's rows and their number; None: not known): one
    leaf each, under the sweep's intermediate bounds as claims where there is a sweep (α-CROWN may have
    tightened them), with the proving row (``lambda``) and α-CROWN's output slopes of it as evidence."""
    if state is None:
        return {i: leaf() for i in rows}
    table = with_bounds(claims(graph, state), leaf(), claim_alpha(graph, state))["bounds"]  # (one, shared)
    evidence = {i: leaf(**_row_evidence(graph, state, r)) for i, r in rows.items()}
    return {i: {"bounds": table, "children": [child]} for i, child in evidence.items()}


def _row_evidence(graph, state, row: tuple[int, int, int] | None) -> dict:
    """A root leaf's evidence: its proving row and that row's output slopes (``CrownState.out_alpha``,
    one box) at the neurons the sweep's bounds leave unstable; none without them."""
    if row is None or not state.out_alpha:
        return {}
    s, m, k = row
    layer, alpha = _layer_of(graph), {}
    for j, a in state.out_alpha.items():
        z = graph.nodes[j].inputs[0]
        if a.shape[1] != 1 or z not in layer or z not in state.bounds:
            continue
        lo, hi = (t.detach().reshape(len(t), -1)[0].cpu().numpy() for t in state.bounds[z])
        unstable = np.flatnonzero((lo < 0) & (hi > 0))
        values = np.round(a[s, 0].detach().reshape(-1).double().cpu().numpy()[unstable], 7)
        alpha[layer[z]] = dict(zip(unstable.tolist(), values.tolist(), strict=True))
    return {"lambda": [float(q == m) for q in range(k)], "alpha": alpha} if alpha else {}


def search_tree(graph, state, lower: np.ndarray, upper: np.ndarray, leaves: list) -> dict:
    """A clause proved by branch and bound: input splits (``leaves``: boxes) tile the box; ReLU splits
    (``leaves``: split histories of pre-activation nodes) form a case split under the root's bounds."""
    if leaves and isinstance(leaves[0], np.ndarray):
        return input_tree(lower, upper, np.stack(leaves))
    layer = _layer_of(graph)
    histories, evidence = [], {}
    for h, ev in leaves:  # (split history by pre-activation node, evidence by node)
        mine = tuple((layer[k], int(i), int(sign)) for k, i, sign in h)
        histories.append(mine)
        if ev:
            by_layer = {w: {layer[k]: v for k, v in ev[w].items()} for w in ("alpha", "beta")}
            evidence[mine] = {"lambda": ev["lambda"], **by_layer}
    return with_bounds(
        claims(graph, state), phase_tree(sorted(histories), evidence), claim_alpha(graph, state)
    )
