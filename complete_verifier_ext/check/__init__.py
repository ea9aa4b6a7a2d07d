"""The independent proof checker (docs/proofs.md): :func:`check_proof` decides whether a
``cve-proof-1`` file proves a VNN-LIB query (1.x or 2.0) ``unsat`` on its ONNX networks (several: one
net from the query's joint input to its joint output, :func:`onnx_net.joint`).

A second implementation of the semantics, sharing no code with the verifier: its own query reader
(:mod:`.query`), ONNX reader (:mod:`.onnx_net`), bounds with every float64 rounding error charged
outward (:mod:`.bounds`, :mod:`.rounding`) and LP fallback with a dual bound (:mod:`.lp`). The steps:
the files' sha256 against the proof's; the proof's ReLU layers against the network's; every term of
the query's disjunctive form covered by a proof obligation (its box containing the term's outward
box, its rows among the term's rows); every tree walked (:mod:`.tree`); a leaf under no bounds node
tried by the bound pass with its evidence alone; the claims of the bounds nodes above the other
leaves and those still open verified (those above first; bounds nodes alike in region and claims, as
a query's obligations under the root's bounds are, once), then each such leaf by the bound pass under
those claims (first without back-substitution where a claim is), or in parts (a small input's box
halved: :func:`by_halves`), or else by the LP fallback (on MLPs, last, by an LP over intermediate
bounds that LPs made: :func:`by_lp_bounds`). An
APTP proof (:mod:`.aptp`) becomes such a document first. ``workers > 1`` deals the bounds nodes and
the leaves over forked processes (the leaves round-robin; the network reaches them by the fork).
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import time
from dataclasses import dataclass

import numpy as np

from . import aptp, batches, bounds, lp, onnx_net, query, tree
from .files import Unsupported, read_bytes, sha256
from .rounding import subnormals_kept
from .tree import FORMAT, Invalid, Leaf

_BATCH_FLOATS = 2**24  # per coefficient matrix of a batched backward pass
# leaves per batch at most: CROWN bounds a batch's neurons that any of its leaves has unstable, so a
# small batch keeps that near each leaf's own (ACAS Xu, 7557 leaves: 14 s at 64, 26 s at 1024)
LEAF_BATCH = 64


NOT_FINITE = "a bound is not finite"
UNDECIDED = "undecided"  # a leaf or claim whose LP stopped at its time limit: neither proved nor refuted


class UsageError(ValueError):
    """A call the checker cannot answer (not a verdict on the proof)."""


@dataclass(frozen=True)
class Result:
    status: str  # "valid" | "invalid" | "unsupported" | "undecided" (an LP stopped at its time limit)
    message: str = ""
    leaves: int = 0
    by_bounds: int = 0  # leaves closed by the bound pass (their evidence, or the checker's defaults)
    by_lp: int = 0  # leaves closed by the LP fallback
    by_halves: int = 0  # leaves closed in parts (:func:`by_halves`)
    seconds: float = 0.0

    def line(self) -> str:
        return "valid" if self.status == "valid" else f"{self.status}: {self.message}"


def check_proof(query_path: str, networks: dict[str, str], proof_path: str, workers: int = 1) -> Result:
    """Whether the proof at ``proof_path`` proves the query ``unsat`` on its networks (``networks``: name
    -> ONNX file; one file under any name for a query of one network). ``OSError`` when a file cannot be
    read, :class:`UsageError` for a call naming other networks than the query's."""
    start = time.monotonic()
    try:
        n_leaves, outcomes = _check(query_path, networks, proof_path, max(1, int(workers)))
    except Unsupported as e:
        return Result("unsupported", str(e), seconds=time.monotonic() - start)
    except Invalid as e:
        return Result("invalid", str(e), seconds=time.monotonic() - start)
    kinds = [o[2] for o in outcomes]
    counts = dict(leaves=n_leaves, by_bounds=kinds.count("bounds"), by_lp=kinds.count("lp"))
    counts["by_halves"] = kinds.count("halves")
    failed = sorted(o for o in outcomes if not o[2]) or sorted(o for o in outcomes if o[2] == UNDECIDED)
    status, why = ("valid", "")
    if failed:
        status = "invalid" if not failed[0][2] else "undecided"
        why = "obligation {} leaf {}: {}".format(*failed[0][:2], failed[0][3])
    return Result(status, why, **counts, seconds=time.monotonic() - start)


def _check(query_path: str, networks: dict[str, str], proof_path: str, workers: int) -> tuple[int, list]:
    if not subnormals_kept():
        raise Unsupported("this process flushes subnormal floats to zero (the error bounds assume not)")
    q_bytes = read_bytes(query_path)
    q = query.parse(q_bytes)
    files = _files(q, networks)
    n_bytes = [read_bytes(f) for f in files]
    net = _joint(q, [onnx_net.parse(b, f) for b, f in zip(n_bytes, files, strict=True)])
    shas = [sha256(b) for b in n_bytes]
    if str(proof_path).endswith((".aptp", ".aptp.gz")):
        if len(files) != 1:
            raise Unsupported("an APTP proof is of one network")
        doc = aptp.document(read_bytes(proof_path), q, net, sha256(q_bytes), shas[0])
    else:
        doc = tree.read(proof_path)
        tree.share_tables(doc)
    shas = dict(zip([n.name for n in q.networks], shas, strict=True))
    layers, net = _header(doc, sha256(q_bytes), shas, net)
    obligations = _cover(doc, q)
    parsed: dict = {}  # (a bounds table shared by nodes is read once)
    items = [x for k, (ob, _, box) in enumerate(obligations) for x in tree.leaves(ob, k, layers, box, parsed)]
    leaves, rows = [x for x in items if isinstance(x, Leaf)], [r for _, r, _ in obligations]
    claims = [x for x in items if isinstance(x, tree.Claims)]
    pool = _Pool(net, workers)
    # a leaf under no bounds node first by its own bounds and evidence alone (no LP yet)
    alone = [x for x in leaves if not x.claims]
    parts = pool.map(discharge, [(rows, alone[w::workers], None) for w in range(workers)])
    closed = [o for part in parts for o in part if o[2]]
    done_ = {o[:2] for o in closed}
    rest = [x for x in leaves if (x.obligation, x.index) not in done_]
    needed = set().union(*(x.claims for x in rest))  # the bounds nodes above them (and theirs)
    verified: dict = {}
    for depth in sorted({len(c.claims) for c in claims if c.key in needed}):  # those above it first
        level: dict[bytes, list] = {}  # alike bounds nodes (every obligation's root claims) once
        for c in (c for c in claims if len(c.claims) == depth and c.key in needed):
            level.setdefault(_same_claims(c, verified), []).append(c)
        alike = list(level.values())
        args = [(g[0], {key: verified[key] for key in g[0].claims}) for g in alike]
        if len(alike) >= pool.workers:  # a node per worker; else the nodes in turn, their LPs dealt
            done = pool.map(verify, args)
        else:
            done = [verify(net, *a, pool=pool) for a in args]
        failed = sorted(why for ok, why in done if not ok)
        if failed:
            return len(leaves), failed[:1]
        verified.update((c.key, v) for g, (_, v) in zip(alike, done, strict=True) for c in g)
    parts = pool.map(discharge, [(rows, rest[w::workers], verified) for w in range(workers)])
    return len(leaves), closed + [o for part in parts for o in part]


def _same_claims(item: tree.Claims, verified: dict) -> bytes:
    """What a bounds node's verification depends on (its region, phases, claims and the verified bounds
    above it), as a digest: nodes alike in it are verified once (a query's obligations share one box and
    the root's bounds)."""
    h = hashlib.sha256(repr(item.phases).encode())
    for key in item.claims:
        h.update(b"above")
        for layer, (lo, hi) in sorted(verified[key].items(), key=str):
            h.update(repr(layer).encode() + lo.tobytes() + hi.tobytes())
    h.update(b"claimed" + item.lower.tobytes() + item.upper.tobytes())
    for layer, (lo, hi) in sorted(item.claimed.items(), key=str):
        h.update(repr(layer).encode() + lo.tobytes() + hi.tobytes())
    return h.digest()


class _Pool:
    """``map(fn, args)``: ``fn(net, *a)`` for each ``a`` of ``args``, dealt over ``workers`` forked
    processes (the network reaches them by the fork: a large net's matrices are too many MB to pickle
    with each task; the results come back pickled), or in this process (one worker, or a platform that
    cannot fork)."""

    def __init__(self, net: onnx_net.Net, workers: int) -> None:
        forks = "fork" in multiprocessing.get_all_start_methods()
        self.net, self.workers = net, workers if forks else 1

    def map(self, fn, args: list) -> list:
        if self.workers == 1 or len(args) < 2:
            return [fn(self.net, *a) for a in args]
        ctx, shares = multiprocessing.get_context("fork"), []
        for w in range(min(self.workers, len(args))):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_serve, args=(send, fn, self.net, args[w :: self.workers]), daemon=True)
            proc.start()
            send.close()
            shares.append((recv, proc))
        out: list = [None] * len(args)
        for w, (recv, proc) in enumerate(shares):
            ok, part = recv.recv()
            proc.join()
            if not ok:
                raise part
            out[w :: self.workers] = part
        return out


def _serve(conn, fn, net: onnx_net.Net, items: list) -> None:
    """A forked worker: ``fn(net, *a)`` for its items, sent back (or the exception that stopped it). It
    runs on one BLAS thread: the workers are as many as the cores, and BLAS threads beside them would
    halve every worker's speed (oval21's leaves at ``--workers 2``: 8.4 s in each, 4.0 s on one)."""
    from threadpoolctl import threadpool_limits

    try:
        with threadpool_limits(1):
            conn.send((True, [fn(net, *a) for a in items]))
    except BaseException as e:  # the parent raises it
        conn.send((False, e))
    finally:
        conn.close()


def _files(q: query.Query, networks: dict[str, str]) -> list[str]:
    """The file of each of the query's networks, in their order: a query of one network takes one file
    under any name, one of several a file for each by its declared name."""
    declared = [n.name for n in q.networks]
    if len(declared) == 1 and len(networks) == 1:
        return list(networks.values())
    if declared == [None]:
        raise UsageError(f"a VNN-LIB 1.x query takes one network, {len(networks)} given")
    if sorted(networks) != sorted(declared):
        given = ", ".join(networks) or "none"
        raise UsageError(f"the query declares the networks {', '.join(map(str, declared))}; given: {given}")
    return [networks[n] for n in declared]


def _joint(q: query.Query, nets: list[onnx_net.Net]) -> onnx_net.Net:
    """The one net from the query's joint input to its joint output (:func:`onnx_net.joint`)."""
    for n, net in zip(q.networks, nets, strict=True):
        if (net.sizes[0], net.sizes[net.output]) != (len(n.inputs), n.n_out):
            raise Invalid(
                f"the network{f' {n.name}' if n.name else ''} maps {net.sizes[0]} inputs to "
                f"{net.sizes[net.output]} outputs, the query declares {len(n.inputs)} and {n.n_out}"
            )
    parts = [(n.name, net, n.inputs, n.out_start) for n, net in zip(q.networks, nets, strict=True)]
    return onnx_net.joint(parts, q.n_inputs, q.n_outputs)


def _header(doc: dict, q_sha: str, shas: dict, net: onnx_net.Net) -> tuple[dict, onnx_net.Net]:
    """The proof's files, ReLU and Sigmoid layers against ours (``shas``: the query's networks' sha256 by
    name): the sizes of the layers by the keys the proof gives them (each names a Relu node by its output,
    by its id; a Sigmoid node ``sID``), and the net with its layers numbered so."""
    if doc.get("format") != FORMAT:
        raise Invalid(f"format {str(doc.get('format'))[:40]!r}, not {FORMAT}")
    about = doc.get("query") if isinstance(doc.get("query"), dict) else {}
    vnnlib, nets = about.get("vnnlib"), about.get("networks")
    if not isinstance(vnnlib, dict) or vnnlib.get("sha256") != q_sha:
        raise Invalid("the proof is about another query (its sha256 differs from the query file's)")
    if not isinstance(nets, list) or len(nets) != len(shas) or not all(isinstance(n, dict) for n in nets):
        raise Invalid(f"the proof does not name the {len(shas)} network(s) of the query")
    listed = (
        {n.get("name"): n.get("sha256") for n in nets}
        if len(nets) > 1
        else {[*shas][0]: nets[0].get("sha256")}
    )
    for name, sha in shas.items():
        if listed.get(name) != sha:
            which = f" {name}" if name else ""
            raise Invalid(
                f"the proof is about another network{which} (its sha256 differs from the ONNX file's)"
            )
    relus = _named(doc.get("relu_layers", []), net.relu_layers, "relu_layers", "Relu")
    sigmoids = _named(doc.get("sigmoid_layers", []), net.sigmoid_layers, "sigmoid_layers", "Sigmoid")
    sizes = {i: r.size for i, r in relus.items()} | {f"s{i}": r.size for i, r in sigmoids.items()}
    return sizes, dataclasses.replace(
        net,
        relu_layers=_numbered(relus, net.relu_layers),
        sigmoid_layers=_numbered(sigmoids, net.sigmoid_layers),
    )


def _named(listed, mine: tuple, what: str, op: str) -> dict[int, onnx_net.ReluLayer]:
    """The proof's list ``what`` of ``op`` nodes against the net's (``mine``): each by its id."""
    by_name = {(r.network, r.output): r for r in mine}
    named: dict[int, onnx_net.ReluLayer] = {}
    for entry in listed if isinstance(listed, list) else [None]:
        ok = isinstance(entry, dict) and type(entry.get("id")) is int
        r = by_name.get((entry.get("network"), entry.get("output"))) if ok else None
        if r is None or entry.get("size") != r.size or entry["id"] in named or r in named.values():
            raise Invalid(
                f"{what}: {str(entry)[:80]} names no {op} node (output, size, network) or one twice"
            )
        named[entry["id"]] = r
    return named


def _numbered(named: dict, mine: tuple) -> tuple:
    """The net's layers numbered as the proof names them, those it does not name after."""
    rest, top = [r for r in mine if r not in named.values()], max(named, default=-1) + 1
    ids = [*named, *range(top, top + len(rest))]
    return tuple(dataclasses.replace(r, id=i) for i, r in zip(ids, [*named.values(), *rest], strict=True))


def _cover(doc: dict, q: query.Query) -> list[tuple]:
    """The proof's obligations, each with its rows as the query has them (radii included) and the box
    around the terms it covers (what its tree must discharge); every term of the query must be covered."""
    obs = doc.get("obligations")
    if not isinstance(obs, list):
        raise Invalid("obligations: not a list")
    out, covered = [], set()
    for k, obj in enumerate(obs):
        ob = tree.obligation(obj, k, q.n_inputs, q.n_outputs)
        match, why, boxes = None, "its rows are not rows of any term of the query", []
        for j, term in enumerate(q.obligations):
            idx = [
                next((i for i in range(len(term.rows.d)) if _same(term.rows, i, c, d)), None)
                for c, d in zip(ob.C, ob.d, strict=True)
            ]
            if None in idx:
                continue
            if (ob.lower <= term.lower).all() and (ob.upper >= term.upper).all():
                covered.add(j)
                match, boxes = match or term.rows.take(idx), [*boxes, (term.lower, term.upper)]
            else:
                bad = int(np.flatnonzero((ob.lower > term.lower) | (ob.upper < term.upper))[0])
                span = [float(term.lower[bad]), float(term.upper[bad])]
                why = f"its box does not contain the query's: X_{bad} in {span}"
        if match is None:
            raise Invalid(f"obligation {k}: {why}")
        out.append((ob, match, (np.min([b[0] for b in boxes], 0), np.max([b[1] for b in boxes], 0))))
    missing = sorted(set(range(len(q.obligations))) - covered)
    if missing:
        raise Invalid(f"the query's term {missing[0]} (of {len(q.obligations)}) is covered by no obligation")
    return out


def _same(rows: query.Rows, i: int, c: np.ndarray, d: float) -> bool:
    return bool(np.array_equal(rows.C[i], c) and rows.d[i] == d)


def discharge(
    net: onnx_net.Net, rows: list[query.Rows], leaves: list[Leaf], verified: dict | None
) -> list[tuple]:
    """``(obligation, leaf index, kind, why)`` per leaf: closed by the bound pass (kind ``"bounds"``), by
    the LP fallback (``"lp"``), or not (``""``, why); ``verified``: the bounds nodes' verified claims
    (``None``: the leaves' own bounds and evidence alone, no claims and no LP). With claims, it stops
    at the first leaf refuted (the leaves come in order: that is the first refuted among them)."""
    out = []
    width = max(net.sizes)
    size = max(1, min(LEAF_BATCH, _BATCH_FLOATS // (2 * width * width)))
    for k in sorted({leaf.obligation for leaf in leaves}):
        group = [leaf for leaf in leaves if leaf.obligation == k]
        for start in range(0, len(group), size):
            chunk = group[start : start + size]
            batch = batches.of(net, chunk, len(rows[k].d), verified)
            with np.errstate(all="ignore"):  # an overflow is a bound that is not finite: nothing proved
                bnd = bounds.node_bounds(net, batch, claimed_crown=not batch.claims)
                best = bounds.objective(net, rows[k], bnd, batch)
                if batch.claims and not (best > 0).all():  # the claims alone fall short: CROWN too
                    bnd = bounds.node_bounds(net, batch)
                    best = np.fmax(best, bounds.objective(net, rows[k], bnd, batch))
            open_ = np.flatnonzero(~(best > 0))
            at = {}  # leaf -> the bounds its LP is over and its row in them, where not the first pass's
            if open_.size and verified is not None:
                again, tighter = _every_neuron(
                    net, [chunk[b] for b in open_], rows[k], verified, (bnd, open_)
                )
                best[open_] = np.fmax(best[open_], again)
                at = {b: (tighter, i) for i, b in enumerate(open_)}
            for b, leaf in enumerate(chunk):
                if best[b] > 0 or verified is None:
                    out.append((k, leaf.index, "bounds" if best[b] > 0 else "", "by its own bounds alone"))
                    continue
                if by_halves(net, rows[k], leaf, verified):
                    out.append((k, leaf.index, "halves", "by halving its box"))
                    continue
                over, i = at.get(b, (bnd, b))
                value, status = (
                    lp.Solver(lp.build(net, over, i, rows[k])).minimum()
                    if over.finite[i]
                    else (-np.inf, NOT_FINITE)
                )
                why = f"at {leaf.path}: not discharged: lower bound {best[b]:.6g} by back-substitution, "
                why += f"{value:.6g} by the LP ({status})"
                deeper = (
                    by_lp_bounds(net, rows[k], leaf, verified) if status == "optimal" and value <= 0 else None
                )
                if deeper is not None:
                    value, status = deeper
                    why += f", {value:.6g} by the LP over LP bounds ({status})"
                out.append((k, leaf.index, "lp" if value > 0 else _failed(status), why))
                if not out[-1][2]:  # refuted: the proof is invalid; the later leaves cannot be the first
                    return out
    return out


def _every_neuron(
    net: onnx_net.Net, items: list, rows: query.Rows, verified: dict, first: tuple
) -> tuple[np.ndarray, bounds.Bounds]:
    """The leaves' objective again, with CROWN on every neuron of each activation's input, stable ones
    too, within the bounds of the first pass (``first``: its bounds and these leaves' rows in them);
    where that falls short and the clause has several rows, also under the weighting of the rows that
    :func:`bounds.row_weights` finds; and the bounds, the tighter ones for the LP fallback (a leaf of
    dist_shift that α-CROWN closed: -3.9e-11 by the LP over the first pass's bounds, 0.13 over
    these). A verifier that bounds its boxes in batches refines the neurons any
    box of a batch has unstable, which tightens a box's later layers beyond its own pass (the native
    engine's input split on small networks: 12 of the 113 leaves of a two-network ACAS Xu query, each
    an LP over LP bounds without this, 0 with it); α,β-CROWN's clipping drops what lies outside several
    rows' half-spaces at once (ACAS Xu 1_1 property 3: 433 of 22,393 leaves that no row alone closes)."""
    batch = batches.of(net, items, len(rows.d), verified)
    before, mine = first
    for z in range(len(net.nodes)):  # (every bound of either pass is valid: their intersection is)
        lo, hi = batch.claims.get(z, (-np.inf, np.inf))
        batch.claims[z] = (np.fmax(lo, before.lower[z][mine]), np.fmin(hi, before.upper[z][mine]))
    with np.errstate(all="ignore"):
        bnd = bounds.node_bounds(net, batch, every=True)
        best = bounds.objective(net, rows, bnd, batch)
        if len(rows.d) > 1 and not (best > 0).all():
            batch.lam = np.concatenate(
                [batch.lam, bounds.row_weights(net, rows, bnd, batch)[:, None]], axis=1
            )
            best = np.fmax(best, bounds.objective(net, rows, bnd, batch))
    return best, bnd


HALVES = (8, 2, 3)  # the halving fallback: inputs of non-zero width at most, inputs halved per step, steps


def by_halves(net: onnx_net.Net, rows: query.Rows, leaf: Leaf, verified: dict) -> bool:
    """Whether the leaf closes in parts: its box halved across its ``HALVES[1]`` widest inputs, each part
    bounded with CROWN on every neuron, those left open halved again, up to ``HALVES[2]`` times; on
    inputs of at most ``HALVES[0]`` non-zero widths, where this closes a leaf α-CROWN closed with slopes
    the proof does not carry (α,β-CROWN's input split: each box's intermediate slopes) more cheaply
    than its LPs. Parts ``[l, m]`` and ``[m, u]`` share the float ``m``: they tile the box exactly."""
    if np.count_nonzero(leaf.upper > leaf.lower) > HALVES[0]:
        return False
    open_ = [leaf]
    for _ in range(HALVES[2]):
        parts = [p for x in open_ for p in _halved(x, HALVES[1])]
        batch = batches.of(net, parts, len(rows.d), verified)
        with np.errstate(all="ignore"):
            best = bounds.objective(net, rows, bounds.node_bounds(net, batch, every=True), batch)
        open_ = [p for p, b in zip(parts, best, strict=True) if not b > 0]
        if not open_:
            return True
    return False


def _halved(leaf: Leaf, k: int) -> list[Leaf]:
    """The leaf's box cut in half across each of its ``k`` widest inputs (``2^k`` parts)."""
    parts = [leaf]
    width = 0.5 * leaf.upper - 0.5 * leaf.lower  # (no overflow)
    for dim in [d for d in np.argsort(-width, kind="stable") if width[d] > 0][:k]:
        halves = []
        for x in parts:
            lo, hi = x.lower.copy(), x.upper.copy()
            lo[dim] = hi[dim] = min(max(0.5 * x.lower[dim] + 0.5 * x.upper[dim], x.lower[dim]), x.upper[dim])
            halves += [dataclasses.replace(x, upper=hi), dataclasses.replace(x, lower=lo)]
        parts = halves
    return parts


LP_BOUNDS_MAX = (2000, 5000)  # the LP over LP bounds: unstable neurons (2 LPs each), the LP's variables


def by_lp_bounds(net: onnx_net.Net, rows: query.Rows, leaf: Leaf, verified: dict) -> tuple[float, str] | None:
    """The last fallback of a leaf: its ReLUs' input bounds by LPs, layer by layer (each unstable
    neuron's minimum and maximum over the LP of the layers below, themselves so bounded; after each
    layer, the bound pass over what is so far proved, which may close the leaf), then the clause's LP
    over them; ``(a rigorous lower bound of τ, the status)``. Bounds so made are at least as
    tight as any that CROWN or interval propagation derive in any order or batch (each such bound is a
    feasible dual of an LP over looser bounds), so a leaf that a verifier's CROWN closed, with
    intermediate bounds the checker's own pass does not reproduce, closes here. Tried within
    ``LP_BOUNDS_MAX`` (MLPs, not conv nets); else None."""
    if sum(net.sizes) > LP_BOUNDS_MAX[1]:
        return None
    batch = batches.of(net, [leaf], len(rows.d), verified)
    count = 0
    smooth = {n.src for n in net.nodes if isinstance(n, onnx_net.Sigmoid)}  # every neuron is curved
    for z in sorted({n.src for n in net.nodes if isinstance(n, (onnx_net.Relu, onnx_net.Sigmoid))}):
        with np.errstate(all="ignore"):
            bnd = bounds.node_bounds(net, batch, every=True)
            best = bounds.objective(net, rows, bnd, batch)[0] if count else -np.inf
        if bnd.empty[0] or not bnd.finite[0]:
            return (np.inf, "optimal") if bnd.empty[0] else (-np.inf, NOT_FINITE)
        if best > 0:  # the layers below, so bounded, are enough
            return best, "optimal"
        lo, hi = bnd.lower[z].copy(), bnd.upper[z].copy()
        unstable = np.flatnonzero((lo[0] < hi[0]) if z in smooth else (lo[0] < 0) & (hi[0] > 0))
        count += len(unstable)
        if count > LP_BOUNDS_MAX[0]:
            return None
        if not len(unstable):
            continue
        bnd.own[z] = (lo, hi)
        solver, at = lp.Solver(lp.build(net, bnd, 0, top=z), many=True), sum(net.sizes[:z])
        for j, sign in ((j, s) for j in unstable for s in (1.0, -1.0)):
            value, status = _neuron_minimum(solver, at + j, sign)
            if status == "infeasible" and value == np.inf:
                return np.inf, "infeasible"
            if status != "optimal":
                return -np.inf, status
            if sign > 0:
                lo[0, j] = max(lo[0, j], value)
            else:
                hi[0, j] = min(hi[0, j], -value)
        old = batch.claims.get(z, (lo, hi))
        batch.claims[z] = (np.fmax(old[0], lo), np.fmin(old[1], hi))
    with np.errstate(all="ignore"):
        bnd = bounds.node_bounds(net, batch, every=True)
        best = bounds.objective(net, rows, bnd, batch)[0]
    if best > 0 or not bnd.finite[0]:
        return (best, "optimal") if best > 0 else (-np.inf, NOT_FINITE)
    return lp.Solver(lp.build(net, bnd, 0, rows)).minimum()


def verify(
    net: onnx_net.Net, item: tree.Claims, above: dict, pool: _Pool | None = None
) -> tuple[bool, object]:
    """A bounds node's claims, as hints, layer by layer over its region (``above``: the verified bounds
    of the bounds nodes above it). Where the checker's own bounds (interval propagation; CROWN only
    where a claim needs it, :func:`_layer_claims`) leave a neuron unstable (elsewhere a claim changes
    nothing the bounds use, and is left out) and the claim is tighter, the claim's slopes, CROWN, or
    an LP over the nodes up to its layer decide: the claim where one reaches it, else the rigorous bound
    (a float32 claim may miss the truth by its rounding; the later layers are then bounded again over
    what was proved). ``(True, {layer id: (lower, upper)})``: the bounds proved; ``(False, (obligation,
    index, "undecided", why))`` where an LP stopped at its time limit. ``pool``: where a layer's LPs
    are dealt (else in this process)."""
    batch = batches.of(net, [item], 0, above)
    pre = batches.claim_inputs(net)
    batch.checking = {pre[i]: _deciding(i, lo, hi) for i, (lo, hi) in item.claimed.items() if i in pre}
    order = sorted(((i, z) for i, z in pre.items() if z in batch.checking), key=lambda p: p[1])
    bnd, first = None, 0  # the nodes bounded up to each layer's input, its claims verified, and on
    for layer, z in [*order, (None, None)]:  # (the last: the nodes after every claimed layer)
        with np.errstate(all="ignore"):
            since = None if bnd is None else (bnd, first)
            bnd = bounds.node_bounds(net, batch, since=since, until=z, checked_crown=False)
        if z is not None:
            stale, outcome = _layer_claims(net, bnd, batch.checking[z], z, item, layer, pool or _Pool(net, 1))
            if outcome is not None:
                return False, outcome
            first = z if stale else z + 1  # (a claim changed: node z from its own bounds again)
    return True, {i: (bnd.lower[z][0], bnd.upper[z][0]) for i, z in pre.items() if z in batch.checking}


def _deciding(layer, lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's claims to verify, (1, n): of a ReLU's input, the side that decides a neuron's phase
    alone where the claims make it stable (the lower bound of a neuron claimed ``<= 0``, the upper
    bound of one claimed ``>= 0``: neither its ReLU's output nor its relaxation uses that side, so it
    is left at the checker's own bound rather than proved by an LP; claims with ``lower > upper``, an
    empty region, keep both); a Sigmoid's input: both sides."""
    lo, hi = lower[None].copy(), upper[None].copy()
    if isinstance(layer, int):  # (a Sigmoid layer's key is "s<id>")
        lo[0, (upper <= 0) & (lower <= upper)] = -np.inf
        hi[0, (lower >= 0) & (upper > lower)] = np.inf
    return lo, hi


def _layer_claims(
    net: onnx_net.Net, bnd: bounds.Bounds, claim: tuple, z: int, item: tree.Claims, layer: int, pool
):
    """One layer's claims (``claim``: its ``(lower, upper)``, (1, n)) where the own bounds fall short:
    by a backward pass with the claims' slopes (:func:`_by_claim_alpha`), else by CROWN's own
    (:func:`_by_own_crown`), else by an LP (dealt over
    ``pool``); a claim either misses (by float32 rounding, or more) becomes the bound it proved (never
    looser than the own). ``(whether a claim changed, None)``, or ``(…, outcome)`` where an LP stopped
    at its time limit."""
    own, used = bnd.own[z], (bnd.lower[z][0], bnd.upper[z][0])
    need = [(j, 1.0) for j in np.flatnonzero(~(own[0][0] >= used[0]))]
    need += [(j, -1.0) for j in np.flatnonzero(~(own[1][0] <= used[1]))]
    near = {
        (j, s): v for j, s in need if _reached(v := s * own[0 if s > 0 else 1][0][j], s, used, j) == "near"
    }
    need = [x for x in need if x not in near]  # the own bound within rounding of the claim
    need, by_slopes = _by_claim_alpha(net, bnd, z, item.alpha.get(layer), need, used)
    # CROWN's own bound, skipped by the pass, where the slopes fell short and where a neuron stays
    # unstable under the claims (its own bound may be the tighter there: looser bounds below it would
    # leave later claims to LPs)
    unstable = (used[0] < 0) & (used[1] > 0) if isinstance(layer, int) else used[0] <= used[1]
    asked = set(need)
    tighten = [(j, s) for j in np.flatnonzero(unstable) for s in (1.0, -1.0) if (j, s) not in asked]
    need, by_own = _by_own_crown(net, bnd, z, (need, tighten), used, own, isinstance(layer, int))
    missed = near | by_slopes | by_own
    if need:
        model, first, w = lp.build(net, bnd, 0, top=z), sum(net.sizes[:z]), min(pool.workers, len(need))
        parts = pool.map(_minima, [(model, [(first + j, s) for j, s in need[k::w]]) for k in range(w)])
        minima = [None] * len(need)
        for k, part in enumerate(parts):
            minima[k::w] = part + [(None, lp.TIME_LIMIT)] * (len(minima[k::w]) - len(part))
        for (j, sign), (value, status) in zip(need, minima, strict=True):
            if status == lp.TIME_LIMIT:
                side = "lower" if sign > 0 else "upper"
                why = f"at {item.path}: the LP of the {side} bound of layer {layer} neuron {j}"
                return bool(missed), (
                    item.obligation,
                    item.index,
                    UNDECIDED,
                    why + " stopped at its time limit",
                )
            if not value >= sign * used[0 if sign > 0 else 1][j]:  # min of ±z_j does not reach ±claim
                missed[j, sign] = value
    for (j, sign), value in missed.items():
        if sign > 0:
            claim[0][0, j] = max(own[0][0][j], value)
        else:
            claim[1][0, j] = min(own[1][0][j], -value)
    return bool(missed), None


def _minima(net: onnx_net.Net, model: lp.Lp, columns: list) -> list[tuple[float, str]]:
    """For each ``(column, sign)``: a rigorous lower bound of ``sign`` times the LP's variable, and the
    LP's status; none after one that stopped at its time limit."""
    solver, out = lp.Solver(model, many=True), []
    for column, sign in columns:
        out.append(_neuron_minimum(solver, column, sign))
        if out[-1][1] == lp.TIME_LIMIT:
            break
    return out


NEAR = 2.0**-12  # a claim that its slopes miss by at most this much of its interval's size: float32 rounding


def _by_claim_alpha(net: onnx_net.Net, bnd: bounds.Bounds, z: int, alpha, need: list, used: tuple):
    """The claims of ``need`` (``(neuron, +1 lower | -1 upper)``) checked by one backward pass from node
    ``z`` with the claims' slopes (``alpha``: ``Claims.alpha`` of the layer): ``(those it leaves to the LP,
    {claim: the bound proved} where it misses by at most ``NEAR`` of the claimed interval's size, the
    float32 rounding of the verifier's sums)``; the claims it reaches are in neither."""
    if alpha is None:
        return need, {}
    neurons, sides = alpha
    row = {(int(j), s): m for s, side in ((1.0, "lower"), (-1.0, "upper")) for m, j in enumerate(neurons)}
    given = [(j, s) for j, s in need if (j, s) in row]
    layers = {r.id: r.node for r in net.relu_layers if r.node >= 0}
    smooth = {f"s{r.id}": r.node for r in net.sigmoid_layers if r.node >= 0}
    done, near = set(), {}
    for part, A in _claim_rows(net, z, given):
        slopes, points = _given(layers, sides, part, row), _given(smooth, sides, part, row)
        batch = bounds.Batch(bnd.lower[0], bnd.upper[0], {}, slopes, {}, A, points=points)
        with np.errstate(all="ignore"):
            res = bounds.best_backward(net.nodes, bnd, z, A, batch)[0]
        for (j, s), value in zip(part, res, strict=True):
            reached = _reached(value, s, used, j)
            if reached == "yes":
                done.add((j, s))
            elif reached == "near":
                near[j, s] = value
    return [x for x in need if x not in done and x not in near], near


def _by_own_crown(
    net: onnx_net.Net, bnd: bounds.Bounds, z: int, todo: tuple, used: tuple, own: tuple, relu: bool
):
    """CROWN's own bounds (adaptive slopes) of the claims ``todo``: ``(need, tighten)``, those the claims'
    slopes left, and proved ones where the own bound may be the tighter; each own bound (``own``, (1, n)
    arrays) raised to what it proves; ``(the claims of need left to the LP, {claim: the bound proved}
    where it misses by at most NEAR, the own bound is the tighter, or (``relu``: of a ReLU's input)
    it makes the neuron stable, where no claim is used)``."""
    left, proved, need = [], {}, set(todo[0])
    for part, A in _claim_rows(net, z, todo[0] + todo[1]):
        with np.errstate(all="ignore"):
            res = bounds.best_backward(net.nodes, bnd, z, A, None)[0]
        for (j, s), value in zip(part, res, strict=True):
            side = own[0 if s > 0 else 1][0]
            side[j] = max(side[j], value) if s > 0 else min(side[j], -value)
            reached = _reached(value, s, used, j) if (j, s) in need else "yes"
            if reached is None and not (relu and (own[0][0][j] >= 0 or own[1][0][j] <= 0)):
                left.append((j, s))
            elif reached != "yes" or s * side[j] > s * used[0 if s > 0 else 1][j]:
                proved[j, s] = value
    return left, proved


def _claim_rows(net: onnx_net.Net, z: int, claims: list):
    """Node ``z``'s claims ``(neuron, ±1)`` in parts that fit one backward pass, each with its rows
    ``(1, len(part), n)``: ``±1`` at the claim's neuron."""
    step = max(1, _BATCH_FLOATS // max(net.sizes))
    for start in range(0, len(claims), step):
        part = claims[start : start + step]
        A = np.zeros((1, len(part), net.sizes[z]))
        A[0, np.arange(len(part)), [j for j, _ in part]] = [s for _, s in part]
        yield part, A


def _given(layers: dict, sides: dict, part: list, row: dict) -> dict:
    """What the claims of ``part`` give at the layers ``layers`` (key -> its node): a ReLU layer's slopes
    (1, Q, n), a Sigmoid layer's pair of those, its two lines' points (NaN: none given)."""
    out: dict = {}
    for layer, node in layers.items():
        for q, (j, s) in enumerate(part):
            given = sides["lower" if s > 0 else "upper"].get(layer)
            if given is None:
                continue
            arrays = given if isinstance(given, tuple) else (given,)
            if node not in out:
                out[node] = [np.full((1, len(part), a.shape[1]), np.nan) for a in arrays]
            for store, a in zip(out[node], arrays, strict=True):
                store[0, q] = a[row[(j, s)]]
    return {node: tuple(v) if len(v) > 1 else v[0] for node, v in out.items()}


def _reached(value: float, s: float, used: tuple, j: int) -> str | None:
    """Whether ``value``, a proved lower bound of ``s · z_j``, reaches the claim on ``z_j`` (``used``:
    the claimed ``(lower, upper)``): ``"yes"``, ``"near"`` (it misses by at most ``NEAR`` of the claimed
    interval's size), or None (a NaN is neither)."""
    lo, hi = used[0][j], used[1][j]
    claim = s * (lo if s > 0 else hi)
    if value >= claim:
        return "yes"
    if np.isfinite(hi - lo) and value >= claim - NEAR * (abs(lo) + abs(hi)):
        return "near"
    return None


def _neuron_minimum(solver: lp.Solver, column: int, sign: float) -> tuple[float, str]:
    """A rigorous lower bound of ``sign`` times the LP's variable ``column`` (a neuron's value), and
    the LP's status."""
    c = np.zeros(len(solver.lp.lo))
    c[column] = sign
    return solver.minimum(c)


def _failed(lp_status: str) -> str:
    """The kind of an outcome the LP did not close: refuted (``""``: solved, or a bound not finite), or
    undecided (it stopped at its time limit, or HiGHS gave no answer)."""
    return "" if lp_status in ("optimal", "infeasible", NOT_FINITE) else UNDECIDED
