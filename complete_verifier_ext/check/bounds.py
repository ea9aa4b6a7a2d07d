"""Rigorous float64 bounds over a batch of B leaves of one obligation (their boxes, phases, evidence).

1. Node by node, bounds ``[l, u]`` of every node's value over each leaf's region (shapes ``(B, n)``):
   interval propagation; for a ReLU's input with a ReLU below it, also CROWN's back-substitution
   (adaptive slopes) for the neurons each leaf has unstable (every neuron, and three fixed slopes
   besides: a second pass for the leaves the first leaves open), and the tighter of the two; a phase
   ``z_j <= 0`` / ``z_j >= 0`` clamps ``[l, min(u, 0)]`` / ``[max(l, 0), u]``, a verified claim of a
   bounds node above the leaf intersects. A leaf with some ``l > u`` has an empty region (its phases
   and claims cannot hold together): nothing to prove there.
2. The objective ``Σ_i λ_i (C_i y - d_i)`` for Q weightings ``λ`` at once (the leaf's, each row alone,
   their sum; in the second pass also one a small LP finds, :func:`row_weights`), by one backward
   pass with the leaf's slopes ``α`` and multipliers ``β``; the best one.

A backward pass carries, per leaf and row, ``a · x_k + const`` with ``target >= a · x_k + const -
slack`` over the region: ``const`` rounded down, ``slack`` (rounding errors so far) rounded up. Steps:

* affine ``z = W x + b``: ``a <- fl(a W)``, ``const += a·b``, ``slack += |a|·(E m_x + eb)``, where
  ``m_x = max(|l_x|, |u_x|)`` and ``E``, ``eb`` bound the rounding (and the radii) per unit of ``|x|``;
* ReLU ``h = max(z, 0)`` on ``[l, u]``: where ``a_j >= 0`` the line ``h >= α_j z`` (any ``α_j`` in
  [0, 1]), where ``a_j < 0`` the line ``h <= s_j z + t_j``, ``s_j = fl(u/(u - l))`` and ``t_j`` the
  smallest float above both ``-s_j l`` and ``u - s_j u`` (the line checked at both ends: by convexity
  it lies above the ReLU on ``[l, u]``); a split neuron adds ``β_j z_j`` (phase ``z_j <= 0``) or
  ``-β_j z_j`` (``z_j >= 0``), a term ``<= 0`` on the region; ``slack`` takes the products' rounding;
* sigmoid ``h = σ(z)`` on ``[l, u]``: where ``a_j >= 0`` its lower line, where ``a_j < 0`` its upper
  line (``sigmoid.lines``: valid in real arithmetic for the float coefficients); ``slack`` takes the
  products' rounding. Where a sigmoid lies below the node bounded, the pass is run twice
  (:func:`best_backward`), the second time with the lines of each sigmoid's hull tightest where the
  first bound is attained (``sigmoid.lines_at``), and each row keeps the better;
* sum ``z = x_a ± x_b``: ``±a`` to each operand (summed where paths meet, the rounding charged);
* input: ``const += min over the box of a·x = a⁺·l + a⁻·u``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import sigmoid
from .onnx_net import Affine, Input, Net, Relu, Sigmoid, affine, matmul, sources
from .query import Rows
from .rounding import down, err, sum_up, up


@dataclass
class Batch:
    """B leaves of one obligation; ReLU nodes are indices into ``net.nodes``."""

    lower: np.ndarray  # (B, n_in)
    upper: np.ndarray
    phase: dict[int, np.ndarray]  # ReLU node -> (B, n) int8: -1 z <= 0, +1 z >= 0, 0 none
    alpha: dict[int, np.ndarray]  # ReLU node -> (B, n), or per row (B, Q, n), lower slopes in [0, 1]; NaN:
    # CROWN's adaptive one
    beta: dict[int, np.ndarray]  # ReLU node -> (B, n) multipliers >= 0
    lam: np.ndarray  # (B, Q, k) row weightings >= 0
    claims: dict = field(default_factory=dict)  # pre-activation node -> (lower, upper) (B, n), verified
    checking: dict = field(default_factory=dict)  # the same, to verify (used where ``own`` is unstable)
    # sigmoid node -> (B, Q, n): its lines' points (lines_at), or a pair: the lower line's, the upper's
    points: dict = field(default_factory=dict)


@dataclass
class Bounds:
    """Per node ``(B, n)`` bounds over each leaf's region; ``relax``: per ReLU node, the adaptive lower
    slope, the upper slope, the upper line's intercept; ``em``: per affine node, ``E m_src + eb``
    rounded up; ``empty``: leaves whose region is empty; ``finite``: leaves whose bounds are all finite
    (where one is not, a relaxation means nothing and nothing is proved); ``own``: per node of
    ``Batch.checking``, the bounds before its claims."""

    lower: list
    upper: list
    relax: dict  # a sigmoid node's: (k_lo, c_lo, k_up, c_up)
    em: dict
    empty: np.ndarray
    finite: np.ndarray
    own: dict = field(default_factory=dict)

    def mag(self, k: int) -> np.ndarray:
        return np.maximum(np.abs(self.lower[k]), np.abs(self.upper[k]))


def _mv(a: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``(B, Q, n) · (B, n)`` or ``· (n,)`` -> ``(B, Q)``."""
    return a @ v if v.ndim == 1 else (a @ v[:, :, None])[..., 0]


def node_bounds(
    net: Net,
    batch: Batch,
    claimed_crown: bool = True,
    every: bool = False,
    since: tuple | None = None,
    until: int | None = None,
    checked_crown: bool = True,
) -> Bounds:
    """Step 1 of the module docstring; ``claimed_crown=False``: no back-substitution at a node with a
    verified claim (its bounds: interval propagation, the claim and the phases, as a verifier's BaB
    keeps the root's bounds below it; much less work on a conv net); ``every``: back-substitution for
    every neuron of a ReLU's input, the stable ones too (tighter later layers, at more cost); ``since``:
    ``(bnd, z)``, the bounds ``bnd`` made of this batch again from node ``z`` on, the nodes before it
    kept, node ``z``'s own bounds too where ``bnd`` has them (where only ``batch.checking`` at ``z`` and
    after it has changed); ``until``: the last node bounded (the later ones left ``None``);
    ``checked_crown=False``: no back-substitution at a node of ``batch.checking`` (the caller runs it
    for the claims that need it)."""
    B, N = len(batch.lower), len(net.nodes)
    bnd = Bounds([None] * N, [None] * N, {}, {}, np.zeros(B, dtype=bool), np.ones(B, dtype=bool))
    first = 0 if since is None else since[1]
    if since is not None:  # (the kept nodes' arrays are shared: nothing below changes them)
        old = since[0]
        bnd = Bounds(list(old.lower), list(old.upper), dict(old.relax), dict(old.em), bnd.empty, bnd.finite)
        bnd.own = dict(old.own)
    acts = {k: [r for r in range(N) if _activation(net.nodes[r]) and net.nodes[r].src == k] for k in range(N)}
    deep = [False] * N  # an activation at or below the node
    for k, node in enumerate(net.nodes[: N if until is None else until + 1]):
        deep[k] = _activation(node) or any(deep[s] for s in sources(node))
        if k < first:
            continue
        if k == first and k in bnd.own:  # only its claims to verify have changed
            bnd.lower[k], bnd.upper[k] = (x.copy() for x in bnd.own[k])
        else:
            bnd.lower[k], bnd.upper[k] = _interval(node, k, bnd, batch)
            phases = [batch.phase.get(r) for r in acts[k]]
            _restrict(bnd, k, phases, batch.claims.get(k))
            crown = acts[k] and not _activation(node) and any(deep[s] for s in sources(node))
            crown = crown and (checked_crown or k not in batch.checking)
            if crown and (claimed_crown or k not in batch.claims):  # (an activation's output: its own)
                _crown(net, bnd, k, every, any(isinstance(net.nodes[r], Sigmoid) for r in acts[k]))
                _restrict(bnd, k, phases, None)
        if k in batch.checking:  # claims used (and to verify) only where the own bounds are unstable
            bnd.own[k] = (bnd.lower[k].copy(), bnd.upper[k].copy())  # (a sigmoid's input: everywhere)
            smooth = any(isinstance(net.nodes[r], Sigmoid) for r in acts[k])
            unstable = smooth | ~((bnd.lower[k] >= 0) | (bnd.upper[k] <= 0))
            lo, hi = batch.checking[k]
            _restrict(bnd, k, [], (np.where(unstable, lo, -np.inf), np.where(unstable, hi, np.inf)))
        if isinstance(node, Relu):
            bnd.relax[k] = _relaxation(bnd.lower[node.src], bnd.upper[node.src])
        elif isinstance(node, Sigmoid):
            bnd.relax[k] = sigmoid.lines(bnd.lower[node.src], bnd.upper[node.src])
    for lo, hi in (x for x in zip(bnd.lower, bnd.upper, strict=True) if x[0] is not None):
        bnd.empty |= (lo > hi).any(axis=1)
        bnd.finite &= np.isfinite(lo).all(axis=1) & np.isfinite(hi).all(axis=1)
    return bnd


def _crown(net: Net, bnd: Bounds, k: int, every: bool = False, whole: bool = False) -> None:
    """CROWN's bounds of node ``k``'s neurons, where tighter, for each leaf on the neurons it has
    unstable (``whole``, a sigmoid's input: on all; ``every``: on all, and the best of four lower slopes
    for the ReLUs below: the adaptive one, ``s_j``, 0 and 1, each neuron's own best): a leaf's bounds
    do not depend on the other leaves of its batch (a leaf is bounded as if alone, as the verifier
    bounded it)."""
    mine = (bnd.lower[k] < 0) & (bnd.upper[k] > 0)  # (B, n)
    mine |= every or whole
    unstable = np.flatnonzero(mine.any(axis=0))
    if unstable.size:
        r = unstable.size
        A = np.zeros((len(bnd.empty), 2 * r, net.sizes[k]))
        A[:, np.arange(r), unstable] = 1.0
        A[:, r + np.arange(r), unstable] = -1.0
        res = best_backward(net.nodes, bnd, k, A, None)
        for pick in (lambda s: s, np.zeros_like, np.ones_like) if every else ():
            # α-CROWN's optimised slopes (α,β-CROWN's input split under α-CROWN bounds) tighten a box's
            # intermediate bounds beyond the adaptive ones: fixed slopes get part of the way
            alpha = {j: pick(bnd.relax[j][1]) for j in bnd.relax if j < k and isinstance(net.nodes[j], Relu)}
            fixed = Batch(bnd.lower[0], bnd.upper[0], {}, alpha, {}, A)
            res = np.fmax(res, backward(net.nodes, bnd, k, A, fixed))
        here = mine[:, unstable]
        lo, hi = bnd.lower[k][:, unstable], bnd.upper[k][:, unstable]
        bnd.lower[k][:, unstable] = np.where(here, np.fmax(lo, res[:, :r]), lo)
        bnd.upper[k][:, unstable] = np.where(here, np.fmin(hi, -res[:, r:]), hi)


def _interval(node, k: int, bnd: Bounds, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Interval propagation through one node, rounded outward."""
    if isinstance(node, Input):
        return batch.lower.copy(), batch.upper.copy()
    if isinstance(node, Relu):
        return np.maximum(bnd.lower[node.src], 0.0), np.maximum(bnd.upper[node.src], 0.0)
    if isinstance(node, Sigmoid):  # increasing
        return sigmoid.value_bounds(bnd.lower[node.src])[0], sigmoid.value_bounds(bnd.upper[node.src])[1]
    if isinstance(node, Affine):
        l, u, n = bnd.lower[node.src], bnd.upper[node.src], node.W.shape[1]
        bnd.em[k] = up(sum_up(matmul(bnd.mag(node.src), node.E.T), n) + node.eb)
        lo, hi = matmul(l, node.Wp) + matmul(u, node.Wn), matmul(u, node.Wp) + matmul(l, node.Wn)
        return down(lo + node.b - bnd.em[k]), up(hi + node.b + bnd.em[k])
    la, ua, lb, ub = bnd.lower[node.a], bnd.upper[node.a], bnd.lower[node.b], bnd.upper[node.b]
    if node.sign > 0:
        return down(la + lb), up(ua + ub)
    return down(la - ub), up(ua - lb)


def _restrict(bnd: Bounds, k: int, phases: list, claim: tuple | None) -> None:
    """Node ``k``'s bounds with the phases clamped in and intersected with a claim ``(lower, upper)``."""
    for p in phases:
        if p is not None:
            bnd.lower[k] = np.where(p > 0, np.maximum(bnd.lower[k], 0.0), bnd.lower[k])
            bnd.upper[k] = np.where(p < 0, np.minimum(bnd.upper[k], 0.0), bnd.upper[k])
    if claim is not None:
        bnd.lower[k], bnd.upper[k] = np.fmax(bnd.lower[k], claim[0]), np.fmin(bnd.upper[k], claim[1])


def _relaxation(l: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adaptive lower slope (1 where ``u > -l``), upper slope and intercept of each neuron's ReLU on
    ``[l, u]``; stable neurons: exact (slopes 1 or 0, intercept 0)."""
    active, unstable = l >= 0, (l < 0) & (u > 0)
    s = np.where(unstable, u / np.where(unstable, u - l, 1.0), active * 1.0)
    t = np.where(unstable, np.maximum(up(-s * l), up(u - down(s * u))), 0.0)
    return np.where(unstable, (u > -l) * 1.0, active * 1.0), s, t


def backward(nodes, bnd: Bounds, top: int, A: np.ndarray, batch: Batch | None, linear: dict | None = None):
    """A lower bound ``(B, Q)`` of ``A · x_top`` over each leaf's region; ``batch``: the leaves' slopes
    and multipliers (``None``: adaptive slopes, no multipliers); ``linear``: given a dict, it gets the
    bound before the input's concretisation, ``"a"`` (B, Q, n_in) and ``"const"`` (B, Q), with
    ``A · x_top >= a · x + const`` over the region."""
    B, Q = A.shape[:2]
    pending = {top: A}
    const, slack = np.zeros((B, Q)), np.zeros((B, Q))
    for k in range(top, -1, -1):
        a = pending.pop(k, None)
        if a is None:
            continue
        node = nodes[k]
        if isinstance(node, Input):
            n = a.shape[2]
            if linear is not None:
                linear["a"], linear["const"] = a, down(const - up(slack + err(_mv(np.abs(a), bnd.mag(0)), n)))
            const = down(
                const + (_mv(np.maximum(a, 0.0), bnd.lower[0]) + _mv(np.minimum(a, 0.0), bnd.upper[0]))
            )
            slack = up(slack + err(_mv(np.abs(a), bnd.mag(0)), 2 * n + 2))
        elif isinstance(node, Affine):
            const = down(const + _mv(a, node.b))
            slack = up(slack + sum_up(_mv(np.abs(a), bnd.em[k]), a.shape[2]))
            slack = _give(pending, bnd, node.src, matmul(a, node.W), slack)
        elif isinstance(node, (Relu, Sigmoid)):
            step_of = _relu_step if isinstance(node, Relu) else _sigmoid_step
            q, c, step = step_of(node, k, a, bnd, batch)
            const = down(const + c)
            slack = _give(pending, bnd, node.src, q, up(slack + step))
        else:
            slack = _give(pending, bnd, node.a, a, slack)
            slack = _give(pending, bnd, node.b, node.sign * a, slack)
    return down(const - slack)


def _relu_step(node: Relu, k: int, a: np.ndarray, bnd: Bounds, batch: Batch | None):
    """The ReLU step of the module docstring: the coefficients ``q`` on the ReLU's input, the float
    value of ``a⁻·t`` (to add to ``const``) and the rounding to add to ``slack``: of ``a⁻·t``, of the
    products ``a_j s_j`` and of adding ``∓β_j`` (``u`` per unit of ``|p| + |q|``, ``err`` with room).
    A stable neuron's lines are exact (``α_j = s_j``, 1 or 0; ``t_j = 0``): only the columns some leaf
    has unstable (``cut``) need the sign of ``a``."""
    al, s, t = bnd.relax[k]
    z = node.src
    unstable = (bnd.lower[z] < 0) & (bnd.upper[z] > 0)
    cut = np.flatnonzero(unstable.any(axis=0))
    a_cut, al = a[:, :, cut], al[:, None, cut]
    if batch is not None and k in batch.alpha:
        given = batch.alpha[k] if batch.alpha[k].ndim == 3 else batch.alpha[k][:, None, :]
        given = given[:, :, cut]
        al = np.where(unstable[:, None, cut] & ~np.isnan(given), np.clip(given, 0.0, 1.0), al)
    p = a * s[:, None, :]
    p[:, :, cut] = np.where(a_cut >= 0, a_cut * al, p[:, :, cut])
    q = p  # then β z_j where z_j <= 0, -β z_j where z_j >= 0
    if batch is not None and k in batch.beta and k in batch.phase:
        q = p - (batch.beta[k] * batch.phase[k])[:, None, :]
        size = _mv(np.abs(p) + np.abs(q), bnd.mag(z))  # the products' |p| + |q| per unit of |z|
    else:
        size = 2.0 * _mv(np.abs(p), bnd.mag(z))
    n, neg_t = a.shape[2], _mv(np.minimum(a_cut, 0.0), t[:, cut])
    step = up(err(-neg_t, n) + err(size, n))
    return q, neg_t, step


def _sigmoid_step(node: Sigmoid, k: int, a: np.ndarray, bnd: Bounds, batch: Batch | None):
    """The sigmoid step of the module docstring, as :func:`_relu_step` returns it: ``a⁺`` takes the
    lower line, ``a⁻`` the upper one; the rounding of the products ``a_j k_j`` and of the intercepts'
    dot product."""
    k_lo, c_lo, k_up, c_up = (x[:, None, :] for x in bnd.relax[k])
    if batch is not None and k in batch.points:
        l, u = bnd.lower[node.src][:, None, :], bnd.upper[node.src][:, None, :]
        p = batch.points[k]
        p_lo, p_up = p if isinstance(p, tuple) else (p, p)
        at = sigmoid.lines_at(l, u, p_lo, p_up)
        lo, hi = ~np.isnan(p_lo), ~np.isnan(p_up)  # (CROWN's lines where no point is given)
        k_lo, c_lo = np.where(lo, at[0], k_lo), np.where(lo, at[1], c_lo)
        k_up, c_up = np.where(hi, at[2], k_up), np.where(hi, at[3], c_up)
    pos, neg = np.maximum(a, 0.0), np.minimum(a, 0.0)
    q = pos * k_lo + neg * k_up
    n = a.shape[2]
    c = (pos * c_lo + neg * c_up).sum(axis=2)
    size = (pos * np.abs(c_lo) - neg * np.abs(c_up)).sum(axis=2)
    step = up(err(size, n) + err(2.0 * _mv(np.abs(q), bnd.mag(node.src)), n))
    return q, c, step


def best_backward(nodes, bnd: Bounds, top: int, A: np.ndarray, batch: Batch | None) -> np.ndarray:
    """:func:`backward`, and where a sigmoid lies below ``top``, once more with each sigmoid's lines
    those of its hull tightest at the value its input takes where the first pass's bound is attained
    (the box's corner its input coefficients pick, per leaf and row, run through the network in plain
    float64: a choice, not a bound): the better of the two, per leaf and row. α-CROWN optimises each
    sigmoid's tangent points; this is one step towards them (a dist_shift leaf α-CROWN closed: -0.18
    with CROWN's lines, 0.087 so)."""
    smooth = [k for k in range(top) if isinstance(nodes[k], Sigmoid)]
    if not smooth:
        return backward(nodes, bnd, top, A, batch)
    linear: dict = {}
    res = backward(nodes, bnd, top, A, batch, linear)
    if "a" not in linear:
        return res
    with np.errstate(all="ignore"):
        x = np.where(linear["a"] >= 0, bnd.lower[0][:, None, :], bnd.upper[0][:, None, :])
        values = _evaluate(nodes, x, top)
        given = batch if batch is not None else Batch(bnd.lower[0], bnd.upper[0], {}, {}, {}, A)
        points = {k: values[nodes[k].src] for k in smooth}
        return np.fmax(res, backward(nodes, bnd, top, A, dataclasses.replace(given, points=points)))


def _evaluate(nodes, x: np.ndarray, top: int) -> list:
    """Each node's value below ``top`` at the inputs ``x`` (B, Q, n_in), in plain float64."""
    v: list = []
    for node in nodes[:top]:
        if isinstance(node, Input):
            v.append(x)
        elif isinstance(node, Affine):
            v.append(matmul(v[node.src], node.W.T) + node.b)
        elif isinstance(node, Relu):
            v.append(np.maximum(v[node.src], 0.0))
        elif isinstance(node, Sigmoid):
            v.append(sigmoid.sigma(v[node.src]))
        else:
            v.append(v[node.a] + node.sign * v[node.b])
    return v


def _activation(node) -> bool:
    return isinstance(node, (Relu, Sigmoid))


def objective(net: Net, rows: Rows, bnd: Bounds, batch: Batch) -> np.ndarray:
    """Step 2 of the module docstring: the best lower bound ``(B,)`` over the batch's weightings of
    the rows (the clause ``λ·(C y - d)`` as one more affine node after the output); ``+inf`` for a leaf
    whose region is empty, ``-inf`` where a bound is not finite."""
    nodes, top = _with_clause(net, rows, bnd)
    res = best_backward(nodes, bnd, top, batch.lam, batch)
    best = np.where(np.isnan(res), -np.inf, res).max(axis=1, initial=-np.inf)
    return np.where(bnd.finite, np.where(bnd.empty, np.inf, best), -np.inf)


def _with_clause(net: Net, rows: Rows, bnd: Bounds) -> tuple[tuple, int]:
    """The network's nodes and the clause's rows ``C y - d`` as one more affine node after the output
    (its rounding per unit of ``|y|`` in ``bnd.em``), and that node's index."""
    clause = affine(net.output, rows.C, -rows.d, rows.C_rad, rows.d_rad)
    top = len(net.nodes)
    bnd.em[top] = up(sum_up(matmul(bnd.mag(net.output), clause.E.T), rows.C.shape[1]) + clause.eb)
    return (*net.nodes, clause), top


def row_weights(net: Net, rows: Rows, bnd: Bounds, batch: Batch) -> np.ndarray:
    """Per leaf, weights ``λ >= 0`` of the rows, ``Σ λ = 1`` (``(B, k)``), that maximise the minimum over
    the leaf's box of ``Σ_r λ_r (a_r · x + c_r)``, each row's own linear lower bound: a small LP per leaf
    (HiGHS). A leaf no row alone closes may be closed by a weighting: α,β-CROWN clips a box to the
    intersection of its rows' half-spaces and drops what lies outside it, which can take several rows
    at once. Only a search heuristic: the bound pass with these weights decides (zeros where the LP
    fails, which prove nothing)."""
    import scipy.sparse as sp
    from scipy.optimize import linprog

    k, linear = len(rows.d), {}
    nodes, top = _with_clause(net, rows, bnd)
    eye = np.broadcast_to(np.eye(k), (len(batch.lower), k, k))
    backward(nodes, bnd, top, eye, batch, linear)
    out = np.zeros((len(batch.lower), k))
    n = batch.lower.shape[1]
    for b in range(len(batch.lower)):
        a, c, lo, hi = linear["a"][b], linear["const"][b], batch.lower[b], batch.upper[b]
        if not (np.isfinite(a).all() and np.isfinite(c).all()):
            continue
        # variables (λ, t): maximise Σ t_i + λ·c with t_i <= λ·a_i l_i, t_i <= λ·a_i u_i, Σ λ = 1
        ub = sp.bmat([[-(a * lo).T, sp.identity(n)], [-(a * hi).T, sp.identity(n)]], format="csr")
        eq = np.concatenate([np.ones(k), np.zeros(n)])[None]
        res = linprog(np.concatenate([-c, -np.ones(n)]), A_ub=ub, b_ub=np.zeros(2 * n), A_eq=eq, b_eq=[1.0],
                      bounds=[(0, None)] * k + [(None, None)] * n, method="highs")  # fmt: skip
        if res.status == 0:
            out[b] = np.maximum(res.x[:k], 0.0)
    return out


def _give(pending: dict, bnd: Bounds, k: int, a: np.ndarray, slack: np.ndarray) -> np.ndarray:
    """Coefficients ``a`` to node ``k``: added to what is already there, that addition's rounding
    (``u`` per unit, ``err`` with room) charged."""
    if k in pending:
        a = pending[k] + a
        slack = up(slack + err(_mv(np.abs(a), bnd.mag(k)), a.shape[2]))
    pending[k] = a
    return slack
