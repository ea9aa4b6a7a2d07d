"""Refinement of intermediate bounds by splitting earlier neurons (``solver.mip.refine_method: split``).

Ground truth: ``testing.exact_min_linear`` on the network cut after a pre-activation layer gives each
neuron's exact range over the box; sampling checks graphs it cannot enumerate (a residual network).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from support import exact_ranges

from complete_verifier_ext import testing
from complete_verifier_ext.bounds import split_refine
from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown, pre_activation_nodes
from complete_verifier_ext.model.onnx_loader import load_model
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch


def _mlp_case(seed: int, sizes=(3, 6, 6, 6, 2), width: float = 1.0, mode: str = "none"):
    net = testing.mlp(sizes, seed)
    graph = from_sequential(net, (sizes[0],)).shard(mode)
    centre = np.random.default_rng(seed).uniform(-1, 1, sizes[0])
    lo, hi = centre - width, centre + width
    box = (torch.tensor(lo, dtype=torch.float32)[None], torch.tensor(hi, dtype=torch.float32)[None])
    _, state = crown(graph, box, torch.eye(sizes[-1])[:1] - torch.eye(sizes[-1])[1:2])
    return net, graph, box, state, lo, hi


def _refine(graph, box, state, depth=6, iteration=20, deadline=60.0, **kw):
    pre = pre_activation_nodes(graph)
    opts = split_refine.SplitOptions(depth=depth, iteration=iteration, max_domains=512, **kw)
    bounds = {k: state.bounds[k] for k in pre}
    return split_refine.refine_bounds(graph, box, bounds, opts, time.monotonic() + deadline)


@pytest.mark.parametrize("seed,passes", [(0, 1), (1, 1), (0, 2)])
def test_refined_bounds_lie_between_the_exact_ranges_and_crown(seed, passes):
    net, graph, box, state, lo, hi = _mlp_case(seed)
    refined, stats = _refine(graph, box, state, depth=4, passes=passes)
    pre = pre_activation_nodes(graph)
    assert stats["layers"] == passes * (len(pre) - 1)  # the first layer is exact by IBP
    assert stats["passes"] == passes
    exact, gained = exact_ranges((3, 6, 6, 6, 2), seed, lo, hi), 0.0
    for i, k in enumerate(pre):
        for j in range(len(exact[i][0])):
            exact_lo, exact_hi = exact[i][0][j], exact[i][1][j]
            r_lo, r_hi = float(refined[k][0][0, j]), float(refined[k][1][0, j])
            tol = 1e-5 * (1 + abs(exact_lo) + abs(exact_hi))
            assert r_lo <= exact_lo + tol and r_hi >= exact_hi - tol  # sound
            c_lo, c_hi = float(state.bounds[k][0][0, j]), float(state.bounds[k][1][0, j])
            assert r_lo >= c_lo and r_hi <= c_hi  # never looser
            gained += (r_lo - c_lo) + (c_hi - r_hi)
    assert gained > 0.1  # CROWN was not exact: the splits did something


def test_splitting_every_earlier_neuron_is_exact_on_the_second_layer():
    """With one ReLU layer before it and every unstable neuron of that layer split, each pattern is a
    polytope on which the neuron is linear; optimal β makes the bound the exact minimum over it (and
    drives the bound of an empty pattern up without limit), so a long optimisation is nearly exact."""
    net, graph, box, state, lo, hi = _mlp_case(4, sizes=(2, 5, 4, 2), width=1.0)
    refined, _ = _refine(graph, box, state, depth=5, iteration=400, lr_beta=0.5, lr_decay=1.0)
    k = pre_activation_nodes(graph)[1]
    net64 = net.double()
    for j in range(4):
        e = np.eye(4)[j]
        exact_lo = testing.exact_min_linear(net64[:3], lo, hi, e)[0]
        exact_hi = -testing.exact_min_linear(net64[:3], lo, hi, -e)[0]
        assert float(refined[k][0][0, j]) == pytest.approx(exact_lo, abs=1e-2 * (1 + abs(exact_lo)))
        assert float(refined[k][1][0, j]) == pytest.approx(exact_hi, abs=1e-2 * (1 + abs(exact_hi)))


def test_a_residual_network_is_refined_soundly(tmp_path):
    graph = load_model(testing.residual_onnx(tmp_path / "res.onnx", seed=0))
    shape = graph.input_shape
    rng = np.random.default_rng(0)
    centre = rng.uniform(0, 1, shape).astype(np.float32)
    box = (torch.tensor(centre - 0.05)[None], torch.tensor(centre + 0.05)[None])
    C = torch.eye(graph.output_size)[:1] - torch.eye(graph.output_size)[1:2]
    _, state = crown(graph, box, C)
    _, state = alpha_crown(graph, box, C, state, AlphaOptions(iteration=5))
    refined, stats = _refine(graph, box, state, depth=3, iteration=5)
    assert stats["layers"] >= 1
    x = box[0] + (box[1] - box[0]) * torch.rand(2000, *shape)
    for k in pre_activation_nodes(graph):
        lo, hi = refined[k]
        with torch.no_grad():
            z = graph.forward(x, upto=k)
        assert (z >= lo - 1e-5).all() and (z <= hi + 1e-5).all()
        assert (lo >= state.bounds[k][0]).all() and (hi <= state.bounds[k][1]).all()


def test_a_second_pass_is_never_looser_and_stops_at_the_deadline():
    net, graph, box, state, lo, hi = _mlp_case(4)
    one, _ = _refine(graph, box, state, depth=2)
    two, stats = _refine(graph, box, state, depth=2, passes=2)
    assert stats["passes"] == 2
    tighter = 0.0
    for k in pre_activation_nodes(graph):
        assert (two[k][0] >= one[k][0] - 1e-6).all() and (two[k][1] <= one[k][1] + 1e-6).all()
        tighter += float((two[k][0] - one[k][0]).sum() + (one[k][1] - two[k][1]).sum())
    assert tighter > 0
    _, stats = _refine(graph, box, state, depth=2, passes=8, deadline=1e-9)  # no time: no second pass
    assert stats["passes"] == 1


def test_refine_layers_limits_the_layers():
    net, graph, box, state, lo, hi = _mlp_case(2)
    refined, stats = _refine(graph, box, state, layers=1)
    last = pre_activation_nodes(graph)[-1]
    assert stats["layers"] == 1
    assert torch.equal(refined[last][0], state.bounds[last][0])


def test_an_expired_deadline_changes_nothing():
    net, graph, box, state, lo, hi = _mlp_case(2)
    refined, stats = _refine(graph, box, state, deadline=-1.0)
    assert stats["layers"] == 0
    for k in pre_activation_nodes(graph):
        assert torch.equal(refined[k][0], state.bounds[k][0]) and torch.equal(
            refined[k][1], state.bounds[k][1]
        )


def _ranks_worker(mode: str):
    net, graph, box, state, lo, hi = _mlp_case(3, mode=mode)
    with graph.replicated():
        refined, stats = _refine(graph, box, state)
    return {k: (v[0].tolist(), v[1].tolist()) for k, v in refined.items()}, stats["solves"], comm.rank()


def test_two_ranks_share_the_targets_and_agree_with_one():
    one = _ranks_worker("none")
    two = launch.run(_ranks_worker, 2, ("fsdp",), backend="gloo")
    assert two[0].keys() == one[0].keys()
    for k in one[0]:
        for a, b in zip(one[0][k], two[0][k], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    assert 0 < two[1] < one[1]  # rank 0 bounded only its share of the targets
