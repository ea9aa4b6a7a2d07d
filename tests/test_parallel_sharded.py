"""ShardedWeight on real gloo ranks (P = 2, 3): values, gradients, collective counts, no full weight saved.

Every rank builds the same full weights and inputs from fixed seeds, so it can compare its sharded
results with the plain torch ops in the same process. One spawned run per world size.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from complete_verifier_ext.parallel import ShardedWeight, comm, run

LINEAR_SHAPES = [(7, 5), (2, 6)]  # out uneven over P = 2, 3; out < P = 3 gives an empty shard
CONV_SHAPE = (5, 3, 3, 3)
CONV_SHAPES = [CONV_SHAPE, (2, 3, 3, 3)]  # the second has an empty shard at P = 3
CONV_GEOMETRIES = [
    {"stride": 1, "padding": 0, "dilation": 1, "output_padding": 0},
    {"stride": 2, "padding": 1, "dilation": 1, "output_padding": 1},
    {"stride": 1, "padding": 2, "dilation": 2, "output_padding": 0},
]
SPEC_ROWS = 5  # rows of the A matrices, sharded over ranks like CROWN's spec rows


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _counts(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    return {name: entry["calls"] for name, entry in stats.items()}


def _compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    return {"bitwise": torch.equal(got, ref), "rel_err": _rel_err(got, ref)}


# ----------------------------------------------------------------------------------------------------------
# Per-rank checks
# ----------------------------------------------------------------------------------------------------------


def _plain_transposed(op: str, a: torch.Tensor, W: torch.Tensor, geometry: dict[str, Any]) -> torch.Tensor:
    """The unsharded op: ``a @ W`` or ``conv_transpose2d(a, W)``."""
    return a @ W if op == "linear_t" else F.conv_transpose2d(a, W, None, **geometry)


def _transposed_checks(
    sw: ShardedWeight, W: torch.Tensor, A: torch.Tensor, op: str, **geometry: Any
) -> dict[str, Any]:
    """``op`` (linear_t / conv_transpose2d) on this rank's rows of A: value, gradient, counts."""
    start, end = comm.shard_range(A.shape[0])
    a_ref = A[start:end].clone().requires_grad_(True)
    ref = _plain_transposed(op, a_ref, W, geometry)
    upstream = _randn(*ref.shape, seed=100 + comm.rank())
    (ref * upstream).sum().backward()
    a = A[start:end].clone().requires_grad_(True)
    comm.reset_stats()
    out = getattr(sw, op)(a, **geometry)
    fwd_counts = _counts(comm.stats())
    comm.reset_stats()
    (out * upstream).sum().backward()
    return {
        "value": _compare(out.detach(), ref.detach()),
        "grad": _compare(a.grad, a_ref.grad),
        "fwd_counts": fwd_counts,
        "bwd_counts": _counts(comm.stats()),
    }


def _forward_checks(sw: ShardedWeight, W: torch.Tensor, x: torch.Tensor, op: str) -> dict[str, Any]:
    """Column-parallel forward: value, and the SUM over ranks of x.grad vs the total loss's gradient."""
    plain = (lambda v: F.linear(v, W)) if op == "linear" else (lambda v: F.conv2d(v, W, padding=1))
    call = (lambda v: sw.linear(v)) if op == "linear" else (lambda v: sw.conv2d(v, padding=1))
    x_ref = x.clone().requires_grad_(True)
    ref = plain(x_ref)
    weights = [_randn(*ref.shape, seed=200 + q) for q in range(comm.world_size())]
    sum((ref * w).sum() for w in weights).backward()  # the objective: sum of every rank's loss
    xs = x.clone().requires_grad_(True)
    comm.reset_stats()
    y = call(xs)
    fwd_counts = _counts(comm.stats())
    comm.reset_stats()
    (y * weights[comm.rank()]).sum().backward()
    bwd_counts = _counts(comm.stats())
    return {
        "value": _compare(y.detach(), ref.detach()),
        "grad_sum": _compare(comm.all_reduce(xs.grad), x_ref.grad),
        "fwd_counts": fwd_counts,
        "bwd_counts": bwd_counts,
    }


def _weight_checks(mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in LINEAR_SHAPES:
        W = _randn(*shape, seed=1)
        sw = ShardedWeight(W, mode)
        A = _randn(SPEC_ROWS, 2, shape[0], seed=2)  # (spec, batch, out)
        out[f"linear{shape}"] = {
            "gathered": torch.equal(sw.gathered(), W),
            "clone": sw.local.untyped_storage().data_ptr() != W.untyped_storage().data_ptr(),
            "no_grad": not sw.local.requires_grad,
            "abs": torch.equal(sw.apply_elementwise(torch.abs).gathered(), W.abs()),
            "forward": _forward_checks(sw, W, _randn(3, shape[1], seed=3), "linear"),
            "transposed": _transposed_checks(sw, W, A, "linear_t"),
        }
    for shape in CONV_SHAPES:
        W = _randn(*shape, seed=4)
        sw = ShardedWeight(W, mode)
        conv: dict[str, Any] = {"gathered": torch.equal(sw.gathered(), W)}
        conv["forward"] = _forward_checks(sw, W, _randn(2, shape[1], 6, 6, seed=5), "conv2d")
        for i, geometry in enumerate(CONV_GEOMETRIES):
            A = _randn(SPEC_ROWS, shape[0], 4, 4, seed=6 + i)  # (spec*batch, out, H', W')
            conv[f"transposed{i}"] = _transposed_checks(sw, W, A, "conv_transpose2d", **geometry)
        out[f"conv{shape}"] = conv
    return out


def _buffer_checks() -> dict[str, Any]:
    """Two fsdp layers gather into the same buffer; the second gather overwrites the first view."""
    w1, w2 = _randn(8, 4, seed=10), _randn(6, 4, seed=11)
    s1, s2 = ShardedWeight(w1, "fsdp"), ShardedWeight(w2, "fsdp")
    g1 = s1.gathered()
    first_ok = torch.equal(g1, w1)
    g2 = s2.gathered()
    return {
        "first_ok": first_ok,
        "same_ptr": g1.data_ptr() == g2.data_ptr(),
        "second_ok": torch.equal(g2, w2),
    }


def _owner_checks() -> dict[str, Any]:
    """tp: the foreign shards of a transposed product come from their owners into one buffer (one foreign
    shard here at a time), each the right rows; ``rows_of`` picks any rows, bitwise, in both modes."""
    W = _randn(7, 5, seed=12)  # 7 rows: unequal shards at P = 2 and 3
    sw = ShardedWeight(W, "tp")
    seen = [(q, shard.clone(), shard.data_ptr()) for q, shard in sw._from_owners()]
    foreign = {ptr for q, _, ptr in seen if q != comm.rank()}
    idx = torch.tensor([6, 0, 3, 3, 1])
    return {
        "order": [q for q, _, _ in seen] == [(comm.rank() - k) % comm.world_size() for k in range(len(seen))],
        "shards": all(torch.equal(s, W[sw._range(q)[0] : sw._range(q)[1]]) for q, s, _ in seen),
        "one_buffer": len(foreign) == 1,
        "rows_of": {
            mode: torch.equal(ShardedWeight(W, mode).rows_of(idx), W[idx]) for mode in ("fsdp", "tp")
        },
    }


def _saved_shapes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Size]]:
    """Run ``fn`` recording the shape of every tensor autograd saves for backward."""
    shapes: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _full_shape_tensors(shape: torch.Size) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.shape == shape)


def _no_full_weight_checks(mode: str) -> dict[str, Any]:
    """After linear_t / conv_transpose2d under autograd, no full-size weight is saved or alive."""
    lin_shape, conv_shape = torch.Size((9, 11)), torch.Size((7, 3, 3, 3))
    lin = ShardedWeight(_randn(*lin_shape, seed=12), mode)  # the full tensors die here
    conv = ShardedWeight(_randn(*conv_shape, seed=13), mode)
    a_lin = _randn(4, 9, seed=14).requires_grad_(True)
    a_conv = _randn(2, 7, 4, 4, seed=15).requires_grad_(True)
    out_lin, saved_lin = _saved_shapes(lambda: lin.linear_t(a_lin).relu())
    out_conv, saved_conv = _saved_shapes(lambda: conv.conv_transpose2d(a_conv, stride=2).relu())
    alive = {"lin": _full_shape_tensors(lin_shape), "conv": _full_shape_tensors(conv_shape)}
    _, saved_naive = _saved_shapes(lambda: a_lin @ lin.gathered())  # the detector catches the naive way
    (out_lin.sum() + out_conv.sum()).backward()
    return {
        "saved_full": lin_shape in saved_lin or conv_shape in saved_conv,
        "alive_full": alive,
        "naive_detected": lin_shape in saved_naive,
    }


def _none_mode_checks() -> dict[str, Any]:
    """Mode "none" at P > 1: the full weight, plain ops, no collectives."""
    W = _randn(7, 5, seed=1)
    sw = ShardedWeight(W, "none")
    A = _randn(3, 7, seed=2)
    comm.reset_stats()
    same = torch.equal(sw.linear_t(A), A @ W) and torch.equal(sw.linear(A @ W), F.linear(A @ W, W))
    return {"same": same, "rows": sw.rows, "counts": comm.stats()}


def _all_checks() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "fsdp": _weight_checks("fsdp"),
        "tp": _weight_checks("tp"),
        "buffer": _buffer_checks(),
        "owners": _owner_checks(),
        "no_full": {mode: _no_full_weight_checks(mode) for mode in ("fsdp", "tp")},
        "none": _none_mode_checks(),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def results(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Rank 0's results of one spawned run at P = 2 or 3 (every rank asserts nothing itself)."""
    return {"P": request.param, **run(_all_checks, request.param, timeout_s=30)}


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_gathered_is_bitwise_the_original(results: dict[str, Any], mode: str) -> None:
    for name, layer in results[mode].items():
        assert layer["gathered"], name
    for shape in LINEAR_SHAPES:
        layer = results[mode][f"linear{shape}"]
        assert layer["clone"] and layer["no_grad"] and layer["abs"]


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_column_parallel_forward_and_input_gradient(results: dict[str, Any], mode: str) -> None:
    for name, layer in results[mode].items():
        fwd = layer["forward"]
        assert fwd["value"]["rel_err"] <= 1e-6, name
        assert fwd["grad_sum"]["rel_err"] <= 1e-6, name
        assert fwd["fwd_counts"] == {"all_gather": 1}, name
        assert fwd["bwd_counts"] == {"reduce_scatter": 1}, name


def test_fsdp_transposed_products_are_bitwise(results: dict[str, Any]) -> None:
    for name, layer in results["fsdp"].items():
        for key, res in layer.items():
            if key.startswith("transposed"):
                assert res["value"]["bitwise"], (name, key)
                assert res["grad"]["bitwise"], (name, key)  # the same kernel on the same full W
                assert res["fwd_counts"] == {"all_gather": 1}, (name, key)
                assert res["bwd_counts"] == {"all_gather": 1}, (name, key)


def test_tp_transposed_products_match(results: dict[str, Any]) -> None:
    ring = {"shard_pass": results["P"] - 1}
    for name, layer in results["tp"].items():
        for key, res in layer.items():
            if key.startswith("transposed"):
                assert res["value"]["rel_err"] <= 1e-6, (name, key)
                assert res["grad"]["rel_err"] <= 1e-6, (name, key)
                assert res["fwd_counts"] == ring, (name, key)
                assert res["bwd_counts"] == ring, (name, key)


def test_gather_buffer_is_reused(results: dict[str, Any]) -> None:
    assert results["buffer"] == {"first_ok": True, "same_ptr": True, "second_ok": True}


def test_tp_takes_foreign_shards_from_their_owners_one_at_a_time(results: dict[str, Any]) -> None:
    assert results["owners"] == {
        "order": True,
        "shards": True,
        "one_buffer": True,
        "rows_of": {"fsdp": True, "tp": True},
    }


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_no_full_weight_saved_or_alive(results: dict[str, Any], mode: str) -> None:
    res = results["no_full"][mode]
    assert res["naive_detected"]
    assert not res["saved_full"]
    assert res["alive_full"] == {"lin": 0, "conv": 0}


def test_none_mode_is_plain_and_silent(results: dict[str, Any]) -> None:
    res = results["none"]
    assert res["same"] and res["rows"] == (0, 7) and res["counts"] == {}


@pytest.mark.parametrize("mode", ["none", "fsdp", "tp"])
def test_world_size_one_equals_plain_ops(mode: str) -> None:
    W, A, x = _randn(7, 5, seed=1), _randn(3, 2, 7, seed=2), _randn(4, 5, seed=3)
    sw = ShardedWeight(W, mode)
    assert sw.rows == (0, 7) and torch.equal(sw.gathered(), W)
    assert torch.equal(sw.linear_t(A), A @ W)
    assert torch.equal(sw.linear(x), F.linear(x, W))
    Wc, Ac = _randn(*CONV_SHAPE, seed=4), _randn(2, 5, 4, 4, seed=5)
    swc = ShardedWeight(Wc, mode)
    assert torch.equal(swc.conv_transpose2d(Ac, stride=2), F.conv_transpose2d(Ac, Wc, stride=2))
