"""ReLU-split BaB (β-CROWN) against EXACT answers: verdicts, counterexamples, soundness fuzzing,
domain-parallel lockstep, timeouts and a rank killed mid-search.

Ground truth: :func:`testing.exact_min_linear` enumerates the activation patterns of a tiny ReLU net
and solves one LP per pattern, so ``m = min_{x in box} c·y(x)`` is exact (up to HiGHS' 1e-7).  With
``scale`` the spread of ``c·y`` over the box, the clause ``c·y <= m - 0.05 scale`` has no solution
(BaB must say unsat) and ``c·y <= m + 0.05 scale`` has one (BaB must say sat, with a checked witness).

Known limitation (see ``test_interior_counterexample_is_found``): the only candidates BaB evaluates are
box corners (the minimiser of a domain's linear bound over the input box), so when every violating
point is interior it ends with "unknown" (never wrong, but not complete).  The "sat" cases below are
ones where a corner of some domain's bound violates the clause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch
from support import rank_processes

from complete_verifier_ext import testing
from complete_verifier_ext.bab.common import BabOptions, BabResult
from complete_verifier_ext.bab.relu_split import ReluSplitBab, relu_split_bab
from complete_verifier_ext.bounds.crown import crown
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch
from complete_verifier_ext.spec import Clause, Clauses, float32_box

OPTS = {"batch_size": 8, "iteration": 30, "max_domains": 20_000}  # settings the named cases are run with
MARGIN = 0.05  # thresholds sit MARGIN * scale below / above the exact minimum


# ----------------------------------------------------------------------------------------------------------
# Cases and ground truth
# ----------------------------------------------------------------------------------------------------------


def _rows(n_out: int, n_rows: int) -> list[list[float]]:
    """Robustness-style rows ``Y_0 - Y_j`` (j = 1..n_rows), each its own clause."""
    eye = np.eye(n_out)
    return [(eye[0] - eye[j]).tolist() for j in range(1, n_rows + 1)]


@functools.cache
def _exact(sizes: tuple, seed: int, lo: tuple, hi: tuple, c: tuple) -> tuple[float, float, np.ndarray]:
    """(exact min of c·y over the box, spread of c·y over the box (sampled max - min), argmin)."""
    net = testing.mlp(sizes, seed).double()
    m, x = testing.exact_min_linear(net, lo, hi, c)
    lo_, hi_ = np.array(lo), np.array(hi)
    X = torch.from_numpy(lo_ + (hi_ - lo_) * np.random.default_rng(seed).random((4000, len(lo))))
    with torch.no_grad():
        top = float((net(X) @ torch.tensor(c, dtype=torch.float64)).max())
    return m, top - m, x


def _spec(sizes, seed, box, n_rows, sat=()) -> dict:
    """A picklable job: the net, the box, one clause per row; clause i is satisfiable iff i in ``sat``."""
    n = sizes[0]
    lo, hi = (box[0],) * n, (box[1],) * n
    rows = _rows(sizes[-1], n_rows)
    d = []
    for i, c in enumerate(rows):
        m, scale, _ = _exact(tuple(sizes), seed, lo, hi, tuple(c))
        d.append(m + (MARGIN if i in sat else -MARGIN) * scale)
    return {"sizes": list(sizes), "seed": seed, "lo": lo, "hi": hi, "rows": rows, "d": d}


def _problem(rows, d) -> Clauses:
    k = len(rows)
    return Clauses(
        torch.tensor(rows, dtype=torch.float32), torch.tensor(d, dtype=torch.float64), torch.arange(k), k
    )


def _setup(sizes, seed, lo, hi, rows, d):
    """(graph, outward float32 box, problem, CROWN lower bounds, CROWN state)."""
    n = sizes[0]
    graph = from_sequential(testing.mlp(sizes, seed), (n,))
    flo, fhi = float32_box(np.array(lo), np.array(hi), inward=False)
    box = (torch.tensor(flo).view(1, n), torch.tensor(fhi).view(1, n))
    problem = _problem(rows, d)
    lb, state = crown(graph, box, problem.C)
    return graph, box, problem, lb, state


def _solve(
    sizes,
    seed,
    lo,
    hi,
    rows,
    d,
    mode: str = "none",
    expire_after: int | None = None,
    kill_rank_at_round: tuple[int, int] | None = None,
    opts: dict | None = None,
    replicate: bool = False,
    collective: bool = False,
) -> tuple[BabResult, int]:
    """One search on this rank (every rank calls it identically): (result, calls of ``expired``;
    ``collective``: ``expired`` is a collective decision, as the clock's)."""
    n = sizes[0]
    graph = from_sequential(testing.mlp(sizes, seed), (n,))
    if comm.world_size() > 1 and mode != "none":
        graph.shard(mode)
    flo, fhi = float32_box(np.array(lo), np.array(hi), inward=False)
    box = (torch.tensor(flo).view(1, n), torch.tensor(fhi).view(1, n))
    problem = _problem(rows, d)
    _, state = crown(graph, box, problem.C)
    calls = [0]

    def expired() -> bool:
        calls[0] += 1
        late = expire_after is not None and calls[0] >= expire_after
        return comm.all_reduce_flag(late) if collective else late

    def on_round(rounds: int, left: int, worst: float, domains: int) -> None:
        if kill_rank_at_round is not None and (comm.rank(), rounds) == kill_rank_at_round:
            os.kill(os.getpid(), signal.SIGKILL)

    with graph.replicated() if replicate else contextlib.nullcontext():  # parallel.bab_weights
        assert not (replicate and graph.sharded)
        result = relu_split_bab(
            graph,
            box,
            problem,
            state,
            BabOptions(**(opts or OPTS)),
            expired,
            np.array(lo),
            np.array(hi),
            on_round,
        )
    assert graph.sharded == (comm.world_size() > 1 and mode != "none")  # the shards are back
    return result, calls[0]


def _assert_counterexample(spec: dict, x, clause: int | None = None) -> None:
    """x lies in the real box (its inward float32 form: a pinned non-float32 value reads as its nearest
    float32) and violates the spec (clause ``clause`` if given) on the torch model."""
    n = spec["sizes"][0]
    assert isinstance(x, np.ndarray) and x.shape == (n,) and x.dtype == np.float32
    lo32, hi32 = float32_box(np.array(spec["lo"]), np.array(spec["hi"]), inward=True)
    assert (x >= lo32).all() and (x <= hi32).all()
    with torch.no_grad():
        y = testing.mlp(spec["sizes"], spec["seed"])(torch.from_numpy(x)[None])[0].double()
    values = torch.tensor(spec["rows"], dtype=torch.float64) @ y
    holds = (values <= torch.tensor(spec["d"])).tolist()
    assert any(holds), (values, spec["d"])
    if clause is not None:
        assert holds[clause]


# ----------------------------------------------------------------------------------------------------------
# 1. The exact minimiser itself
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, seed, box",
    [
        ([3, 8, 2], 0, (-1.0, 1.0)),
        ([4, 5, 5, 2], 1, (-0.5, 1.5)),
        ([2, 3, 3, 3, 2], 4, (-2.0, 1.0)),
        ([5, 10, 2], 2, (-1.0, 1.0)),
    ],
)
def test_exact_min_against_dense_sampling(sizes, seed, box):
    net = testing.mlp(sizes, seed).double()
    n = sizes[0]
    lo, hi = np.full(n, box[0]), np.full(n, box[1])
    c = np.random.default_rng(seed).standard_normal(sizes[-1])
    m, x = testing.exact_min_linear(net, lo, hi, c)
    assert x.shape == (n,) and (x >= lo).all() and (x <= hi).all()
    with torch.no_grad():
        at_x = float(net(torch.from_numpy(x)[None])[0] @ torch.from_numpy(c))
        X = torch.from_numpy(lo + (hi - lo) * np.random.default_rng(100 + seed).random((200_000, n)))
        sampled = net(X) @ torch.from_numpy(c)
    assert at_x == pytest.approx(m, abs=1e-6)  # the minimum is attained at the returned point
    assert float(sampled.min()) >= m - 1e-6  # and no sampled point goes below it
    assert float(sampled.min()) - m < 0.05 * float(sampled.max() - sampled.min())  # sampling gets close


def test_exact_min_finds_an_interior_kink():
    """|x0 - 0.3| + |x1 + 0.2| - 1 on [-1, 1]^2: minimum -1 at (0.3, -0.2), where sampling never lands."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).double()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0], [-1, 0], [0, 1], [0, -1]]))
        net[0].bias.copy_(torch.tensor([-0.3, 0.3, 0.2, -0.2]))
        net[2].weight.fill_(1.0)
        net[2].bias.fill_(-1.0)
    m, x = testing.exact_min_linear(net, [-1, -1], [1, 1], [1.0])
    assert m == pytest.approx(-1.0, abs=1e-9)
    np.testing.assert_allclose(x, [0.3, -0.2], atol=1e-7)
    with pytest.raises(ValueError, match="ReLUs"):
        testing.exact_min_linear(testing.mlp([2, 13, 1], 0), [-1, -1], [1, 1], [1.0])


# ----------------------------------------------------------------------------------------------------------
# 2. Verdicts against the exact minimum
# ----------------------------------------------------------------------------------------------------------

# (sizes, seed, box): 1 and 2 hidden layers, input dims 3-5; CROWN alone fails on every unsat case
SINGLE = [
    ([3, 8, 2], 0, (-1.0, 1.0)),
    ([4, 8, 2], 2, (-0.5, 1.5)),
    ([5, 6, 2], 1, (-1.0, 1.0)),
    ([3, 5, 5, 2], 0, (-1.0, 1.0)),
    ([4, 5, 4, 2], 1, (-1.0, 1.0)),
    ([3, 5, 5, 2], 1, (-0.5, 1.5)),
]
SAT = [
    ([3, 8, 2], 1, (-1.0, 1.0)),
    ([4, 8, 2], 1, (-1.0, 1.0)),
    ([5, 6, 2], 2, (-1.0, 1.0)),
    ([3, 5, 5, 2], 0, (-0.5, 1.5)),
    ([4, 5, 4, 2], 0, (-1.0, 1.0)),
    ([4, 5, 4, 2], 1, (-1.0, 1.0)),
]
MULTI = ([4, 8, 3], 0, (-1.0, 1.0))  # robustness-style: Y_0 - Y_1 <= d_0 or Y_0 - Y_2 <= d_1


@pytest.mark.parametrize("sizes, seed, box", SINGLE)
def test_unsat_below_the_exact_minimum(sizes, seed, box):
    spec = _spec(sizes, seed, box, 1)
    _, _, problem, lb, _ = _setup(**spec)
    assert (problem.margins(lb) <= 0).any()  # CROWN alone does not prove it: BaB has work to do
    r, _ = _solve(**spec)
    assert r.verdict == "unsat", r
    assert r.counterexample is None and r.domains > 1 and r.rounds >= 1  # it branched
    exact = _exact(tuple(sizes), seed, tuple(spec["lo"]), tuple(spec["hi"]), tuple(spec["rows"][0]))[0]
    assert 0 < r.bound <= exact - spec["d"][0] + 1e-5  # the least leaf bound: sound, and above 0


def test_a_pass_that_runs_out_of_memory_runs_again_in_halves(monkeypatch, capsys):
    """P = 1: β-CROWN over more than 3 domains at once raises ``torch.OutOfMemoryError`` (what CUDA
    raises): the round's children (4) are bounded and branched again in passes of 2, one warning line,
    and so are the later rounds'. The verdict is the one of the run that never ran out; a domain that
    does not fit alone gives up with the error, after one line."""
    from complete_verifier_ext.bab.domain import BetaCrown

    spec = _spec(*SINGLE[0], 1)
    bound = BetaCrown.bound

    def stand_in(self, doms, *args, **kwargs):
        if len(doms) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return bound(self, doms, *args, **kwargs)

    monkeypatch.setattr(BetaCrown, "bound", stand_in)
    limit = 3
    r, _ = _solve(**spec)
    assert r.verdict == "unsat" and r.domains > 1, r
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: out of memory")]
    assert warnings == [
        "warning: out of memory in a pass of 4 domains of a BaB round; retrying in passes of 2"
    ]
    limit = 0
    with pytest.raises(torch.OutOfMemoryError):
        _solve(**spec)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "warning: out of memory in a pass of 1 domain(s) of a BaB round (one domain per pass): giving up"
    )


def _oom_worker(spec: dict, cases: list[tuple[str, bool, int | None]]) -> list[list[tuple]]:
    """Every case ``(mode, replicate, limit)`` on every rank, with a collective ``expired``: rank 1 runs
    out of memory in the third β-CROWN step of a batch of more than ``limit`` domains (after two steps'
    collectives and backward passes). Per case, every rank's (verdict, domains, collectives issued) or
    ("out of memory", collectives issued)."""
    from complete_verifier_ext.bab import domain

    torch.set_num_threads(1)
    split_bound, limit, steps = domain.split_bound, [None], [0]

    def stand_in(graph, start, A, bounds, box, *args, **kwargs):
        out = split_bound(graph, start, A, bounds, box, *args, **kwargs)
        if comm.rank() == 1 and limit[0] is not None and box[0].shape[0] > limit[0]:
            steps[0] += 1
            if steps[0] % 3 == 0:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return out

    domain.split_bound = stand_in
    out = []
    for mode, replicate, limit[0] in cases:
        before, steps[0] = comm.issued(), 0
        try:
            r, _ = _solve(**spec, mode=mode, replicate=replicate, collective=True)
            mine = (r.verdict, r.domains, comm.issued() - before)
        except torch.OutOfMemoryError:  # every rank raises together: the group is still in lockstep
            mine = ("out of memory", comm.issued() - before)
        out.append(comm.all_gather_object(mine))
    return out


def test_at_p2_a_pass_that_runs_out_on_one_rank_runs_again_in_halves_on_every_rank(capfd):
    """P = 2, tp (collectives inside every bound and its backward) and fsdp with whole weights (only the
    collective ``expired`` inside): rank 1 runs out of memory in the third β-CROWN step of more than 2
    domains at once. It ends the pass with the others over no domain, replaying the collectives it
    issued (the ``expired`` decisions as they were), the ranks vote, and every rank bounds that
    round's children and the later rounds' in passes of half as many. The verdict is P = 1's, both
    ranks issue the same collectives, one line per pass that ran out; a domain that does not fit alone
    ends every rank with the error."""
    spec = {**_single("unsat")[0]}
    cases = [("tp", False, 2), ("fsdp", True, 2), ("fsdp", True, 0)]
    results = launch.run(_oom_worker, 2, (spec, cases), backend="gloo")
    for (mode, _, limit), (r0, r1) in zip(cases, results, strict=True):
        assert r0 == r1, (mode, r0, r1)  # the same result and the same collectives on both ranks
        assert r0[0] == ("out of memory" if limit == 0 else "unsat"), (mode, r0)
    err = capfd.readouterr().err
    line = "warning: out of memory on rank 1 in a pass of 4 domains of a BaB round; every rank runs that"
    assert err.count(line) == 2, err  # once per search: the later rounds' passes are of 2
    assert err.count("warning: out of memory on rank 1 in a pass of 1 of a BaB round's domains") == 1


@pytest.mark.parametrize("sizes, seed, box", SAT)
def test_sat_above_the_exact_minimum(sizes, seed, box):
    spec = _spec(sizes, seed, box, 1, sat=(0,))
    _, _, problem, lb, _ = _setup(**spec)
    assert (problem.margins(lb) <= 0).all()
    r, _ = _solve(**spec)
    assert r.verdict == "sat", r
    _assert_counterexample(spec, r.counterexample)


def test_two_clauses_unsat_and_sat():
    unsat = _spec(*MULTI, 2)
    _, _, problem, lb, _ = _setup(**unsat)
    assert (problem.margins(lb) <= 0).any()
    r, _ = _solve(**unsat)
    assert r.verdict == "unsat" and r.domains > 1, r
    for clause in (0, 1):  # only clause `clause` has solutions; the witness must satisfy that one
        spec = _spec(*MULTI, 2, sat=(clause,))
        r, _ = _solve(**spec)
        assert r.verdict == "sat", (clause, r)
        _assert_counterexample(spec, r.counterexample, clause)


@pytest.mark.parametrize("share_time", [False, True])
def test_the_quick_search_proves_the_easy_clauses_first(share_time):
    """The two searches take a region's open clauses one by one.  Before the refinement
    (``search_easiest_first``) it goes easiest first and on past a clause it cannot prove, so the clauses it
    proves are out of the way; after it, worst first, and the first clause not proven ends the
    search.  Clause 0 is easy (CROWN proves it; its bound is given as -0.1 so that it counts as open),
    clause 1 needs more domains than ``bab.max_domains`` allows, so its search says unknown."""
    from complete_verifier_ext import verify
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.spec import Clause, Region

    sizes, seed, box = MULTI
    n, rows = sizes[0], _rows(sizes[-1], 2)
    lo, hi = (box[0],) * n, (box[1],) * n
    m = [_exact(tuple(sizes), seed, lo, hi, tuple(c))[:2] for c in rows]
    d = [m[0][0] - 2 * m[0][1], m[1][0] - MARGIN * m[1][1]]  # clause 0: far below its minimum
    region = Region(
        np.array(lo),
        np.array(hi),
        tuple(Clause(np.array([c]), np.array([t])) for c, t in zip(rows, d, strict=True)),
    )
    graph = from_sequential(testing.mlp(sizes, seed), (n,))
    C = torch.tensor(rows, dtype=torch.float32)
    _, state = crown(graph, verify.input_box(region, graph), C)
    cfg, _ = load_config(None, ["--bab.max_domains", "1", "--solver.batch_size", "8"])
    clock = verify.Clock(time.monotonic() + 60)
    run = verify.RegionRun(graph, region, cfg, clock, {})
    run.state, run.cb = state, np.array([-0.1, -1.0])
    search = verify.search_easiest_first if share_time else verify.search_worst_first
    res = search(run, clock) if share_time else search(run)
    cb = run.cb
    assert res.verdict == "unknown", res
    if share_time:  # easiest first: clause 0 is proven, with a sound bound, and clause 1 still tried
        assert 0 < cb[0] <= m[0][0] - d[0] + 1e-5 and cb[1] == -1.0
        assert res.domains > 1
    else:  # worst first: clause 1 ends the search before clause 0 is tried
        assert list(cb) == [-0.1, -1.0]


def test_interior_counterexample_is_found():
    """No box corner violates the spec: the sign-gradient steps from each round's candidates find it."""
    spec = _spec([4, 8, 2], 2, (-1.0, 1.0), 1, sat=(0,))
    corners = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0])] * 4)
    with torch.no_grad():
        y = testing.mlp(spec["sizes"], spec["seed"])(corners).double()
    at_corners = y @ torch.tensor(spec["rows"][0], dtype=torch.float64)
    assert float(at_corners.min()) > spec["d"][0]  # every counterexample is interior
    r, _ = _solve(**spec)
    assert r.verdict == "sat"
    _assert_counterexample(spec, r.counterexample)
    r, _ = _solve(
        **spec, opts={"iteration": 20, "pgd_steps": 0}
    )  # corners only: never unsat, but cannot find it
    assert r.verdict in ("unknown", "timeout"), r


def test_a_pinned_input_that_is_not_a_float32():
    """x_0 in [0.1, 0.1]: no float32 value lies in the real box; a witness reads x_0 as float32(0.1),
    the value the network computes on, and nothing else."""
    sizes, seed, c = [3, 8, 2], 1, (1.0, -1.0)
    lo, hi = (0.1, -1.0, -1.0), (0.1, 1.0, 1.0)
    m, scale, _ = _exact(tuple(sizes), seed, lo, hi, c)
    spec = {"sizes": sizes, "seed": seed, "lo": lo, "hi": hi, "rows": [list(c)], "d": [m + MARGIN * scale]}
    r, _ = _solve(**spec)
    assert r.verdict in ("sat", "unknown"), r  # there are real counterexamples (x_0 = 0.1 exactly)
    if r.verdict == "sat":
        _assert_counterexample(spec, r.counterexample)


def test_threshold_just_above_the_minimum_is_never_unsat():
    """A threshold just above the exact minimum (0.1% of the spread): the violating set is tiny."""
    sizes, seed, box = [3, 5, 5, 2], 2, (-1.0, 1.0)
    spec = _spec(sizes, seed, box, 1)
    m, scale, _ = _exact(tuple(sizes), seed, spec["lo"], spec["hi"], tuple(spec["rows"][0]))
    spec["d"] = [m + 1e-3 * scale]
    r, _ = _solve(**spec, opts={**OPTS, "iteration": 10})
    assert r.verdict in ("sat", "unknown"), r
    if r.verdict == "sat":
        _assert_counterexample(spec, r.counterexample)


# ----------------------------------------------------------------------------------------------------------
# 3. Soundness fuzzing
# ----------------------------------------------------------------------------------------------------------


FUZZ_OPTS = {"batch_size": 8, "iteration": 10, "max_domains": 500}


def _fuzz_case(i: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    n = int(rng.integers(2, 5))
    hidden = [int(rng.integers(4, 9))] if i % 2 == 0 else [int(rng.integers(3, 6)), int(rng.integers(3, 6))]
    sizes = [n, *hidden, 2]
    centre, radius = rng.uniform(-1, 1, n), rng.uniform(0.3, 1.5, n)
    lo, hi = tuple((centre - radius).tolist()), tuple((centre + radius).tolist())
    c = tuple(rng.standard_normal(2).tolist())
    m, scale, _ = _exact(tuple(sizes), i, lo, hi, c)
    u = rng.uniform(0.005, 0.15) * rng.choice([-1, 1])
    d = m + u * max(scale, 1e-2)  # never a float tie d == m (a constant net has scale 0)
    return {"sizes": sizes, "seed": i, "lo": lo, "hi": hi, "rows": [list(c)], "d": [d], "min": m}


def test_soundness_fuzz():
    verdicts = []
    for i in range(20):
        case = _fuzz_case(i)
        m = case.pop("min")
        d = case["d"][0]
        n = case["sizes"][0]
        lo, hi = np.array(case["lo"]), np.array(case["hi"])
        X = torch.from_numpy(lo + (hi - lo) * np.random.default_rng(i).random((20_000, n))).float()
        with torch.no_grad():
            sampled = testing.mlp(case["sizes"], i)(X).double() @ torch.tensor(
                case["rows"][0], dtype=torch.float64
            )
        r, calls = _solve(**case, expire_after=60, opts=FUZZ_OPTS)
        verdicts.append(r.verdict)
        info = (i, case, m, r)
        if float(sampled.min()) <= d or m <= d:  # a counterexample exists
            assert r.verdict in ("sat", "unknown", "timeout"), info
        else:  # m > d: nothing below the threshold anywhere in the box
            assert r.verdict in ("unsat", "unknown", "timeout"), info
        if r.verdict == "sat":
            _assert_counterexample(case, r.counterexample)
        assert calls <= 60
    # the fuzz is not vacuous: BaB decides a good share of the cases either way
    assert verdicts.count("unsat") >= 4 and verdicts.count("sat") >= 4, verdicts


# ----------------------------------------------------------------------------------------------------------
# 4-5. Domain-parallel: P = 2 and 3 give the verdicts of P = 1; timeouts
# ----------------------------------------------------------------------------------------------------------

PAR_UNSAT = ([3, 5, 5, 2], 0, (-1.0, 1.0))  # ~45 domains at P = 1: rebalancing happens
PAR_SAT = ([4, 8, 2], 1, (-1.0, 1.0))  # the witness shows up only after some branching
LONG = ([3, 5, 5, 2], 2, (-1.0, 1.0))  # ~100 domains, ~25 rounds at P = 1 (timeouts, the killed rank)
PAR_OPTS = {**OPTS, "batch_size": 4}  # small batches: queues differ enough across ranks to be rebalanced


def _worker(jobs: list[dict]) -> list[list[tuple]]:
    """Every job on every rank; per job, every rank's (verdict, cex, domains, rounds, max_queue, calls)."""
    torch.set_num_threads(1)
    out = []
    for job in jobs:
        r, calls = _solve(**{k: v for k, v in job.items() if k != "tag"})
        mine = (r.verdict, r.counterexample, r.domains, r.rounds, r.max_queue, calls)
        out.append([comm.broadcast_object(mine, src=q) for q in range(comm.world_size())])
    return out


@functools.cache
def _single(which: str) -> tuple:
    spec = _spec(
        *{"unsat": PAR_UNSAT, "sat": PAR_SAT, "long": LONG}[which], 1, sat=(0,) if which == "sat" else ()
    )
    spec["opts"] = PAR_OPTS
    r, _ = _solve(**spec)
    return spec, r.verdict, r.domains, r.rounds


def _job(which: str, mode: str) -> dict:
    return {**_single(which)[0], "mode": mode, "tag": which}


def _check(jobs: list[dict], results: list[list[tuple]], world: int) -> None:
    for job, per_rank in zip(jobs, results, strict=True):
        assert len(per_rank) == world
        verdict, cex, domains, rounds, max_queue, calls = per_rank[0]
        for other in per_rank[1:]:  # lockstep: every rank returns the same result
            assert other[0] == verdict and other[2:] == (domains, rounds, max_queue, calls)
            assert (other[1] is None) == (cex is None) and (cex is None or np.array_equal(other[1], cex))
        assert len(max_queue) == world
        if job.get("expire_after"):
            # expired() may be asked within a round too; it said True at call expire_after, and BaB stopped
            k = job["expire_after"]
            assert verdict == "timeout" and k <= calls <= k + 1, per_rank[0]
            assert rounds < _single(job["tag"])[3]
            continue
        expected = "sat" if job["tag"] == "sat" else "unsat"
        assert verdict == _single(job["tag"])[1] == expected, (job, per_rank[0])
        if verdict == "sat":
            _assert_counterexample(job, cex)
        else:
            assert cex is None and domains > 1


def test_domain_parallel_two_ranks():
    jobs = [_job("unsat", "fsdp"), _job("sat", "tp"), {**_job("long", "fsdp"), "expire_after": 3}]
    jobs += [{**_job("unsat", "fsdp"), "replicate": True}, {**_job("sat", "fsdp"), "replicate": True}]
    results = launch.run(_worker, 2, (jobs,), backend="gloo")
    _check(jobs, results, 2)
    assert results[0][0][4][1] > 0  # rank 1 got domains by rebalancing
    # weights gathered once are bitwise the shards gathered per use: the very same search
    assert results[3][0][2:5] == results[0][0][2:5]


def test_domain_parallel_three_ranks():
    jobs = [_job("unsat", "fsdp"), _job("sat", "tp")]  # (an unsat search under tp is ~3x slower than fsdp)
    results = launch.run(_worker, 3, (jobs,), backend="gloo")
    _check(jobs, results, 3)
    assert results[0][0][4][1] > 0  # rank 1 got domains by rebalancing


def test_timeout_single_rank():
    spec, verdict, _, rounds = _single("long")
    assert verdict == "unsat" and rounds > 4
    for k in (1, 3, 10):  # the first k - 1 answers are False
        r, calls = _solve(**spec, expire_after=k)
        assert r.verdict == "timeout" and k <= calls <= k + 1 and r.rounds < min(k + 1, rounds), (k, calls, r)


# ----------------------------------------------------------------------------------------------------------
# 6. A rank killed mid-search
# ----------------------------------------------------------------------------------------------------------


def test_rank_killed_mid_bab_is_reported():
    spec, _, _, rounds = _single("long")
    assert rounds >= 3
    job = {**spec, "mode": "fsdp", "kill_rank_at_round": (1, 2)}
    t0 = time.monotonic()
    with pytest.raises(launch.RankFailure) as info:
        launch.run(_worker, 2, ([job],), backend="gloo")
    elapsed = time.monotonic() - t0
    assert info.value.rank == 1 and "died (signal 9)" in str(info.value), str(info.value)
    assert elapsed < 30, elapsed
    assert not multiprocessing.active_children()
    assert not rank_processes(os.getpid())


# ----------------------------------------------------------------------------------------------------------
# 7. α and β stored in float16 between rounds stay sound
# ----------------------------------------------------------------------------------------------------------


def test_domains_bounded_from_float16_alpha_beta_are_sound():
    """Domains bounded from their parent's float16 α and β alone (one β-CROWN step: no optimisation
    after the rounding) never claim more than sampled points of the domain (those that satisfy its
    splits) show."""
    sizes, box = [3, 20, 20, 2], ((-1.0,) * 3, (1.0,) * 3)
    graph = from_sequential(testing.mlp(sizes, 1), (3,))
    x = torch.rand(200_000, 3, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        c = graph(x) @ torch.tensor([1.0, -1.0])
    d = float(c.min() - 0.02 * (c.max() - c.min()))  # unsat, and CROWN alone cannot show it
    problem = Clauses.of([Clause(np.array([[1.0, -1.0]]), np.array([d]))])
    lo, hi = float32_box(np.array(box[0]), np.array(box[1]), inward=False)
    tbox = (torch.tensor(lo)[None], torch.tensor(hi)[None])
    _, state = crown(graph, tbox, problem.C)
    opts = BabOptions(batch_size=8, iteration=8, store_dtype=torch.float16)
    bab = ReluSplitBab(graph, tbox, problem, opts, np.array(box[0]), np.array(box[1]), state)
    bab.start()
    bab.expand(4)
    bab.expand(4)
    bab.bc.opts = dataclasses.replace(opts, iteration=1)  # bound from the stored values, as they are
    bab.expand(4)
    assert bab.queue and any(bool((b != 0).any()) for d in bab.queue for b in d.beta.values())
    assert all(a.dtype == torch.float16 for d in bab.queue for a in d.alpha.values())
    with torch.no_grad():
        margins = problem.point_margins(graph(x).double()).min(1).values
    for d in bab.queue:
        inside = torch.ones(len(x), dtype=torch.bool)
        for k, sp in d.splits.items():
            z, s = graph.forward(x, upto=k).reshape(len(x), -1), sp.reshape(-1)
            inside &= ((z >= 0) | (s != 1)).all(1) & ((z <= 0) | (s != -1)).all(1)
        if inside.any():
            assert float(margins[inside].min()) >= d.worst - 1e-5, (d.splits, d.worst)


def test_branch_scores_by_hand():
    """BaBSR's score and intercept term on three neurons, computed by hand: (l, u) = (-1, 1), slope
    1/2, intercept 1/2; (-1, 3), slope 3/4, intercept 3/4; (1, 2) stable. Bias 0.4; row 1 is closed."""
    from complete_verifier_ext.bounds.ops import Relu

    lo, hi = torch.tensor([[-1.0, -1.0, 1.0]]), torch.tensor([[1.0, 3.0, 2.0]])
    A = torch.tensor([[[-2.0, 2.0, 5.0]], [[100.0, 100.0, 100.0]]])  # (S=2, B=1, 3)
    rows = torch.tensor([[1.0], [0.0]])
    free = torch.ones(1, 3, dtype=torch.bool)
    score, term = Relu.branch_scores(A, lo, hi, torch.full((3,), 0.4), rows, free)
    # neuron 0: term -2 * 1/2 = -1; bias: bA = -0.8, max(-0.8 * -1/2, -0.8 * 1/2) = 0.4 -> |-0.6|
    # neuron 1: term 0 (A > 0 takes the lower slope); bias: bA = 0.8, max(0.8 * -1/4, 0.8 * 3/4) = 0.6
    torch.testing.assert_close(score, torch.tensor([[0.6, 0.6, -1.0]]))
    torch.testing.assert_close(term, torch.tensor([[1.0, 0.0, -1.0]]))
    score, term = Relu.branch_scores(A, lo, hi, None, rows, torch.tensor([[True, False, True]]))
    torch.testing.assert_close(score, torch.tensor([[1.0, -1.0, -1.0]]))
    torch.testing.assert_close(term, torch.tensor([[1.0, -1.0, -1.0]]))
