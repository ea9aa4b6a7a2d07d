"""Sharded bound propagation on real gloo ranks equals one process, on every rank."""

from __future__ import annotations

import pytest
import torch

from complete_verifier_ext import testing
from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown, ibp, pre_activation_nodes
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch


def _problem(kind: str):
    """A small network, an input box and a spec matrix, identical on every rank."""
    if kind == "mlp":
        net, shape = testing.mlp([6, 20, 20, 20, 4], seed=3), (6,)
    else:
        net, shape = testing.cnn(seed=4), testing.CNN_INPUT_SHAPE
    graph = from_sequential(net, shape)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.rand(1, *shape, generator=gen)
    box = (x0 - 0.15, x0 + 0.15)
    n_out = graph.output_size
    C = torch.stack([torch.eye(n_out)[0] - torch.eye(n_out)[j] for j in range(1, n_out)])
    return graph, box, C


def _bounds(kind: str, mode: str) -> dict:
    graph, box, C = _problem(kind)
    if comm.world_size() > 1:
        graph.shard(mode)
    comm.reset_stats()
    lb_ibp, _ = ibp(graph, box, C)
    ibp_stats = comm.stats()
    comm.reset_stats()
    lb_crown, state = crown(graph, box, C)
    crown_stats = comm.stats()
    lb_alpha, _ = alpha_crown(graph, box, C, state, AlphaOptions(iteration=8, early_stop=False))
    return {
        "rank": comm.rank(),
        "ibp": lb_ibp,
        "crown": lb_crown,
        "alpha": lb_alpha,
        "inter": {k: state.bounds[k] for k in pre_activation_nodes(graph)},
        "ibp_stats": ibp_stats,
        "crown_stats": crown_stats,
        "n_linear": sum(type(n.op).__name__ in ("Linear", "Conv") for n in graph.nodes),
        "n_refined": len(state.rows),
    }


def _all_ranks(kind: str, mode: str) -> list[dict]:
    """Run on every rank and return every rank's result (gathered as objects to rank 0)."""
    res = _bounds(kind, mode)
    return [comm.broadcast_object(res, src=r) for r in range(comm.world_size())]


@pytest.mark.parametrize(
    "world,mode,kind",
    [(2, "fsdp", "mlp"), (3, "fsdp", "mlp"), (2, "tp", "mlp"), (3, "tp", "cnn"), (2, "fsdp", "cnn")],
)
def test_sharded_equals_single_on_every_rank(world, mode, kind):
    single = _bounds(kind, "none")
    per_rank = launch.run(_all_ranks, world, (kind, mode))
    assert len(per_rank) == world
    for res in per_rank:
        # IBP is column-parallel with the same rows: identical up to the matmul kernel.
        torch.testing.assert_close(res["ibp"], single["ibp"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["crown"], single["crown"], rtol=1e-6, atol=1e-6)
        for k, (lo, hi) in single["inter"].items():
            torch.testing.assert_close(res["inter"][k][0], lo, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(res["inter"][k][1], hi, rtol=1e-6, atol=1e-6)
        # α-CROWN sums gradients in another order across ranks: equal to optimiser round-off.
        torch.testing.assert_close(res["alpha"], single["alpha"], rtol=1e-4, atol=1e-5)
        assert (res["alpha"] >= res["crown"] - 1e-6).all()


def test_collective_counts_per_crown_pass():
    """FSDP CROWN: one all-gather per refined layer and for the output rows, one weight gather per
    Linear back-substitution step, one activation all-gather per Linear in the IBP sweep, and one
    all-reduce per pass (the ranks' vote on running out of memory)."""
    per_rank = launch.run(_all_ranks, 2, ("mlp", "fsdp"))
    res = per_rank[0]
    n_lin, n_ref = res["n_linear"], res["n_refined"]
    # IBP: one gather per Linear (mid and radius travel together), plus one weight gather for C @ W
    # of the last layer (the spec merged into it).
    assert res["ibp_stats"]["all_gather"]["calls"] == n_lin + 1
    # Refined layers: layer k (k = 2..n) back-substitutes through k Linear layers.
    steps = sum(range(2, n_ref + 2)) + n_lin
    expected = n_lin + n_ref + 1 + steps  # IBP sweep + row gathers + output gather + weight gathers
    assert res["crown_stats"]["all_gather"]["calls"] == expected
    # one out-of-memory vote per back-substitution pass (oom.lockstep_on_oom): refined layers, output
    assert res["crown_stats"]["all_reduce"]["calls"] == n_ref + 1
    assert "all_gather_sizes" not in res["crown_stats"]  # sizes are global knowledge
