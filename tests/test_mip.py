"""MILP refinement of intermediate bounds (``general.complete_verifier: bab-refine``).

Ground truth: ``testing.exact_min_linear`` on the network cut after a pre-activation layer gives the
exact minimum (and, with ``-e_j``, maximum) of every neuron over the box; the refined bounds must
contain it and, when no solve hits its time limit, equal it up to the safety margin.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import pytest
import torch
from support import exact_ranges

from complete_verifier_ext import testing
from complete_verifier_ext.bounds import mip
from complete_verifier_ext.bounds.crown import crown, pre_activation_nodes
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch

SIZES = (3, 6, 6, 6, 2)


def _case(seed: int, sizes=SIZES, width: float = 1.0, mode: str = "none"):
    net = testing.mlp(sizes, seed)
    graph = from_sequential(net, (sizes[0],)).shard(mode)
    rng = np.random.default_rng(seed)
    centre = rng.uniform(-1, 1, sizes[0])
    lo, hi = centre - width, centre + width
    box = (torch.tensor(lo, dtype=torch.float32)[None], torch.tensor(hi, dtype=torch.float32)[None])
    C = torch.eye(sizes[-1])[:1] - torch.eye(sizes[-1])[1:2]
    _, state = crown(graph, box, C)
    return net, graph, box, state, lo, hi


def _refine(graph, box, state, timeout=30.0, threads=1):
    pre = pre_activation_nodes(graph)
    bounds = {k: state.bounds[k] for k in pre}
    opts = mip.MipOptions(neuron_timeout=timeout, threads=threads)
    return mip.refine_bounds(graph, box, bounds, opts, time.monotonic() + 60)


@pytest.mark.parametrize("seed,threads", [(0, 1), (0, 2)])  # one net: its exact ranges take ~30 s
def test_refined_bounds_are_the_exact_neuron_ranges(seed, threads):
    net, graph, box, state, lo, hi = _case(seed)
    refined, stats = _refine(graph, box, state, threads=threads)
    pre = pre_activation_nodes(graph)
    assert stats["layers"] == len(pre) - 1
    exact = exact_ranges(SIZES, seed, lo, hi)
    tighter = 0
    for i, k in enumerate(pre):
        for j in range(len(exact[i][0])):
            exact_lo, exact_hi = exact[i][0][j], exact[i][1][j]
            r_lo, r_hi = float(refined[k][0][0, j]), float(refined[k][1][0, j])
            tol = 1e-5 * (1 + abs(exact_lo) + abs(exact_hi))
            assert r_lo <= exact_lo + tol and r_hi >= exact_hi - tol  # sound
            c_lo, c_hi = float(state.bounds[k][0][0, j]), float(state.bounds[k][1][0, j])
            if i >= 1 and c_lo < 0 < c_hi:  # solved to optimality: exact up to the outward margin
                slack = 2 * mip.SAFETY * (1 + max(abs(exact_lo), abs(exact_hi))) + tol
                assert r_lo >= exact_lo - slack and r_hi <= exact_hi + slack
                tighter += r_lo > c_lo + 1e-6
    assert tighter > 0  # CROWN was not already exact: the MILP did something


def test_time_limited_solves_stay_sound():
    sizes = (8, 24, 24, 24, 3)
    net, graph, box, state, lo, hi = _case(5, sizes, width=0.8)
    refined, stats = _refine(graph, box, state, timeout=0.02)
    assert stats["solves"] > 0
    x = torch.tensor(lo + (hi - lo) * np.random.default_rng(0).random((4000, len(lo))), dtype=torch.float32)
    for i, k in enumerate(pre_activation_nodes(graph)):
        with torch.no_grad():
            z = net[: 2 * i + 1](x)
        assert (z >= refined[k][0] - 1e-5).all() and (z <= refined[k][1] + 1e-5).all()
        assert (refined[k][0] >= state.bounds[k][0]).all() and (refined[k][1] <= state.bounds[k][1]).all()


def test_a_stopped_solve_still_gives_its_dual_bound():
    """A MILP stopped by its limit (one node: no test of time, so machine load cannot change it)
    before any feasible point (no heuristics run) reports HiGHS's dual bound: finite, at least the LP
    relaxation's, and below the exact minimum."""
    sizes = (10, 40, 40, 40, 2)
    net, graph, box, state, lo, hi = _case(7, sizes, width=1.0)
    layers, _ = mip.chain_layers(graph)
    cur = {ly.node: tuple(t.double().reshape(-1).numpy() for t in state.bounds[ly.node]) for ly in layers}
    model = mip.ChainMilp(layers, cur, lo, hi, 2)
    assert model.integrality.sum() > 20
    relaxed = mip.ChainMilp(layers, cur, lo, hi, 2)
    relaxed.integrality[:] = 0
    relaxed.highs.changeColsIntegrality(
        relaxed.n_var, np.arange(relaxed.n_var, dtype=np.int32), np.zeros(relaxed.n_var, dtype=np.uint8)
    )
    x = torch.tensor(lo + (hi - lo) * np.random.default_rng(1).random((4000, len(lo))), dtype=torch.float64)
    with torch.no_grad():
        z = net.double()[:5](x)  # the third pre-activation layer
    for j in range(4):
        w = layers[2].M[j]
        stopped, lp = model.minimum(w, 300.0, node_limit=1), relaxed.minimum(w, 300.0)
        assert np.isfinite(stopped) and np.isfinite(lp)
        assert stopped >= lp - 1e-6 * (1 + abs(lp))
        assert stopped + layers[2].c[j] <= float(z[:, j].min()) + 1e-6


def test_a_residual_network_is_not_a_chain(tmp_path):
    from complete_verifier_ext.model.onnx_loader import load_model

    graph = load_model(testing.residual_onnx(tmp_path / "res.onnx", seed=0))
    with pytest.raises(mip.UnsupportedForMip):
        mip.chain_layers(graph)


def _ranks_worker(mode: str):
    net, graph, box, state, lo, hi = _case(3, mode=mode)
    refined, stats = _refine(graph, box, state)
    return {k: (v[0].tolist(), v[1].tolist()) for k, v in refined.items()}, stats["solves"], comm.rank()


def test_two_ranks_share_the_solves_and_agree_with_one():
    one = _ranks_worker("none")
    two = launch.run(_ranks_worker, 2, ("fsdp",), backend="gloo")
    assert two[0] == one[0]
    assert 0 < two[1] < one[1]  # rank 0 did only its share of the solves


def _prove(graph, box, state, clauses, threads=1, timeout=30.0):
    return mip.prove_clauses(
        graph, box, state.bounds, clauses, mip.MipOptions(threads=threads), time.monotonic() + timeout
    )


@pytest.mark.parametrize("seed,threads", [(0, 1), (2, 2)])
def test_output_milp_proves_exactly_the_clauses_that_hold(seed, threads):
    """Clause ``c · y <= d`` with c = e_0 - e_1: proven when d is below the exact minimum of c · y (the
    bound then lies between d's margin and the exact one), and a point with c · y <= d (up to the
    cutoff) found when d is above it.  Clauses of two rows (both must hold) are checked by sampling."""
    net, graph, box, state, lo, hi = _case(seed, (3, 6, 6, 2))  # 12 ReLUs: enumerable
    c = np.eye(2)[0] - np.eye(2)[1]
    exact, _ = testing.exact_min_linear(net.double(), lo, hi, c)
    cut = lambda v: mip.SAFETY * (1 + abs(v))
    below, above = exact - 0.05, exact + 0.05
    rows = np.stack([c, -c])
    pair_lo, pair_hi = exact - 1.0, -exact - 1.0  # c·y <= exact - 1: never; -c·y <= -exact - 1: never
    clauses = [(c[None], np.array([below])), (rows, np.array([pair_lo, pair_hi]))]
    proven, pair = _prove(graph, box, state, clauses, threads)
    (found,) = _prove(graph, box, state, [(c[None], np.array([above]))], threads)  # a find stops the others
    assert proven.status == "proven" and 0 < proven.bound <= exact - below + 1e-6, proven
    assert found.status == "found" and found.point is not None
    with torch.no_grad():
        y = net.double()(torch.tensor(found.point)[None])[0].numpy()
    assert c @ y - above <= cut(above) + 1e-6
    assert np.all(lo - 1e-6 <= found.point) and np.all(found.point <= hi + 1e-6)
    x = torch.tensor(lo + (hi - lo) * np.random.default_rng(seed).random((4000, len(lo))))
    with torch.no_grad():
        ys = net.double()(x).numpy()
    margin = np.maximum(ys @ c - pair_lo, -(ys @ c) - pair_hi)
    assert pair.status == "proven" and pair.bound <= margin.min() + 1e-6


def _prove_worker(mode: str):
    net, graph, box, state, lo, hi = _case(2, (3, 6, 6, 2), mode=mode)
    c = np.eye(2)[0] - np.eye(2)[1]
    exact, _ = testing.exact_min_linear(net.double(), lo, hi, c)
    clauses = [(c[None], np.array([exact + gap])) for gap in (-0.05, -0.1, -0.5, 0.05)]  # the last: found
    res = _prove(graph, box, state, clauses)
    return [r.status for r in res], res[-1].point


def test_two_ranks_share_the_output_milps_and_agree_with_one():
    """Rank 1 finds the point of the last clause (clauses are dealt round-robin); rank 0 gets it."""
    one = _prove_worker("none")
    two = launch.run(_prove_worker, 2, ("fsdp",), backend="gloo")
    assert one[0] == two[0] == ["proven"] * 3 + ["found"]
    assert np.allclose(one[1], two[1])


def test_output_milp_stops_at_its_deadline():
    """A clause far from decided on a larger network: the solve ends at the deadline, unproven."""
    net, graph, box, state, lo, hi = _case(7, (10, 40, 40, 40, 2), width=1.0)
    c = np.eye(2)[0] - np.eye(2)[1]
    t0 = time.monotonic()
    (res,) = _prove(graph, box, state, [(c[None], np.array([-1e3]))], timeout=0.2)
    assert time.monotonic() - t0 < 120  # a hang detector, not a speed test
    assert res.status in ("proven", "unknown")


def _instance(tmp_path, onnx_path, n_in, n_out, width):
    lo, hi = np.full(n_in, -width), np.full(n_in, width)
    return onnx_path, testing.write_vnnlib(tmp_path / "p.vnnlib", lo, hi, label=0, n_outputs=n_out)


@functools.cache
def _exact_margin(sizes: tuple[int, ...], seed: int, width: float) -> float:
    """The exact minimum of ``Y_0 - Y_j`` over the box (shared by the parametrizations)."""
    net, n_out = testing.mlp(sizes, seed).double(), sizes[-1]
    lo, hi = np.full(sizes[0], -width), np.full(sizes[0], width)
    c = [np.eye(n_out)[0] - np.eye(n_out)[j] for j in range(1, n_out)]
    return min(testing.exact_min_linear(net, lo, hi, row)[0] for row in c)


@pytest.mark.parametrize("method", ["split", "milp", "split+milp"])
def test_bab_refine_pipeline(tmp_path, capsys, method):
    """A chain network is refined (the summary has the refined bounds) and the verdict is exact; a
    residual one is refined by ``split``, and ``milp`` skips it with a warning instead of an error."""
    from complete_verifier_ext.config import MipConfig
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.verify import verify_instance

    cfg, _ = load_config(
        None,
        ["--general.complete_verifier", "bab-refine", "--solver.alpha-crown.iteration", "2"]
        + ["--solver.mip.refine_neuron_timeout", "5", "--attack.pgd_order", "skip"]
        + ["--solver.mip.quick_bab_percentage", "0", "--solver.mip.refine_method", method],
    )
    sizes = (4, 6, 6, 3)
    onnx_path, vnnlib = _instance(tmp_path, testing.mlp_onnx(tmp_path / "m.onnx", sizes, 3), 4, 3, 0.3)
    res = verify_instance(cfg, onnx_path, vnnlib, timeout=60)
    exact = _exact_margin(sizes, 3, 0.3)
    assert res.verdict == ("unsat" if exact > 0 else "sat"), (res, exact)
    assert min(res.bounds["alpha_crown"]) < 0  # the case needs the refinement (or BaB)
    assert min(res.bounds["alpha_crown"]) <= min(res.bounds["refined"]) <= exact + 1e-4
    mip_cfg = MipConfig(refine_method=method)
    quick = dataclasses.replace(cfg, solver=dataclasses.replace(cfg.solver, mip=mip_cfg))
    res = verify_instance(quick, onnx_path, vnnlib, timeout=60)  # a short plain BaB solves it: no refinement
    assert res.verdict == ("unsat" if exact > 0 else "sat") and "refined" not in res.bounds
    n_in = int(np.prod(testing.RESIDUAL_INPUT_SHAPE))
    res_path = testing.residual_onnx(tmp_path / "r.onnx", seed=0)
    onnx_path, vnnlib = _instance(tmp_path, res_path, n_in, testing.RESIDUAL_OUTPUTS, 0.05)
    res = verify_instance(cfg, onnx_path, vnnlib, timeout=60)
    assert res.verdict in ("unsat", "sat", "unknown")
    if min(res.bounds.get("alpha_crown", [1.0])) <= 0:  # α-CROWN left it open: refinement was asked
        if "milp" in method:
            assert "no MILP refinement" in capsys.readouterr().err
        if method == "milp":
            assert "refined" not in res.bounds
        else:  # split refines any network
            assert min(res.bounds["alpha_crown"]) <= min(res.bounds["refined"])


def test_split_milp_skips_the_milp_when_split_verifies(tmp_path, capsys):
    """``split+milp`` checks split's bounds with α-CROWN first; when they verify, no MILP is built.
    The spec ``Y_0 > t`` puts t between α-CROWN's bound of Y_0 and the bound after split refinement."""
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.verify import verify_instance

    sizes = (4, 6, 6, 3)
    onnx_path = testing.mlp_onnx(tmp_path / "m.onnx", sizes, 7)

    def run(method: str, t: float):
        lines = [f"(declare-const X_{i} Real)" for i in range(4)]
        lines += [f"(declare-const Y_{j} Real)" for j in range(3)]
        lines += [f"(assert (>= X_{i} -0.6))\n(assert (<= X_{i} 0.6))" for i in range(4)]
        (tmp_path / "p.vnnlib").write_text("\n".join(lines + [f"(assert (<= Y_0 {t!r}))"]) + "\n")
        args = ["--general.complete_verifier", "bab-refine", "--solver.alpha-crown.iteration", "2"]
        args += ["--attack.pgd_order", "skip", "--solver.mip.quick_bab_percentage", "0"]
        args += ["--general.verbose", "true", "--solver.mip.refine_method", method]
        said: list[str] = []
        cfg = load_config(None, args)[0]
        res = verify_instance(cfg, onnx_path, str(tmp_path / "p.vnnlib"), timeout=60, progress=said.append)
        return res, sum("refine node" in line for line in said)

    res, _ = run("split", 100.0)  # unreachable bound: sat after the refinement; read its bounds
    a, r = res.bounds["alpha_crown"][0] + 100.0, res.bounds["refined"][0] + 100.0
    assert r > a + 0.1  # the split refinement tightens the bound of Y_0
    t = (a + r) / 2
    split, n_split = run("split", t)
    both, n_both = run("split+milp", t)
    assert split.verdict == both.verdict == "unsat"
    assert min(both.bounds["alpha_crown"]) < 0 < min(both.bounds["refined"])
    assert n_both == n_split > 0  # only split's layers were refined: no MILP


def _y0_instance(tmp_path, gap: float) -> tuple[str, str, list[str]]:
    """The spec ``Y_0 <= t``, t = the exact minimum of Y_0 + gap, on a net where α-CROWN and a shallow
    split refinement leave it open; and the arguments of a pipeline without PGD or quick BaB."""
    sizes = (4, 6, 6, 3)
    onnx_path = testing.mlp_onnx(tmp_path / "m.onnx", sizes, 7)
    lo, hi = np.full(4, -0.6), np.full(4, 0.6)
    exact, _ = testing.exact_min_linear(testing.mlp(sizes, 7).double(), lo, hi, np.eye(3)[0])
    t = exact + gap
    lines = [f"(declare-const X_{i} Real)" for i in range(4)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(3)]
    lines += [f"(assert (>= X_{i} -0.6))\n(assert (<= X_{i} 0.6))" for i in range(4)]
    (tmp_path / "p.vnnlib").write_text("\n".join(lines + [f"(assert (<= Y_0 {t!r}))"]) + "\n")
    args = ["--solver.alpha-crown.iteration", "2"]
    args += ["--attack.pgd_order", "skip", "--solver.mip.quick_bab_percentage", "0"]
    args += ["--solver.mip.refine_method", "split", "--solver.mip.refine_split_depth", "1"]
    return onnx_path, str(tmp_path / "p.vnnlib"), args


@pytest.mark.parametrize("gap,mode", [(-0.01, "share"), (0.01, "share"), (-0.01, "mip")])
def test_output_milp_decides_what_the_refinement_leaves_open(tmp_path, gap, mode):
    """``solver.mip.output_milp_percentage`` (or ``complete_verifier: mip``): t just below (unsat) or
    just above (sat) the exact minimum of Y_0; the refinement leaves it open and the output MILP
    decides, with no BaB; a sat carries a counterexample checked on the network."""
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.verify import verify_instance

    onnx_path, vnnlib, args = _y0_instance(tmp_path, gap)
    if mode == "mip":
        args += ["--general.complete_verifier", "mip"]
    else:
        args += ["--general.complete_verifier", "bab-refine", "--solver.mip.output_milp_percentage", "0.5"]
    res = verify_instance(load_config(None, args)[0], onnx_path, vnnlib, timeout=60)
    assert res.verdict == ("unsat" if gap < 0 else "sat"), res
    assert max(res.bounds["refined"]) < 0 and "output_milp" in res.bounds
    assert res.bab.get("domains", 0) == 0
    if gap < 0:
        assert 0 < res.bounds["output_milp"][0] <= -gap + 1e-6
    else:
        assert res.counterexample is not None


@pytest.mark.parametrize("gap", [-0.01, 0.01])
def test_mip_mode_at_two_ranks_gives_the_verdict_of_one(tmp_path, gap):
    """``abcrown`` with ``complete_verifier: mip`` at P = 1 and P = 2 (FSDP, gloo): same verdict."""
    import json

    from complete_verifier_ext.cli import main

    onnx_path, vnnlib, args = _y0_instance(tmp_path, gap)
    args += ["--general.complete_verifier", "mip", "--model.onnx_path", onnx_path]
    args += ["--specification.vnnlib_path", vnnlib, "--bab.timeout", "60", "--quiet"]
    verdicts = []
    for extra in ([], ["--parallel.mode", "fsdp", "--parallel.world_size", "2"]):
        out, summary = tmp_path / "out.txt", tmp_path / "summary.json"
        code = main([*args, *extra, "--general.results_file", str(out), "--summary", str(summary)])
        data = json.loads(summary.read_text())
        assert code == 0 and "output_milp" in data["bounds"], data
        verdicts.append(out.read_text().split()[0])
    assert verdicts == ["unsat" if gap < 0 else "sat"] * 2


def test_output_milp_leaves_a_residual_network_to_bab(tmp_path, capsys):
    from complete_verifier_ext.config_load import load_config
    from complete_verifier_ext.verify import verify_instance

    n_in = int(np.prod(testing.RESIDUAL_INPUT_SHAPE))
    onnx_path = testing.residual_onnx(tmp_path / "r.onnx", seed=0)
    lo, hi = np.full(n_in, -0.05), np.full(n_in, 0.05)
    vnnlib = testing.write_vnnlib(tmp_path / "p.vnnlib", lo, hi, label=0, n_outputs=testing.RESIDUAL_OUTPUTS)
    args = ["--general.complete_verifier", "mip", "--solver.alpha-crown.iteration", "2"]
    args += ["--attack.pgd_order", "skip", "--solver.mip.quick_bab_percentage", "0"]
    args += ["--solver.mip.refine_split_depth", "2"]
    res = verify_instance(load_config(None, args)[0], onnx_path, vnnlib, timeout=60)
    if max(res.bounds.get("refined", [1.0])) <= 0:  # open after the refinement: the MILP was asked
        assert "output milp" in capsys.readouterr().err and "output_milp" not in res.bounds
    assert res.verdict in ("unsat", "sat", "unknown")
