"""The independent proof checker (``complete_verifier_ext/check``, docs/proofs.md) on tiny generated nets:
hand-computed bounds, proofs built here by bisection with this file's own interval arithmetic, phase
splits closed by multipliers or the LP fallback, and proofs that must be refused (a leaf removed, a
phase child missing, a cut point outside its box, a shrunk box, another property, another network, a
sat instance, a margin only a naive float64 evaluation finds positive); the command line; the real
ACAS Xu network on a part of property 1 (the whole property: ``CVE_CHECK_ACASXU=1``, a benchmark)."""

from __future__ import annotations

import ast
import copy
import gzip
import hashlib
import itertools
import json
import os
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from complete_verifier_ext import proofs, solver_cli
from complete_verifier_ext.check import batches, bounds, check_proof, discharge, onnx_net, query, tree
from complete_verifier_ext.check.files import read_bytes

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "benchmarks"
ABS = [(np.array([[1.0], [-1.0]]), np.zeros(2)), (np.array([[1.0, 1.0]]), np.zeros(1))]  # y = |x|


# ------------------------------------------------------------------------------------------------------
# instances
# ------------------------------------------------------------------------------------------------------


def save_net(path: Path, layers, dtype=TensorProto.DOUBLE, act: str | tuple = "Relu") -> Path:
    """Gemm layers ``(W (out, in), b)`` with a Relu (``act``, or ``act[i]`` after layer ``i``; output
    ``h{i}``) between consecutive ones."""
    nodes, inits, prev = [], [], "x"
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    for i, (W, b) in enumerate(layers):
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"b{i}"], [f"z{i}"], transB=1))
        inits += [numpy_helper.from_array(np.asarray(W, np_type), f"W{i}")]
        inits += [numpy_helper.from_array(np.asarray(b, np_type), f"b{i}")]
        prev = f"z{i}"
        if i < len(layers) - 1:
            nodes.append(helper.make_node(act if isinstance(act, str) else act[i], [prev], [f"h{i}"]))
            prev = f"h{i}"
    x = helper.make_tensor_value_info("x", dtype, [1, layers[0][0].shape[1]])
    y = helper.make_tensor_value_info(prev, dtype, [1, layers[-1][0].shape[0]])
    model = helper.make_model(helper.make_graph(nodes, "net", [x], [y], inits))
    data = model.SerializeToString()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def save_query(path: Path, lower, upper, rows) -> Path:
    """Inputs in ``[lower, upper]``; rows ``(c, d)``: the counterexamples meet every ``c · Y <= d``."""
    n_out = len(rows[0][0])
    text = "".join(f"(declare-const X_{i} Real)\n" for i in range(len(lower)))
    text += "".join(f"(declare-const Y_{j} Real)\n" for j in range(n_out))
    for i, (lo, hi) in enumerate(zip(lower, upper, strict=True)):
        text += f"(assert (>= X_{i} {exact(lo)}))\n(assert (<= X_{i} {exact(hi)}))\n"
    for c, d in rows:
        terms = " ".join(f"(* {float(v)!r} Y_{j})" for j, v in enumerate(c) if v)
        text += f"(assert (<= (+ {terms}) {float(d)!r}))\n"
    path.write_bytes(gzip.compress(text.encode()) if path.suffix == ".gz" else text.encode())
    return path


def exact(v: float) -> str:
    """The decimal that is exactly the float ``v`` (the query's box is then the box of the proof)."""
    return str(Decimal(float(v)))


def sha(path: Path) -> str:
    return hashlib.sha256(read_bytes(str(path))).hexdigest()


def proof(q: Path, n: Path, layers, obligations: list[dict]) -> dict:
    relus = [{"id": i, "output": f"h{i}", "size": len(W)} for i, (W, _) in enumerate(layers[:-1])]
    about = {
        "vnnlib": {"path": q.name, "sha256": sha(q)},
        "networks": [{"name": "N", "path": n.name, "sha256": sha(n)}],
    }
    return {"format": "cve-proof-1", "query": about, "producer": {"engine": "test"}, "relu_layers": relus,
            "obligations": obligations}  # fmt: skip


def obligation(lower, upper, rows, node: dict) -> dict:
    box = {"lower": [float(v) for v in lower], "upper": [float(v) for v in upper]}
    C, d = [list(map(float, c)) for c, _ in rows], [float(d) for _, d in rows]
    return {"box": box, "rows": {"C": C, "d": d}, "tree": node}


def without_halves(monkeypatch) -> None:
    """The checker without its halving fallback (``by_halves``): a leaf its bound passes leave open goes
    to the LP."""
    import complete_verifier_ext.check as checker

    monkeypatch.setattr(checker, "HALVES", (0, *checker.HALVES[1:]))


@pytest.fixture
def no_halves(monkeypatch):
    without_halves(monkeypatch)


def check(tmp_path: Path, doc: dict, q: Path, n: Path, workers: int = 1):
    p = tmp_path / "proof.json"
    p.write_text(json.dumps(doc))
    return check_proof(str(q), {"N": str(n)}, str(p), workers)


def abs_instance(tmp_path: Path, d: float = -0.25, node: dict | None = None):
    """``y = |x|`` on ``[-1, 2]``, counterexamples ``y <= d``; the proof: one obligation, tree ``node``."""
    rows = [([1.0], d)]
    q, n = save_query(tmp_path / "abs.vnnlib", [-1.0], [2.0], rows), save_net(tmp_path / "abs.onnx", ABS)
    return proof(q, n, ABS, [obligation([-1.0], [2.0], rows, node or {"leaf": {}})]), q, n


def random_layers(seed: int, sizes=(3, 8, 8, 2)):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(o, i)) / np.sqrt(i), rng.normal(size=o) * 0.1)
        for i, o in zip(sizes, sizes[1:], strict=False)
    ]


# ------------------------------------------------------------------------------------------------------
# this file's own reference: plain float64 interval arithmetic and bisection (a margin of 1e-6 covers its
# rounding; the checker decides)
# ------------------------------------------------------------------------------------------------------


def forward(layers, x: np.ndarray, act=lambda z: np.maximum(z, 0)) -> np.ndarray:
    for i, (W, b) in enumerate(layers):
        x = x @ W.T + b
        x = act(x) if i < len(layers) - 1 else x
    return x


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def interval(layers, lo: np.ndarray, hi: np.ndarray):
    for i, (W, b) in enumerate(layers):
        c, r = (lo + hi) / 2 @ W.T + b, (hi - lo) / 2 @ np.abs(W).T
        lo, hi = c - r, c + r
        if i < len(layers) - 1:
            lo, hi = np.maximum(lo, 0), np.maximum(hi, 0)
    return lo, hi


def bisect(layers, c: np.ndarray, d: float, lo: np.ndarray, hi: np.ndarray, depth: int = 0) -> dict:
    """A tree of input splits whose leaves have ``c · y - d > 0`` by interval arithmetic; every other
    split cuts the widest dimension at two points, the rest at one."""
    ylo, yhi = interval(layers, lo, hi)
    if np.maximum(c, 0) @ ylo + np.minimum(c, 0) @ yhi - d > 1e-6:
        return {"leaf": {}}
    assert depth < 40, "the bisection does not end"
    dim = int(np.argmax(hi - lo))
    at = [lo[dim] + (hi[dim] - lo[dim]) * f for f in ((0.5,) if depth % 2 else (1 / 3, 2 / 3))]
    cuts, kids = [lo[dim], *at, hi[dim]], []
    for a, b in zip(cuts, cuts[1:], strict=False):
        k_lo, k_hi = lo.copy(), hi.copy()
        k_lo[dim], k_hi[dim] = a, b
        kids.append(bisect(layers, c, d, k_lo, k_hi, depth + 1))
    return {"input": {"dim": dim, "at": [float(v) for v in at]}, "children": kids}


def bisection_instance(tmp_path: Path, seed: int = 0, suffix: str = ""):
    """A random 3-8-8-2 net on ``[-1, 1]^3``, counterexamples ``y_0 - y_1 <= d`` with ``d`` below the
    sampled minimum by a third of the range; the proof by :func:`bisect`."""
    layers = random_layers(seed)
    lo, hi = -np.ones(3), np.ones(3)
    margins = forward(layers, np.random.default_rng(1).uniform(lo, hi, (4000, 3))) @ np.array([1.0, -1.0])
    d = float(np.round(margins.min() - (margins.max() - margins.min()) / 3, 3))
    rows = [([1.0, -1.0], d)]
    q = save_query(tmp_path / f"q.vnnlib{suffix}", lo, hi, rows)
    n = save_net(tmp_path / f"net.onnx{suffix}", layers)
    node = bisect(layers, np.array([1.0, -1.0]), d, lo, hi)
    return proof(q, n, layers, [obligation(lo, hi, rows, node)]), q, n, layers


def count_leaves(node: dict) -> int:
    return 1 if "leaf" in node else sum(count_leaves(k) for k in node["children"])


# ------------------------------------------------------------------------------------------------------
# proofs that hold
# ------------------------------------------------------------------------------------------------------


def test_abs_by_hand(tmp_path, monkeypatch):
    """``|x| = relu(x) + relu(-x)`` on ``[-1, 2]``, ``|x| <= -1/4`` unsat: the exact bound is 1/4 (at x = 0).
    CROWN's adaptive slopes (1 and 0) give ``y >= x``, ``-3/4``; halving the box closes the leaf, and
    without that the LP fallback does; slopes 1/2 and 1/2 as evidence give ``y >= 0`` and close it
    with the bound pass, at 1/4 from below."""
    doc, q, n = abs_instance(tmp_path)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_halves, r.by_lp) == ("valid", 1, 0, 1, 0), r
    without_halves(monkeypatch)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_halves, r.by_lp) == ("valid", 1, 0, 0, 1), r
    doc["obligations"][0]["tree"] = {"leaf": {"alpha": {"0": [0.5, 0.5]}, "lambda": [1.0]}}
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.by_bounds, r.by_lp) == ("valid", 1, 0), r

    net = onnx_net.parse(read_bytes(str(tmp_path / "abs.onnx")), "abs")
    rows = query.parse(read_bytes(str(q))).obligations[0].rows
    for alpha, expected in ((np.nan, -0.75), (0.5, 0.25)):
        batch = bounds.Batch(np.array([[-1.0]]), np.array([[2.0]]), {}, {2: np.full((1, 2), alpha)}, {},
                             np.ones((1, 1, 1)))  # fmt: skip
        got = bounds.objective(net, rows, bounds.node_bounds(net, batch), batch)[0]
        assert expected - 1e-12 < got <= expected


def test_abs_with_a_zero_margin_is_invalid(tmp_path):
    """``|x| <= 0`` holds at ``x = 0``: the margin's minimum is exactly 0, never ``> 0``."""
    doc, q, n = abs_instance(tmp_path, d=0.0, node={"leaf": {"alpha": {"0": [0.5, 0.5]}}})
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and r.message.startswith("obligation 0 leaf 0: at root: not discharged"), r


def test_alpha_for_some_neurons_is_read_by_neuron(tmp_path):
    """``alpha`` as an object ``{neuron: slope}`` (what the native engine writes: the leaf's unstable
    neurons): those slopes, the checker's own elsewhere; a neuron the layer does not have is refused."""
    doc, q, n = abs_instance(tmp_path, node={"leaf": {"alpha": {"0": {"1": 1.0}}}})  # own slopes: LP
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.by_bounds) == ("valid", 1), r
    doc, q, n = abs_instance(tmp_path, node={"leaf": {"alpha": {"0": {"5": 0.25}}}})
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and "alpha of layer 0: neuron" in r.message, r


def test_phase_split_closed_by_beta_or_the_lp(tmp_path, no_halves):
    """Split ``relu(x)``: where ``x <= 0`` the bound pass proves ``y >= 0``; where ``x >= 0`` it needs the
    phase: ``β = 1`` adds ``-x`` (``y >= x + 0 - x``), or the LP fallback (which has ``z >= 0``) does it."""
    split = {"relu": {"layer": 0, "neuron": 0}, "children": [{"leaf": {}}, {"leaf": {}}]}
    doc, q, n = abs_instance(tmp_path, node=split)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_lp) == ("valid", 2, 1, 1), r
    split["children"][1] = {"leaf": {"beta": {"0": {"0": 1.0}}}}
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_lp) == ("valid", 2, 2, 0), r


def test_sigmoid_lines_and_values_hold_in_real_arithmetic():
    """``sigmoid.lines``, ``sigmoid.tangents`` and ``sigmoid.lines_at`` (the hull's lines at a random point
    of the interval, at one left of it, at its right end; the upper line at another of these) on
    intervals below, above and across 0, tiny, wide and far out (where ``e^-z`` overflows in float64),
    and ``sigmoid.value_bounds``: every line below / above σ at 41 points of its interval and every
    enclosure around σ, with σ and the lines' values in 40-digit arithmetic."""
    mpmath = pytest.importorskip("mpmath")
    from complete_verifier_ext.check import sigmoid

    mpmath.mp.dps = 40
    rng = np.random.default_rng(0)
    c, w = rng.normal(size=200) * 4, np.abs(rng.normal(size=200)) * rng.choice([1e-6, 0.1, 1, 5, 30], 200)
    l, u = (
        np.concatenate([c - w, [-800, -740, -40, 0, -1e-9, 700]]),
        np.concatenate([c + w, [-700, -700, 40, 0, 1e-9, 710]]),
    )
    k_lo, c_lo, k_up, c_up = sigmoid.lines(l, u)
    k_t, lo_t, hi_t = sigmoid.tangents(l, u, 3)
    v_lo, v_hi = sigmoid.value_bounds(np.concatenate([l, u]))
    p = np.stack([rng.uniform(l, u), l - 1.0, u, np.full(len(l), np.nan)], axis=1)  # (a NaN: lines of NaN)
    at = sigmoid.lines_at(l[:, None], u[:, None], p, p[:, ::-1])  # (the upper line at other points)

    def sig(z):
        return 1 / (1 + mpmath.exp(-mpmath.mpf(z)))

    for i in range(len(l)):
        for z in np.linspace(l[i], u[i], 41):
            exact = sig(z)
            assert (
                mpmath.mpf(k_lo[i]) * z + mpmath.mpf(c_lo[i])
                <= exact
                <= mpmath.mpf(k_up[i]) * z + mpmath.mpf(c_up[i])
            )
            for a_lo, b_lo, a_up, b_up in zip(*(x[i] for x in at), strict=True):
                if np.isfinite([a_lo, b_lo]).all():
                    assert mpmath.mpf(a_lo) * z + mpmath.mpf(b_lo) <= exact
                if np.isfinite([a_up, b_up]).all():
                    assert exact <= mpmath.mpf(a_up) * z + mpmath.mpf(b_up)
            for k, c_below, c_above in zip(k_t[i], lo_t[i], hi_t[i], strict=True):
                assert (
                    mpmath.mpf(k) * z + mpmath.mpf(c_below)
                    <= exact
                    <= mpmath.mpf(k) * z + mpmath.mpf(c_above)
                )
    assert all(a <= sig(z) <= b for z, a, b in zip(np.concatenate([l, u]), v_lo, v_hi, strict=True))
    # CROWN's lines as auto_LiRPA draws them: across 0, the tangent at the midpoint where that lies left
    # of the point whose tangent passes through (u, σ(u)) (on [-4, 0.5]: -1.75), else at that point
    k_lo, _, _, _ = sigmoid.lines(np.array([-4.0, -4.0]), np.array([0.5, 4.0]))
    m = np.array([-1.75, 0.0])
    assert np.isclose(k_lo[0], sigmoid.sigma(m[0]) * (1 - sigmoid.sigma(m[0])))
    assert k_lo[1] < sigmoid.sigma(-1.0) * (1 - sigmoid.sigma(-1.0))  # (the point there: about -1.5)
    # CROWN's lines: on a narrow interval both lines are within its rounding of σ
    k_lo, c_lo, k_up, c_up = sigmoid.lines(np.array([0.3]), np.array([0.3 + 1e-4]))
    assert 0 < (k_up - k_lo)[0] * 0.3 + (c_up - c_lo)[0] < 1e-8


def sigmoid_instance(tmp_path: Path, margin: float, cuts: tuple = ()):
    """A 3-8-8-2 net with Sigmoids between its Gemms on ``[-1, 1]^3``, counterexamples ``y_0 - y_1 <= d``,
    ``d`` the sampled minimum minus ``margin`` of the range (negative: a sampled point is one); a proof
    of one leaf, the whole box (``cuts``: the box cut at these points in each dimension)."""
    layers = random_layers(5)
    lo, hi = -np.ones(3), np.ones(3)
    margins = forward(layers, np.random.default_rng(1).uniform(lo, hi, (4000, 3)), sigmoid) @ np.array(
        [1.0, -1.0]
    )
    d = float(margins.min() - margin * (margins.max() - margins.min()))
    rows = [([1.0, -1.0], d)]
    q = save_query(tmp_path / "q.vnnlib", lo, hi, rows)
    n = save_net(tmp_path / "sig.onnx", layers, act="Sigmoid")
    node = {"leaf": {}}
    for dim in range(3 if cuts else 0):
        node = {
            "input": {"dim": dim, "at": list(cuts)},
            "children": [copy.deepcopy(node) for _ in range(len(cuts) + 1)],
        }
    doc = proof(q, n, layers, [obligation(lo, hi, rows, node)])
    doc["relu_layers"] = []
    return doc, q, n


def test_sigmoid_net_proofs(tmp_path, no_halves):
    """A sigmoid net (dist_shift's generator ends in a Sigmoid): a property with a margin of a fifth of
    the sampled range closes on the whole box by the bound pass; one of a tenth by the LP (CROWN's
    lines alone leave it at 0, the tangents of ``lp.TANGENTS`` close it); one of a twentieth not on
    the whole box, on the box cut in four along each dimension; one that a sampled point violates is
    ``invalid``."""
    doc, q, n = sigmoid_instance(tmp_path, 0.2)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds) == ("valid", 1, 1), r
    doc, q, n = sigmoid_instance(tmp_path, 0.1)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_lp) == ("valid", 1, 1), r
    doc, q, n = sigmoid_instance(tmp_path, 0.05)
    assert check(tmp_path, doc, q, n).status == "invalid"
    doc, q, n = sigmoid_instance(tmp_path, 0.05, cuts=(-0.5, 0.0, 0.5))
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves) == ("valid", 64), r
    doc, q, n = sigmoid_instance(tmp_path, -0.01)
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and "not discharged" in r.message, r


def relu_counterexample_instance(tmp_path: Path, seed: int):
    """A random 3-8-8-2 ReLU net on ``[-1, 1]^3``, counterexamples ``y_0 - y_1 <= d`` with ``d`` just above
    a sampled point's margin (that point is one); a proof of one leaf, the whole box."""
    layers = random_layers(seed)
    lo, hi = -np.ones(3), np.ones(3)
    margins = forward(layers, np.random.default_rng(seed).uniform(lo, hi, (4000, 3))) @ np.array([1.0, -1.0])
    rows = [([1.0, -1.0], float(margins.min() + 1e-3))]
    q, n = save_query(tmp_path / "q.vnnlib", lo, hi, rows), save_net(tmp_path / "n.onnx", layers)
    return proof(q, n, layers, [obligation(lo, hi, rows, {"leaf": {}})]), q, n


def test_halving_closes_a_leaf_in_parts_and_never_one_with_a_counterexample(tmp_path):
    """The checker's halving fallback (``by_halves``): the sigmoid net's one-leaf proof with a margin of a
    twentieth of the range, which the bound pass and the LP leave open on the whole box, closes in
    halves; a leaf whose box holds a counterexample (the sigmoid net's, three ReLU nets') stays open
    whatever the parts: ``invalid``, naming the leaf."""
    doc, q, n = sigmoid_instance(tmp_path, 0.05)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_halves, r.by_lp) == ("valid", 1, 0, 1, 0), r
    for k in range(4):
        (tmp_path / str(k)).mkdir()
        made = relu_counterexample_instance if k else lambda t, _: sigmoid_instance(t, -0.01)
        doc, q, n = made(tmp_path / str(k), k)
        r = check(tmp_path / str(k), doc, q, n)
        assert r.status == "invalid" and r.message.startswith("obligation 0 leaf 0: at root: not"), r


def test_halved_parts_tile_the_leafs_box():
    """``_halved``: ``2^k`` parts across the ``k`` widest inputs of non-zero width, each inside the box,
    the cut dimensions' volumes summing to the box's exactly (as rationals) and every sampled point,
    corner and midpoint in some part: they tile it, also where the midpoint rounds (a subnormal width,
    a width of 2e308)."""
    from complete_verifier_ext.check import _halved

    rng = np.random.default_rng(0)
    boxes = [np.sort(rng.uniform(-3, 3, (2, 5)), axis=0) for _ in range(5)]
    boxes += [np.array([[0.0, 1.0, 2.0, -1e308], [5e-324, 1.0, 3.0, 1e308]])]  # (a width of 0)
    boxes += [np.array([[0.1, 0.2], [0.1 + 2**-52, 0.7]])]
    for lo, hi in boxes:
        leaf = tree.Leaf(0, 0, "root", lo, hi, (), tree.Evidence())
        parts = _halved(leaf, 2)
        cut = [d for d in np.argsort(-(hi / 2 - lo / 2), kind="stable") if hi[d] > lo[d]][:2]
        assert len(parts) == 2 ** len(cut)
        for p in parts:
            assert (lo <= p.lower).all() and (p.lower <= p.upper).all() and (p.upper <= hi).all()
            rest = [d for d in range(len(lo)) if d not in cut]
            assert np.array_equal(p.lower[rest], lo[rest]) and np.array_equal(p.upper[rest], hi[rest])
        whole = np.prod([Fraction(hi[d]) - Fraction(lo[d]) for d in cut])
        volumes = [np.prod([Fraction(p.upper[d]) - Fraction(p.lower[d]) for d in cut]) for p in parts]
        assert sum(volumes) == whole
        f = rng.uniform(0, 1, (200, len(lo)))
        points = list((1 - f) * lo + f * hi)
        points += [np.where(c, hi, lo) for c in itertools.product([0, 1], repeat=len(lo))]
        points += [np.array([p.upper for p in parts]).min(0)]
        for x in points:
            x = np.clip(x, lo, hi)
            assert any(((p.lower <= x) & (x <= p.upper)).all() for p in parts), x


def test_the_sigmoid_hulls_lines_where_the_bound_is_attained_close_what_crowns_lines_do_not(tmp_path):
    """``y = σ(x)`` on ``[-4, 4]``, counterexamples ``y <= 0.01`` (none: ``σ(-4) = 0.018``). CROWN's
    lower line across 0 (the tangent through ``(4, σ(4))``, at about -1.5) is -0.19 at ``x = -4``; the
    bound pass's second try takes the hull's line at the value ``x`` takes where the first bound is
    attained (-4: the tangent there), and closes the leaf by itself."""
    layers = [(np.array([[1.0]]), np.array([0.0])), (np.array([[1.0]]), np.array([0.0]))]
    rows = [([1.0], 0.01)]
    q = save_query(tmp_path / "q.vnnlib", [-4.0], [4.0], rows)
    n = save_net(tmp_path / "n.onnx", layers, act="Sigmoid")
    doc = proof(q, n, layers, [obligation([-4.0], [4.0], rows, {"leaf": {}})])
    doc["relu_layers"] = []
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.by_bounds) == ("valid", 1), r
    net = onnx_net.parse(read_bytes(str(n)), "n")
    qrows = query.parse(read_bytes(str(q))).obligations[0].rows
    batch = bounds.Batch(np.array([[-4.0]]), np.array([[4.0]]), {}, {}, {}, np.ones((1, 1, 1)))
    bnd = bounds.node_bounds(net, batch)
    nodes, top = bounds._with_clause(net, qrows, bnd)
    crown, hull = (
        f(nodes, bnd, top, batch.lam, batch)[0, 0] for f in (bounds.backward, bounds.best_backward)
    )
    assert crown < -0.15 and 0.0079 < hull <= 1 / (1 + np.exp(4.0)) - 0.01, (crown, hull)


def sigmoid_relu_instance(tmp_path: Path, d: float, claims: dict):
    """``y = relu(2σ(x) - σ(x) + 0.2)`` on ``[-4, 4]``, its two sigmoids apart (the ReLU's input: minimum
    ``σ(-4) + 0.2 = 0.218``; interval propagation -0.75, CROWN's lines -0.18), counterexamples
    ``y <= d``; the proof: the root's ``claims`` (a bounds node), one leaf under it."""
    layers = [(np.array([[1.0], [1.0]]), np.zeros(2)), (np.array([[2.0, -1.0]]), np.array([0.2]))]
    layers.append((np.array([[1.0]]), np.array([0.0])))
    rows = [([1.0], d)]
    q = save_query(tmp_path / "q.vnnlib", [-4.0], [4.0], rows)
    n = save_net(tmp_path / "n.onnx", layers, act=("Sigmoid", "Relu"))
    node = {"bounds": claims, "children": [{"leaf": {}}]}
    doc = proof(q, n, layers, [obligation([-4.0], [4.0], rows, node)])
    doc["relu_layers"] = [{"id": 0, "output": "h1", "size": 1}]
    doc["sigmoid_layers"] = [{"id": 0, "output": "h0", "size": 2}]
    return doc, q, n


def test_a_claim_after_a_sigmoid_is_reached_with_its_tangent_points(tmp_path, monkeypatch):
    """A claim on the ReLU's input after the sigmoids (``2σ(x) - σ(x) + 0.2 >= 0.10``, true), with the
    tangent points of its pass as evidence (the first sigmoid's lower line at -2.4, the second's upper
    line at -4: 0.104): reached by that pass, no LP, and the leaf (``y <= 0.05``) closes under it (by
    its LP: its own pass goes on to the input through CROWN's sigmoid lines). The
    bound pass's own try at the hull's lines where the bound is attained is turned off (its points made
    NaN), as on a net where it misses: without the points CROWN's lines give -0.18, and the claim needs
    an LP."""
    from complete_verifier_ext import check as C

    nowhere = lambda nodes, x, top: [np.full(x.shape[:2] + (2,), np.nan)] * top
    monkeypatch.setattr(bounds, "_evaluate", nowhere)
    lps = []
    real_minima = C._minima
    monkeypatch.setattr(C, "_minima", lambda *a: lps.append(a) or real_minima(*a))
    points = {"index": [0, 1], "lower_line": [[-2.4, -2.4]], "upper_line": [[-4.0, -4.0]]}
    claim = {"lower": [0.10], "upper": [2.5],
             "alpha": {"neurons": [0], "lower": {"s0": points}, "upper": {"s0": points}}}  # fmt: skip
    doc, q, n = sigmoid_relu_instance(tmp_path, 0.05, {"0": claim})
    r = check(tmp_path, doc, q, n)
    assert (r.status, len(lps)) == ("valid", 0), (r, lps)
    del claim["alpha"]
    check(tmp_path, doc, q, n)
    assert len(lps) == 1, lps


def test_a_false_claim_on_a_sigmoids_input_proves_nothing(tmp_path):
    """An instance with a counterexample (``y <= 0.3``: ``x = -4`` gives 0.218) and a proof whose root
    claims the sigmoids' inputs ``>= 0`` (false: they reach -4), which would close its leaf (CROWN's
    lines over ``[0, 4]`` give ``y >= 0.53``): the checker verifies the claim (an LP gives -4), does not
    use it, and the leaf stays open: ``invalid``. A proof naming a sigmoid layer the header does not
    list, or a Relu node as a sigmoid layer, or a sigmoid in a leaf's evidence, is ``invalid`` too."""
    doc, q, n = sigmoid_relu_instance(tmp_path, 0.3, {"s0": {"lower": [0.0, 0.0], "upper": [4.0, 4.0]}})
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and "not discharged" in r.message, r
    bad = copy.deepcopy(doc)
    bad["sigmoid_layers"] = [{"id": 0, "output": "h1", "size": 1}]
    assert "names no Sigmoid node" in check(tmp_path, bad, q, n).message
    bad = copy.deepcopy(doc)
    bad["obligations"][0]["tree"]["bounds"] = {"s1": {"lower": [-4.0] * 2, "upper": [4.0] * 2}}
    assert "layer 's1'" in check(tmp_path, bad, q, n).message
    bad = copy.deepcopy(doc)
    bad["obligations"][0]["tree"]["children"] = [{"leaf": {"alpha": {"s0": [0.5, 0.5]}}}]
    assert check(tmp_path, bad, q, n).status == "invalid"


def test_a_leaf_only_a_weighting_of_its_rows_closes(tmp_path):
    """``y = x`` on ``[-1, 1]``, counterexamples ``2y <= -0.2`` and ``-y <= -0.2`` (none: ``y <= -0.1`` and
    ``y >= 0.2``). No row alone closes the leaf (margins ``2y + 0.2`` and ``0.2 - y``, minima -1.8 and
    -0.8), nor their sum (``y + 0.4``, -0.6); the rows' small LP finds the weights (1/3, 2/3), whose
    margin is 0.2 everywhere: closed by the bound pass, with no LP over the network."""
    layers = [(np.array([[1.0]]), np.array([0.0]))]
    rows = [([2.0], -0.2), ([-1.0], -0.2)]
    q, n = save_query(tmp_path / "q.vnnlib", [-1.0], [1.0], rows), save_net(tmp_path / "n.onnx", layers)
    doc = proof(q, n, layers, [obligation([-1.0], [1.0], rows, {"leaf": {}})])
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds, r.by_lp) == ("valid", 1, 1, 0), r

    net = onnx_net.parse(read_bytes(str(n)), "n")
    qrows = query.parse(read_bytes(str(q))).obligations[0].rows
    batch = bounds.Batch(np.array([[-1.0]]), np.array([[1.0]]), {}, {}, {}, np.eye(2)[None])
    bnd = bounds.node_bounds(net, batch)
    alone = bounds.objective(net, qrows, bnd, batch)[0]
    lam = bounds.row_weights(net, qrows, bnd, batch)
    batch.lam = lam[:, None]
    weighted = bounds.objective(net, qrows, bnd, batch)[0]
    assert alone < 0 < weighted and np.isclose(lam.sum(), 1.0), (alone, lam, weighted)


def test_an_lp_stopped_at_its_time_limit_is_undecided_not_invalid(tmp_path, monkeypatch, no_halves):
    """The leaf that needs the LP fallback (``x >= 0`` without β), its LP given no time: ``undecided``
    (exit 2), naming the leaf; an LP that runs and refutes stays ``invalid``."""
    from complete_verifier_ext.check import lp

    split = {"relu": {"layer": 0, "neuron": 0}, "children": [{"leaf": {}}, {"leaf": {}}]}
    doc, q, n = abs_instance(tmp_path, node=split)
    monkeypatch.setattr(lp.Solver.__init__, "__defaults__", (0.0, False))
    r = check(tmp_path, doc, q, n)
    assert (
        r.status == "undecided" and r.message.startswith("obligation 0 leaf 1:") and "time limit" in r.message
    ), r
    assert (
        solver_cli.main(["check", str(q), "--network", f"N={n}", "--proof", str(tmp_path / "proof.json")])
        == 2
    )


def _random_lp(n: int, m: int, seed: int):
    """A feasible LP ``lo <= A v <= hi`` over the box ``[-1, 1]^n``: rows around a point of the box."""
    import scipy.sparse as sp

    from complete_verifier_ext.check import lp

    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=4 / n, random_state=seed, format="csr") + sp.eye(m, n, format="csr")
    mid = A @ rng.uniform(-0.5, 0.5, n)
    lo, hi = np.full(n, -1.0), np.full(n, 1.0)
    return lp.Lp(A, None, mid - 0.1, mid + 0.1, lo, hi, np.zeros(n))


def test_the_lp_time_limit_is_per_objective():
    """HiGHS's own time limit counts every run of an instance: 400 objectives of a small LP, each well
    within 0.2 s but more than that together, are all solved."""
    from complete_verifier_ext.check import lp

    solver = lp.Solver(_random_lp(200, 100, 0), time_limit=0.2)
    rng = np.random.default_rng(1)
    statuses = {solver.minimum(rng.normal(size=200))[1] for _ in range(400)}
    assert statuses == {"optimal"}


def test_an_lp_that_presolve_calls_infeasible_is_solved_again_without_it(monkeypatch):
    """HiGHS's presolve called a feasible LP of oval21's deep net infeasible: with presolve made to say
    so here (a fault injected into every run with it on), the LP is solved again without presolve, and
    its bound is the one of a solver left alone; from then on presolve stays off."""
    import highspy

    from complete_verifier_ext.check import lp

    prob, c = _random_lp(200, 100, 4), np.random.default_rng(5).normal(size=200)
    expected = lp.Solver(prob).minimum(c)
    real = lp.Solver._run

    def wrong(self, solver: str, seconds: float, crossover: bool = False, presolve: bool | None = None):
        status = real(self, solver, seconds, crossover, presolve)
        return highspy.HighsModelStatus.kInfeasible if self.presolve else status

    monkeypatch.setattr(lp.Solver, "_run", wrong)
    solver = lp.Solver(prob)
    value, status = solver.minimum(c)
    assert (status, expected[1], solver.presolve) == ("optimal", "optimal", False)
    assert abs(value - expected[0]) <= 1e-7 * (1 + abs(value)), (value, expected)


def test_an_infeasible_verdict_no_ray_proves_is_solved_again_from_cold(monkeypatch):
    """HiGHS's simplex, warm-started from an earlier objective or run without presolve, called a feasible
    LP of a dist_shift leaf infeasible, with no dual ray to prove it: with every run before a cold start
    made to say so here (a fault injected), the LP is solved again from cold and its bound is the one
    of a solver left alone; where even that says infeasible with no ray, nothing is proved (``-inf``)."""
    import highspy

    from complete_verifier_ext.check import lp

    prob, c = _random_lp(200, 100, 6), np.random.default_rng(7).normal(size=200)
    expected = lp.Solver(prob).minimum(c)
    real, cold = lp.Solver._run, []

    def wrong(self, solver: str, seconds: float, crossover: bool = False, presolve: bool | None = None):
        status = real(self, solver, seconds, crossover, presolve)
        return status if cold else highspy.HighsModelStatus.kInfeasible

    solver = lp.Solver(prob)
    clear = solver.h.clearSolver
    monkeypatch.setattr(lp.Solver, "_run", wrong)
    monkeypatch.setattr(solver.h, "clearSolver", lambda: (cold.append(1), clear())[1])
    value, status = solver.minimum(c)
    assert (status, expected[1], len(cold)) == ("optimal", "optimal", 1)
    assert abs(value - expected[0]) <= 1e-7 * (1 + abs(value)), (value, expected)
    monkeypatch.setattr(lp.Solver, "_run", lambda *a, **k: highspy.HighsModelStatus.kInfeasible)
    assert lp.Solver(prob).minimum(c) == (-np.inf, "infeasible")


def test_tiny_coefficients_are_folded_into_their_rows_sides(tmp_path):
    """A sigmoid far out (input near -22) has lines of slope ``σ' < 1e-9``, which HiGHS would drop
    without moving the rows' sides: the LP holds no coefficient that small, every sampled point of the
    network satisfies every row (the sides moved out by the dropped terms' range), and the LP's bound
    is below the sampled minimum."""
    from complete_verifier_ext.check import lp

    layers = random_layers(5)
    layers[0] = (layers[0][0], layers[0][1] - 22.0 * (np.arange(8) % 2))  # half the neurons far out
    n = save_net(tmp_path / "far.onnx", layers, act="Sigmoid")
    net = onnx_net.parse(read_bytes(str(n)), "n")
    lo, hi = -np.ones(3), np.ones(3)
    batch = bounds.Batch(lo[None], hi[None], {}, {}, {}, np.ones((1, 1, 1)))
    bnd = bounds.node_bounds(net, batch)
    assert (bnd.relax[2][0] < lp.TINY).any()  # (node 2: the first Sigmoid; its lower slopes)
    top = len(net.nodes) - 1
    bnd.own[top] = (bnd.lower[top], bnd.upper[top])  # (the LP over every node, no clause)
    model = lp.build(net, bnd, 0, top=top)
    assert np.abs(model.A.data).min() >= lp.TINY
    x = np.random.default_rng(2).uniform(lo, hi, (2000, 3))
    values = [x]
    for node in net.nodes[1:]:
        if isinstance(node, onnx_net.Affine):
            values.append(values[node.src] @ node.W.T + node.b)
        else:
            values.append(sigmoid(values[node.src]))
    v = np.concatenate(values, axis=1)
    Av = (model.A @ v.T).T
    assert (Av >= model.row_lo - 1e-12).all() and (Av <= model.row_hi + 1e-12).all()
    c = np.zeros(v.shape[1])
    c[-2] = 1.0  # y_0
    value, status = lp.Solver(model).minimum(c)
    assert status == "optimal" and value <= v[:, -2].min(), (value, v[:, -2].min())


def test_a_conv_sized_lp_re_solved_warm_gives_the_interior_point_bounds():
    """An LP of over 5000 variables with ``many`` objectives: crossed over once, then re-solved by the
    dual simplex from that basis; each rigorous bound is the IPM's (the same optimum, to its tolerance)."""
    from complete_verifier_ext.check import lp

    prob = _random_lp(5100, 1000, 2)
    cold, warm = lp.Solver(prob), lp.Solver(prob, many=True)
    rng = np.random.default_rng(3)
    for _ in range(4):
        c = np.zeros(5100)
        c[rng.integers(0, 5100, 20)] = rng.normal(size=20)
        (a, sa), (b, sb) = cold.minimum(c), warm.minimum(c)
        assert sa == sb == "optimal" and abs(a - b) <= 1e-5 * (1 + abs(a)), (a, b)
    assert warm.basis is not None and warm.warm


def test_bounds_tables_are_shared_by_reference_and_a_bad_reference_is_invalid(tmp_path):
    """A bounds node may name a table of the proof's ``bounds_tables`` (the writer keeps each distinct
    table once, the trees it was given unchanged): the proof checks as with the table in place; a
    reference out of range, or with anything beside it, is invalid."""
    e = 1e-9
    claims = {"0": {"lower": [-1 - e, -e], "upper": [e, 1 + e]}}
    other = {"0": {"lower": [-e, -2 - e], "upper": [2 + e, e]}}
    kids = [{"bounds": claims, "children": [{"leaf": {}}]}, {"bounds": other, "children": [{"leaf": {}}]}]
    split = {"relu": {"layer": 0, "neuron": 0}, "children": kids}
    doc, q, n = abs_instance(tmp_path, node=split)
    again = copy.deepcopy(doc["obligations"][0])
    obligations, tables = proofs.shared_tables([doc["obligations"][0], again])
    assert len(tables) == 2 and split["children"][0]["bounds"] is claims  # one each, the tree untouched
    refs = [[c["bounds"] for c in o["tree"]["children"]] for o in obligations]
    assert refs[0] == refs[1] and sorted(r["table"] for r in refs[0]) == [0, 1]
    doc["obligations"][0], doc["bounds_tables"] = obligations[0], tables
    assert check(tmp_path, doc, q, n).status == "valid"
    for bad, why in (
        ({"table": 2}, "table: expected an integer in"),
        ({"table": 0, "0": {}}, "nothing else"),
    ):
        broken = copy.deepcopy(doc)
        broken["obligations"][0]["tree"]["children"][1]["bounds"] = bad
        r = check(tmp_path, broken, q, n)
        assert r.status == "invalid" and why in r.message, r


def test_bounds_nodes_are_verified_then_used(tmp_path):
    """Claimed bounds of the first layer's ``(x, -x)`` under each phase of ``x`` (with a margin of 1e-9 for
    rounding; ``-x >= -1e-9`` where ``x <= 0`` needs an LP over the region, interval bounds do not reach
    it). Claims are hints: one the checker's own bounds or LP do not reach is replaced by what they
    prove (a float32 claim may miss by its rounding), so a false claim proves nothing: children flipped
    (each claim over the other phase) the property still holds and the proof is valid; a false claim
    that alone would close a leaf of a property that does not hold leaves that leaf open, named. A
    claim of a neuron stable by the checker's own bounds is not used. Below a bounds node, the leaves'
    bounds are intersected with the claims (first without back-substitution where a claim is, as a
    verifier's BaB keeps its root's bounds; with it where that falls short)."""
    e = 1e-9  # claims leave room for rounding
    inactive = {"bounds": {"0": {"lower": [-1 - e, -e], "upper": [e, 1 + e]}}, "children": [{"leaf": {}}]}
    active = {"bounds": {"0": {"lower": [-e, -2 - e], "upper": [2 + e, e]}}, "children": [{"leaf": {}}]}
    split = {"relu": {"layer": 0, "neuron": 0}, "children": [inactive, active]}
    doc, q, n = abs_instance(tmp_path, node=split)
    r = check(tmp_path, doc, q, n, workers=2)
    assert (r.status, r.leaves) == ("valid", 2), r
    split["children"].reverse()
    assert check(tmp_path, doc, q, n).status == "valid"
    split["children"].reverse()
    active["bounds"]["0"]["lower"][0] = 1.0  # a neuron stable by the phase: the claim is not used
    assert check(tmp_path, doc, q, n).status == "valid"
    # y = |x| <= 0.5 at x = 0: claiming x in [0.9, 2] would close the leaf; the LP proves x >= -1 only
    lie = {"bounds": {"0": {"lower": [0.9, -2.0], "upper": [2.0, -0.9]}}, "children": [{"leaf": {}}]}
    doc, q, n = abs_instance(tmp_path, d=0.5, node=lie)
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and r.message.startswith("obligation 0 leaf 0: at root/0: not discharged"), r

    net = onnx_net.parse(read_bytes(str(n)), "abs")
    claim = (np.array([[0.5, -2.0]]), np.array([[1.5, -0.5]]))
    batch = bounds.Batch(
        np.array([[-1.0]]), np.array([[2.0]]), {}, {}, {}, np.ones((1, 1, 1)), claims={1: claim}
    )
    bnd = bounds.node_bounds(net, batch)
    assert bnd.lower[1].tolist() == [[0.5, -2.0]] and bnd.upper[1].tolist() == [[1.5, -0.5]]


def test_alike_bounds_nodes_are_verified_once(tmp_path, monkeypatch):
    """Two obligations whose trees hold the same bounds nodes over the same box (a query's clauses, each
    proved under the root's bounds) have them verified once; a node whose claims differ by one value is
    verified on its own."""
    from complete_verifier_ext import check as checker

    real, calls = checker.verify, []
    monkeypatch.setattr(
        checker, "verify", lambda net, item, above: calls.append(item.key) or real(net, item, above)
    )
    e = 1e-9

    def split(low: float) -> dict:
        inactive = {"bounds": {"0": {"lower": [-1 - e, -e], "upper": [e, 1 + e]}}, "children": [{"leaf": {}}]}
        active = {"bounds": {"0": {"lower": [low, -2 - e], "upper": [2 + e, e]}}, "children": [{"leaf": {}}]}
        return {"relu": {"layer": 0, "neuron": 0}, "children": [inactive, active]}

    doc, q, n = abs_instance(tmp_path, node=split(-e))
    doc["obligations"].append(obligation([-1.0], [2.0], [([1.0], -0.25)], split(-e)))
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, len(calls)) == ("valid", 4, 2), (r, calls)
    calls.clear()
    doc["obligations"][1]["tree"] = split(-2 * e)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, len(calls)) == ("valid", 4, 3), (r, calls)


def test_claims_are_verified_by_their_slopes_an_lp_only_where_they_fall_short(tmp_path, monkeypatch):
    """``x`` in ``[-1, 2]``, ``h = relu(x, -x, x + 1)``, ``z = h_0 + h_1 - h_2 / 2 = |x| - (x + 1) / 2``,
    whose minimum is -0.5 (at 0). CROWN's adaptive slopes (1, 0) give ``z >= x / 2 - 1/2 >= -1``; the
    slopes (1, 1/2) give ``z >= -1/2``: a claim ``z >= -0.5 - e`` with them needs no LP; with slopes
    that fall short by more than rounding, or none, the LP decides; a false claim becomes what the
    slopes or the LP prove, never itself (``-0.4``: the LP's -0.5; ``-0.5 + 1e-5``, a miss within
    ``NEAR``, the slopes' -0.5 and no LP)."""
    from complete_verifier_ext import check as checker

    layers = [(np.array([[1.0], [-1.0], [1.0]]), np.array([0.0, 0.0, 1.0])),
              (np.array([[1.0, 1.0, -0.5]]), np.zeros(1)), (np.array([[1.0]]), np.zeros(1))]  # fmt: skip
    net = onnx_net.parse(read_bytes(str(save_net(tmp_path / "n.onnx", layers))), "n")
    real, lps = checker._neuron_minimum, []
    monkeypatch.setattr(checker, "_neuron_minimum", lambda *a: lps.append(a[1:]) or real(*a))

    def lower(claim: float, slopes) -> float:
        alpha = (
            {} if slopes is None else {1: (np.array([0]), {"lower": {0: np.array([slopes])}, "upper": {}})}
        )
        claimed = {1: (np.array([claim]), np.array([3.0]))}
        item = tree.Claims(0, 0, "root", np.array([-1.0]), np.array([2.0]), (), (), claimed, alpha)
        ok, proved = checker.verify(net, item, {})
        assert ok
        return float(proved[1][0][0])

    e = 1e-9
    assert lower(-0.5 - e, [1.0, 0.5, np.nan]) == -0.5 - e and not lps
    for slopes in ([1.0, 0.45, np.nan], None):  # -0.55 by the slopes; -1 by CROWN's own
        assert lower(-0.5 - e, slopes) == -0.5 - e and len(lps) == 1
        lps.clear()
    assert -0.5 - 1e-9 < lower(-0.4, [1.0, 0.5, np.nan]) <= -0.5 and len(lps) == 1
    lps.clear()
    assert -0.5 - 1e-9 < lower(-0.5 + 1e-5, [1.0, 0.5, np.nan]) <= -0.5 and not lps


def test_false_claims_at_every_layer_are_proved_over_what_the_layers_before_proved(tmp_path):
    """A 3-8-8-8-1 ReLU net whose three layers each claim a false interval (the middle of each
    neuron's own bounds, 1e-3 wide): each layer's claims are verified over the bounds proved for the
    layers before it (only the nodes from a layer whose claims changed on are bounded again), so what
    ``verify`` proves contains every sampled input's values, and equals one fresh pass over the proved
    claims as ``verify`` bounds (CROWN at a claimed layer only for the claims that need it, folded into
    what is proved)."""
    from complete_verifier_ext import check as checker

    net = onnx_net.parse(
        read_bytes(str(save_net(tmp_path / "n.onnx", random_layers(7, (3, 8, 8, 8, 1))))), "n"
    )
    lo, hi = -np.ones(3), np.ones(3)
    own = bounds.node_bounds(net, bounds.Batch(lo[None], hi[None], {}, {}, {}, np.ones((1, 1, 1))))
    pre = batches.claim_inputs(net)
    mid = {i: (own.lower[z][0] + own.upper[z][0]) / 2 for i, z in pre.items()}
    claimed = {i: (m - 5e-4, m + 5e-4) for i, m in mid.items()}
    ok, proved = checker.verify(net, tree.Claims(0, 0, "root", lo, hi, (), (), claimed, {}), {})
    assert ok and all((proved[i][1] - proved[i][0] > 1e-3).any() for i in pre)
    x = np.random.default_rng(0).uniform(lo, hi, (4000, 3))
    values = [x]
    for node in net.nodes[1:]:
        is_affine = isinstance(node, onnx_net.Affine)
        values.append(values[node.src] @ node.W.T + node.b if is_affine else np.maximum(values[node.src], 0))
    for i, z in pre.items():
        assert (proved[i][0] <= values[z].min(axis=0) + 1e-9).all()
        assert (values[z].max(axis=0) <= proved[i][1] + 1e-9).all()
    batch = batches.of(net, [tree.Claims(0, 0, "root", lo, hi, (), (), {}, {})], 0, {})
    batch.checking = {z: (proved[i][0][None].copy(), proved[i][1][None].copy()) for i, z in pre.items()}
    fresh = bounds.node_bounds(net, batch, checked_crown=False)
    for i, z in pre.items():
        assert np.array_equal(fresh.lower[z][0], proved[i][0]) and np.array_equal(
            fresh.upper[z][0], proved[i][1]
        )


def test_the_side_of_a_claim_that_does_not_decide_a_neurons_phase_is_left_at_the_own_bound(
    tmp_path, monkeypatch
):
    """Claims that make the first layer's unstable neurons stable, both sides false (the first layer's
    own bounds over a box are its exact range): inactive ``[l/2, l/4]`` at even neurons, active
    ``[u/4, u/2]`` at odd ones. Only the side that decides the phase goes to the LP (the upper bound
    of an inactive claim, the lower of an active one), and is replaced by what it proves; the other
    side is the own bound, not an LP's. Claims of an empty interval (``lower > upper``) and a Sigmoid's
    keep both sides."""
    from complete_verifier_ext import check as checker

    net = onnx_net.parse(read_bytes(str(save_net(tmp_path / "n.onnx", random_layers(3, (3, 8, 8, 1))))), "n")
    lo, hi = -np.ones(3), np.ones(3)
    own = bounds.node_bounds(net, bounds.Batch(lo[None], hi[None], {}, {}, {}, np.ones((1, 1, 1))))
    first, z = min(batches.claim_inputs(net).items(), key=lambda kv: kv[1])
    l, u = own.lower[z][0], own.upper[z][0]
    unstable = np.flatnonzero((l < 0) & (u > 0))
    assert len(unstable) >= 4
    even = np.arange(len(l)) % 2 == 0
    claim_lo, claim_hi = np.where(even, l / 2, u / 4), np.where(even, l / 4, u / 2)
    asked = []
    real = checker._minima
    monkeypatch.setattr(checker, "_minima", lambda n, m, cols: asked.extend(cols) or real(n, m, cols))
    item = tree.Claims(0, 0, "root", lo, hi, (), (), {first: (claim_lo, claim_hi)}, {})
    ok, proved = checker.verify(net, item, {})
    at = sum(net.sizes[:z])
    assert ok and sorted(asked) == sorted((at + j, 1.0 if j % 2 else -1.0) for j in unstable)
    p_lo, p_hi = proved[first]
    assert np.allclose(p_lo[unstable][even[unstable]], l[unstable][even[unstable]], rtol=0, atol=0)
    assert np.allclose(p_hi[unstable][~even[unstable]], u[unstable][~even[unstable]], rtol=0, atol=0)
    assert (p_hi[unstable][even[unstable]] > 0).all() and (p_lo[unstable][~even[unstable]] < 0).all()
    keep = checker._deciding(0, np.array([1.0, -2.0]), np.array([-1.0, -1.0]))
    assert [x.tolist() for x in keep] == [[[1.0, -np.inf]], [[-1.0, -1.0]]]
    assert [x.tolist() for x in checker._deciding("s0", np.array([-2.0]), np.array([-1.0]))] == [
        [[-2.0]],
        [[-1.0]],
    ]
    nan = checker._deciding(0, np.array([np.nan, -1.0]), np.array([-1.0, np.nan]))  # (NaN: nothing dropped)
    assert np.isnan(nan[0][0, 0]) and nan[0][0, 1] == -1.0 and nan[1][0, 0] == -1.0 and np.isnan(nan[1][0, 1])


def test_claims_crown_shows_stable_take_no_lp_and_false_sides_are_not_taken(tmp_path, monkeypatch):
    """Every layer of a 3-8-8-8-1 net on ``[-0.1, 0.1]^3`` claims CROWN's own bounds, with no slopes,
    each neuron that CROWN shows stable claimed 0.01 tighter on the side that decides its phase (a
    false claim). ``verify``
    runs CROWN at a claimed layer only for the claims interval propagation leaves open: it solves no
    LP (a neuron CROWN shows stable takes no claim; the true claims are CROWN's own bounds) and proves
    CROWN's bounds, never a false side."""
    from complete_verifier_ext import check as checker

    net = onnx_net.parse(
        read_bytes(str(save_net(tmp_path / "n.onnx", random_layers(1, (3, 8, 8, 8, 1))))), "n"
    )
    lo, hi = np.full(3, -0.1), np.full(3, 0.1)
    own = bounds.node_bounds(net, bounds.Batch(lo[None], hi[None], {}, {}, {}, np.ones((1, 1, 1))))
    claimed, active, inactive = {}, {}, {}
    for i, z in batches.claim_inputs(net).items():
        l, u = own.lower[z][0], own.upper[z][0]
        active[i], inactive[i] = l >= 0, u <= 0
        claimed[i] = (np.where(active[i], l + 0.01, l), np.where(inactive[i], u - 0.01, u))
    assert sum(a.sum() + b.sum() for a, b in zip(active.values(), inactive.values(), strict=True)) >= 4
    asked = []
    real = checker._minima
    monkeypatch.setattr(checker, "_minima", lambda n, m, cols: asked.extend(cols) or real(n, m, cols))
    ok, proved = checker.verify(net, tree.Claims(0, 0, "root", lo, hi, (), (), claimed, {}), {})
    assert ok and asked == []
    for i, z in batches.claim_inputs(net).items():
        l, u = own.lower[z][0], own.upper[z][0]
        assert np.allclose(proved[i][0][active[i]], l[active[i]], rtol=0, atol=1e-9)
        assert np.allclose(proved[i][1][inactive[i]], u[inactive[i]], rtol=0, atol=1e-9)
        unstable = ~active[i] & ~inactive[i]
        assert (proved[i][0][unstable] <= l[unstable] + 1e-9).all()
        assert (proved[i][1][unstable] >= u[unstable] - 1e-9).all()


def test_a_claim_whose_slopes_give_nan_or_inf_is_left_to_the_lp(monkeypatch):
    """The slopes' pass proves a claim only with a number at or above it, or takes one within ``NEAR``
    of it: a NaN or ``-inf`` bound is neither (the LP decides)."""
    from complete_verifier_ext import check as checker

    values = np.array([np.nan, -np.inf, -1.0 - 1e-9, -2.0])
    monkeypatch.setattr(checker.bounds, "backward", lambda *a: values[None])
    net = SimpleNamespace(sizes=[4], relu_layers=[], sigmoid_layers=[], nodes=[])  # (what the pass reads)
    bnd = bounds.Bounds([np.zeros((1, 4))], [np.zeros((1, 4))], {}, {}, np.zeros(1, bool), np.ones(1, bool))
    need = [(j, 1.0) for j in range(4)]
    used = (np.full(4, -1.0), np.full(4, 1.0))
    alpha = (np.arange(4), {"lower": {}, "upper": {}})
    rest, near = checker._by_claim_alpha(net, bnd, 0, alpha, need, used)
    assert rest == [(0, 1.0), (1, 1.0), (3, 1.0)] and list(near) == [(2, 1.0)]
    # CROWN's own pass alike, and a NaN or -inf leaves the own bound as it was (unstable: no shortcut)
    own = (np.full((1, 4), -5.0), np.full((1, 4), 5.0))
    rest, proved = checker._by_own_crown(net, bnd, 0, (need, []), used, own, True)
    assert rest == [(0, 1.0), (1, 1.0), (3, 1.0)] and list(proved) == [(2, 1.0)]
    assert own[0].tolist() == [[-5.0, -5.0, -1.0 - 1e-9, -2.0]] and own[1].tolist() == [[5.0] * 4]


def test_halves_close_nothing_on_a_nan_or_minus_inf_bound(tmp_path, monkeypatch):
    """``by_halves`` closes a leaf only where every part's bound is a number ``> 0``: NaN or ``-inf``
    bounds of the parts leave it open (the LP decides)."""
    from complete_verifier_ext import check as checker

    doc, q, n = abs_instance(tmp_path)
    net = onnx_net.parse(read_bytes(str(n)), "abs")
    rows = query.parse(read_bytes(str(q))).obligations[0].rows
    leaf = tree.Leaf(0, 0, "root", np.array([-1.0]), np.array([2.0]), (), tree.Evidence())
    assert checker.by_halves(net, rows, leaf, {})
    for bad in (np.nan, -np.inf):
        monkeypatch.setattr(checker.bounds, "objective", lambda *a, v=bad: np.full(len(a[3].lower), v))
        assert not checker.by_halves(net, rows, leaf, {})


def test_regions_are_within_the_query_box(tmp_path):
    """A proof box wider than the query's (``[-1.5, 2.5]`` for ``[-1, 2]``): the tree is validated on it,
    the regions are discharged within the query's box, where a claim ``x >= -1`` holds."""
    e = 1e-9
    claims = {"0": {"lower": [-1 - e, -2 - e], "upper": [2 + e, 1 + e]}}
    doc, q, n = abs_instance(tmp_path, node={"bounds": claims, "children": [{"leaf": {}}]})
    doc["obligations"][0]["box"] = {"lower": [-1.5], "upper": [2.5]}
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves) == ("valid", 1), r


def test_clip_slabs_are_leaves_of_the_checker(tmp_path):
    """A clip to ``[-0.5, 1]`` inside ``[-1, 2]``: the slabs ``[-1, -0.5]`` and ``[1, 2]`` are checked too."""
    clip = {"clip": {"lower": [-0.5], "upper": [1.0]}, "children": [{"leaf": {"alpha": {"0": [0.5, 0.5]}}}]}
    doc, q, n = abs_instance(tmp_path, node=clip)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves) == ("valid", 3), r
    clip["clip"] = {"lower": [3.0], "upper": [4.0]}
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and "clip box does not meet" in r.message, r


def test_a_bisection_proof_is_valid_sharded_or_not(tmp_path):
    doc, q, n, _ = bisection_instance(tmp_path)
    leaves = count_leaves(doc["obligations"][0]["tree"])
    assert leaves > 20
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.leaves, r.by_bounds) == ("valid", leaves, leaves), r
    r2 = check(tmp_path, doc, q, n, workers=2)
    assert (r2.status, r2.leaves, r2.by_bounds) == ("valid", leaves, leaves), r2


def test_a_bound_reaches_a_claim_only_when_a_number_at_or_within_near_of_it():
    """``_reached``, the one comparison of a proved bound (the checker's own or the slopes') with a
    claim: NaN and -inf reach nothing, nor is any bound near a claim whose interval is not finite."""
    from complete_verifier_ext import check as checker

    used = (np.array([-1.0, -np.inf]), np.array([1.0, 1.0]))
    near = -1.0 - checker.NEAR  # within NEAR · (|l| + |u|) = 2 NEAR of the lower claim -1
    assert checker._reached(-0.5, 1.0, used, 0) == "yes" and checker._reached(near, 1.0, used, 0) == "near"
    assert checker._reached(-1.1, 1.0, used, 0) is None
    # the upper side: a lower bound of -z against -u = -1
    assert checker._reached(-1.0, -1.0, used, 0) == "yes" and checker._reached(-1.2, -1.0, used, 0) is None
    for bad in (np.nan, -np.inf):
        assert checker._reached(bad, 1.0, used, 0) is None and checker._reached(bad, -1.0, used, 0) is None
    assert checker._reached(-1.0 - 1e-12, -1.0, used, 1) is None  # an interval not finite: nothing near


def test_a_layers_claim_lps_dealt_over_workers_prove_what_one_process_proves(tmp_path, monkeypatch):
    """A 3-6-5-1 ReLU net whose second layer claims a false lower bound (10) at every neuron: each claim
    goes to an LP and becomes the LP's rigorous minimum; with the LPs dealt over two forked workers the
    proved bounds are the same, in the same order. Every LP stopped at its time limit: undecided, the
    first claim in order named (a worker stops at its first)."""
    from complete_verifier_ext import check as checker

    rng = np.random.default_rng(3)
    layers = [(rng.normal(size=(6, 3)), rng.normal(size=6)), (rng.normal(size=(5, 6)), rng.normal(size=5)),
              (rng.normal(size=(1, 5)), np.zeros(1))]  # fmt: skip
    net = onnx_net.parse(read_bytes(str(save_net(tmp_path / "n.onnx", layers))), "n")

    def claims() -> tree.Claims:  # (verify proves into the claims it is given: a new one each time)
        claimed = {1: (np.full(5, 10.0), np.full(5, 20.0))}
        return tree.Claims(0, 0, "root", -np.ones(3), np.ones(3), (), (), claimed, {})

    one, two = (
        checker.verify(net, claims(), {}),
        checker.verify(net, claims(), {}, pool=checker._Pool(net, 2)),
    )
    assert one[0] and two[0] and (one[1][1][0] < 10).all()
    for side in (0, 1):  # (each worker warm-starts its own LPs: the duals may differ in the last bits)
        np.testing.assert_allclose(one[1][1][side], two[1][1][side], rtol=1e-9, atol=1e-12)
    monkeypatch.setattr(checker, "_neuron_minimum", lambda *a: (-np.inf, checker.lp.TIME_LIMIT))
    ok, outcome = checker.verify(net, claims(), {}, pool=checker._Pool(net, 2))
    assert not ok and outcome[2] == "undecided", outcome
    assert "the LP of the lower bound of layer 1 neuron 0 stopped at its time limit" in outcome[3], outcome


def test_the_checkers_workers_keep_the_order_and_raise_what_one_raised():
    """``--workers``: tasks dealt over forked processes (the network reaches them by the fork, unpickled)
    come back in order; an exception in a worker is raised in the checker."""
    from complete_verifier_ext.check import _Pool

    pool = _Pool("net", 2)
    assert pool.map(lambda net, x: (net, x * x), [(i,) for i in range(5)]) == [
        ("net", i * i) for i in range(5)
    ]
    with pytest.raises(ZeroDivisionError):
        pool.map(lambda net, x: 1 / x, [(1,), (0,), (2,)])


def test_gzipped_files(tmp_path):
    doc, q, n, _ = bisection_instance(tmp_path, seed=3, suffix=".gz")
    p = tmp_path / "proof.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert check_proof(str(q), {"N": str(n)}, str(p)).status == "valid"


# ------------------------------------------------------------------------------------------------------
# proofs that must be refused
# ------------------------------------------------------------------------------------------------------


def first(node: dict, kind: str, cuts: int = 0) -> dict:
    """The first node of ``kind`` depth first (an input split: with ``cuts`` cut points, if given)."""
    stack = [node]
    while stack:
        n = stack.pop(0)
        if kind in n and (not cuts or len(n[kind]["at"]) == cuts):
            return n
        stack[:0] = n.get("children", [])
    raise AssertionError(f"no {kind} node")


def drop_a_leaf(doc: dict) -> None:
    first(doc["obligations"][0]["tree"], "input")["children"].pop()


def cut_outside(doc: dict) -> None:
    first(doc["obligations"][0]["tree"], "input", cuts=1)["input"]["at"] = [5.0]


def cuts_reversed(doc: dict) -> None:
    first(doc["obligations"][0]["tree"], "input", cuts=2)["input"]["at"].reverse()


def box_shrunk(doc: dict) -> None:
    doc["obligations"][0]["box"]["upper"][1] -= 1e-3


def other_rows(doc: dict) -> None:
    doc["obligations"][0]["rows"]["d"][0] += 0.5


def phase_child_missing(doc: dict) -> None:
    ob = doc["obligations"][0]
    ob["tree"] = {"relu": {"layer": 1, "neuron": 3}, "children": [ob["tree"]]}


def split_twice(doc: dict) -> None:
    ob = doc["obligations"][0]
    inner = {"relu": {"layer": 0, "neuron": 2}, "children": [ob["tree"], ob["tree"]]}
    ob["tree"] = {"relu": {"layer": 0, "neuron": 2}, "children": [ob["tree"], inner]}


def unknown_layer(doc: dict) -> None:
    ob = doc["obligations"][0]
    ob["tree"] = {"relu": {"layer": 2, "neuron": 0}, "children": [ob["tree"], ob["tree"]]}


def claim_slopes_short(doc: dict) -> None:
    ob = doc["obligations"][0]
    alpha = {"neurons": [0], "lower": {"0": {"index": [0, 1], "values": [[0.5]]}}}
    claims = {"1": {"lower": [-1e9] * 8, "upper": [1e9] * 8, "alpha": alpha}}
    ob["tree"] = {"bounds": claims, "children": [ob["tree"]]}


def claim_slope_a_boolean(doc: dict) -> None:
    claim_slopes_short(doc)
    doc["obligations"][0]["tree"]["bounds"]["1"]["alpha"]["lower"]["0"]["values"] = [[0.5, True]]


def other_format(doc: dict) -> None:
    doc["format"] = "cve-proof-0"


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (drop_a_leaf, r"obligation 0 leaf \d+: at root[/\d]*: input split at 2 points has 2 children, not 3"),
        (
            cut_outside,
            r"obligation 0 leaf \d+: at root[/\d]*: input split of dim \d at \[5.0\]: not strictly inside",
        ),
        (cuts_reversed, r"obligation 0 leaf \d+: at root[/\d]*: input split .*not strictly inside"),
        (box_shrunk, r"obligation 0: its box does not contain the query's: X_1"),
        (other_rows, r"obligation 0: its rows are not rows of any term of the query"),
        (phase_child_missing, r"obligation 0 leaf 0: at root: a phase split needs a neuron and two children"),
        (split_twice, r"obligation 0 leaf \d+: at root/1: layer 0 neuron 2 is split twice on one path"),
        (unknown_layer, r"obligation 0 leaf 0: at root: phase split of layer 2: no such ReLU layer"),
        (other_format, r"format 'cve-proof-0', not cve-proof-1"),
        (
            claim_slopes_short,
            r"obligation 0 leaf 0: at root: alpha of the bounds of layer 1: lower of layer 0: values: "
            r"expected a list of 2 num",
        ),
        (
            claim_slope_a_boolean,
            r"obligation 0 leaf 0: at root: alpha of the bounds of layer 1: lower of layer 0: values: "
            r"expected a number, got true",
        ),
    ],
)
def test_a_broken_proof_is_invalid(tmp_path, mutate, expected):
    doc, q, n, _ = bisection_instance(tmp_path)
    assert check(tmp_path, doc, q, n).status == "valid"
    mutate(doc)
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and re.fullmatch(expected + ".*", r.message), r


def test_a_proof_about_other_files_is_invalid(tmp_path):
    """A weight changed after the proof was written; a query with another threshold."""
    doc, q, n, layers = bisection_instance(tmp_path)
    layers[0][0][0, 0] += 1e-3
    save_net(n, layers)
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.message) == ("invalid", "the proof is about another network (its sha256 differs from "
                                     "the ONNX file's)")  # fmt: skip
    doc, q, n, layers = bisection_instance(tmp_path)
    q.write_text(q.read_text().replace("(assert (<= (+", "(assert (<= (+ (* 0.0 Y_0)", 1))
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and r.message.startswith("the proof is about another query"), r


def test_a_proof_of_a_sat_instance_is_invalid(tmp_path):
    """A threshold above the sampled minimum: the leaves around the minimiser ``x*`` never close."""
    layers = random_layers(5)
    lo, hi = -np.ones(3), np.ones(3)
    xs = np.random.default_rng(2).uniform(lo, hi, (4000, 3))
    margins = forward(layers, xs) @ np.array([1.0, -1.0])
    x_star, d = xs[np.argmin(margins)], float(margins.min() + 0.05 * (margins.max() - margins.min()))
    rows = [([1.0, -1.0], d)]
    q, n = save_query(tmp_path / "q.vnnlib", lo, hi, rows), save_net(tmp_path / "net.onnx", layers)

    def halves(depth: int, lo: np.ndarray, hi: np.ndarray) -> dict:  # cut every dimension at its middle
        if not depth:
            return {"leaf": {}}
        dim, kids = depth % 3, []
        mid = (lo[dim] + hi[dim]) / 2
        for a, b in ((lo[dim], mid), (mid, hi[dim])):
            k_lo, k_hi = lo.copy(), hi.copy()
            k_lo[dim], k_hi[dim] = a, b
            kids.append(halves(depth - 1, k_lo, k_hi))
        return {"input": {"dim": dim, "at": [float(mid)]}, "children": kids}

    doc = proof(q, n, layers, [obligation(lo, hi, rows, halves(6, lo, hi))])
    r = check(tmp_path, doc, q, n)
    assert r.status == "invalid" and "not discharged" in r.message, r
    ob = tree.obligation(doc["obligations"][0], 0, 3, 2)
    leaves = list(tree.leaves(ob, 0, {0: 8, 1: 8}))
    net = onnx_net.parse(read_bytes(str(n)), "net")
    rows = [query.parse(read_bytes(str(q))).obligations[0].rows]
    around = [leaf for leaf in leaves if (leaf.lower <= x_star).all() and (x_star <= leaf.upper).all()]
    assert around and all(discharge(net, rows, [leaf], {})[0][2] == "" for leaf in around)


def test_a_margin_only_naive_rounding_finds_positive(tmp_path):
    """``z = 2^-3 x_0 - 2^-57 x_1 - 2^-57 x_2 - (2^-3 - 2^-56)`` at ``x = (1, 1, 1)`` is exactly 0, so
    ``relu(z) <= 0`` has a counterexample; float64 from the left rounds ``2^-3 - 2^-57`` (a tie) to ``2^-3``
    twice and finds ``z = 2^-56 > 0``. The checker must not say valid."""
    w, b = [2.0**-3, -(2.0**-57), -(2.0**-57)], -(2.0**-3 - 2.0**-56)
    assert ((w[0] + w[1]) + w[2]) + b == 2.0**-56 > 0
    assert sum(map(Fraction, w)) + Fraction(b) == 0
    layers = [(np.array([w]), np.array([b])), (np.array([[1.0]]), np.array([0.0]))]
    rows = [([1.0], 0.0)]
    q, n = (
        save_query(tmp_path / "q.vnnlib", np.ones(3), np.ones(3), rows),
        save_net(tmp_path / "net.onnx", layers),
    )
    for leaf in ({}, {"alpha": {"0": [1.0]}}):
        doc = proof(q, n, layers, [obligation(np.ones(3), np.ones(3), rows, {"leaf": leaf})])
        r = check(tmp_path, doc, q, n)
        assert r.status == "invalid" and "not discharged" in r.message, r


def test_bounds_that_overflow_prove_nothing(tmp_path):
    """Weights of 1e300 on a box of ±1e10: every bound overflows; whatever the rows, nothing is proved
    (a relaxation built from infinite bounds means nothing: a sigmoid's lines there are NaN), and
    nothing crashes; with ReLUs or Sigmoids between the layers."""
    from complete_verifier_ext import check as checker
    from complete_verifier_ext.check import sigmoid

    assert not np.isfinite(sigmoid.lines(np.array([-np.inf]), np.array([np.inf]))).all()
    layers = [(np.array([[1e300], [-1e300]]), np.zeros(2)), (np.array([[1e300, 1e300]]), np.zeros(1))]
    lo, hi = np.array([-1e10]), np.array([1e10])
    for act, (c, d) in itertools.product(("Relu", "Sigmoid"), (([1.0], -1.0), ([-1.0], 1.0))):
        rows = [(c, d)]  # y <= -1, -y <= 1
        q = save_query(tmp_path / "q.vnnlib", lo, hi, rows)
        n = save_net(tmp_path / "net.onnx", layers, act=act)
        doc = proof(q, n, layers, [obligation(lo, hi, rows, {"leaf": {}})])
        doc["relu_layers"] = doc["relu_layers"] if act == "Relu" else []
        r = check(tmp_path, doc, q, n)
        assert r.status == "invalid" and "not finite" in r.message, (act, r)
        # the last fallback too: its LPs over infinite bounds prove nothing
        net, term = onnx_net.parse(read_bytes(str(n)), "net"), query.parse(read_bytes(str(q))).obligations[0]
        leaf = tree.Leaf(0, 0, "root", lo, hi, (), tree.Evidence())
        assert checker.by_lp_bounds(net, term.rows, leaf, {}) == (-np.inf, checker.NOT_FINITE)


# ------------------------------------------------------------------------------------------------------
# the readers, the command, the separation from the verifier
# ------------------------------------------------------------------------------------------------------


def test_the_onnx_reader_agrees_with_onnx_reference():
    """Conv (pads, strides), BatchNormalization, Sub of a constant, Relu, Reshape, MatMul, Add, Sigmoid,
    Gemm with alpha and beta, a residual Add: at a point, the bounds of the output bracket
    onnx.reference's float64 evaluation, within rounding."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(1)
    arrays = {"K": rng.normal(size=(4, 2, 3, 3)), "kb": rng.normal(size=4), "sc": rng.uniform(0.5, 2, 4),
              "bb": rng.normal(size=4), "mu": rng.normal(size=4), "var": rng.uniform(0.5, 2, 4),
              "sub": rng.normal(size=(1, 4, 1, 1)), "M": rng.normal(size=(36, 5)), "mb": rng.normal(size=5),
              "G": rng.normal(size=(5, 5)), "gb": rng.normal(size=5)}  # fmt: skip
    inits = [numpy_helper.from_array(a, k) for k, a in arrays.items()]
    inits.append(numpy_helper.from_array(np.array([1, -1], np.int64), "shape"))
    make = helper.make_node
    nodes = [make("Conv", ["x", "K", "kb"], ["c"], pads=[1, 0, 1, 1], strides=[2, 1]),
             make("BatchNormalization", ["c", "sc", "bb", "mu", "var"], ["bn"], epsilon=1e-3),
             make("Sub", ["bn", "sub"], ["s"]), make("Relu", ["s"], ["r"]),
             make("Reshape", ["r", "shape"], ["f"]), make("MatMul", ["f", "M"], ["m"]),
             make("Add", ["m", "mb"], ["a"]), make("Relu", ["a"], ["r2"]), make("Sigmoid", ["r2"], ["sg"]),
             make("Gemm", ["sg", "G", "gb"], ["g"], alpha=0.3, beta=1.7), make("Add", ["g", "r2"], ["res"]),
             make("Relu", ["res"], ["y"])]  # fmt: skip
    x_info = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 2, 5, 4])
    y_info = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 5])
    model = helper.make_model(helper.make_graph(nodes, "g", [x_info], [y_info], inits),
                              opset_imports=[helper.make_opsetid("", 15)])  # fmt: skip
    net = onnx_net.parse(model.SerializeToString(), "conv")
    assert [r.output for r in net.relu_layers] == ["r", "r2", "y"]
    x = rng.normal(size=(1, 2, 5, 4))
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0].ravel()
    flat = x.reshape(1, -1)
    bnd = bounds.node_bounds(net, bounds.Batch(flat, flat, {}, {}, {}, np.ones((1, 1, 0))))
    lower, upper = bnd.lower[net.output][0], bnd.upper[net.output][0]
    tol = 1e-12 * (1 + np.abs(expected))
    assert (
        (lower <= expected + tol).all() and (expected - tol <= upper).all() and (upper - lower < 1e-9).all()
    )


def test_a_conv_is_a_sparse_matrix_that_stays_sparse_through_batchnorm():
    """A Conv node's matrix (CSR) is the convolution's, column by column (onnx.reference on each unit
    input), with one entry per kernel tap that meets the input; a BatchNormalization composed with it
    keeps those entries, its radii on them only (a zero coefficient times the scale is an exact zero);
    a backward product through it equals the dense matrix's."""
    import scipy.sparse as sp
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(4)
    K, shape = rng.normal(size=(3, 2, 3, 3)), (1, 2, 6, 5)
    conv = helper.make_node("Conv", ["x", "K"], ["c"], pads=[1, 0, 1, 1], strides=[2, 1])
    bn = helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["y"])
    inits = [numpy_helper.from_array(K, "K")] + [
        numpy_helper.from_array(rng.uniform(0.5, 2, 3), k) for k in ("s", "t", "m", "v")
    ]
    x_info = helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))
    models = [
        helper.make_model(helper.make_graph(nodes, "g", [x_info], [helper.make_tensor_value_info(
            out, TensorProto.DOUBLE, None)], inits), opset_imports=[helper.make_opsetid("", 15)])
        for nodes, out in (([conv], "c"), ([conv, bn], "y"))
    ]  # fmt: skip
    plain, folded = (onnx_net.parse(m.SerializeToString(), "conv").nodes[-1] for m in models)
    run = ReferenceEvaluator(models[0])
    dense = np.stack([run.run(None, {"x": e.reshape(shape)})[0].ravel() for e in np.eye(60)], axis=1)
    assert sp.issparse(plain.W) and np.array_equal(plain.W.toarray(), dense)
    assert plain.W.nnz == np.count_nonzero(dense) and plain.W.nnz < dense.size / 4
    assert sp.issparse(folded.W) and np.array_equal(folded.W.indices, plain.W.indices)
    assert folded.W_rad.nnz == plain.W.nnz and (folded.W_rad.data > 0).all()
    a = rng.normal(size=(2, 4, dense.shape[0]))
    gap = np.abs(onnx_net.matmul(a, folded.W) - a @ folded.W.toarray())
    assert (gap <= 1e-14 * (np.abs(a) @ np.abs(folded.W.toarray()))).all()


def test_ops_that_move_elements_agree_with_onnx_reference():
    """Transpose, Slice, Gather of constant indices, Concat of tensors and a constant, Unsqueeze and
    Squeeze (linearizenn's Slice and Concat among them), between Gemms and a Relu: at a point, the
    output's bounds bracket onnx.reference's evaluation; an Unsqueeze that moves nothing adds no node."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(2)
    i64 = lambda v, k: numpy_helper.from_array(np.array(v, np.int64), k)
    inits = [i64([1, 2, 3], "s23"), i64([1, 6], "s6"), i64([1], "one"), i64([5], "five"), i64([5, 0], "idx"),
             i64([2], "ax2"), numpy_helper.from_array(rng.normal(size=(1, 2)), "k"),
             numpy_helper.from_array(rng.normal(size=(5, 8)), "W"),
             numpy_helper.from_array(rng.normal(size=5), "b"),
             numpy_helper.from_array(rng.normal(size=(3, 5)), "W2")]  # fmt: skip
    make = helper.make_node
    nodes = [make("Reshape", ["x", "s23"], ["x3"]), make("Transpose", ["x3"], ["t"], perm=[0, 2, 1]),
             make("Reshape", ["t", "s6"], ["f"]), make("Slice", ["f", "one", "five", "one"], ["sl"]),
             make("Gather", ["f", "idx"], ["ga"], axis=1), make("Concat", ["sl", "k", "ga"], ["c"], axis=1),
             make("Gemm", ["c", "W", "b"], ["g"], transB=1), make("Relu", ["g"], ["r"]),
             make("Unsqueeze", ["r", "ax2"], ["u"]), make("Squeeze", ["u", "ax2"], ["q"]),
             make("Gemm", ["q", "W2"], ["y"], transB=1)]  # fmt: skip
    x_info = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 6])
    y_info = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 3])
    model = helper.make_model(helper.make_graph(nodes, "g", [x_info], [y_info], inits),
                              opset_imports=[helper.make_opsetid("", 15)])  # fmt: skip
    net = onnx_net.parse(model.SerializeToString(), "moves")
    assert [r.output for r in net.relu_layers] == ["r"]
    x = rng.normal(size=(1, 6))
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0].ravel()
    bnd = bounds.node_bounds(net, bounds.Batch(x, x, {}, {}, {}, np.ones((1, 1, 0))))
    lower, upper = bnd.lower[net.output][0], bnd.upper[net.output][0]
    tol = 1e-12 * (1 + np.abs(expected))
    assert (
        (lower <= expected + tol).all() and (expected - tol <= upper).all() and (upper - lower < 1e-9).all()
    )
    relu = net.relu_layers[0].node  # the Gemm after it reads it directly: Unsqueeze, Squeeze add no node
    assert isinstance(net.nodes[relu + 1], onnx_net.Affine) and net.nodes[relu + 1].src == relu


def test_an_unsupported_operator_is_named(tmp_path, capsys):
    doc, q, n = abs_instance(tmp_path)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["y"], name="squash")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])]))  # fmt: skip
    n.write_bytes(model.SerializeToString())
    r = check(tmp_path, doc, q, n)
    assert (r.status, r.message) == ("unsupported", "squash Tanh")
    code = solver_cli.main(["check", str(q), "--network", f"N={n}", "--proof", str(tmp_path / "proof.json")])
    assert (code, capsys.readouterr().out) == (2, "unsupported: squash Tanh\n")


def test_the_query_reader(tmp_path):
    """Bounds rounded outward from the decimal text; a disjunction of X and Y constraints expands to one
    obligation per term (a term with an empty box is dropped); an unbounded input is unsupported."""
    text = """; a comment
    (declare-const X_0 Real) (declare-const X_1 Real) (declare-const Y_0 Real) (declare-const Y_1 Real)
    (assert (>= X_0 0.1)) (assert (<= X_0 0.3))
    (assert (or (and (<= X_1 0.5) (>= X_1 -0.5) (<= Y_0 Y_1))
                (and (>= X_1 0.25) (<= X_1 1e-1) (>= Y_0 2))
                (and (>= X_1 0) (<= X_1 1) (<= (+ Y_0 (* -2 Y_1) (- 3)) 0.1))))"""
    q = query.parse(text.encode())
    assert (q.n_inputs, q.n_outputs, len(q.obligations)) == (2, 2, 2)
    first_term, last_term = q.obligations
    lo, hi = first_term.lower[0], first_term.upper[0]
    assert Fraction(lo) <= Fraction("0.1") < Fraction(np.nextafter(lo, 1)) and lo < 0.1
    assert Fraction(np.nextafter(hi, 0)) < Fraction("0.3") <= Fraction(hi) and hi > 0.3
    assert first_term.rows.C.tolist() == [[1.0, -1.0]] and first_term.rows.d.tolist() == [0.0]
    assert last_term.rows.C.tolist() == [[1.0, -2.0]] and last_term.rows.d.tolist() == [3.1]
    assert last_term.rows.d_rad[0] > 0 == first_term.rows.d_rad[0]  # 3.1 is not a float64, 0 is
    with pytest.raises(query.Unsupported, match="X_1 is unbounded"):
        query.parse(text.replace("(<= X_1 0.5)", "").encode())


def test_the_query_reader_takes_vnnlib_2():
    """VNN-LIB 2.0: a tensor's elements at their row-major flat index (spaces in an index or before it
    allowed), any element type, ``==``; the same obligations as the 1.x form. Two networks: the joint
    input leaves out an element tied to one before it, the joint output is both networks' in order; a
    tie inside an ``or`` is no tie (unsupported, as any row over two inputs)."""
    v2 = """(vnnlib-version <2.0>)
    (declare-network f (declare-input X float32 [1, 2]) (declare-output Y Real [2]))
    (assert (and (>= X[0,0] 0.1) (<= X [0, 0] 0.3)))
    (assert (== X[0,1] 0.5))
    (assert (or (<= Y[0] Y[1]) (>= Y[0] 2)))"""
    v1 = """(declare-const X_0 Real) (declare-const X_1 Real)
    (declare-const Y_0 Real) (declare-const Y_1 Real)
    (assert (>= X_0 0.1)) (assert (<= X_0 0.3)) (assert (= X_1 0.5))
    (assert (or (<= Y_0 Y_1) (>= Y_0 2)))"""
    a, b = query.parse(v2.encode()), query.parse(v1.encode())
    assert (a.n_inputs, a.n_outputs, len(a.obligations)) == (2, 2, 2)
    for x, y in zip(a.obligations, b.obligations, strict=True):
        assert x.lower.tolist() == y.lower.tolist() and x.upper.tolist() == y.upper.tolist()
        assert x.rows.C.tolist() == y.rows.C.tolist() and x.rows.d.tolist() == y.rows.d.tolist()
    two = v2.replace(
        "(assert",
        "(declare-network g (isomorphic-to f) (declare-input U Real [3]) (declare-output V Real [1]))\n"
        "(assert (and (== U[2] X[0,0]) (<= U[1] 1) (>= U[1] -1)))\n(assert (= U[0] X[0,1]))\n(assert",
        1,
    ).replace("(>= Y[0] 2)", "(>= V[0] Y[1])")
    q = query.parse(two.encode())
    assert (q.n_inputs, q.n_outputs, len(q.obligations)) == (3, 3, 2)
    assert [(n.name, n.inputs, n.out_start, n.n_out) for n in q.networks] == [
        ("f", (0, 1), 0, 2),
        ("g", (1, 2, 0), 2, 1),
    ]
    assert q.obligations[1].lower.tolist()[1:] == [0.5, -1.0] and q.obligations[1].upper.tolist()[1:] == [
        0.5,
        1.0,
    ]
    assert q.obligations[1].rows.C.tolist() == [[0.0, 1.0, -1.0]]  # Y[1] - V[0] <= 0
    with pytest.raises(query.Unsupported, match="over several inputs"):
        query.parse(
            two.replace("(assert (= U[0] X[0,1]))", "(assert (or (= U[0] X[0,1]) (<= U[0] 0)))").encode()
        )
    with pytest.raises(query.Unsupported, match="declared twice"):
        query.parse(two.replace("(declare-output V Real [1])", "(declare-output Y Real [2])").encode())
    with pytest.raises(query.Unsupported, match="declare-hidden"):
        query.parse(v2.replace("(declare-input X", "(declare-hidden H Real [2]) (declare-input X").encode())


def test_the_command(tmp_path, capsys):
    doc, q, n = abs_instance(tmp_path)
    p = tmp_path / "proof.json"
    p.write_text(json.dumps(doc))
    argv = ["check", str(q), "--network", f"N={n}", "--proof", str(p)]
    assert solver_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "valid\n" and "1 leaves, 0 closed by their bounds, 1 in halves, 0 by the LP fallback" in err
    doc["obligations"][0]["box"]["lower"] = [-0.5]
    p.write_text(json.dumps(doc))
    assert solver_cli.main([*argv, "--workers", "2"]) == 1
    out, _ = capsys.readouterr()
    assert out.startswith("invalid: obligation 0: its box does not contain") and out.count("\n") == 1
    assert solver_cli.main(argv[:-1] + [str(tmp_path / "missing.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "missing.json" in err and err.count("\n") == 1
    assert solver_cli.main(argv[:4]) == 2  # no --proof
    out, err = capsys.readouterr()
    assert out == "" and "--proof" in err
    assert solver_cli.main([*argv[:4], "--network", f"M={n}", *argv[4:]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "a VNN-LIB 1.x query takes one network, 2 given" in err


def test_the_checker_imports_nothing_of_the_verifier():
    """Every import of ``complete_verifier_ext/check/`` stays inside it (or outside the package): none
    reaches the verifier's bounds, bab, model, spec, plugin, verify or attack."""
    found = []
    for f in sorted((REPO / "complete_verifier_ext" / "check").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level > 1 or (node.module or "").startswith("complete")
            ):
                found.append(f"{f.name}:{node.lineno}")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("complete_verifier_ext") for a in node.names
            ):
                found.append(f"{f.name}:{node.lineno}")
    assert found == []


# ------------------------------------------------------------------------------------------------------
# ACAS Xu: the real network
# ------------------------------------------------------------------------------------------------------

ACAS_NET = SHARED / "acasxu" / "onnx" / "ACASXU_run2a_1_1_batch_2000.onnx"
ACAS_PROP = SHARED / "acasxu" / "vnnlib" / "prop_1.vnnlib"


def acas_layers():
    from onnx import load

    weights = {
        t.name: numpy_helper.to_array(t).astype(np.float64) for t in load(str(ACAS_NET)).graph.initializer
    }
    return [(weights[f"W{i}"], weights[f"B{i}"]) for i in range(7)]


def acas_instance(tmp_path: Path, part: float):
    """Property 1 (``Y_0 >= 3.991…`` unsafe) on the corner of its box of relative size ``part`` per input
    (the upper bounds rewritten); the box as the checker rounds it: the lower ends one float lower."""
    text = ACAS_PROP.read_text()
    bounds_of = {(m[1], int(m[2])): float(m[3]) for m in re.finditer(r"\((<=|>=) X_(\d) ([-\d.]+)\)", text)}
    lo = np.array([np.nextafter(bounds_of[">=", i], -1) for i in range(5)])
    hi = np.array([bounds_of["<=", i] for i in range(5)])
    hi = lo + (hi - lo) * part
    for i in range(5):
        text = re.sub(rf"\(<= X_{i} [-\d.]+\)", f"(<= X_{i} {exact(hi[i])})", text)
    q = tmp_path / "prop_1_part.vnnlib"
    q.write_text(text)
    d = -float(re.search(r"\(>= Y_0 ([\d.]+)\)", text)[1])
    return q, lo, hi, [([-1.0, 0.0, 0.0, 0.0, 0.0], d)]


@pytest.mark.skipif(not ACAS_NET.is_file(), reason="the ACAS Xu benchmark files are not here")
def test_acasxu_property_1_on_a_part_of_its_box(tmp_path):
    q, lo, hi, rows = acas_instance(tmp_path, 0.4)
    node = bisect(acas_layers(), np.array(rows[0][0]), rows[0][1], lo, hi)
    leaves = count_leaves(node)
    assert leaves > 100
    doc = proof(q, ACAS_NET, acas_layers(), [obligation(lo, hi, rows, node)])
    doc["relu_layers"] = [{"id": i, "output": f"R{i}", "size": 50} for i in range(6)]
    r = check(tmp_path, doc, q, ACAS_NET, workers=2)
    assert (r.status, r.leaves, r.by_bounds) == ("valid", leaves, leaves), r


ACAS_4_1 = SHARED / "acasxu" / "onnx" / "ACASXU_run2a_4_1_batch_2000.onnx"


def acas_4_1_box():
    """A box of α,β-CROWN's ACAS Xu 4_1 property 1 proof (input split, CROWN bounds): the network, the
    clause's row and the leaf."""
    net = onnx_net.parse(ACAS_4_1.read_bytes(), "N")
    rows = query.Rows(
        np.array([[-1.0, 0, 0, 0, 0]]), np.array([-3.991125645861615]), np.zeros((1, 5)), np.zeros(1)
    )
    lo = np.array([0.639928936958313, -0.125, -0.25, 0.48750001192092896, -0.48750001192092896])
    hi = np.array([0.6598933935165405, 0.0, -0.125, 0.5, -0.4749999940395355])
    return net, rows, tree.Leaf(0, 0, "root/0", lo, hi, (), tree.Evidence())


@pytest.mark.skipif(not ACAS_4_1.is_file(), reason="the ACAS Xu benchmark files are not here")
def test_a_leaf_closed_only_over_lp_bounds(tmp_path, monkeypatch):
    """A box of α,β-CROWN's ACAS Xu 4_1 property 1 proof (its input split with CROWN bounds): auto_LiRPA's
    CROWN proves it (margin 0.025), the checker's own pass does not (-0.52: its intermediate bounds
    differ from auto_LiRPA's, tighter at most neurons, looser at some), nor does the LP over them (0);
    the LP over LP-made intermediate bounds does. So does the second pass, CROWN on every neuron (the
    stable ones too, as auto_LiRPA refines the neurons any box of its batch has unstable), and that is
    the leaf's outcome."""
    from complete_verifier_ext.check import by_lp_bounds, lp

    net, rows, leaf = acas_4_1_box()
    lo, hi = leaf.lower, leaf.upper
    batch = bounds.Batch(lo[None], hi[None], {}, {}, {}, np.ones((1, 1, 1)))
    bnd = bounds.node_bounds(net, batch)
    assert bounds.objective(net, rows, bnd, batch)[0] < 0
    assert lp.Solver(lp.build(net, bnd, 0, rows)).minimum()[0] <= 0
    value, status = by_lp_bounds(net, rows, leaf, {})
    assert status == "optimal" and value > 0.02, (value, status)
    assert bounds.objective(net, rows, bounds.node_bounds(net, batch, every=True), batch)[0] > 0
    ((_, _, kind, why),) = discharge(net, [rows], [leaf], {})
    assert kind == "bounds", why
    # a NaN bound pass stops nothing early (NaN proves nothing): the LPs decide, to the same end
    monkeypatch.setattr(bounds, "objective", lambda *args: np.array([np.nan]))
    value, status = by_lp_bounds(net, rows, leaf, {})
    assert status == "optimal" and value > 0.02, (value, status)


@pytest.mark.skipif(not ACAS_4_1.is_file(), reason="the ACAS Xu benchmark files are not here")
def test_the_lp_fallback_is_over_the_second_passs_bounds(monkeypatch):
    """The box above with the bound pass made to prove nothing (a fault injected): the LP fallback runs
    over the second pass's bounds (CROWN on every neuron, within the first pass's), over which it
    closes the box (over the first pass's it gave 0), before any LP over LP bounds."""
    import complete_verifier_ext.check as checker

    net, rows, leaf = acas_4_1_box()
    monkeypatch.setattr(bounds, "objective", lambda *args: np.full(len(args[3].lower), -1.0))
    monkeypatch.setattr(checker, "by_lp_bounds", lambda *args: pytest.fail("an LP over LP bounds"))
    ((_, _, kind, why),) = discharge(net, [rows], [leaf], {})
    assert kind == "lp", why


def crown(layers, c: np.ndarray, L: np.ndarray, U: np.ndarray) -> np.ndarray:
    """This file's CROWN (plain float64, adaptive slopes): lower bounds ``(B,)`` of ``c · y`` on boxes."""
    pre: list = []

    def back(A: np.ndarray, k: int) -> np.ndarray:  # A: (B, Q, n_k) on the pre-activation of layer k
        const, A = A @ layers[k][1], A @ layers[k][0]
        for j in range(k - 1, -1, -1):
            l, u = pre[j]
            unstable, active = (l < 0) & (u > 0), l >= 0
            s = np.where(unstable, u / np.where(unstable, u - l, 1), active * 1.0)[:, None]
            alpha = np.where(unstable, u > -l, active)[:, None]
            const += (np.minimum(A, 0) * np.where(unstable, -s[:, 0] * l, 0)[:, None]).sum(-1)
            A = np.where(A >= 0, A * alpha, A * s)
            const, A = const + A @ layers[j][1], A @ layers[j][0]
        return const + (np.maximum(A, 0) * L[:, None]).sum(-1) + (np.minimum(A, 0) * U[:, None]).sum(-1)

    for k in range(len(layers) - 1):
        n = len(layers[k][1])
        r = back(np.broadcast_to(np.concatenate([np.eye(n), -np.eye(n)]), (len(L), 2 * n, n)), k)
        pre.append((r[:, :n], -r[:, n:]))
    return back(np.broadcast_to(c, (len(L), 1, len(c))), len(layers) - 1)[:, 0]


def crown_bisect(layers, c: np.ndarray, d: float, lo: np.ndarray, hi: np.ndarray) -> dict:
    """Bisection of the widest (relative) dimension until :func:`crown` proves ``c · y - d > 1e-9``."""
    root: dict = {}
    frontier = [(root, lo, hi)]
    while frontier:
        ok = np.concatenate([crown(layers, c, np.stack([f[1] for f in frontier[i : i + 2048]]),
                                   np.stack([f[2] for f in frontier[i : i + 2048]])) - d > 1e-9
                             for i in range(0, len(frontier), 2048)])  # fmt: skip
        grown = []
        for (node, l, h), good in zip(frontier, ok, strict=True):
            if good:
                node["leaf"] = {}
                continue
            dim = int(np.argmax((h - l) / (hi - lo)))
            mid, kids = (l[dim] + h[dim]) / 2, [{}, {}]
            node.update({"input": {"dim": dim, "at": [float(mid)]}, "children": kids})
            h2, l2 = h.copy(), l.copy()
            h2[dim], l2[dim] = mid, mid
            grown += [(kids[0], l, h2), (kids[1], l2, h)]
        frontier = grown
    return root


@pytest.mark.skipif(not os.environ.get("CVE_CHECK_ACASXU"), reason="a benchmark: CVE_CHECK_ACASXU=1 runs it")
def test_acasxu_property_1_whole(tmp_path):
    """The whole of property 1 on ACAS Xu 1_1: a proof of tens of thousands of leaves built by this
    file's CROWN, checked with 2 workers (minutes)."""
    q, lo, hi, rows = acas_instance(tmp_path, 1.0)
    node = crown_bisect(acas_layers(), np.array(rows[0][0]), rows[0][1], lo, hi)
    doc = proof(q, ACAS_NET, acas_layers(), [obligation(lo, hi, rows, node)])
    doc["relu_layers"] = [{"id": i, "output": f"R{i}", "size": 50} for i in range(6)]
    r = check(tmp_path, doc, q, ACAS_NET, workers=2)
    print(r)
    assert (r.status, r.leaves) == ("valid", count_leaves(node)), r


# ------------------------------------------------------------------------------------------------------
# APTP proofs (dynaroars/aptpchecker's format)
# ------------------------------------------------------------------------------------------------------


def aptp_text(leaves: list[str], n_hidden: int) -> str:
    """An APTP file of the README's shape: declarations, then the leaves' ``(or (and ...) ...)``."""
    text = "".join(f"(declare-pwl N_{k} ReLU)\n" for k in range(1, n_hidden + 1))
    return text + "(assert (or\n" + "".join(f"    (and {leaf})\n" for leaf in leaves) + "))\n"


def test_aptp_phase_leaves(tmp_path, capsys):
    """The README's sample: 2 inputs, 2 layers of 2 ReLUs (``N_1, N_2``; ``N_3, N_4``), its four leaves;
    without one leaf the others do not cover the phases."""
    rng = np.random.default_rng(7)
    layers = [(rng.normal(size=(2, 2)), rng.normal(size=2)), (rng.normal(size=(2, 2)), rng.normal(size=2))]
    layers.append((np.array([[1.0, -1.0], [-1.0, 1.0]]), np.array([5.0, 0.0])))  # y_0 - y_1 >= 5 - small
    lo, hi = np.array([-2.0, -1.0]), np.array([2.0, 1.0])
    q, n = (
        save_query(tmp_path / "q.vnnlib", lo, hi, [([1.0, -1.0], 0.0)]),
        save_net(tmp_path / "n.onnx", layers),
    )
    leaves = [
        "(< N_4 0)",
        "(< N_2 0) (>= N_4 0)",
        "(>= N_2 0) (>= N_1 0) (>= N_4 0)",
        "(>= N_2 0) (< N_1 0) (>= N_4 0)",
    ]
    p = tmp_path / "proof.aptp"
    p.write_text(aptp_text(leaves, 4))
    r = check_proof(str(q), {"N": str(n)}, str(p))
    assert (r.status, r.leaves) == ("valid", 4), r
    p.write_text(aptp_text(leaves[:3], 4))
    r = check_proof(str(q), {"N": str(n)}, str(p))
    assert r.status == "invalid" and "nothing covers the box" in r.message and "(0, 0, -1)" in r.message, r
    p.write_text(aptp_text(["(< N_5 0)", "(>= N_5 0)"], 5))
    assert solver_cli.main(["check", str(q), "--network", f"N={n}", "--proof", str(p)]) == 1
    assert "N_5: the network has 4 ReLU neurons" in capsys.readouterr().out


def test_aptp_input_boxes(tmp_path):
    """NeuralSAT's APTP leaves are input boxes: ``|x|`` on ``[-1, 2]`` cut at 0 and 0.5 is valid; a leaf
    whose upper end is written with fewer digits than the query's leaves a sliver uncovered."""
    doc, q, n = abs_instance(tmp_path)
    boxes = ["(>= X_0 -1) (<= X_0 0)", "(>= X_0 0) (<= X_0 0.5)", "(>= X_0 0.5) (<= X_0 2)"]
    p = tmp_path / "proof.aptp"
    p.write_text(aptp_text(boxes, 2))
    r = check_proof(str(q), {"N": str(n)}, str(p))
    assert (r.status, r.leaves) == ("valid", 3), r
    p.write_text(aptp_text([*boxes[:2], "(>= X_0 0.5) (<= X_0 1.9999999)"], 2))
    r = check_proof(str(q), {"N": str(n)}, str(p))
    assert r.status == "invalid" and "nothing covers the box [1.9999999" in r.message, r
