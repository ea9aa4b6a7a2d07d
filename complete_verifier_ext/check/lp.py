"""The LP fallback: a leaf's triangle relaxation solved by HiGHS, and a rigorous lower bound from the
dual solution (the LP's own objective value is never used).

Variables ``v``: every node's value, in the leaf's bounds (its phases clamped in), and ``τ`` in
``[0, T]``. Rows ``lo <= A v <= hi``: per affine node ``z - W x = b`` (within ``b ± b_rad``); per ReLU
neuron, stable active ``h - z = 0`` (a dead one is fixed at 0 by its box), unstable ``h - z >= 0`` and
``h - s z <= t`` (the bound pass's upper line); per sigmoid neuron, the bound pass's two lines
``h - k_lo z >= c_lo`` and ``h - k_up z <= c_up`` and :data:`TANGENTS` pairs more; per sum
``z - x_a ∓ x_b = 0``; per clause row ``C_i y - τ <= d_i``. ``T = max_i (Σ_j |C_ij| m_y_j + |d_i|) + 1``
exceeds every row's value. Minimise ``τ``: a point of the relaxation meeting every row has ``τ = 0``
feasible, so a lower bound ``> 0`` on ``τ`` (or an infeasible LP) leaves no point of the leaf meeting
the clause.

The bound (Neumaier and Shcherbina, "Safe bounds in linear and mixed-integer linear programming",
2004): for any row multipliers ``y`` and feasible ``v``, ``c·v = (c - Aᵀy)·v + y·(Av) >= min over the
box of (c - Aᵀy)·v + Σ_i min(y_i lo_i, y_i hi_i)`` (``y_i`` kept only where that side is finite). It is
evaluated in float64 with the rounding of ``c - Aᵀy`` and of each dot product, and the coefficient
radii, charged outward. With HiGHS's optimal duals it is the LP's optimum up to rounding; for an
infeasible LP, HiGHS's dual ray in the same formula with ``c = 0`` gives a bound ``> 0`` on ``0``: no
feasible point at all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from . import sigmoid
from .bounds import Bounds
from .onnx_net import Affine, Input, Net, Relu, Sigmoid, entries
from .query import Rows
from .rounding import down, err, sum_up, up

# per sigmoid neuron, lines of σ' at so many points of its interval (sigmoid.tangents; with 6, an LP of a
# dist_shift proof stopped at its time limit)
TANGENTS = 3
TINY = 1e-9  # smaller coefficients are folded into their rows' sides (_fold_tiny)
TIME_LIMIT = "time limit"  # Solver.minimum's status where HiGHS stopped at its time limit


@dataclass
class Lp:
    A: sp.csr_matrix
    A_rad: sp.csr_matrix | None
    row_lo: np.ndarray
    row_hi: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    c: np.ndarray


@dataclass
class _Rows:
    """Rows collected as triplets (row, column, value, radius) with their two sides."""

    r: list
    c: list
    v: list
    rad: list
    lo: list
    hi: list
    n: int = 0

    def add(self, cols: list, vals: list, rads: list, lo, hi) -> None:
        """Rows ``lo <= Σ_t vals[t][i] v[cols[t][i]] <= hi``, one per ``i``."""
        m = np.broadcast_shapes(np.shape(cols[0]), np.shape(vals[0]))[0]
        for col, val, rad in zip(cols, vals, rads, strict=True):
            col, val = np.broadcast_arrays(np.asarray(col), np.asarray(val, dtype=np.float64))
            rows = np.broadcast_to(self.n + np.arange(m).reshape((m,) + (1,) * (col.ndim - 1)), col.shape)
            self.r.append(rows.ravel())
            self.c.append(col.ravel())
            self.v.append(val.ravel())
            self.rad.append(np.broadcast_to(np.asarray(rad, dtype=np.float64), col.shape).ravel())
        self._sides(m, lo, hi)

    def add_sparse(self, m: int, *terms: tuple, lo=None, hi=None) -> None:
        """``m`` rows ``lo <= Σ val · v[col] <= hi`` from ``terms`` ``(row among the m, col, val, rad)``."""
        for row, col, val, rad in terms:
            col = np.asarray(col)
            self.r.append(self.n + np.broadcast_to(row, col.shape))
            self.c.append(col)
            self.v.append(np.broadcast_to(np.asarray(val, dtype=np.float64), col.shape))
            self.rad.append(np.broadcast_to(np.asarray(rad, dtype=np.float64), col.shape))
        self._sides(m, lo, hi)

    def _sides(self, m: int, lo, hi) -> None:
        """The two sides of the ``m`` rows just added, which are counted."""
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=np.float64), m))
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=np.float64), m))
        self.n += m


def build(net: Net, bnd: Bounds, b: int, rows: Rows | None = None, top: int | None = None) -> Lp:
    """The LP of leaf ``b`` of a batch whose bounds are ``bnd``: with ``rows``, over every node, the
    clause's rows and ``τ`` (the objective); else over the nodes up to ``top``, whose box is its own
    bounds ``bnd.own[top]`` (a claim being verified), with no objective yet."""
    top = len(net.nodes) - 1 if top is None else top
    off = np.concatenate([[0], np.cumsum(net.sizes[: top + 1])])
    tau = int(off[-1])
    R = _Rows([], [], [], [], [], [])
    for k, node in enumerate(net.nodes[: top + 1]):
        me = off[k] + np.arange(net.sizes[k])
        if isinstance(node, Affine):
            b_rad = 0.0 if node.b_rad is None else node.b_rad
            i, j, w, w_rad = entries(node)
            R.add_sparse(
                len(me),
                (np.arange(len(me)), me, 1.0, 0.0),
                (i, off[node.src] + j, -w, w_rad),
                lo=down(node.b - b_rad),
                hi=up(node.b + b_rad),
            )
        elif isinstance(node, (Relu, Sigmoid)):
            _activation_rows(R, node, k, bnd, b, me, off[node.src] + np.arange(net.sizes[k]))
        elif not isinstance(node, Input):
            a, c = off[node.a] + np.arange(net.sizes[k]), off[node.b] + np.arange(net.sizes[k])
            R.add([me, a, c], [1.0, -1.0, -node.sign], [0.0, 0.0, 0.0], 0.0, 0.0)
    lo, hi = [bnd.lower[k][b] for k in range(top + 1)], [bnd.upper[k][b] for k in range(top + 1)]
    if rows is None:
        lo[top], hi[top] = bnd.own[top][0][b], bnd.own[top][1][b]
        lo, hi = np.concatenate(lo), np.concatenate(hi)
    else:
        y = off[net.output] + np.arange(net.sizes[net.output])[None, :]
        R.add(
            [y, np.full(len(rows.d), tau)],
            [rows.C, -1.0],
            [rows.C_rad, 0.0],
            -np.inf,
            up(rows.d + rows.d_rad),
        )
        m_y = bnd.mag(net.output)[b]
        T = up(up(np.max(np.abs(rows.C) @ m_y + np.abs(rows.d), initial=0.0) * (1 + 2**-40)) + 1.0)
        lo, hi = np.concatenate([*lo, [0.0]]), np.concatenate([*hi, [T]])
    shape = (R.n, len(lo))
    ijv = [np.concatenate(x) for x in (R.r, R.c, R.v, R.rad)]
    row_lo, row_hi = _fold_tiny(
        ijv, np.concatenate(R.lo), np.concatenate(R.hi), np.fmax(np.abs(lo), np.abs(hi))
    )
    A = sp.csr_matrix((ijv[2], (ijv[0], ijv[1])), shape=shape)
    A.eliminate_zeros()
    A_rad = sp.csr_matrix((ijv[3], (ijv[0], ijv[1])), shape=shape) if ijv[3].any() else None
    c = np.zeros(len(lo))
    c[-1] = 1.0 if rows is not None else 0.0
    return Lp(A, A_rad, row_lo, row_hi, lo, hi, c)


def _fold_tiny(
    ijv: list, row_lo: np.ndarray, row_hi: np.ndarray, m: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows' sides with every coefficient below :data:`TINY` in magnitude moved into them (in place:
    the coefficient and its radius become 0): its term lies within ``±(|a| + rad) m_x`` (``m_x`` the
    column's largest magnitude), so the sides move out by that much. HiGHS drops such coefficients
    itself, without moving the sides (its ``small_matrix_value``), which changes the LP; a sigmoid's
    lines far out have slopes down to 1e-13, and the LP of a dist_shift leaf with them was called
    infeasible."""
    r, _, v, rad = ijv
    tiny = (np.abs(v) < TINY) & (v != 0)
    if not tiny.any():
        return row_lo, row_hi
    term = up(up(np.abs(v[tiny]) + rad[tiny]) * m[ijv[1][tiny]])
    shift = np.zeros(len(row_lo))
    np.add.at(shift, r[tiny], term)
    shift = sum_up(shift, int(np.bincount(r[tiny]).max()))
    v[tiny], rad[tiny] = 0.0, 0.0
    with np.errstate(invalid="ignore"):  # (an infinite side stays so)
        return down(row_lo - shift), up(row_hi + shift)


def _activation_rows(R: _Rows, node, k: int, bnd: Bounds, b: int, me: np.ndarray, z: np.ndarray) -> None:
    """The rows of an activation node ``k`` of leaf ``b`` (``me``, ``z``: its and its input's columns):
    a ReLU's triangle, a sigmoid's lines (module docstring)."""
    l, u = bnd.lower[node.src][b], bnd.upper[node.src][b]
    if isinstance(node, Relu):
        _, s, t = (x[b] for x in bnd.relax[k])
        act, uns = l >= 0, (l < 0) & (u > 0)
        R.add([me[act], z[act]], [1.0, -1.0], [0.0, 0.0], 0.0, 0.0)
        R.add([me[uns], z[uns]], [1.0, -1.0], [0.0, 0.0], 0.0, np.inf)
        R.add([me[uns], z[uns]], [1.0, -s[uns]], [0.0, 0.0], -np.inf, t[uns])
        return
    k_lo, c_lo, k_up, c_up = (x[b] for x in bnd.relax[k])
    R.add([me, z], [1.0, -k_lo], [0.0, 0.0], c_lo, np.inf)
    R.add([me, z], [1.0, -k_up], [0.0, 0.0], -np.inf, c_up)
    k_t, lo_t, hi_t = sigmoid.tangents(l, u, TANGENTS)
    me_t, z_t = np.repeat(me, TANGENTS), np.repeat(z, TANGENTS)
    R.add([me_t, z_t], [1.0, -k_t.ravel()], [0.0, 0.0], lo_t.ravel(), np.inf)
    R.add([me_t, z_t], [1.0, -k_t.ravel()], [0.0, 0.0], -np.inf, hi_t.ravel())


def lagrangian(lp: Lp, y: np.ndarray, c: np.ndarray) -> float:
    """The rigorous lower bound of ``c·v`` over the LP's feasible set from multipliers ``y`` (module
    docstring), rounded down."""
    y = np.where(np.isfinite(y), y, 0.0)
    y = np.where(((y > 0) & np.isfinite(lp.row_lo)) | ((y < 0) & np.isfinite(lp.row_hi)), y, 0.0)
    n_rows, n = len(y), len(c)
    ay = np.abs(y)
    r = c - lp.A.T @ y
    e = err(np.abs(c) + abs(lp.A).T @ ay, n_rows + 2)
    if lp.A_rad is not None:
        e = up(e + sum_up(lp.A_rad.T @ ay, n_rows))
    m = np.maximum(np.abs(lp.lo), np.abs(lp.hi))
    side = np.where(y > 0, lp.row_lo, np.where(y < 0, lp.row_hi, 0.0))
    value = (np.maximum(r, 0.0) @ lp.lo + np.minimum(r, 0.0) @ lp.hi) + y @ side
    charge = up(sum_up(e @ m, n) + up(err(np.abs(r) @ m, 2 * n + 2) + err(ay @ np.abs(side), n_rows + 2)))
    return float(down(down(value) - charge)) if np.isfinite(value) else -np.inf


WARM_LIMIT = 5.0  # seconds for a conv net's crossover to a basis, and for each warm re-solve from it


class Solver:
    """An LP in HiGHS, minimised for one objective after another: the dual simplex (warm-started from
    the last objective), or for LPs of over 5000 variables (conv nets) the interior-point method
    without crossover (the duals need not be exact: the bound is rigorous for any); the simplex for a
    dual ray where the LP is infeasible. ``many`` (objectives to come, on a conv net): the first
    solution is crossed over to a basis, from which the dual simplex re-solves each next objective in a
    few pivots where the IPM starts over (oval21's base net, 197 claim LPs: 5 s instead of 47 s); a
    crossover or a re-solve that takes over ``WARM_LIMIT`` (oval21's deep net has both) gives way to
    the IPM. An LP that HiGHS's presolve calls infeasible is solved again without it (on oval21's deep
    net presolve called a feasible LP infeasible). ``time_limit``: seconds per objective."""

    def __init__(self, lp: Lp, time_limit: float = 60.0, many: bool = False) -> None:
        import highspy

        self.lp, self.h, self.time_limit = lp, _highs(), float(time_limit)
        self.h.setOptionValue("output_flag", False)
        self.solver = "ipm" if lp.A.shape[1] > 5000 else "simplex"
        self.warm, self.basis, self.presolve = many and self.solver == "ipm", None, True
        A = lp.A.tocsc()
        model = highspy.HighsLp()
        model.num_col_, model.num_row_ = A.shape[1], A.shape[0]
        model.col_cost_, model.col_lower_, model.col_upper_ = lp.c, lp.lo, lp.hi
        model.row_lower_, model.row_upper_ = lp.row_lo, lp.row_hi
        model.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        model.a_matrix_.start_, model.a_matrix_.index_, model.a_matrix_.value_ = A.indptr, A.indices, A.data
        self.h.passModel(model)

    def _run(self, solver: str, seconds: float, crossover: bool = False, presolve: bool | None = None):
        """One HiGHS run within ``seconds`` (its own limit counts every run of the instance); presolve as
        ``self.presolve`` says unless ``presolve`` does."""
        self.h.setOptionValue("solver", solver)
        self.h.setOptionValue("run_crossover", "on" if crossover else "off")
        self.h.setOptionValue(
            "presolve", "on" if (self.presolve if presolve is None else presolve) else "off"
        )
        self.h.setOptionValue("time_limit", self.h.getRunTime() + seconds)
        self.h.run()
        return self.h.getModelStatus()

    def minimum(self, c: np.ndarray | None = None) -> tuple[float, str]:
        """A rigorous lower bound of the minimum of ``c · v`` (default: the LP's objective) over the LP
        (``inf``: proven infeasible) and HiGHS's status."""
        import highspy

        kind = highspy.HighsModelStatus
        c = self.lp.c if c is None else c
        self.h.changeColsCost(len(c), np.arange(len(c), dtype=np.int32), c.astype(np.float64))
        status = None
        if self.warm:
            if self.basis is not None:
                self.h.setBasis(self.basis)
            first = self.basis is None
            status = self._run("ipm" if first else "simplex", WARM_LIMIT, crossover=first)
            if status == kind.kOptimal and self.h.getBasis().valid:
                self.basis = self.h.getBasis()
            elif status != kind.kInfeasible:
                self.warm, status = self.basis is not None, None  # no basis in time: the IPM from now on
        if status is None:
            status = self._run(self.solver, self.time_limit)
        if status == kind.kInfeasible and self.presolve:  # presolve's verdict: wrong at times, so without it
            self.presolve = False
            status = self._run(self.solver, self.time_limit)
        if status == kind.kInfeasible and not self._certified():
            # no dual ray proves it: once more from cold, with presolve (HiGHS's simplex warm-started
            # from an earlier objective, and a run without presolve, called a feasible LP infeasible)
            self.h.clearSolver()
            status = self._run(self.solver, self.time_limit, presolve=True)
            if status == kind.kInfeasible and not self._certified():
                return -np.inf, "infeasible"
        if status == kind.kOptimal:
            return lagrangian(self.lp, np.asarray(self.h.getSolution().row_dual), c), "optimal"
        if status == kind.kInfeasible:
            return np.inf, "infeasible"
        if status == kind.kTimeLimit:
            return -np.inf, TIME_LIMIT
        return -np.inf, self.h.modelStatusToString(status)

    def _certified(self) -> bool:
        """Whether HiGHS's dual ray (the simplex's: another solver is run again for it) proves the LP,
        just called infeasible, infeasible."""
        if self.solver != "simplex":
            self._run("simplex", self.time_limit)
        _, has_ray, ray = self.h.getDualRay()
        if not has_ray:
            return False
        zero = np.zeros(len(self.lp.lo))
        ray = np.asarray(ray)
        return max(lagrangian(self.lp, ray, zero), lagrangian(self.lp, -ray, zero)) > 0


def _highs():
    """A HiGHS instance on one thread (the checker deals its work over forked processes, which a
    running thread pool would not survive); the banner its constructor prints from C goes nowhere
    (stdout has the one-line answer, stderr the counts)."""
    import highspy

    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        h = highspy.Highs()
        h.setOptionValue("threads", 1)
        return h
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
