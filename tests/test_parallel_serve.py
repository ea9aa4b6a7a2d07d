"""Weights on demand with the ranks out of lockstep (``parallel.serve``), on real gloo ranks (P = 3).

Inside ``serve.serving()`` each rank runs a different number of products on batches of its own
size (rank 0 none at all, as a BaB rank with no domain), with gradients; every result must equal the
plain op on the whole weight, and every rank must leave together. A rank that raises inside keeps
serving the others; a lockstep collective called inside raises instead of pairing up with a tick.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from complete_verifier_ext.parallel import ShardedWeight, comm, run, serve


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _one_product(mode: str, name: str, sw, W: torch.Tensor, i: int, errs: dict[str, float]) -> bool:
    """One weight's products while serving (``i``: the round): the transposed product with its gradient,
    the column-parallel forward and, for a matrix, the row sum, each against the whole weight's;
    returns whether fsdp's are bit for bit."""

    def note(key: str, got: torch.Tensor, want: torch.Tensor) -> None:
        errs[key] = max(errs.get(key, 0.0), _rel(got.detach(), want.detach()))

    if name == "conv":
        a = _randn(1 + i, 5, 4, 4, seed=10 + i).requires_grad_(True)
        out = sw.conv_transpose2d(a, stride=2, output_padding=1)
        ref_a = a.detach().clone().requires_grad_(True)
        ref = F.conv_transpose2d(ref_a, W, stride=2, output_padding=1)
        x = _randn(1 + i, 3, 6, 6, seed=20 + i)
        fwd, fwd_ref = sw.columns(lambda w, rows, x=x: F.conv2d(x, w), 1), F.conv2d(x, W)
    else:
        a = _randn(1 + i, 3, W.shape[0], seed=10 + i).requires_grad_(True)
        out = sw.linear_t(a)
        ref_a = a.detach().clone().requires_grad_(True)
        ref = ref_a @ W
        x = _randn(2 + i, W.shape[1], seed=20 + i)
        fwd, fwd_ref = sw.columns(lambda w, rows, x=x: F.linear(x, w), -1), F.linear(x, W)
        c = _randn(2, W.shape[0], seed=30 + i)
        note(f"{mode}-{name}-row_sum", sw.row_sum(lambda w, rows, c=c: c[:, rows[0] : rows[1]] @ w), c @ W)
    up = _randn(*ref.shape, seed=40 + i)
    (out * up).sum().backward()
    (ref * up).sum().backward()
    note(f"{mode}-{name}-value", out, ref)
    note(f"{mode}-{name}-grad", a.grad, ref_a.grad)
    note(f"{mode}-{name}-forward", fwd, fwd_ref)
    return mode != "fsdp" or (torch.equal(sw.gathered(), W) and torch.equal(out.detach(), ref.detach()))


def _failures_while_serving(me: int, sharded: dict, weights: dict) -> tuple:
    """A rank that raises inside ``serving()`` (the others still get their weights from it), and a
    lockstep collective called inside it (refused): (the error, whether refused, bit for bit)."""
    bitwise, raised, guarded = True, None, None
    try:
        with serve.serving():
            if me == 1:
                raise ValueError("boom")
            for _ in range(3):  # the others still get their weights from rank 1
                bitwise &= torch.equal(sharded["fsdp", "lin"].gathered(), weights["lin"])
    except ValueError as e:
        raised = str(e)
    try:
        with serve.serving():
            if me == 2:  # a lockstep collective here would pair up with the others' ticks
                comm.all_reduce(torch.ones(1))
    except RuntimeError as e:
        guarded = "ranks run different work" in str(e)
    return raised, guarded, bitwise


def _out_of_lockstep() -> dict[str, Any]:
    torch.set_num_threads(1)
    me = comm.rank()
    weights = {"lin": _randn(7, 5, seed=1), "small": _randn(2, 6, seed=2), "conv": _randn(5, 3, 3, 3, seed=3)}
    sharded = {(m, k): ShardedWeight(w, m) for m in ("fsdp", "tp") for k, w in weights.items()}
    errs: dict[str, float] = {}
    bitwise = True
    with serve.serving():
        for i in range(2 * me):  # rank 0: nothing; rank 1: two rounds; rank 2: four
            for (mode, name), sw in sharded.items():
                bitwise &= _one_product(mode, name, sw, weights[name], i, errs)
    raised, guarded, whole = _failures_while_serving(me, sharded, weights)
    after = comm.all_gather_object(me)  # lockstep again: a plain collective works
    mine = {"errs": errs, "bitwise": bitwise and whole, "raised": raised, "guarded": guarded, "after": after}
    mine["active"] = serve.active()
    return comm.all_gather_object(mine)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run(_out_of_lockstep, 3, timeout_s=60)


def test_products_out_of_lockstep_equal_the_plain_ops(results: list[dict[str, Any]]) -> None:
    assert results[0]["errs"] == {}  # rank 0 only served
    for r in (1, 2):
        errs = results[r]["errs"]
        assert len(errs) == 2 * (3 * 3 + 2), errs  # fsdp/tp x lin/small/conv x 3 checks + row sums
        assert max(errs.values()) <= 1e-6, errs
        assert results[r]["bitwise"]


def test_errors_inside_leave_the_others_served(results: list[dict[str, Any]]) -> None:
    assert [r["raised"] for r in results] == [None, "boom", None]
    assert [r["guarded"] for r in results] == [None, None, True]
    assert all(r["after"] == [0, 1, 2] and not r["active"] for r in results)
