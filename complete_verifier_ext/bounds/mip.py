"""MILP refinement of intermediate bounds (α,β-CROWN's ``bab-refine``), solved by HiGHS (highspy).

For a chain network (Linear layers with ReLUs between them, plus Flatten and elementwise affine
ops), the pre-activation bounds of layer i are tightened by solving, for each unstable neuron j,
``min`` and ``max`` of ``z_ij`` over the exact mixed-integer model of the layers before it, in
float64: the input box, and for every unstable ReLU of an earlier layer a binary ``δ`` with
``a >= 0, a >= z, a <= u δ, a <= z - l (1 - δ)`` (Tjeng et al.'s big-M encoding); stable ReLUs
are ``a = z`` or ``a = 0``.  Each solve has a time limit; a solve stopped by it still gives a sound
bound, the dual bound of HiGHS's branch and bound, which is at least the LP (triangle) bound.
Layers are refined in order, so each layer's model has the tightened bounds of the layers before
it (fewer binaries, smaller big-M).  The first layer is exact by IBP and needs no solve.

Soundness: the solver works to tolerances of about 1e-7 to 1e-6, so every new bound is moved out
by ``SAFETY * (1 + |bound|)`` and intersected with the old one (never looser).

Ranks: ``refine.refine_in_order`` deals the (neuron, side) solves of a layer over the ranks.  The
model needs whole weight matrices: under FSDP each layer is gathered once (``gathered``,
collective); under TP the refinement is refused (no rank may hold a full layer).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp
import torch

from ..parallel import comm
from .graph import Graph
from .refine import FlatBounds, Task, refine_in_order
from .walk import Bounds

SAFETY = 1e-4  # relative outward margin on every bound from the solver


class UnsupportedForMip(ValueError):
    """The network is not a chain of Linear / elementwise-affine / ReLU layers."""


@dataclass
class Layer:
    """``z = M v + c``: the pre-activation node ``node`` as an affine map of the previous ReLU's
    output (or of the flat input, for the first layer)."""

    M: np.ndarray  # (n, n_prev) float64
    c: np.ndarray  # (n,) float64
    node: int


@dataclass(frozen=True)
class MipOptions:
    neuron_timeout: float = 15.0  # seconds per solve (α,β-CROWN's solver.mip.refine_neuron_timeout)
    layers: int = 0  # how many layers after the first to refine; 0: all
    threads: int = 1  # solves run at once on this rank (one HiGHS model each; HiGHS frees the GIL)


def chain_layers(graph: Graph) -> tuple[list[Layer], Layer]:
    """The pre-activation layers of a chain network as affine maps (float64, whole weights), and
    the output as an affine map of the last ReLU's output.

    Collective under FSDP (one gather per Linear).  Raises ``UnsupportedForMip`` (on every rank
    alike) for anything but Flatten / Affine / Linear / ReLU in a single chain."""
    layers: list[Layer] = []
    M: np.ndarray | None = None  # None: the identity on the current variables
    c = np.zeros(int(np.prod(graph.input_shape)))
    for k in range(1, len(graph.nodes)):
        node = graph.nodes[k]
        if node.inputs != (k - 1,):
            raise UnsupportedForMip(f"node {node.name} does not read the node before it")
        op = node.op
        if op.is_relu:
            if M is None:
                raise UnsupportedForMip(f"ReLU {node.name} directly on the input")
            layers.append(Layer(M, c, k - 1))
            M, c = None, np.zeros(int(np.prod(node.shape)))
            continue
        try:
            M, c = op.compose_affine(M, c, node.shape)
        except NotImplementedError:
            raise UnsupportedForMip(f"node {node.name}: {type(op).__name__} has no MILP encoding") from None
    if not layers:
        raise UnsupportedForMip(f"{graph.source}: no ReLU")
    out = len(graph.nodes) - 1
    return layers, Layer(np.eye(len(c)) if M is None else M, c, out)


def _highs() -> highspy.Highs:
    """A HiGHS instance; the banner HiGHS prints from C on the first one stays off our stdout."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


class _Rows:
    """Constraint rows ``lo <= A v <= hi``, collected as COO triplets."""

    def __init__(self) -> None:
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.n = 0

    def add(self, cols: np.ndarray, vals: np.ndarray, lo, hi) -> None:
        """Rows ``lo <= sum_t vals[i, t] v[cols[i, t]] <= hi``; cols, vals: (rows, terms)."""
        rows, terms = cols.shape
        self.r.append(np.repeat(self.n + np.arange(rows), terms))
        self.c.append(cols.ravel())
        self.v.append(vals.ravel())
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=np.float64), rows))
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=np.float64), rows))
        self.n += rows

    def matrix(self, n_var: int) -> tuple[sp.csc_matrix, np.ndarray, np.ndarray]:
        """The rows as a column-wise sparse matrix, with their lower and upper sides."""
        cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)
        A = sp.csc_matrix((cat(self.v, float), (cat(self.r, int), cat(self.c, int))), shape=(self.n, n_var))
        return A, cat(self.lo, float), cat(self.hi, float)


@dataclass
class _Cols:
    """The model's columns in blocks: their lower and upper bounds and integrality (1: a binary δ)."""

    lo: list[np.ndarray]
    hi: list[np.ndarray]
    integ: list[np.ndarray]
    n: int

    @classmethod
    def inputs(cls, x_lo: np.ndarray, x_hi: np.ndarray) -> _Cols:
        """The input columns alone."""
        return cls([x_lo], [x_hi], [np.zeros(len(x_lo))], len(x_lo))


def _add_relu_layer(
    layer: Layer, l: np.ndarray, u: np.ndarray, prev: np.ndarray, cols: _Cols, rows: _Rows
) -> np.ndarray:
    """Add ``relu(M v + c)`` of ``layer`` with pre-activation bounds ``[l, u]`` (v: the columns
    ``prev``, -1 for an input fixed at 0): ``a`` for its active neurons, ``z, a, δ`` and the
    big-M rows for its unstable ones. Returns the column of each output (-1: inactive, fixed at 0)."""
    keep = prev >= 0
    M, in_cols = layer.M[:, keep], prev[keep]
    act, uns = np.nonzero(l >= 0)[0], np.nonzero((l < 0) & (u > 0))[0]
    na, nu = len(act), len(uns)
    a_act = cols.n + np.arange(na)
    z_u = cols.n + na + np.arange(nu)
    a_u, d_u = z_u + nu, z_u + 2 * nu
    cols.n += na + 3 * nu
    cols.lo += [l[act], l[uns], np.zeros(nu), np.zeros(nu)]
    cols.hi += [u[act], u[uns], u[uns], np.ones(nu)]
    cols.integ += [np.zeros(na + 2 * nu), np.ones(nu)]
    for idx, out in ((act, a_act), (uns, z_u)):  # out - M[idx] @ prev = c[idx]
        k = len(in_cols)
        rows.add(
            np.hstack([out[:, None], np.broadcast_to(in_cols, (len(idx), k))]),
            np.hstack([np.ones((len(idx), 1)), -M[idx]]),
            layer.c[idx],
            layer.c[idx],
        )
    one, lo_u, hi_u = np.ones(nu), l[uns], u[uns]
    rows.add(np.c_[a_u, z_u], np.c_[one, -one], 0.0, np.inf)  # a >= z
    rows.add(np.c_[a_u, d_u], np.c_[one, -hi_u], -np.inf, 0.0)  # a <= u δ
    rows.add(np.c_[a_u, z_u, d_u], np.c_[one, -one, -lo_u], -np.inf, -lo_u)  # a <= z - l (1 - δ)
    out_cols = np.full(len(l), -1)
    out_cols[act], out_cols[uns] = a_act, a_u
    return out_cols


def _add_spec(spec: tuple[np.ndarray, np.ndarray], prev: np.ndarray, cols: _Cols, rows: _Rows) -> None:
    """Add the column ``t`` (last) with ``t - A_r v >= b_r`` for every row r of ``spec = (A, b)``."""
    A, b = spec
    keep = prev >= 0
    t = cols.n
    cols.n += 1
    cols.lo.append(np.full(1, -np.inf))
    cols.hi.append(np.full(1, np.inf))
    cols.integ.append(np.zeros(1))
    k = int(keep.sum())
    rows.add(
        np.hstack([np.full((len(b), 1), t), np.broadcast_to(prev[keep], (len(b), k))]),
        np.hstack([np.ones((len(b), 1)), -A[:, keep]]),
        b,
        np.inf,
    )


def _highs_lp(cols: _Cols, rows: _Rows, integrality: np.ndarray, minimise_last: bool) -> highspy.HighsLp:
    """The HiGHS model of ``cols`` and ``rows``; its cost is ``t`` (the last column) or zero."""
    n_var = cols.n
    A, row_lo, row_hi = rows.matrix(n_var)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_var, A.shape[0]
    lp.col_cost_ = np.zeros(n_var)
    if minimise_last:
        lp.col_cost_[-1] = 1.0  # minimise t
    lp.col_lower_, lp.col_upper_ = np.concatenate(cols.lo), np.concatenate(cols.hi)
    lp.row_lower_, lp.row_upper_ = row_lo, row_hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(t)] for t in integrality]
    return lp


class ChainMilp:
    """The mixed-integer model of the input box and the ReLU layers before layer ``upto``.

    Columns: the input, then per layer ``a`` of its active neurons, and ``z, a, δ`` of its unstable
    ones; an inactive neuron has no column (its output is 0).  With ``spec = (A, b)``, one more
    column ``t`` with ``t >= A_r · v + b_r`` for every row r (v: the inputs of layer ``upto``), for
    ``prove_above``."""

    def __init__(
        self,
        layers: list[Layer],
        bounds: dict[int, tuple[np.ndarray, np.ndarray]],
        x_lo: np.ndarray,
        x_hi: np.ndarray,
        upto: int,
        spec: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        cols, rows = _Cols.inputs(x_lo, x_hi), _Rows()
        prev = np.arange(len(x_lo))  # column of each input of the current layer (-1: a ReLU fixed at 0)
        for layer in layers[:upto]:
            prev = _add_relu_layer(layer, *bounds[layer.node], prev, cols, rows)
        if spec is not None:  # t - A_r v >= b_r
            _add_spec(spec, prev, cols, rows)
        self.n_in = len(x_lo)
        self.n_var = cols.n
        self.prev = prev
        self.integrality = np.concatenate(cols.integ)
        lp = _highs_lp(cols, rows, self.integrality, minimise_last=spec is not None)
        self.highs = _highs()
        # one objective per model (spec): presolve pays; many objectives: it would run for each
        presolve, heuristics = ("on", 0.05) if spec is not None else ("off", 0.0)
        options = {"output_flag": False, "presolve": presolve, "mip_heuristic_effort": heuristics}
        for key, value in options.items():
            self.highs.setOptionValue(key, value)
        self.highs.passModel(lp)

    def minimum(self, w: np.ndarray, time_limit: float, node_limit: int | None = None) -> float:
        """A sound lower bound of ``w · v`` (v: the inputs of layer ``upto``), or -inf.  The solve
        stops at ``time_limit`` seconds or after ``node_limit`` branch-and-bound nodes."""
        keep = self.prev >= 0
        obj = np.zeros(self.n_var)
        obj[self.prev[keep]] = w[keep]
        h = self.highs
        h.clearSolver()  # every solve starts afresh: no state of the previous objective is trusted
        h.changeColsCost(self.n_var, np.arange(self.n_var, dtype=np.int32), obj)
        h.setOptionValue("time_limit", max(time_limit, 0.01))
        h.setOptionValue("mip_max_nodes", node_limit if node_limit is not None else highspy.kHighsIInf)
        h.run()
        status, info = h.getModelStatus(), h.getInfo()
        if not self.integrality.any():  # an LP: only its optimum is a bound (no dual bound is kept)
            optimal = status == highspy.HighsModelStatus.kOptimal
            return float(info.objective_function_value) if optimal else -np.inf
        stopped = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kSolutionLimit)
        if status == highspy.HighsModelStatus.kOptimal or status in stopped:
            bound = float(info.mip_dual_bound)
            return bound if np.isfinite(bound) else -np.inf
        return -np.inf

    def prove_above(self, cutoff: float, time_limit: float) -> tuple[str, float, np.ndarray | None]:
        """Search for a point with ``t < cutoff`` (the model needs ``spec``).  Returns
        ``("proven", bound, None)``: no such point, ``t >= bound >= cutoff`` everywhere;
        ``("found", bound, x)``: an input ``x`` whose ``t`` is below ``cutoff`` (up to the solver's
        tolerances: check it on the network); ``("unknown", bound, None)``: stopped by the time limit.
        ``bound`` is a sound lower bound of ``t`` (-inf when none)."""
        h = self.highs
        # t <= cutoff as a bound of the column, not a solver cutoff: "infeasible" then means exactly
        # that no point has t <= cutoff, and a dual bound D < cutoff of this model bounds t everywhere
        h.changeColBounds(self.n_var - 1, -np.inf, cutoff)
        h.setOptionValue("time_limit", max(time_limit, 0.01))
        h.setOptionValue("mip_max_nodes", highspy.kHighsIInf)
        h.run()
        status, info = h.getModelStatus(), h.getInfo()
        S = highspy.HighsModelStatus
        if status == S.kInfeasible:
            return "proven", cutoff, None
        if self.integrality.any():
            dual = float(info.mip_dual_bound)
        else:  # an LP: only its optimum is a bound
            dual = float(info.objective_function_value) if status == S.kOptimal else -np.inf
        dual = dual if np.isfinite(dual) else -np.inf
        if dual >= cutoff:
            return "proven", dual, None
        if info.primal_solution_status == 2 and info.objective_function_value < cutoff:
            x = np.asarray(h.getSolution().col_value[: self.n_in], dtype=np.float64)
            return "found", dual, x
        return "unknown", dual, None


def refine_bounds(
    graph: Graph,
    box: tuple[torch.Tensor, torch.Tensor],
    bounds: Bounds,
    opts: MipOptions,
    deadline: float,
    log: Callable[[str], None] = lambda s: None,
    weight: dict[int, np.ndarray] | None = None,
) -> tuple[Bounds, dict[str, int]]:
    """Tighter bounds of every pre-activation node (batch of one), and counts of what was done.

    ``bounds``: sound bounds of every pre-activation node, (1, *shape) each (e.g. α-CROWN's).
    ``weight[k]``: how much each neuron of node k matters (e.g. |A| of the output bound at its
    ReLU); see ``refine.refine_in_order`` for the order, the ranks and the deadline.
    Collective: every rank calls it with the same arguments; each solves its share."""
    layers, _ = chain_layers(graph)
    x_lo, x_hi = (t.double().cpu().reshape(-1).numpy() for t in box)
    index = {ly.node: i for i, ly in enumerate(layers)}

    def solve(k: int, tasks: list[Task], cur: FlatBounds, deadline: float) -> np.ndarray:
        layer = layers[index[k]]
        found = np.full(len(tasks), -np.inf)
        order = iter(range(len(tasks)))  # shared by the workers: the most useful tasks first
        lock = threading.Lock()

        def work(model: ChainMilp) -> None:
            while True:
                with lock:
                    t = next(order, None)
                left = deadline - time.monotonic()
                if t is None or left <= 0:
                    return
                j, s = tasks[t]
                found[t] = model.minimum(s * layer.M[j], min(opts.neuron_timeout, left)) + s * layer.c[j]

        n = max(1, min(opts.threads, len(tasks)))
        models = [ChainMilp(layers, cur, x_lo, x_hi, index[k]) for _ in range(n)]
        if n == 1:
            work(models[0])
        else:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(work, models))
        return found

    last = len(layers) if opts.layers <= 0 else min(len(layers), 1 + opts.layers)
    nodes = [ly.node for ly in layers[1:last]]  # the first layer is exact by IBP
    return refine_in_order(
        nodes,
        {ly.node: bounds[ly.node] for ly in layers},
        solve,
        deadline,
        weight,
        margin=lambda v: SAFETY * (1 + abs(v)),
        log=log,
        names={k: graph.nodes[k].name for k in nodes},
    )


@dataclass
class ClauseResult:
    status: str  # proven | found | unknown
    bound: float  # a sound lower bound of the clause's margin, max over its rows of C_r y - d_r
    point: np.ndarray | None = None  # found: the input the solver found (check it on the network)


_CODES = ("proven", "found", "unknown")


def prove_clauses(
    graph: Graph,
    box: tuple[torch.Tensor, torch.Tensor],
    bounds: Bounds,
    clauses: list[tuple[np.ndarray, np.ndarray]],
    opts: MipOptions,
    deadline: float,
    log: Callable[[str], None] = lambda s: None,
    names: list[str] | None = None,
) -> list[ClauseResult]:
    """For every clause ``(C, d)`` (a counterexample has ``C y <= d`` on all rows), a MILP of the whole
    network over ``box``, with ``bounds`` (sound bounds of every pre-activation node): is the margin
    ``max_r C_r y - d_r`` above 0 (by ``SAFETY``) everywhere?  Each solve stops at the first point below
    that cutoff, or when no part of its search tree can hold one.

    The clauses, in the order given, are dealt round-robin over the ranks and solved ``opts.threads``
    at a time on each, until ``deadline``; a rank whose solver finds a point stops its other solves.
    Collective: every rank calls it with the same arguments and gets every clause's result."""
    layers, out = chain_layers(graph)
    x_lo, x_hi = (t.double().cpu().reshape(-1).numpy() for t in box)
    cur = {ly.node: tuple(t.double().cpu().reshape(-1).numpy() for t in bounds[ly.node]) for ly in layers}
    P, rank = comm.world_size(), comm.rank()
    order = iter(range(rank, len(clauses), P))
    results: dict[int, ClauseResult] = {}
    lock, stop = threading.Lock(), threading.Event()
    live: list[ChainMilp] = []

    def work() -> None:
        while True:
            with lock:
                i = None if stop.is_set() else next(order, None)
            left = deadline - time.monotonic()
            if i is None or left <= 0:
                return
            C, d = clauses[i]
            b = C @ out.c - d
            model = ChainMilp(layers, cur, x_lo, x_hi, len(layers), spec=(C @ out.M, b))
            model.highs.HandleUserInterrupt = True  # so that cancelSolve stops it
            with lock:
                if stop.is_set():
                    return
                live.append(model)
            t0 = time.monotonic()
            status, bound, x = model.prove_above(SAFETY * (1 + np.abs(b).max()), left)
            name = names[i] if names else str(i)
            log(f"  output milp, clause {name}: {status}, bound {bound:+.5f}, {time.monotonic() - t0:.1f} s")
            with lock:
                live.remove(model)
                results[i] = ClauseResult(status, bound, x)
                if status == "found":
                    stop.set()
                    for other in live:
                        other.highs.cancelSolve()

    n = max(1, min(opts.threads, -(-len(clauses) // P)))
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda _: work(), range(n)))
    return _merged(results, len(clauses))


def _merged(results: dict[int, ClauseResult], n: int) -> list[ClauseResult]:
    """Every rank's results (clause i solved on rank i % P) on every rank. Collective."""
    P = comm.world_size()
    table = torch.zeros(n, 2, dtype=torch.float64)  # (status code + 1, bound); 0: not mine
    for i, r in results.items():
        table[i] = torch.tensor([_CODES.index(r.status) + 1.0, r.bound])
    table = comm.all_reduce(table, "sum")
    merged = []
    for i in range(n):
        code, bound = int(table[i, 0]), float(table[i, 1])
        status = _CODES[code - 1] if code else "unknown"
        point = None
        if status == "found":
            mine = results.get(i)
            point = comm.broadcast_object(mine.point if mine else None, src=i % P)
        merged.append(ClauseResult(status, bound if code else -np.inf, point))
    return merged
