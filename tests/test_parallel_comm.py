"""comm helpers on real gloo ranks (P = 2, 3; P = 4 in two process groups) and as no-ops at world size 1.

One spawned run per world size does every check and returns plain results; the tests assert on them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from complete_verifier_ext.parallel import comm, run


def _blocks(p: int) -> list[torch.Tensor]:
    """Rank q's block: q rows (rank 0's is empty) of 3 columns, values that identify rank and row."""
    return [torch.arange(q * 3, dtype=torch.float32).reshape(q, 3) + 100 * q for q in range(p)]


def _gather_checks(r: int, p: int) -> dict[str, Any]:
    blocks = _blocks(p)
    full = torch.cat(blocks, 0)  # (sum q, 3)
    sizes = [b.shape[0] for b in blocks]
    out: dict[str, Any] = {}
    comm.reset_stats()
    out["dim0_known_sizes"] = torch.equal(comm.all_gather_cat(blocks[r], 0, sizes=sizes), full)
    out["stats_known_sizes"] = comm.stats()
    comm.reset_stats()
    out["dim0_exchanged_sizes"] = torch.equal(comm.all_gather_cat(blocks[r]), full)
    out["stats_exchanged_sizes"] = comm.stats()
    out["dim1"] = torch.equal(comm.all_gather_cat(blocks[r].T, 1), full.T)
    out["dim_neg1"] = torch.equal(comm.all_gather_cat(blocks[r].T.unsqueeze(0), -1), full.T.unsqueeze(0))
    even = torch.full((2, 2), float(r))
    out["even"] = torch.equal(
        comm.all_gather_cat(even), torch.cat([torch.full((2, 2), float(q)) for q in range(p)])
    )
    comm.reset_stats()
    empty = comm.all_gather_cat(torch.empty(0, 4), 0, sizes=[0] * p)
    out["all_empty_shape"] = tuple(empty.shape)
    out["stats_all_empty"] = comm.stats()
    return out


def _losses_weights(p: int, n: int) -> torch.Tensor:
    """Each rank's loss weights over the gathered tensor: (P, n, 2)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(p, n, 2, generator=g)


def _gather_grad_checks(r: int, p: int) -> dict[str, Any]:
    """Rank r's loss = sum(w_r * gathered); grad of its block must be the total loss's grad."""
    sizes = [q + 1 for q in range(p)]
    n = sum(sizes)
    g = torch.Generator().manual_seed(3)
    full_ref = torch.randn(n, 2, generator=g).requires_grad_(True)
    w = _losses_weights(p, n)
    (w * full_ref).sum().backward()  # reference: the sum over ranks of every rank's loss
    start = sum(sizes[:r])
    block = full_ref.detach()[start : start + sizes[r]].clone().requires_grad_(True)
    comm.reset_stats()
    gathered = comm.all_gather_cat_grad(block, 0, sizes=sizes)
    (w[r] * gathered).sum().backward()
    return {
        "forward": torch.equal(gathered.detach(), full_ref.detach()),
        "grad_err": (block.grad - full_ref.grad[start : start + sizes[r]]).abs().max().item(),
        "stats": comm.stats(),
    }


def _scatter_grad_case(r: int, p: int, n: int) -> dict[str, Any]:
    """``all_gather_cat_grad`` along dim 1 of (2, n_r, 3) blocks, ``shard_sizes(n)`` rows each: its
    reduce-scatter backward against the all-reduce-and-narrow it replaces and against one process."""
    sizes, (start, end) = comm.shard_sizes(n), comm.shard_range(n)
    g = torch.Generator().manual_seed(11)
    full, w = torch.randn(2, n, 3, generator=g), torch.randn(p, 2, n, 3, generator=g)
    block = full[:, start:end].clone().requires_grad_(True)
    comm.reset_stats()
    gathered = comm.all_gather_cat_grad(block, 1, sizes=sizes)
    (w[r] * gathered.square()).sum().backward()
    stats = comm.stats()
    local = full.clone().requires_grad_(True)  # the rank's gradient of the whole gathered tensor
    (w[r] * local.square()).sum().backward()
    old = comm.all_reduce(local.grad).narrow(1, start, end - start)  # the old backward, by hand
    terms = comm.all_reduce(local.grad.abs()).narrow(1, start, end - start)  # sum of |every rank's term|
    one = full.clone().requires_grad_(True)  # one process: the sum of every rank's loss
    sum((w[q] * one.square()).sum() for q in range(p)).backward()
    return {
        "sizes": sizes,
        "bitwise_old": torch.equal(block.grad, old),
        "rounding": ((block.grad - old).abs() / terms.clamp_min(1e-30)).max().item(),
        "one_err": (block.grad - one.grad[:, start:end]).abs().max().item(),
        "stats": stats,
    }


def _scatter_grad_checks(r: int, p: int) -> list[dict[str, Any]]:
    """Uneven (5 rows) and even (6 rows) blocks; every rank's results."""
    return comm.all_gather_object({n: _scatter_grad_case(r, p, n) for n in (5, 6)})


def _misc_checks(r: int, p: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": r, "world": p, "range": comm.shard_range(10)}
    t = torch.tensor([float(r), -float(r)])
    out["sum"] = comm.all_reduce(t).tolist()
    out["max"] = comm.all_reduce(t, "max").tolist()
    out["min"] = comm.all_reduce(t, "min").tolist()
    out["input_untouched"] = t.tolist() == [float(r), -float(r)]
    out["or"] = comm.all_reduce_flag(r == p - 1, "or")
    out["and"] = comm.all_reduce_flag(r == p - 1, "and")
    out["and_all"] = comm.all_reduce_flag(True, "and")
    out["bcast"] = comm.broadcast(torch.full((2,), float(r + 5)), src=1).tolist()
    out["bcast_obj"] = comm.broadcast_object({"from": r} if r == 0 else None)
    mine = torch.arange(r + 1, dtype=torch.float32)  # sizes differ per rank
    prev = (r - 1) % p
    out["ring_shape_exchanged"] = comm.ring_pass(mine).tolist()
    out["ring_shape_known"] = comm.ring_pass(mine, recv_shape=(prev + 1,)).tolist()
    out["ring_expected"] = list(range(prev + 1))
    comm.reset_stats()
    comm.ring_pass(mine, recv_shape=(prev + 1,))
    comm.barrier()
    out["stats_ring_barrier"] = comm.stats()
    return out


def _large_gather_checks(r: int, p: int) -> dict[str, Any]:
    """Blocks of 1 MiB and more go round the ring straight into the result on gloo: uneven ones through
    ``all_gather_cat``, equal ones into a caller's buffer (``all_gather_into``)."""
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(3 * 300 + 3, 1024, generator=gen)  # rows 300 + q for rank q: over 1 MiB each
    sizes = [300 + q for q in range(p)]
    start = sum(sizes[:r])
    mine = full[start : start + sizes[r]]
    comm.reset_stats()
    cat = comm.all_gather_cat(mine, 0, sizes=sizes)
    buf = torch.empty(p * 300 * 1024)
    comm.all_gather_into(buf, full[r * 300 : (r + 1) * 300])
    return {
        "uneven": torch.equal(cat, full[: sum(sizes)]),
        "into": torch.equal(buf.view(-1, 1024), full[: p * 300]),
        "counts": {k: v["calls"] for k, v in comm.stats().items()},
    }


def _all_checks() -> dict[str, Any]:
    torch.set_num_threads(1)
    r, p = comm.rank(), comm.world_size()
    return {
        "large": _large_gather_checks(r, p),
        "gather": _gather_checks(r, p),
        "grad": _gather_grad_checks(r, p),
        "scatter": _scatter_grad_checks(r, p),
        "misc": _misc_checks(r, p),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def results(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Rank 0's results of one spawned run at P = 2 or 3."""
    return {"P": request.param, **run(_all_checks, request.param, timeout_s=30)}


def test_large_blocks_gathered_round_the_ring_are_exact(results: dict[str, Any]) -> None:
    assert results["large"] == {"uneven": True, "into": True, "counts": {"all_gather": 2}}


def test_all_gather_cat_uneven_and_empty_blocks(results: dict[str, Any]) -> None:
    g = results["gather"]
    for key in ("dim0_known_sizes", "dim0_exchanged_sizes", "dim1", "dim_neg1", "even"):
        assert g[key], key
    assert g["all_empty_shape"] == (0, 4)


def test_all_gather_cat_collective_counts(results: dict[str, Any]) -> None:
    g = results["gather"]
    assert g["stats_known_sizes"].keys() == {"all_gather"}
    assert g["stats_known_sizes"]["all_gather"]["calls"] == 1
    largest = (results["P"] - 1) * 3 * 4  # the largest block, in bytes (every block is padded to it)
    assert g["stats_known_sizes"]["all_gather"]["bytes"] == largest
    assert {k: v["calls"] for k, v in g["stats_exchanged_sizes"].items()} == {
        "all_gather_sizes": 1,
        "all_gather": 1,
    }
    assert g["stats_all_empty"] == {}


def test_all_gather_cat_grad_matches_single_process(results: dict[str, Any]) -> None:
    g = results["grad"]
    assert g["forward"]
    assert g["grad_err"] <= 1e-6
    assert {k: v["calls"] for k, v in g["stats"].items()} == {"all_gather": 1, "reduce_scatter": 1}


def test_all_gather_cat_grad_backward_is_a_reduce_scatter(results: dict[str, Any]) -> None:
    """The gradient is the old all-reduce-and-narrow's, uneven blocks included: bitwise at P = 2, and at
    P = 3 up to the order in which gloo adds the three ranks' terms (which differs between the two
    collectives, and for the all-reduce with the element's place in the flat buffer): each order is within
    (P - 1) u sum|terms| of the exact sum, so the two differ by at most (P - 1) eps sum|terms|. One
    reduce-scatter of the full gradient, padded to the largest block, is the backward's only collective."""
    p, eps = results["P"], torch.finfo(torch.float32).eps
    for rank_results in results["scatter"]:
        for n, case in rank_results.items():
            assert case["bitwise_old"] or p > 2, (p, n)
            assert case["rounding"] <= (p - 1) * eps, (p, n)
            assert case["one_err"] <= 1e-5, (p, n)
            padded = p * max(case["sizes"]) * 2 * 3 * 4  # (P * largest block, 2, 3) float32
            assert case["stats"]["reduce_scatter"] == {"calls": 1, "bytes": padded}
            assert case["stats"].keys() == {"all_gather", "reduce_scatter"}
    assert [c["sizes"] for c in results["scatter"][0].values()] == [
        [(q + 1) * n // p - q * n // p for q in range(p)] for n in (5, 6)
    ]


def test_reductions_broadcast_ring(results: dict[str, Any]) -> None:
    m, p = results["misc"], results["P"]
    assert (m["rank"], m["world"]) == (0, p)
    assert m["range"] == (0, 10 // p)
    total = sum(range(p))
    assert m["sum"] == [total, -total]
    assert m["max"] == [p - 1, 0]
    assert m["min"] == [0, -(p - 1)]
    assert m["input_untouched"]
    assert (m["or"], m["and"], m["and_all"]) == (True, False, True)
    assert m["bcast"] == [6.0, 6.0]
    assert m["bcast_obj"] == {"from": 0}
    assert m["ring_shape_exchanged"] == m["ring_expected"] == m["ring_shape_known"]
    counts = {k: v["calls"] for k, v in m["stats_ring_barrier"].items()}
    assert counts == {"ring_pass": 1, "barrier": 1}


def test_world_size_one_is_identity() -> None:
    comm.reset_stats()
    t = torch.randn(3, 2)
    assert (comm.rank(), comm.world_size()) == (0, 1)
    assert comm.shard_range(7) == (0, 7)
    assert comm.all_gather_cat(t, 1) is t
    assert comm.all_gather_cat_grad(t) is t
    assert comm.all_reduce(t, "max") is t
    assert comm.all_reduce_flag(True, "and") is True
    assert comm.broadcast(t) is t
    assert comm.broadcast_object([1]) == [1]
    assert comm.ring_pass(t) is t
    comm.barrier()
    assert comm.stats() == {}


def test_shard_range_covers_rows_in_order() -> None:
    for n in (0, 1, 5, 7, 12):
        for p in (1, 2, 3, 5):
            ranges = [comm.shard_range(n, q, p) for q in range(p)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert comm.shard_sizes(n, p) == [e - s for s, e in ranges]


# --------------------------------------------------------------------------------------------------
# Process groups: P = 4 split into {0, 1} and {2, 3}
# --------------------------------------------------------------------------------------------------


def _group_grad(group: Any, r: int) -> dict[str, Any]:
    """``all_gather_cat_grad`` inside a group of 2 with blocks of 1 and 2 rows: rank r's loss is
    ``sum(w_r * gathered)``; its block's gradient must be the sum of its group's weights only."""
    sizes, me = [1, 2], comm.rank(group)
    w = _losses_weights(4, 3)  # (4, 3, 2): every world rank's weights
    mates = [q for q in range(4) if q // 2 == r // 2]
    start = sum(sizes[:me])
    block = torch.full((sizes[me], 2), float(r)).requires_grad_(True)
    gathered = comm.all_gather_cat_grad(block, 0, sizes=sizes, group=group)
    (w[r] * gathered).sum().backward()
    expected = sum(w[q] for q in mates)[start : start + sizes[me]]
    return {"grad_err": (block.grad - expected).abs().max().item()}


def _group_collectives(group: Any, r: int) -> dict[str, Any]:
    """Every kind of collective inside ``group`` and over the world, with their counts."""
    comm.reset_stats()
    out: dict[str, Any] = {
        "gather": comm.all_gather_cat(torch.full((r % 2 + 1, 1), float(r)), group=group).flatten().tolist(),
        "sum": comm.all_reduce(torch.tensor([float(r)]), group=group).item(),
        "flag": comm.all_reduce_flag(r == 1, group=group),
        "bcast": comm.broadcast(torch.tensor([float(r)]), src=1, group=group).item(),
        "bcast_obj": comm.broadcast_object(r if comm.rank(group) == 0 else None, group=group),
        "objects": comm.all_gather_object(r, group=group),
        "ring": comm.ring_pass(torch.arange(r + 1.0), group=group).tolist(),
    }
    comm.barrier(group=group)
    out["stats"] = {k: v["calls"] for k, v in comm.stats().items()}
    comm.reset_stats()
    out["world_gather"] = comm.all_gather_cat(torch.tensor([float(r)])).tolist()
    out["world_sum"] = comm.all_reduce(torch.tensor([float(r)])).item()
    out["world_stats"] = {k: v["calls"] for k, v in comm.stats().items()}
    return out


def _group_checks() -> list[dict[str, Any]]:
    """Rank r's view of the pair group {2 (r // 2), 2 (r // 2) + 1} and of its own one-rank group;
    every rank's results (rank 0 returns them all)."""
    torch.set_num_threads(1)
    r = comm.rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    singles = [dist.new_group([q]) for q in range(4)]
    group, alone = pairs[r // 2], singles[r]
    out: dict[str, Any] = {
        "rank": r,
        "world": comm.world_size(),
        "group": (comm.rank(group), comm.world_size(group)),
    }
    out["range"], out["sizes"] = comm.shard_range(5, group=group), comm.shard_sizes(5, group=group)
    out.update(_group_collectives(group, r))
    out.update(_group_grad(group, r))
    comm.reset_stats()
    t = torch.ones(2)
    out["alone_identity"] = comm.all_reduce(t, group=alone) is t and comm.all_gather_cat(t, group=alone) is t
    out["alone_stats"] = comm.stats()
    return comm.all_gather_object(out)


@pytest.fixture(scope="module")
def group_results() -> list[dict[str, Any]]:
    """Every rank's results of one spawned run at P = 4 (two groups of 2)."""
    return run(_group_checks, 4, timeout_s=60)


def test_group_rank_size_and_shards(group_results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(group_results):
        assert (res["rank"], res["world"], res["group"]) == (r, 4, (r % 2, 2))
        assert res["range"] == [(0, 2), (2, 5)][r % 2]
        assert res["sizes"] == [2, 3]


def test_group_collectives_see_only_the_group(group_results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(group_results):
        a, b = 2 * (r // 2), 2 * (r // 2) + 1  # the group's world ranks
        assert res["gather"] == [float(a), float(b), float(b)]
        assert res["sum"] == float(a + b)
        assert res["flag"] is (r // 2 == 0)
        assert res["bcast"] == float(b)  # src=1 is the group's rank 1
        assert res["bcast_obj"] == a
        assert res["objects"] == [a, b]
        assert res["ring"] == [float(v) for v in range([b, a][r % 2] + 1)]
        assert res["grad_err"] <= 1e-6


def test_group_default_still_sees_the_world(group_results: list[dict[str, Any]]) -> None:
    for res in group_results:
        assert res["world_gather"] == [0.0, 1.0, 2.0, 3.0]
        assert res["world_sum"] == 6.0
        assert res["world_stats"] == {"all_gather_sizes": 1, "all_gather": 1, "all_reduce": 1}


def test_group_collective_counts(group_results: list[dict[str, Any]]) -> None:
    for res in group_results:
        assert res["stats"] == {
            "all_gather_sizes": 1,
            "all_gather": 1,
            "all_reduce": 1,
            "all_reduce_flag": 1,
            "broadcast": 1,
            "broadcast_object": 1,
            "all_gather_object": 1,
            "ring_pass_shape": 1,
            "ring_pass": 1,
            "barrier": 1,
        }
        assert res["alone_identity"]
        assert res["alone_stats"] == {}
