"""Input-split BaB: verdicts against dense grids, counterexamples, termination, domain-parallel lockstep.

Ground truth: a dense grid gives the minimum ``m`` of ``Y_0 - Y_j`` over the box up to ``err`` (a
Lipschitz bound of the row, from spectral norms, times the largest distance to a grid point). A clause
``Y_0 - Y_j <= m - 1.5 err`` has no solution (unsat), ``Y_0 - Y_j <= m + 0.01`` has the grid's minimiser
as a witness (sat).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from complete_verifier_ext import testing
from complete_verifier_ext.bab import input_split
from complete_verifier_ext.bab.common import BabOptions, BabResult, rebalance_plan
from complete_verifier_ext.bab.input_split import (
    Domains,
    branch_dims,
    evaluate,
    input_split_bab,
    split,
    spread_pick,
)
from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch
from complete_verifier_ext.spec import Clauses

NETS = {2: ([2, 16, 16, 2], 6), 3: ([3, 12, 12, 3], 0)}  # input dim -> (sizes, seed); interior minima
GRID = {2: 1001, 3: 121}


def _lipschitz(net: torch.nn.Sequential, c: torch.Tensor) -> float:
    weights = [m.weight.detach() for m in net if isinstance(m, torch.nn.Linear)]
    lip = float((c @ weights[-1]).norm())
    for w in weights[:-1]:
        lip *= float(torch.linalg.matrix_norm(w, 2))
    return lip


@functools.cache
def _grid(dim: int) -> tuple[list[float], list[float], list[list[float]]]:
    """Per output row j = 1.. of ``Y_0 - Y_j``: grid minimum, error bound, grid minimiser."""
    sizes, seed = NETS[dim]
    net = testing.mlp(sizes, seed)
    t = torch.linspace(-1, 1, GRID[dim])
    X = torch.cartesian_prod(*[t] * dim)
    with torch.no_grad():
        y = net(X)
    mins, errs, args = [], [], []
    for j in range(1, sizes[-1]):
        f = y[:, 0] - y[:, j]
        c = torch.zeros(sizes[-1])
        c[0], c[j] = 1.0, -1.0
        mins.append(float(f.min()))
        errs.append(_lipschitz(net, c) * float(t[1] - t[0]) * math.sqrt(dim) / 2)
        args.append(X[f.argmin()].tolist())
    return mins, errs, args


def _case(name: str) -> tuple[int, Clauses]:
    """Named properties on the box [-1, 1]^dim; a counterexample is an x with (C y)_s <= d_s for the rows s
    of some clause."""
    dim = 2 if name.endswith("2") else 3
    mins, errs, _ = _grid(dim)
    below = [m - 1.5 * e for m, e in zip(mins, errs, strict=True)]
    if name == "unsat2":
        d = [below[0]]
    elif name == "sat2":
        d = [mins[0] + 0.01]
    elif name == "unsat3":  # two clauses: Y_0 <= Y_1 + d_0 or Y_0 <= Y_2 + d_1
        d = below
    elif name == "sat3":  # only the first clause has solutions, around an interior minimiser
        d = [mins[0] + 0.01, below[1]]
    else:
        raise KeyError(name)
    n_out = NETS[dim][0][-1]
    C = torch.stack([torch.eye(n_out)[0] - torch.eye(n_out)[j] for j in range(1, len(d) + 1)])
    problem = Clauses(C, torch.tensor(d, dtype=torch.float64), torch.arange(len(d)), len(d))
    return dim, problem


def _graph(dim: int):
    sizes, seed = NETS[dim]
    return from_sequential(testing.mlp(sizes, seed), (dim,))


def _box(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return -torch.ones(1, dim), torch.ones(1, dim)


def _run(
    name: str,
    method: str = "crown",
    batch: int = 8,
    expire_after: int | None = None,
    max_domains: int = 200_000,
    mode: str = "none",
) -> BabResult:
    """One search on this rank (every rank calls it identically)."""
    dim, problem = _case(name)
    graph = _graph(dim)
    if comm.world_size() > 1 and mode != "none":
        graph.shard(mode)
    calls = [0]

    def expired() -> bool:
        calls[0] += 1
        return expire_after is not None and calls[0] >= expire_after

    opts = BabOptions(batch_size=batch, max_domains=max_domains, iteration=3, lr_alpha=0.1)
    result = input_split_bab(graph, _box(dim), problem, opts, expired, method, _box(dim))
    assert calls[0] == result.rounds  # expired() is asked exactly once per round
    return result


def _worker(jobs: list[dict]) -> list[list[tuple]]:
    """Every job on every rank; returns, per job, every rank's result (gathered as objects)."""
    torch.set_num_threads(1)
    out = []
    for job in jobs:
        r = _run(**job)
        mine = (r.verdict, r.counterexample, r.domains, r.rounds, r.max_queue)
        out.append([comm.broadcast_object(mine, src=q) for q in range(comm.world_size())])
    return out


def _assert_valid_counterexample(name: str, x: np.ndarray) -> None:
    dim, problem = _case(name)
    assert isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (dim,)
    assert (x >= -1).all() and (x <= 1).all()
    sizes, seed = NETS[dim]
    with torch.no_grad():
        y = testing.mlp(sizes, seed)(torch.from_numpy(x)[None])
    assert bool(problem.violated(y)[0])


# ----------------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------------


def test_engine_handles_an_empty_batch():
    graph = _graph(2)
    _, problem = _case("unsat2")
    empty = (torch.zeros(0, 2), torch.zeros(0, 2))
    lb, state = crown(graph, empty, problem.C)
    assert lb.shape == (0, 1)
    lb, _ = alpha_crown(graph, empty, problem.C, state, AlphaOptions(iteration=2))
    assert lb.shape == (0, 1)
    assert evaluate(graph, torch.zeros(0, 2)).shape == (0, 2)


@pytest.mark.parametrize("name", ["unsat2", "unsat3"])
def test_bab_proves_what_crown_alone_cannot(name):
    dim, problem = _case(name)
    lb, _ = crown(_graph(dim), _box(dim), problem.C)
    assert (problem.margins(lb) <= 0).any()  # CROWN on the whole box fails
    for method in ("crown", "alpha-crown") if name == "unsat2" else ("crown",):
        r = _run(name, method)
        assert r.verdict == "unsat", (method, r)
        assert r.counterexample is None and r.domains > 1 and r.rounds > 1 and len(r.max_queue) == 1


@pytest.mark.parametrize("name", ["sat2", "sat3"])
def test_sat_returns_a_counterexample_inside_the_box(name):
    r = _run(name)
    assert r.verdict == "sat", r
    _assert_valid_counterexample(name, r.counterexample)


def test_timeout_and_unknown():
    r = _run("unsat2", expire_after=3)
    assert (r.verdict, r.rounds) == ("timeout", 3)
    assert _run("unsat2", max_domains=2).verdict == "unknown"


def test_split_branches_on_the_sensitive_dimension():
    lo, hi = torch.zeros(3, 2), torch.tensor([[1.0, 1.0], [20.0, 1.0], [1.0, 2.0]])
    coef = torch.tensor([[0.1, 1.0], [0.1, 1.0], [0.0, 0.0]])
    d = Domains(lo, hi, torch.zeros(3, 1, dtype=torch.float64), coef)
    # width x |a|: dim 1 wins; width 20 beats a 10x sensitivity; no coefficients: the widest dimension
    assert branch_dims(d).tolist() == [1, 0, 1]
    lo, hi, margins = split(d)
    assert lo.shape == hi.shape == (6, 2) and margins.shape == (6, 1)
    torch.testing.assert_close(hi[0], torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(lo[3], torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(hi[1], torch.tensor([10.0, 1.0]))


@pytest.mark.parametrize("sizes", [[10, 0, 3], [0, 0, 7], [5, 5], [9, 1, 1, 0], [0, 1]])
def test_rebalance_plan_evens_out_the_queues(sizes):
    new = list(sizes)
    for src, dst, count in rebalance_plan(sizes):
        assert count > 0 and src != dst
        new[src] -= count
        new[dst] += count
    assert sum(new) == sum(sizes) and max(new) - min(new) <= 1
    q = Domains(
        torch.zeros(7, 1),
        torch.ones(7, 1),
        torch.arange(7.0, dtype=torch.float64)[:, None],
        torch.zeros(7, 1),
    )
    assert sorted(spread_pick(q, 3).tolist()) == [1, 3, 5]


# ----------------------------------------------------------------------------------------------------------
# Domain-parallel: P = 2 and 3 give the verdicts of P = 1, every rank the same result
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def _single(name: str) -> tuple:
    r = _run(name)
    return r.verdict, r.domains, r.rounds


def _check_parallel(jobs: list[dict], results: list[list[tuple]], world: int) -> None:
    for job, per_rank in zip(jobs, results, strict=True):
        assert len(per_rank) == world
        verdict, cex, domains, rounds, max_queue = per_rank[0]
        for other in per_rank[1:]:  # every rank returns the same result
            assert other[0] == verdict and other[2:] == (domains, rounds, max_queue)
            assert (other[1] is None) == (cex is None) and (cex is None or np.array_equal(other[1], cex))
        assert len(max_queue) == world
        if job.get("expire_after"):
            assert (verdict, rounds) == ("timeout", job["expire_after"])
            continue
        assert verdict == _single(job["name"])[0], (job, per_rank[0])
        if verdict == "sat":
            _assert_valid_counterexample(job["name"], cex)
        else:
            assert cex is None


def test_domain_parallel_two_ranks_fsdp():
    jobs = [{"name": n, "mode": "fsdp"} for n in ("unsat2", "sat2")]
    jobs.append({"name": "unsat2", "mode": "fsdp", "method": "alpha-crown"})
    jobs.append({"name": "unsat2", "mode": "fsdp", "expire_after": 4})
    results = launch.run(_worker, 2, (jobs,), backend="gloo")
    _check_parallel(jobs, results, 2)
    assert results[0][0][4][1] > 0  # rank 1 got domains by rebalancing


def test_domain_parallel_three_ranks_with_empty_batches():
    jobs = [
        {"name": "unsat2", "mode": "fsdp"},
        {"name": "sat2", "mode": "tp"},
        {"name": "unsat3", "mode": "tp"},  # two clauses
        # one batch holds the whole search: no rebalancing, ranks 1 and 2 bound empty batches throughout
        {"name": "unsat2", "mode": "fsdp", "batch": 64},
    ]
    results = launch.run(_worker, 3, (jobs,), backend="gloo")
    _check_parallel(jobs, results, 3)
    assert min(results[0][0][4]) > 0  # every rank got domains by rebalancing
    assert results[-1][0][4][1:] == [0, 0]


def test_a_round_that_runs_out_of_memory_runs_again_with_half_its_boxes(monkeypatch, capsys):
    """P = 1: bounding more than 5 boxes at once raises ``torch.OutOfMemoryError`` (what CUDA raises):
    the first round of 4 parents (8 children) goes back on the queue and runs again with 2, one warning
    line, and the later rounds pick 2 (of 8 a round). Still unsat; a parent that does not fit even
    alone gives up with the error."""
    bound = input_split._bound_children

    def stand_in(graph, problem, method, opts, lo, *args):
        if lo.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return bound(graph, problem, method, opts, lo, *args)

    monkeypatch.setattr(input_split, "_bound_children", stand_in)
    limit = 5
    r = _run("unsat2")
    assert r.verdict == "unsat" and r.domains > 1, r
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: out of memory")]
    assert warnings == [
        "warning: out of memory in a pass of 4 parents of a BaB round; retrying in passes of 2"
    ]
    limit = 1
    with pytest.raises(torch.OutOfMemoryError):
        _run("unsat2")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "warning: out of memory in a pass of 1 parent(s) of a BaB round (one parent per pass): giving up"
    )


def _out_of_memory_worker(limit: int, who: int, mode: str, method: str) -> tuple:
    """unsat2 at P = 2 (``mode``, ``method``, batches of 8 parents a rank) where rank ``who`` runs out of
    memory in any
    pass of a layer's neuron rows over more than ``limit`` boxes (the stand-in for
    ``torch.OutOfMemoryError``): its row passes halve in lockstep down to one row, then every rank
    stops the round together and runs it again with half as many parents. Returns every rank's result
    and the most boxes of a pass that bounded rows there."""
    from complete_verifier_ext.bounds import crown as crown_module

    torch.set_num_threads(1)
    unit_rows, boxes = crown_module._bound_unit_rows, []

    def stand_in(graph, k, part, bounds, box, a):
        if comm.rank() == who and len(part) > 0 and box[0].shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        boxes.extend([box[0].shape[0]] if len(part) > 0 else [])  # not a pass of no row (a dummy)
        return unit_rows(graph, k, part, bounds, box, a)

    crown_module._bound_unit_rows = stand_in
    try:
        r = _run("unsat2", method, mode=mode)
    finally:
        crown_module._bound_unit_rows = unit_rows
    return comm.all_gather_object(((r.verdict, r.domains, r.rounds, r.max_queue), max(boxes)))


def test_a_round_at_two_ranks_that_runs_out_of_memory_runs_again_on_every_rank(capfd):
    """P = 2 (tp, α-CROWN: ring passes and α's gradient in the passes): rank 1 cannot bound a layer's
    rows over more than 6 boxes, even one row at a time. Every rank stops the round at the same point
    and runs it again with at most half the most parents any rank popped, until the gathered batch fits
    (one parent a rank: 4 boxes), and later rounds pick that many: the same verdict as P = 1, the same
    result on both ranks, no rows bounded on rank 1 over more than 6 boxes. A limit below 2 boxes (one
    parent a rank) gives up on both ranks with the error (fsdp, CROWN)."""
    results = launch.run(_out_of_memory_worker, 2, (6, 1, "tp", "alpha-crown"), backend="gloo")
    assert results[0][0] == results[1][0]
    verdict, domains, _, _ = results[0][0]
    assert verdict == _run("unsat2", "alpha-crown").verdict == "unsat" and domains > 1
    assert results[1][1] <= 6  # rank 0's passes of a round that rank 1 stopped ran over more
    err = capfd.readouterr().err
    retries = [ln for ln in err.splitlines() if "every rank stopped together" in ln]
    caps = [int(ln.rsplit(" ", 3)[1]) for ln in retries]  # "... retrying with at most N per rank"
    assert retries and caps[-1] == 1, err
    for ln, cap in zip(retries, caps, strict=True):
        assert ln == (
            f"warning: out of memory in a pass of up to {2 * cap} parents per rank of a BaB round (every "
            f"rank stopped together); retrying with at most {cap} per rank"
        )
    with pytest.raises(launch.RankFailure, match="OutOfMemoryError"):
        launch.run(_out_of_memory_worker, 2, (1, 1, "fsdp", "crown"), backend="gloo")
    assert "(one parent per rank): giving up" in capfd.readouterr().err
