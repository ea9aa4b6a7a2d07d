"""The verification pipeline of one instance: attack -> IBP -> CROWN -> α-CROWN -> verdict.

Runs identically on every rank (lockstep): every data-dependent decision (stop on time, verdict)
is taken from replicated values or through a collective.  World size 1 is the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from . import proofs, witness
from .attack import check_counterexample, format_counterexample, pgd_attack
from .bab.common import BabResult
from .bab.relu_split import relu_split_bab
from .bounds import mip, split_refine
from .bounds.alpha import alpha_crown
from .bounds.crown import CrownState, crown, ibp, pre_activation_nodes, spec_matrix
from .bounds.graph import Graph
from .bounds.mip import MipOptions, UnsupportedForMip
from .bounds.walk import Bounds, back_substitute
from .clock import END_RESERVE_S
from .config import Config
from .errors import UserError
from .model import joint
from .model.onnx_loader import load_model
from .options import alpha_options, bab_options, compute_device, crown_chunk, split_options
from .parallel import comm
from .parallel.memory import PeakMemory
from .parallel.sharded import release_gather_buffers
from .results import bab_record, summary_record
from .spec import Clauses, Region, Spec, float32_box, load_vnnlib


@dataclass
class InstanceResult:
    verdict: str
    time_s: float
    bounds: dict[str, list[float]] = field(default_factory=dict)  # method -> one bound per clause
    counterexample: str | None = None  # VNN-COMP "((X_0 v) ... (Y_0 v) ...)" for sat
    peak_mb: list[float] = field(default_factory=list)  # per rank
    message: str = ""
    bab: dict = field(default_factory=dict)  # results.bab_record: domains, rounds, max_queue per rank
    peak_exact: bool = True  # False: peak_mb is an upper bound (the CPU allocator's kept blocks count too)
    crown_batch_size: int = 0  # neurons per CROWN back-substitution pass (solver.crown.batch_size, resolved)
    started_at: float = 0.0  # time.time() when this rank began work on the instance (after start-up)

    def to_json(self) -> dict:
        """The summary record (:func:`~complete_verifier_ext.results.summary_record`)."""
        return summary_record(
            engine="native",
            verdict=self.verdict,
            time_s=self.time_s,
            bounds=self.bounds,
            peak_mb=self.peak_mb,
            peak_mb_exact=self.peak_exact,
            crown_batch_size=self.crown_batch_size,
            message=self.message,
            bab=self.bab or None,
            started_at=self.started_at,
        )


def box_overflows(region: Region) -> bool:
    """True when some input interval is wider than float32 can hold (hi - lo > 3.4e38, or a bound
    beyond float32's range): every bound of such a box is -inf or NaN, so none is computed."""
    lo, hi = float32_box(region.lower, region.upper, inward=False)
    with np.errstate(over="ignore", invalid="ignore"):
        return not np.isfinite(hi - lo).all()


def _quiet(_: str) -> None:
    pass


@dataclass
class Clock:
    """Deadline whose expiry every rank agrees on (one all-reduce per question), and where the stages
    say what they are doing (``say``: a one-line status; the CLI shows it as progress)."""

    deadline: float
    say: Callable[[str], None] = _quiet

    def expired(self, ahead: float = 0.0) -> bool:
        """Whether the deadline has passed (or will have, ``ahead`` seconds from now), on any rank."""
        return comm.all_reduce_flag(time.monotonic() + ahead > self.deadline, "or")

    def within(self, deadline: float) -> Clock:
        """A clock with an earlier deadline that reports to the same place."""
        return Clock(deadline, self.say)


def input_box(region: Region, graph: Graph) -> tuple[Tensor, Tensor]:
    """The outward-rounded float32 box, shaped (1, *input_shape)."""
    lo, hi = float32_box(region.lower, region.upper, inward=False)
    shape = (1, *graph.input_shape)
    return torch.tensor(lo).view(shape), torch.tensor(hi).view(shape)


def attack(graph: Graph, region: Region, cfg: Config, clock: Clock, onnx_path: str) -> str | None:
    """PGD; returns the formatted counterexample, re-checked on the model and onnxruntime."""
    clock.say("PGD attack")
    with torch.enable_grad():
        x = pgd_attack(
            lambda v: graph(comm.reduce_grad(v)),  # the full input gradient on every rank
            graph.input_shape,
            region,
            cfg.attack,
            seed=cfg.general.seed,
            should_stop=clock.expired,
            device=compute_device(cfg),
        )
    if x is None:
        return None
    ok, y = check_counterexample(graph, graph.input_shape, x, region, onnx_path, compute_device(cfg))
    ok = comm.all_reduce_flag(ok, "and")
    return format_counterexample(x, y) if ok else None


@dataclass
class RegionRun:
    """One region of a spec on its way through the stages: what every stage reads, and the bounds
    they leave for the next one."""

    graph: Graph
    region: Region
    cfg: Config
    clock: Clock
    bounds: dict[str, list[float]]  # method -> the clause bounds reported in the summary (all regions)
    clauses: Clauses = field(init=False)
    box: tuple[Tensor, Tensor] = field(init=False)  # the outward-rounded float32 input box
    state: CrownState | None = None  # the last CROWN-type sweep: where BaB and the refinement start
    cb: np.ndarray = field(init=False)  # lower bound of every clause's margin (> 0: proven)
    work: BabResult = field(default_factory=lambda: BabResult("timeout"))  # what the searches did
    proof: dict[int, dict] = field(default_factory=dict)  # clause -> its proof tree (general.proof)

    def __post_init__(self) -> None:
        self.clauses = Clauses.of(self.region.clauses).to(compute_device(self.cfg))
        self.box = input_box(self.region, self.graph)
        self.cb = np.full(self.clauses.n_clauses, -np.inf)

    @property
    def proven(self) -> bool:
        return bool((self.cb > 0).all())

    def record(self, method: str, before: np.ndarray | None = None, lb: Tensor | None = None) -> None:
        """The clause bounds of ``method`` for the summary; with ``general.proof``, a one-leaf tree for
        every clause it proved that was open ``before`` (``lb``: the rows' bounds ``(1, S)``, where
        ``state`` holds their output slopes: each leaf's evidence is its best row's)."""
        self.bounds.setdefault(method, []).extend(self.cb.tolist())
        if self.cfg.general.proof is not None and before is not None:
            proved = np.nonzero((self.cb > 0) & (before <= 0))[0]
            rows = {int(i): self._best_row(int(i), lb) for i in proved}
            self.proof.update(proofs.root_trees(self.graph, self.state, rows) if rows else {})

    def _best_row(self, i: int, lb: Tensor | None) -> tuple[int, int, int] | None:
        """Clause ``i``'s row of the largest margin by ``lb``: its spec row, its place among the
        clause's rows, their number (None without ``lb``)."""
        if lb is None:
            return None
        rows = np.flatnonzero(self.clauses.owner.numpy() == i)
        m = int(np.argmax(self.clauses.row_margins(lb.detach().cpu())[0].numpy()[rows]))
        return int(rows[m]), m, len(rows)


def bound_region(run: RegionRun) -> bool:
    """IBP, then CROWN, then α-CROWN (up to ``solver.bound_prop_method``); ``run.state`` becomes the
    last CROWN-type sweep (which BaB starts from), ``run.cb`` the clause bounds of the strongest
    method. Returns whether the region is proven."""
    cfg, clock, cl, box, C = run.cfg, run.clock, run.clauses, run.box, run.clauses.C
    method = cfg.solver.bound_prop_method
    clock.say("IBP")
    with torch.no_grad():
        lb, _ = ibp(run.graph, box, C)
    before, run.cb = run.cb, cl.bound(lb)
    run.record("ibp", before)
    if run.proven or method == "ibp":
        return run.proven
    clock.say(f"CROWN (IBP worst {run.cb.min():+.4g})")
    lb, run.state = crown(
        run.graph, box, C, intersect=cfg.solver.intersect_ibp, chunk=cfg.solver.crown.batch_size
    )
    before, run.cb = run.cb, cl.bound(lb)
    run.record("crown", before)
    if run.proven or method == "crown":
        return run.proven
    a = cfg.solver.alpha_crown
    clock.say(f"α-CROWN (CROWN worst {run.cb.min():+.4g})")

    def step(it: int, best: Tensor) -> None:
        clock.say(f"α-CROWN {it + 1}/{a.iteration}: worst {cl.bound(best).min():+.4g}")

    opts = alpha_options(cfg)
    lb, run.state = alpha_crown(run.graph, box, C, run.state, opts, should_stop=clock.expired, on_step=step)
    before, run.cb = run.cb, np.maximum(cl.bound(lb), run.cb)
    run.record("alpha_crown", before, lb)
    return run.proven


def open_rows_weight(run: RegionRun) -> dict[int, np.ndarray]:
    """|A| of the rows of the clauses still open (the quick search may prove some) at every ReLU input,
    summed over the rows: which neurons their bounds depend on (the refinement's order)."""
    graph, owner, C = run.graph, run.clauses.owner.numpy(), run.clauses.C
    record: dict[int, Tensor] = {}
    out = len(graph.nodes) - 1
    rows = torch.as_tensor(run.cb[owner] <= 0)
    with torch.no_grad():
        A = spec_matrix(C[rows.to(C.device)], 1, graph.nodes[out].shape)
        back_substitute(graph, out, A, run.state.bounds, run.box, record=record)
    return {graph.nodes[j].inputs[0]: a.abs().sum(0).cpu().double().numpy() for j, a in record.items() if j}


def refine_region(run: RegionRun) -> bool:
    """``bab-refine``: tighten every intermediate bound (``solver.mip.refine_method``: ``split``, batched
    β-CROWN over splits of earlier neurons; ``milp``; or ``split+milp``, MILP from split's bounds for
    the rest of the budget unless they verify the region already), then run α-CROWN again on the
    tightened bounds, which become ``run.state`` and ``run.cb``. Returns whether the region is proven.
    A network that is not a chain of Linear and ReLU layers gets no MILP refinement (with a warning)."""
    graph, cfg, clock, box, state = run.graph, run.cfg, run.clock, run.box, run.state
    m = cfg.solver.mip
    budget = m.refine_neuron_time_percentage * max(0.0, clock.deadline - time.monotonic())
    deadline = time.monotonic() + budget
    log = clock.say
    C, weight = run.clauses.C, open_rows_weight(run)
    refined = {k: state.bounds[k] for k in pre_activation_nodes(graph)}
    opts = alpha_options(cfg)

    def recheck(refined: Bounds) -> tuple[CrownState, np.ndarray]:  # α-CROWN on the new bounds
        lb, new = alpha_crown(
            graph, box, C, CrownState({**state.bounds, **refined}, state.rows, []), opts, clock.expired
        )
        return new, np.maximum(run.clauses.bound(lb), run.cb)

    def finish(result: tuple[CrownState, np.ndarray]) -> bool:
        run.state, run.cb = result
        run.record("refined")
        return run.proven

    checked = None
    if m.refine_method in ("split", "split+milp"):
        split_opts = split_options(cfg)
        with whole_weights(graph, cfg, shards_usable=False):
            refined, _ = split_refine.refine_bounds(graph, box, refined, split_opts, deadline, log, weight)
    if m.refine_method == "split+milp":  # split's bounds may do already: then no MILP
        checked = recheck(refined)
        if (checked[1] > 0).all():
            return finish(checked)
    if m.refine_method in ("milp", "split+milp"):  # after split: the rest of the budget, from its bounds
        try:
            refined, _ = mip.refine_bounds(
                graph,
                box,
                refined,
                MipOptions(
                    neuron_timeout=m.refine_neuron_timeout,
                    layers=m.refine_layers,
                    threads=torch.get_num_threads(),  # the cores this rank's torch would use
                ),
                deadline,
                log=log,
                weight=weight,
            )
        except UnsupportedForMip as e:
            if comm.rank() == 0:
                print(f"warning: bab-refine: {graph.source}: {e}; no MILP refinement", file=sys.stderr)
            if checked is None:  # milp alone: nothing refined
                return False
            return finish(checked)  # split's bounds, checked already
    return finish(recheck(refined))


def output_milp(run: RegionRun, share: float) -> BabResult | None:
    """A MILP of the whole network (``mip.prove_clauses``) for every clause that ``run.cb`` leaves
    open, worst first, on the bounds of ``run.state``, for ``share`` of the time left; what they prove
    goes into ``run.cb``. Returns ``unsat``, or ``sat`` with a point checked on the network, when that
    decides the region, else None. A network that is not a chain of Linear and ReLU layers is left to
    BaB (with a warning)."""
    graph, region, clock = run.graph, run.region, run.clock
    budget = share * max(0.0, clock.deadline - time.monotonic())
    d, owner = run.clauses.d.numpy(), run.clauses.owner.numpy()
    todo = [int(i) for i in np.argsort(run.cb, kind="stable") if run.cb[i] <= 0]
    C64 = run.clauses.C.double().cpu().numpy()  # the float32 rows that the bounds and the MILPs bound
    clauses = [(C64[owner == i], d[owner == i]) for i in todo]
    opts = MipOptions(threads=torch.get_num_threads())
    try:
        deadline, names = time.monotonic() + budget, [str(i) for i in todo]
        found = mip.prove_clauses(graph, run.box, run.state.bounds, clauses, opts, deadline, clock.say, names)
    except UnsupportedForMip as e:
        if comm.rank() == 0:
            print(f"warning: output milp: {graph.source}: {e}; left to BaB", file=sys.stderr)
        return None
    run.cb = run.cb.copy()
    for i, r in zip(todo, found, strict=True):
        run.cb[i] = max(run.cb[i], r.bound)
    run.record("output_milp")
    lo, hi = float32_box(region.lower, region.upper, inward=True)
    for r in found:
        if r.status == "found":  # within the solver's tolerances: only the network decides
            x = np.clip(r.point, lo, hi).astype(np.float32)
            ok, _ = check_counterexample(graph, graph.input_shape, x, region, None, compute_device(run.cfg))
            if comm.all_reduce_flag(ok, "and"):
                return BabResult("sat", counterexample=x)
    return BabResult("unsat") if run.proven else None


def clause_state(state: CrownState | None, rows: np.ndarray) -> CrownState | None:
    """``state`` with α-CROWN's output slopes cut down to the spec rows ``rows`` (a mask) of one clause."""
    if state is None or not state.out_alpha:
        return state
    keep = torch.as_tensor(rows)
    out_alpha = {j: a[keep.to(a.device)] for j, a in state.out_alpha.items()}
    return CrownState(state.bounds, state.rows, state.gathered, out_alpha)


def search_worst_first(run: RegionRun) -> BabResult:
    """Branch and bound on the clauses that ``run.cb`` leaves open, one at a time (each search carries
    only that clause's rows), worst first with all the time each, as α,β-CROWN does: the first clause
    that is not proven decides the verdict."""
    return _clause_searches(run, run.clock, easiest_first=False)


def search_easiest_first(run: RegionRun, clock: Clock) -> BabResult:
    """The quick search before the refinement: the open clauses easiest first, each with an equal share
    of ``clock``'s time left, going on past the clauses it does not prove, so that as many as possible
    are out of the way of the refinement and of what comes after it."""
    return _clause_searches(run, clock, easiest_first=True)


def _clause_searches(run: RegionRun, clock: Clock, easiest_first: bool) -> BabResult:
    """The searches of :func:`search_worst_first` / :func:`search_easiest_first`: the verdict (``unsat``
    when every open clause is proven), with the bounds BaB proved (its least verified leaf bound,
    > 0) put into ``run.cb``."""
    total = BabResult("unsat", domains=0, rounds=0)
    owner = run.clauses.owner.numpy()
    run.cb = run.cb.copy()
    todo = [int(i) for i in np.argsort(run.cb, kind="stable") if run.cb[i] <= 0]
    if easiest_first:
        todo.reverse()
    failed: BabResult | None = None
    for n, i in enumerate(todo):
        one = Region(run.region.lower, run.region.upper, (run.region.clauses[i],))
        slot = clock
        if easiest_first:
            slot = clock.within(
                time.monotonic() + max(0.0, clock.deadline - time.monotonic()) / (len(todo) - n)
            )
        res = complete_clause(run.graph, one, run.cfg, slot, clause_state(run.state, owner == i))
        total.add_work(res)
        if res.verdict == "unsat":
            run.cb[i] = max(run.cb[i], res.bound)
            if res.leaves is not None:
                lo, hi = (t.reshape(-1).double().cpu().numpy() for t in run.box)
                run.proof[i] = proofs.search_tree(run.graph, run.state, lo, hi, res.leaves)
            continue
        failed = res
        if res.verdict == "sat" or not easiest_first or clock.expired():
            break
    if failed is None:
        return total
    failed.domains, failed.rounds, failed.max_queue = total.domains, total.rounds, total.max_queue
    return failed


def complete_clause(
    graph: Graph, region: Region, cfg: Config, clock: Clock, state: CrownState | None
) -> BabResult:
    """Branch and bound on one region (ReLU splits, or input splits when enabled)."""
    problem = Clauses.of(region.clauses).to(compute_device(cfg))
    C = problem.C
    box = input_box(region, graph)
    opts = bab_options(cfg)
    if opts.input_split:
        from .bab.input_split import input_split_bab

        method = "alpha-crown" if cfg.solver.bound_prop_method == "alpha-crown" else "crown"
        lo, hi = float32_box(region.lower, region.upper, inward=True)
        inner = (torch.tensor(lo), torch.tensor(hi))
        return input_split_bab(graph, box, problem, opts, clock.expired, method, inner)
    if state is None:
        with torch.no_grad():
            _, state = crown(
                graph, box, C, intersect=cfg.solver.intersect_ibp, chunk=cfg.solver.crown.batch_size
            )

    t0 = last = time.monotonic()
    # a round starts only if twice the last one still fits: a batch is at most twice the last one
    # (every domain has two children), and a round's time grows with its batch
    round_s = [0.0]

    def report(rounds: int, left: int, worst: float, domains: int) -> None:
        nonlocal last
        now = time.monotonic()
        round_s[0], last = now - last, now
        rate = domains / max(1e-9, now - t0)
        clock.say(f"BaB round {rounds}: {left} domains left, worst {worst:+.5f}, {rate:.0f} domains/s")

    with whole_weights(graph, cfg, shards_usable=True):
        return relu_split_bab(
            graph,
            box,
            problem,
            state,
            opts,
            clock.expired,
            region.lower,
            region.upper,
            report,
            round_expired=lambda: clock.expired(ahead=2 * round_s[0]),
        )


Stage = Callable[[RegionRun], "BabResult | None"]


def _quick_search(run: RegionRun) -> BabResult | None:
    """``solver.mip.quick_bab_percentage`` of the time left for :func:`search_easiest_first`."""
    share = run.cfg.solver.mip.quick_bab_percentage
    clock = run.clock.within(time.monotonic() + share * max(0.0, run.clock.deadline - time.monotonic()))
    res = search_easiest_first(run, clock)
    run.record("quick_bab")
    if res.verdict in ("unsat", "sat") or run.clock.expired():
        return res
    run.work.add_work(res)
    return None


def _refine(run: RegionRun) -> BabResult | None:
    verified = refine_region(run)
    if verified or run.clock.expired():
        return BabResult("unsat" if verified else "timeout")
    return None


def _output_milp(run: RegionRun) -> BabResult | None:
    """``solver.mip.output_milp_percentage`` of the time left (all of it with ``mip``)."""
    cfg = run.cfg
    share = 1.0 if cfg.general.complete_verifier == "mip" else cfg.solver.mip.output_milp_percentage
    decided = output_milp(run, share)
    if decided is not None or run.clock.expired():
        return decided or BabResult("timeout")
    return None


def complete_stages(run: RegionRun) -> list[Stage]:
    """The stages of the complete phase, chosen once from the config. Plain BaB:
    :func:`search_worst_first`. With ``bab-refine``/``mip`` (and a CROWN-type state to refine): a quick
    search (:func:`search_easiest_first`, ``solver.mip.quick_bab_percentage`` of the time; easy
    instances end there, and the clauses it proves are out of the way), the refinement
    (:func:`refine_region`), a MILP per open clause (:func:`output_milp`), then the search again
    from the refined bounds on the clauses still open."""
    cfg, m = run.cfg, run.cfg.solver.mip
    refine = cfg.general.complete_verifier in ("bab-refine", "mip") and run.state is not None
    if not refine or cfg.bab.branching.input_split.enable:
        return [search_worst_first]
    milp_share = 1.0 if cfg.general.complete_verifier == "mip" else m.output_milp_percentage
    return [
        *([_quick_search] if m.quick_bab_percentage > 0 else []),
        _refine,
        *([_output_milp] if milp_share > 0 else []),
        search_worst_first,
    ]


def complete_region(run: RegionRun) -> BabResult:
    """Branch and bound on a region the incomplete bounds left open: the first stage that decides
    returns, with the work of the stages before it."""
    for stage in complete_stages(run):
        res = stage(run)
        if res is not None:
            res.add_work(run.work)
            return res
    raise AssertionError("the last stage always decides")


def whole_weights(graph: Graph, cfg: Config, *, shards_usable: bool):
    """The one rule for a search's weights: every sharded weight whole on every rank for the search
    (``Graph.replicated``: gathered once) under ``fsdp`` at P > 1, unless the search can use the shards
    (``shards_usable``: ReLU BaB, which fetches them) and ``parallel.bab_weights`` resolves to
    ``sharded``; the split refinement cannot (its back-substitutions are rank-local and issue no
    collective). ``tp`` never holds a whole layer (the refinement is refused under it)."""
    replicate = comm.world_size() > 1 and cfg.parallel.mode == "fsdp"
    if shards_usable and cfg.parallel.bab_weights_resolved == "sharded":
        replicate = False
    return graph.replicated() if replicate else contextlib.nullcontext()


@dataclass
class Loaded:
    """An instance as it is verified: the graph (this rank's shards), the spec, the ONNX file the
    graph was read from (a VNN-LIB 2.0 instance's joint model, :mod:`~complete_verifier_ext.model.joint`)
    and, for a 2.0 spec, each network's own file."""

    graph: Graph
    spec: Spec
    model_path: str
    networks: dict[str, str] | None


def load_instance(cfg: Config, onnx_arg: str, vnnlib_path: str) -> Loaded:
    """Read model and spec on the host, keep this rank's shards, move them to the compute device.
    ``onnx_arg``: a path, or a VNN-COMP 2026 network list."""
    spec = load_vnnlib(vnnlib_path)
    onnx_path, networks = joint.model_for(onnx_arg, spec)
    graph = load_model(onnx_path)
    n_in = int(np.prod(graph.input_shape))
    if spec.n_inputs != n_in:
        raise UserError(f"{vnnlib_path}: declares {spec.n_inputs} inputs, but {onnx_path} takes {n_in}")
    if spec.n_outputs != graph.output_size:
        raise UserError(
            f"{vnnlib_path}: declares {spec.n_outputs} outputs, but {onnx_path} has {graph.output_size}"
        )
    if comm.world_size() > 1:
        graph.shard(cfg.parallel.mode)
    device = compute_device(cfg)
    if device.type != "cpu":
        graph.to(device)
    return Loaded(graph, spec, onnx_path, networks)


def verify_instance(
    cfg: Config,
    onnx_path: str,
    vnnlib_path: str,
    timeout: float,
    progress: Callable[[str], None] | None = None,
    started: float | None = None,
) -> InstanceResult:
    """Verify one (model, spec) pair on this rank; every rank must call it with the same arguments.
    The clock starts at ``started`` (``time.monotonic()`` of the verifier's start, so that start-up
    counts as in VNN-COMP, and ``END_RESERVE_S`` is kept for the results), else now.  ``progress``
    receives a one-line status from every stage (PGD, each bound method, α-CROWN steps, BaB rounds)."""
    began = time.time()
    t0 = time.monotonic()
    if started is not None:
        t0, timeout = started, max(0.0, timeout - END_RESERVE_S)
    inst = load_instance(cfg, onnx_path, vnnlib_path)  # on the host; only shards move
    try:
        device = compute_device(cfg)
        # factory functions create tensors on the compute device (a hook on every torch call: not on CPU)
        with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
            res = _verify_instance(cfg, inst, timeout, t0, progress)
    finally:
        release_gather_buffers()  # the next instance's layers have other shapes
    res.started_at = began
    return vnnlib2_result(res, inst)


def vnnlib2_result(res: InstanceResult, inst: Loaded) -> InstanceResult:
    """A VNN-LIB 2.0 ``sat``: its counterexample re-checked on every network's own file and written
    in the 2.0 form; ``unknown`` (never a wrong ``sat``) where it does not hold there."""
    if res.verdict != "sat" or inst.spec.layout is None:
        return res
    x = witness.read_inputs(res.counterexample or "")
    text = None if x is None else witness.vnnlib2_witness(x, inst.spec, inst.networks)
    if text is None:
        why = "the counterexample does not hold when each network runs on its own ONNX file: unknown"
        return dataclasses.replace(res, verdict="unknown", counterexample=None, message=why)
    return dataclasses.replace(res, counterexample=text)


@dataclass
class RegionVerdict:
    verdict: str  # sat | unsat | unknown
    counterexample: str | None = None  # sat: VNN-COMP "((X_0 v) ... (Y_0 v) ...)", checked
    search: BabResult | None = None  # what the complete phase did, if it ran
    message: str = ""


def verify_region(run: RegionRun, onnx_path: str) -> RegionVerdict:
    """One region of the spec: the attack (before or after the rest, ``attack.pgd_order``), the
    incomplete bounds, then the complete phase's stages. ``unsat`` when the region is proven, ``sat``
    with a counterexample checked on the network (and onnxruntime), else ``unknown``."""
    graph, region, cfg, clock = run.graph, run.region, run.cfg, run.clock
    order = cfg.attack.pgd_order
    if order == "before":
        cex = attack(graph, region, cfg, clock, onnx_path)
        if cex is not None:
            return RegionVerdict("sat", cex)
    out, verified = RegionVerdict("unknown"), False
    if box_overflows(region):  # nothing can be proven; the attack (before or after) still runs
        out.message = (
            "the input box is wider than float32 can hold: no bound computed (only an attack decides it)"
        )
    elif cfg.general.enable_incomplete_verification:  # else straight to BaB (from CROWN's bounds)
        verified = bound_region(run)
    if not verified and cfg.general.complete_verifier != "skip" and not clock.expired() and not out.message:
        res = out.search = complete_region(run)
        verified = res.verdict == "unsat"
        out.message = res.reason if res.verdict == "unknown" else ""
        if res.verdict == "sat" and res.counterexample is not None:
            cex, device = res.counterexample, compute_device(cfg)
            ok, y = check_counterexample(graph, graph.input_shape, cex, region, onnx_path, device)
            if comm.all_reduce_flag(ok, "and"):
                out.verdict, out.counterexample = "sat", format_counterexample(res.counterexample, y)
                return out
    if not verified and order == "after":
        cex = attack(graph, region, cfg, clock, onnx_path)
        if cex is not None:
            out.verdict, out.counterexample = "sat", cex
            return out
    if verified:
        out.verdict = "unsat"
    return out


def _for_proof(cfg: Config) -> Config:
    """With ``general.proof``: ``bab-refine`` and ``mip`` as ``bab`` (a checker cannot re-derive a MILP's
    bounds), said in one line."""
    if cfg.general.proof is None or cfg.general.complete_verifier not in ("bab-refine", "mip"):
        return cfg
    if comm.rank() == 0:
        print(f"note: general.proof: complete_verifier {cfg.general.complete_verifier} runs as bab (no MILP "
              "refinement: a proof's checker cannot re-derive it)", file=sys.stderr)  # fmt: skip
    return dataclasses.replace(cfg, general=dataclasses.replace(cfg.general, complete_verifier="bab"))


def _write_proof(cfg: Config, inst: Loaded, runs: list[RegionRun]) -> None:
    """The proof of an ``unsat``: an obligation per (region, clause), each with the tree that proved it."""
    obligations = []
    for k, run in enumerate(runs):
        lo, hi = (t.reshape(-1).double().cpu().numpy() for t in run.box)
        for i, clause in enumerate(run.region.clauses):
            if i not in run.proof:  # a step that keeps no record proved it: no proof rather than a wrong one
                print(f"note: no proof written: region {k} clause {i} was proved by a step that records none",
                      file=sys.stderr)  # fmt: skip
                return
            obligations.append(proofs.Obligation(lo, hi, clause.C, clause.d, run.proof[i]))
    producer = {"engine": "native", "world_size": comm.world_size(), "mode": cfg.parallel.mode}
    try:
        sizes = proofs.graph_relu_sizes(inst.graph)
        networks, layers = proofs.named(inst.spec, inst.model_path, inst.networks, sizes)
        proofs.write(cfg.general.proof, inst.spec.path, networks, layers, obligations, producer)
    except ValueError as e:
        print(f"note: no proof written: {e}", file=sys.stderr)


def _verify_instance(
    cfg: Config, inst: Loaded, timeout: float, t0: float, progress: Callable | None
) -> InstanceResult:
    graph, spec, onnx_path = inst.graph, inst.spec, inst.model_path
    torch.manual_seed(cfg.general.seed)
    if torch.are_deterministic_algorithms_enabled() != cfg.general.deterministic:
        torch.use_deterministic_algorithms(cfg.general.deterministic)  # imports torch._inductor: 2-3 s
    clock = Clock(t0 + timeout, progress or _quiet)
    chunk = crown_chunk(cfg, graph)  # resolved once: every stage reads it from the config
    cfg = dataclasses.replace(
        cfg,
        solver=dataclasses.replace(cfg.solver, crown=dataclasses.replace(cfg.solver.crown, batch_size=chunk)),
    )
    memory = PeakMemory(compute_device(cfg))
    memory.start()
    bounds: dict[str, list[float]] = {}
    verdict, cex, message, out_of_time = "unsat", None, "", False
    work: BabResult | None = None  # what the searches did, all regions together
    cfg, runs = _for_proof(cfg), []
    for region in spec.regions:
        runs.append(RegionRun(graph, region, cfg, clock, bounds))
        r = verify_region(runs[-1], onnx_path)
        message = message or r.message
        if r.search is not None:
            out_of_time = out_of_time or r.search.verdict == "timeout"  # also a search that left a round out
            work = work or BabResult("unsat")
            work.add_work(r.search)
        if r.verdict == "sat":
            verdict, cex = "sat", r.counterexample
            break
        if r.verdict == "unknown":
            verdict = "unknown"
    if verdict == "unknown" and (out_of_time or clock.expired()):
        verdict = "timeout"
    if verdict == "unsat" and cfg.general.proof is not None and comm.rank() == 0:
        _write_proof(cfg, inst, runs)
    peak = comm.all_gather_cat(torch.tensor([memory.peak_mb()], dtype=torch.float64), 0)
    exact = comm.all_reduce_flag(memory.exact, "and")
    bab = {} if work is None else bab_record(work.domains, work.rounds, work.max_queue)
    return InstanceResult(
        verdict, time.monotonic() - t0, bounds, cex, peak.tolist(), message, bab, exact, chunk
    )
