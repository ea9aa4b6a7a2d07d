"""The independent proof checker (docs/proofs.md): :func:`check_proof` decides whether a
``cve-proof-1`` file proves a VNN-LIB 1.x query ``unsat`` on an ONNX network.

A second implementation of the semantics, sharing no code with the verifier: its own query reader
(:mod:`.query`), ONNX reader (:mod:`.onnx_net`), bounds with every float64 rounding error charged
outward (:mod:`.bounds`, :mod:`.rounding`) and LP fallback with a dual bound (:mod:`.lp`). The steps:
the files' sha256 against the proof's; the proof's ReLU layers against the network's; every term of
the query's disjunctive form covered by a proof obligation (its box containing the term's outward
box, its rows among the term's rows); every tree walked (:mod:`.tree`); every leaf discharged, by the
bound pass with its evidence or else by the LP fallback. ``workers > 1`` deals the leaves round-robin
over a process pool.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

import numpy as np

from . import bounds, lp, onnx_net, query, tree
from .files import Unsupported, read_bytes, sha256
from .rounding import subnormals_kept
from .tree import Invalid, Leaf

FORMAT = "cve-proof-1"
_BATCH_FLOATS = 2**24  # per coefficient matrix of a batched backward pass


class UsageError(ValueError):
    """A call the checker cannot answer (not a verdict on the proof)."""


@dataclass(frozen=True)
class Result:
    status: str  # "valid" | "invalid" | "unsupported"
    message: str = ""
    leaves: int = 0
    by_bounds: int = 0  # leaves closed by the bound pass (their evidence, or the checker's defaults)
    by_lp: int = 0  # leaves closed by the LP fallback
    seconds: float = 0.0

    def line(self) -> str:
        return "valid" if self.status == "valid" else f"{self.status}: {self.message}"


def check_proof(query_path: str, networks: dict[str, str], proof_path: str, workers: int = 1) -> Result:
    """Whether the proof at ``proof_path`` proves the query ``unsat`` on the network (``networks``: one
    name -> ONNX file, for a VNN-LIB 1.x query). ``OSError`` when a file cannot be read,
    :class:`UsageError` for a call naming other than one network."""
    start = time.monotonic()
    try:
        outcomes = _check(query_path, networks, proof_path, max(1, int(workers)))
    except Unsupported as e:
        return Result("unsupported", str(e), seconds=time.monotonic() - start)
    except Invalid as e:
        return Result("invalid", str(e), seconds=time.monotonic() - start)
    kinds = [o[2] for o in outcomes]
    counts = dict(leaves=len(outcomes), by_bounds=kinds.count("bounds"), by_lp=kinds.count("lp"))
    failed = sorted(o for o in outcomes if not o[2])
    if failed:
        k, i, _, why = failed[0]
        return Result(
            "invalid", f"obligation {k} leaf {i}: {why}", **counts, seconds=time.monotonic() - start
        )
    return Result("valid", "", **counts, seconds=time.monotonic() - start)


def _check(query_path: str, networks: dict[str, str], proof_path: str, workers: int) -> list:
    if len(networks) != 1:
        raise UsageError(f"a VNN-LIB 1.x query takes one network, {len(networks)} given")
    if not subnormals_kept():
        raise Unsupported("this process flushes subnormal floats to zero (the error bounds assume not)")
    ((_, net_path),) = networks.items()
    q_bytes, n_bytes = read_bytes(query_path), read_bytes(net_path)
    doc = tree.read(proof_path)
    q, net = query.parse(q_bytes), onnx_net.parse(n_bytes, net_path)
    layers = _header(doc, sha256(q_bytes), sha256(n_bytes), net)
    if (net.sizes[0], net.sizes[net.output]) != (q.n_inputs, q.n_outputs):
        raise Invalid(
            f"the network maps {net.sizes[0]} inputs to {net.sizes[net.output]} outputs, the "
            f"query declares {q.n_inputs} and {q.n_outputs}"
        )
    obligations = _cover(doc, q)
    leaves = [leaf for k, (ob, _) in enumerate(obligations) for leaf in tree.leaves(ob, k, layers)]
    rows = [r for _, r in obligations]
    if workers == 1 or len(leaves) < 2:
        return discharge(net, rows, leaves)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ctx.Pool(workers) as pool:
        parts = pool.starmap(discharge, [(net, rows, leaves[w::workers]) for w in range(workers)])
    return [o for part in parts for o in part]


def _header(doc: dict, q_sha: str, n_sha: str, net: onnx_net.Net) -> dict[int, int]:
    """The proof's files and ReLU layers against ours; the layers' sizes by id."""
    if doc.get("format") != FORMAT:
        raise Invalid(f"format {str(doc.get('format'))[:40]!r}, not {FORMAT}")
    about = doc.get("query") if isinstance(doc.get("query"), dict) else {}
    vnnlib, nets = about.get("vnnlib"), about.get("networks")
    if not isinstance(vnnlib, dict) or vnnlib.get("sha256") != q_sha:
        raise Invalid("the proof is about another query (its sha256 differs from the query file's)")
    if not isinstance(nets, list) or len(nets) != 1 or not isinstance(nets[0], dict):
        raise Invalid("the proof does not name the one network of a VNN-LIB 1.x query")
    if nets[0].get("sha256") != n_sha:
        raise Invalid("the proof is about another network (its sha256 differs from the ONNX file's)")
    mine = {r.id: r for r in net.relu_layers}
    listed = doc.get("relu_layers", [])
    out = {}
    for entry in listed if isinstance(listed, list) else [None]:
        r = (
            mine.get(entry.get("id"))
            if isinstance(entry, dict) and not isinstance(entry.get("id"), bool)
            else None
        )
        if r is None or (entry.get("output"), entry.get("size")) != (r.output, r.size):
            raise Invalid(
                f"relu_layers: {str(entry)[:80]} is not a Relu node of the network (id, output, size)"
            )
        out[r.id] = r.size
    return out


def _cover(doc: dict, q: query.Query) -> list[tuple[tree.ProofObligation, query.Rows]]:
    """The proof's obligations, each with its rows as the query has them (radii included); every term
    of the query must be covered by one."""
    obs = doc.get("obligations")
    if not isinstance(obs, list):
        raise Invalid("obligations: not a list")
    out, covered = [], set()
    for k, obj in enumerate(obs):
        ob = tree.obligation(obj, k, q.n_inputs, q.n_outputs)
        match, why = None, "its rows are not rows of any term of the query"
        for j, term in enumerate(q.obligations):
            idx = [
                next((i for i in range(len(term.rows.d)) if _same(term.rows, i, c, d)), None)
                for c, d in zip(ob.C, ob.d, strict=True)
            ]
            if None in idx:
                continue
            if (ob.lower <= term.lower).all() and (ob.upper >= term.upper).all():
                covered.add(j)
                match = match or term.rows.take(idx)
            else:
                bad = int(np.flatnonzero((ob.lower > term.lower) | (ob.upper < term.upper))[0])
                span = [float(term.lower[bad]), float(term.upper[bad])]
                why = f"its box does not contain the query's: X_{bad} in {span}"
        if match is None:
            raise Invalid(f"obligation {k}: {why}")
        out.append((ob, match))
    missing = sorted(set(range(len(q.obligations))) - covered)
    if missing:
        raise Invalid(f"the query's term {missing[0]} (of {len(q.obligations)}) is covered by no obligation")
    return out


def _same(rows: query.Rows, i: int, c: np.ndarray, d: float) -> bool:
    return bool(np.array_equal(rows.C[i], c) and rows.d[i] == d)


def discharge(net: onnx_net.Net, rows: list[query.Rows], leaves: list[Leaf]) -> list[tuple]:
    """``(obligation, leaf, "bounds" | "lp" | "", why)`` per leaf: closed by the bound pass, by the LP
    fallback, or not (why)."""
    out = []
    width = max(net.sizes)
    size = max(1, min(1024, _BATCH_FLOATS // (2 * width * width)))
    for k in sorted({leaf.obligation for leaf in leaves}):
        group = [leaf for leaf in leaves if leaf.obligation == k]
        for start in range(0, len(group), size):
            chunk = group[start : start + size]
            batch = _batch(net, chunk, rows[k])
            bnd = bounds.node_bounds(net, batch)
            best = bounds.objective(net, rows[k], bnd, batch)
            for b, leaf in enumerate(chunk):
                if best[b] > 0:
                    out.append((k, leaf.index, "bounds", ""))
                    continue
                value, status = lp.solve(lp.build(net, rows[k], bnd, b))
                why = f"at {leaf.path}: not discharged: lower bound {best[b]:.6g} by back-substitution, "
                out.append(
                    (k, leaf.index, "lp" if value > 0 else "", why + f"{value:.6g} by the LP ({status})")
                )
    return out


def _batch(net: onnx_net.Net, leaves: list[Leaf], rows: query.Rows) -> bounds.Batch:
    """The leaves' regions and evidence as arrays over ReLU nodes; the weightings tried: each row, the
    sum, and the leaf's ``lambda`` (else the sum again)."""
    B, k = len(leaves), len(rows.d)
    node_of = {r.id: (r.node, r.size) for r in net.relu_layers}
    lam = np.concatenate([np.eye(k), np.ones((2, k))])[None].repeat(B, axis=0)
    phase: dict = {}
    alpha: dict = {}
    beta: dict = {}
    for i, leaf in enumerate(leaves):
        for layer, j, sign in leaf.phases:
            node, n = node_of[layer]
            if node >= 0:
                phase.setdefault(node, np.zeros((B, n), dtype=np.int8))[i, j] = sign
        for layer, a in leaf.evidence.alpha.items():
            node, n = node_of[layer]
            if node >= 0:
                alpha.setdefault(node, np.full((B, n), np.nan))[i] = a
        for layer, by_neuron in leaf.evidence.beta.items():
            node, n = node_of[layer]
            for j, value in by_neuron.items():
                if node >= 0:
                    beta.setdefault(node, np.zeros((B, n)))[i, j] = value
        if leaf.evidence.lam is not None:
            lam[i, -1] = leaf.evidence.lam
    lower, upper = np.stack([leaf.lower for leaf in leaves]), np.stack([leaf.upper for leaf in leaves])
    return bounds.Batch(lower, upper, phase, alpha, beta, lam)
