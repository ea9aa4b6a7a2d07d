"""Tests for complete_verifier_ext.attack (PGD falsification, float32 boxes, counterexample checks)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from complete_verifier_ext.attack import (
    check_counterexample,
    clause_margins,
    format_counterexample,
    pgd_attack,
)
from complete_verifier_ext.spec import Clause, Region, float32_box

N_IN, N_HID, N_OUT = 4, 16, 3


def make_cfg(**overrides: object) -> SimpleNamespace:
    """An attack config with small defaults suitable for quick tests."""
    values: dict[str, object] = {
        "pgd_order": "before",
        "pgd_steps": 40,
        "pgd_restarts": 8,
        "pgd_alpha": "auto",
        "pgd_early_stop": True,
        "pgd_lr_decay": 0.95,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    """A small ReLU MLP with fixed weights (no global RNG use, parameters frozen)."""
    rng = np.random.default_rng(seed)
    net = torch.nn.Sequential(torch.nn.Linear(N_IN, N_HID), torch.nn.ReLU(), torch.nn.Linear(N_HID, N_OUT))
    with torch.no_grad():
        for layer in (net[0], net[2]):
            layer.weight.copy_(torch.from_numpy(rng.normal(size=tuple(layer.weight.shape))))
            layer.bias.copy_(torch.from_numpy(rng.normal(size=tuple(layer.bias.shape))))
    net.requires_grad_(False)
    return net


def clause(C: list[list[float]], d: list[float]) -> Clause:
    return Clause(np.array(C, dtype=np.float64), np.array(d, dtype=np.float64))


def box(lower: list[float] | np.ndarray, upper: list[float] | np.ndarray, *clauses: Clause) -> Region:
    return Region(np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64), tuple(clauses))


def outputs(net: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return net(torch.as_tensor(x, dtype=torch.float32)).double().numpy()


def mlp_region_hidden_cex(net: torch.nn.Module) -> Region:
    """A region for ``net`` whose clause is false at the box centre but true at some sampled point."""
    lower, upper = np.full(N_IN, -1.0), np.full(N_IN, 1.0)
    samples = np.random.default_rng(1).uniform(lower, upper, size=(2000, N_IN))
    row = np.array([1.0, -1.0, 0.0])  # clause: Y_0 - Y_1 <= d
    values = outputs(net, samples) @ row
    centre_value = float(outputs(net, np.zeros((1, N_IN)))[0] @ row)
    assert values.min() < centre_value
    d = values.min() + 0.3 * (centre_value - values.min())
    return box(lower, upper, clause([row.tolist()], [d]))


class CountingForward:
    """Wraps a model and counts forward calls."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net = net
        self.calls = 0
        self.batch_sizes: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.batch_sizes.append(x.shape[0])
        return self.net(x)


def assert_valid_cex(x: np.ndarray, net: torch.nn.Module, region: Region) -> None:
    assert x is not None
    assert x.dtype == np.float32 and x.shape == (region.lower.size,)
    lo32, hi32 = float32_box(region.lower, region.upper, inward=True)
    assert np.all(lo32 <= x) and np.all(x <= hi32)
    assert np.all(region.lower <= x.astype(np.float64)) and np.all(x.astype(np.float64) <= region.upper)
    y = outputs(net, x[None])[0]
    assert clause_margins(y, region.clauses).min() <= 0.0


# ---------------------------------------------------------------------------------------------------------
# float32_box
# ---------------------------------------------------------------------------------------------------------


def test_float32_box_inward_and_outward_rounding() -> None:
    lower = np.array([0.1, -0.1, 1.0 / 3.0, -2.0 / 3.0, 0.5, 1e-40, -1e39])
    upper = np.array([0.7, 0.3, 2.0 / 3.0, -1.0 / 3.0, 0.75, 1e-3, 1e39])
    lo_in, hi_in = float32_box(lower, upper, inward=True)
    lo_out, hi_out = float32_box(lower, upper, inward=False)
    for arr in (lo_in, hi_in, lo_out, hi_out):
        assert arr.dtype == np.float32 and arr.shape == lower.shape
    # Inward: every float32 point of the box lies in the real box, and the rounding is tight.
    assert np.all(lo_in.astype(np.float64) >= lower) and np.all(hi_in.astype(np.float64) <= upper)
    with np.errstate(over="ignore"):
        assert np.all(np.nextafter(lo_in, np.float32(-np.inf)).astype(np.float64) < lower)
        assert np.all(np.nextafter(hi_in, np.float32(np.inf)).astype(np.float64) > upper)
    # Outward: the box contains the real box, tightly: where a float64 is a float32 it may be the nearest
    # float64 of a decimal just beyond that float32, so the box steps one float32 out there too.
    assert np.all(lo_out.astype(np.float64) <= lower) and np.all(hi_out.astype(np.float64) >= upper)
    finite = np.isfinite(lo_out) & np.isfinite(hi_out)
    exact_lo, exact_hi = lower.astype(np.float32) == lower, upper.astype(np.float32) == upper
    up, down = np.float32(np.inf), np.float32(-np.inf)
    inner_lo = np.where(exact_lo, np.nextafter(np.nextafter(lo_out, up), up), np.nextafter(lo_out, up))
    inner_hi = np.where(exact_hi, np.nextafter(np.nextafter(hi_out, down), down), np.nextafter(hi_out, down))
    assert np.all(inner_lo[finite].astype(np.float64) > lower[finite])
    assert np.all(inner_hi[finite].astype(np.float64) < upper[finite])
    # Non-representable values really moved in the expected direction; representable ones did not.
    f01 = np.float32(0.1)  # 0.100000001490116... > 0.1
    assert lo_in[0] == f01 and lo_out[0] == np.nextafter(f01, np.float32(-np.inf))
    f03 = np.float32(0.3)  # 0.300000011920928... > 0.3
    assert hi_out[1] == f03 and hi_in[1] == np.nextafter(f03, np.float32(-np.inf))
    assert lo_in[1] == np.nextafter(-f01, np.float32(np.inf)) and lo_out[1] == -f01
    assert lo_in[2] != lo_out[2] and hi_in[2] != hi_out[2]
    assert lo_in[4] == np.float32(0.5) and hi_in[4] == np.float32(0.75)
    assert lo_out[4] == np.nextafter(np.float32(0.5), down) and hi_out[4] == np.nextafter(
        np.float32(0.75), up
    )
    # Beyond the float32 range: +-max inward, +-inf outward.
    assert lo_in[6] == -np.finfo(np.float32).max and hi_in[6] == np.finfo(np.float32).max
    assert lo_out[6] == -np.inf and hi_out[6] == np.inf


def test_float32_box_degenerate_dimensions() -> None:
    lo, hi = float32_box([0.5, 0.25], [0.5, 0.25], inward=True)
    assert lo.tolist() == [0.5, 0.25] and hi.tolist() == [0.5, 0.25]
    # 0.1 is not a float32: a pinned 0.1 reads as the float32 the network computes on
    lo, hi = float32_box([0.0, 0.1, 0.1], [1.0, 0.1, np.nextafter(0.1, 1.0)], inward=True)
    assert lo.tolist() == [0.0, np.float32(0.1), np.float32(0.1)] and hi[1:].tolist() == lo[1:].tolist()
    lo, hi = float32_box([0.1], [0.1], inward=False)
    assert lo[0] < hi[0] and lo[0] <= 0.1 <= hi[0]
    with pytest.raises(ValueError):
        float32_box([1.0], [0.0], inward=False)
    with pytest.raises(ValueError):
        float32_box([np.nan], [0.0], inward=True)


# ---------------------------------------------------------------------------------------------------------
# clause_margins / format_counterexample
# ---------------------------------------------------------------------------------------------------------


def test_clause_margins() -> None:
    clauses = (clause([[1.0, -1.0], [0.0, 1.0]], [0.0, 2.0]), clause([[1.0, 0.0]], [5.0]))
    margins = clause_margins(np.array([1.0, 3.0]), clauses)
    np.testing.assert_array_equal(margins, [1.0, -4.0])
    assert clause_margins(np.array([1.0, 3.0]), ()).shape == (0,)


def test_format_counterexample_round_trips() -> None:
    x = np.array([0.1, -1.0 / 3.0, 1e-30, 0.0, 12345.678], dtype=np.float32)
    y = np.array([np.float32(2.0 / 3.0), -7.25], dtype=np.float64)
    text = format_counterexample(x, y)
    assert text.startswith("((X_0 ") and text.endswith("))")
    lines = text.split("\n")
    assert len(lines) == x.size + y.size and all(line.startswith(" (") for line in lines[1:])
    pairs = re.findall(r"\(([XY])_(\d+) ([^()\s]+)\)", text)
    xs = {int(i): float(v) for kind, i, v in pairs if kind == "X"}
    ys = {int(i): float(v) for kind, i, v in pairs if kind == "Y"}
    assert sorted(xs) == list(range(x.size)) and sorted(ys) == list(range(y.size))
    np.testing.assert_array_equal(np.array([xs[i] for i in range(x.size)], dtype=np.float32), x)
    assert all(float(np.float32(xs[i])) == xs[i] for i in xs)  # written exactly, not just close
    np.testing.assert_array_equal(np.array([ys[j] for j in range(y.size)]), y)


# ---------------------------------------------------------------------------------------------------------
# pgd_attack
# ---------------------------------------------------------------------------------------------------------


def test_pgd_finds_counterexample_true_at_centre() -> None:
    net = make_mlp()
    y0 = outputs(net, np.zeros((1, N_IN)))[0]
    row = [-1.0, 1.0, 0.0] if y0[0] >= y0[1] else [1.0, -1.0, 0.0]  # the clause holds at the centre
    region = box(np.full(N_IN, -0.5), np.full(N_IN, 0.5), clause([row], [0.0]))
    fwd = CountingForward(net)
    x = pgd_attack(fwd, (N_IN,), region, make_cfg(), seed=0)
    assert_valid_cex(x, net, region)
    assert fwd.calls == 2  # first step found it (early stop), then the single-point re-check
    assert fwd.batch_sizes == [8, 1]


def test_pgd_finds_hidden_counterexample() -> None:
    net = make_mlp()
    region = mlp_region_hidden_cex(net)
    assert clause_margins(outputs(net, np.zeros((1, N_IN)))[0], region.clauses)[0] > 0
    x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert_valid_cex(x, net, region)
    # From the centre alone (no random restarts), the gradient steps must get there.
    fwd = CountingForward(net)
    x = pgd_attack(fwd, (N_IN,), region, make_cfg(pgd_restarts=1), seed=0)
    assert_valid_cex(x, net, region)
    assert fwd.calls > 2


def test_pgd_works_inside_no_grad_and_with_trainable_params() -> None:
    net = make_mlp()
    net.requires_grad_(True)
    region = mlp_region_hidden_cex(net)
    with torch.no_grad():
        x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert_valid_cex(x, net, region)
    assert all(p.grad is None for p in net.parameters())


def test_pgd_returns_none_for_true_property() -> None:
    # y = x0 + 2*x1 + 1 on [0, 1]^2 lies in [1, 4]: "y <= 0.5" never holds.
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 2.0]]))
        net.bias.fill_(1.0)
    net.requires_grad_(False)
    region = box([0.0, 0.0], [1.0, 1.0], clause([[1.0]], [0.5]))
    fwd = CountingForward(net)
    assert pgd_attack(fwd, (2,), region, make_cfg(pgd_steps=15), seed=0) is None
    assert fwd.calls == 15


def test_pgd_multi_row_clause_at_corner() -> None:
    # Identity model on [-1, 1]^2; clause "y0 <= -0.9 and y1 >= 0.9" only holds near the corner (-1, 1).
    net = torch.nn.Identity()
    region = box([-1.0, -1.0], [1.0, 1.0], clause([[1.0, 0.0], [0.0, -1.0]], [-0.9, -0.9]))
    x = pgd_attack(net, (2,), region, make_cfg(pgd_restarts=2), seed=0)
    assert_valid_cex(x, net, region)
    assert x[0] <= -0.9 and x[1] >= 0.9


def test_pgd_multi_row_clause_mlp_target_class() -> None:
    net = make_mlp()
    lower, upper = np.full(N_IN, -1.0), np.full(N_IN, 1.0)
    samples = np.random.default_rng(2).uniform(lower, upper, size=(2000, N_IN))
    winners = np.argmax(outputs(net, samples), axis=1)
    centre_winner = int(np.argmax(outputs(net, np.zeros((1, N_IN)))[0]))
    others = sorted(set(winners.tolist()) - {centre_winner})
    assert others, "the test network should have another reachable winner"
    target = others[0]
    rows = [
        [(1.0 if j == i else 0.0) - (1.0 if j == target else 0.0) for j in range(N_OUT)]
        for i in range(N_OUT)
        if i != target
    ]  # Y_i - Y_target <= 0 for all i != target
    region = box(lower, upper, clause(rows, [0.0] * len(rows)))
    x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert_valid_cex(x, net, region)
    assert int(np.argmax(outputs(net, x[None])[0])) == target


def test_pgd_several_clauses_only_last_falsifiable() -> None:
    net = torch.nn.Identity()
    region = box(
        [0.0, 0.0],
        [1.0, 1.0],
        clause([[1.0, 0.0]], [-1.0]),  # y0 <= -1: impossible
        clause([[0.0, -1.0]], [-2.0]),  # y1 >= 2: impossible
        clause([[-1.0, -1.0]], [-1.9]),  # y0 + y1 >= 1.9: near the corner (1, 1)
    )
    fwd = CountingForward(net)
    x = pgd_attack(fwd, (2,), region, make_cfg(pgd_restarts=3), seed=0)
    assert_valid_cex(x, net, region)
    margins = clause_margins(x.astype(np.float64), region.clauses)
    assert margins[0] > 0 and margins[1] > 0 and margins[2] <= 0
    assert fwd.batch_sizes[0] == 3 * 3  # restarts * clauses in one batch


def test_pgd_without_clauses() -> None:
    net = make_mlp()
    fwd = CountingForward(net)
    assert pgd_attack(fwd, (N_IN,), box(np.zeros(N_IN), np.ones(N_IN)), make_cfg()) is None
    assert fwd.calls == 0


def test_pgd_on_a_pinned_input_that_is_not_a_float32() -> None:
    """``X_0 = 0.1`` (no float32 equals it): the attack searches at the float32 the network reads for
    0.1, and the counterexample it finds checks there (as the VNN-COMP checkers read a witness)."""
    net = make_mlp()
    lower = np.array([0.1, -1.0, -1.0, -1.0])
    region = box(lower, np.array([0.1, 1.0, 1.0, 1.0]), clause([[1.0, 0.0, 0.0]], [1e9]))
    x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert x is not None and x[0] == np.float32(0.1)
    ok, _ = check_counterexample(net, (N_IN,), x, region)
    assert ok


def test_pgd_image_shaped_input() -> None:
    net = torch.nn.Sequential(torch.nn.Flatten(), make_mlp())
    region = mlp_region_hidden_cex(make_mlp())
    x = pgd_attack(net, (1, 2, 2), region, make_cfg(), seed=0)
    assert_valid_cex(x, make_mlp(), region)


def test_pgd_deterministic_and_leaves_global_rng_alone() -> None:
    net = make_mlp()
    region = mlp_region_hidden_cex(net)
    cfg = make_cfg(pgd_early_stop=False, pgd_steps=20)
    state = torch.get_rng_state()
    first = pgd_attack(net, (N_IN,), region, cfg, seed=7)
    second = pgd_attack(net, (N_IN,), region, cfg, seed=7)
    assert torch.equal(state, torch.get_rng_state())
    assert first is not None and second is not None
    np.testing.assert_array_equal(first, second)


def test_should_stop_stops_at_first_step() -> None:
    net = make_mlp()
    region = mlp_region_hidden_cex(net)
    fwd = CountingForward(net)
    polls: list[int] = []

    def stop_now() -> bool:
        polls.append(fwd.calls)
        return True

    assert pgd_attack(fwd, (N_IN,), region, make_cfg(), should_stop=stop_now) is None
    assert polls == [0] and fwd.calls == 0


def test_should_stop_polled_once_per_step_in_lockstep_with_forward() -> None:
    net = torch.nn.Identity()
    region = box([0.0, 0.0], [1.0, 1.0], clause([[1.0, 0.0]], [-1.0]))  # never holds
    fwd = CountingForward(net)
    polls: list[int] = []

    def stop_after_five() -> bool:
        polls.append(fwd.calls)
        return len(polls) > 5

    assert pgd_attack(fwd, (2,), region, make_cfg(pgd_steps=50), should_stop=stop_after_five) is None
    assert polls == [0, 1, 2, 3, 4, 5] and fwd.calls == 5


# ---------------------------------------------------------------------------------------------------------
# check_counterexample (torch and onnxruntime)
# ---------------------------------------------------------------------------------------------------------


def mlp_onnx_helper(net: torch.nn.Sequential, path: Path) -> None:
    """Write ``net`` (Linear-ReLU-Linear) as a Gemm+Relu+Gemm ONNX graph."""
    w1, b1 = net[0].weight.numpy().astype(np.float32), net[0].bias.numpy().astype(np.float32)
    w2, b2 = net[2].weight.numpy().astype(np.float32), net[2].bias.numpy().astype(np.float32)
    inits = [numpy_helper.from_array(a, name) for a, name in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N_IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N_OUT])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def export_onnx(net: torch.nn.Sequential, path: Path) -> None:
    """Export with torch.onnx.export (legacy exporter), falling back to onnx.helper if that fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (torch.zeros(1, N_IN),), str(path), dynamo=False)
    except Exception:  # e.g. a missing onnxscript or a changed exporter
        mlp_onnx_helper(net, path)


def test_check_counterexample_with_onnxruntime(tmp_path: Path) -> None:
    net = make_mlp()
    region = mlp_region_hidden_cex(net)
    x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert x is not None
    path = tmp_path / "mlp.onnx"
    export_onnx(net, path)
    ok, y = check_counterexample(net, (N_IN,), x, region)
    assert ok and y.shape == (N_OUT,)
    np.testing.assert_array_equal(y, outputs(net, x[None])[0])
    ok, _ = check_counterexample(net, (N_IN,), x, region, onnx_path=str(path))
    assert ok
    helper_path = tmp_path / "mlp_helper.onnx"
    mlp_onnx_helper(net, helper_path)
    assert check_counterexample(net, (N_IN,), x, region, onnx_path=str(helper_path))[0]


def test_check_counterexample_rejects_disagreement_and_outside_points(tmp_path: Path) -> None:
    net = make_mlp()
    region = mlp_region_hidden_cex(net)
    x = pgd_attack(net, (N_IN,), region, make_cfg(), seed=0)
    assert x is not None
    margin = clause_margins(outputs(net, x[None])[0], region.clauses)[0]
    assert margin <= 0
    # ONNX model whose Y_0 - Y_1 is larger by (1 - margin): torch says yes, onnxruntime says no.
    shifted = tmp_path / "shifted.onnx"
    net_shift = make_mlp()
    with torch.no_grad():
        net_shift[2].bias[0] += float(1.0 - margin)
    mlp_onnx_helper(net_shift, shifted)
    ok, y = check_counterexample(net, (N_IN,), x, region, onnx_path=str(shifted))
    assert not ok
    np.testing.assert_array_equal(y, outputs(net, x[None])[0])
    # A point outside the real box is never a counterexample.
    outside = x.copy()
    outside[0] = np.float32(1.5)
    assert not check_counterexample(net, (N_IN,), outside, region)[0]
    # No clauses: nothing can hold.
    assert not check_counterexample(net, (N_IN,), x, box(region.lower, region.upper))[0]
