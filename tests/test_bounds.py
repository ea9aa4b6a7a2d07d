"""Tests for complete_verifier_ext.bounds: IBP, CROWN and α-CROWN.

* hand-computed bounds on 2-2-1 and 2-2-1-1 networks (the arithmetic is in the comments);
* sampling soundness on random MLPs, CNNs and a residual ONNX net: sampled ``C @ y`` never falls below
  the bound, and every intermediate bound contains the sampled value of its node;
* α-CROWN never ends below the CROWN bound it starts from;
* a convolution's backward equals its dense matrix (stride 2 with odd and even input sizes).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from complete_verifier_ext import testing
from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import (
    _unit_rows,
    crown,
    final_bounds,
    ibp,
    neuron_rows,
    pre_activation_nodes,
)
from complete_verifier_ext.bounds.graph import Graph
from complete_verifier_ext.bounds.ops import Add, Affine, Conv, Flatten, Input, Linear, Relu, Slopes
from complete_verifier_ext.bounds.walk import back_substitute
from complete_verifier_ext.bounds.window import Window, accumulate
from complete_verifier_ext.model.onnx_loader import load_model
from complete_verifier_ext.model.torch_loader import from_sequential

TOL = 1e-5
ALPHA_FAST = AlphaOptions(iteration=10, lr_alpha=0.1, lr_decay=0.98, early_stop=False)

# ---------------------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------------------
#
# Net A (2-2-1), x in [-1, 1]^2:
#   z1 = x1 + x2 + 0.5   in [-1.5, 2.5]   (adaptive lower slope 1: u = 2.5 > -l = 1.5)
#   z2 = x1 - x2 - 0.5   in [-2.5, 1.5]   (adaptive lower slope 0: u = 1.5 < -l = 2.5)
#   y  = relu(z1) + relu(z2) - 1
# Upper lines u/(u-l) (z - l):  relu(z1) <= 0.625 z1 + 0.9375,  relu(z2) <= 0.375 z2 + 0.9375.
# The true range of y is [-1, 1.5]: -1 at x = (-1, 0) (both ReLUs off), 1.5 at x = (1, 1).


def net_a() -> nn.Sequential:
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
        net[0].bias.copy_(torch.tensor([0.5, -0.5]))
        net[2].weight.copy_(torch.tensor([[1.0, 1.0]]))
        net[2].bias.copy_(torch.tensor([-1.0]))
    return net


# Net B (2-2-1-1) = net A followed by out = relu(y) (weight 1, bias 0); y is now a pre-activation whose
# bounds CROWN refines:
#   IBP:   y in [-1, 3]
#   CROWN: y >= z1 - 1 (slopes 1, 0) = x1 + x2 - 0.5 >= -2.5;
#          -y >= -(0.625 z1 + 0.9375) - (0.375 z2 + 0.9375) + 1 = -x1 - 0.25 x2 - 1 >= -2.25, so y <= 2.25.
#   intersect=True:  y in [-1, 2.25]  -> adaptive slope 1 (2.25 > 1)   -> out >= y >= -2.5
#   intersect=False: y in [-2.5, 2.25] -> adaptive slope 0 (2.25 < 2.5) -> out >= 0
#   upper bound: the upper line through (u, u) evaluated at CROWN's max of y gives u = 2.25 in both cases.
# The true range of out is [0, 1.5]; α-CROWN reaches 0 (lower slope 0 on relu(y)).


def net_b() -> nn.Sequential:
    net = net_a()
    last = nn.Linear(1, 1)
    with torch.no_grad():
        last.weight.fill_(1.0)
        last.bias.fill_(0.0)
    return nn.Sequential(*net, nn.ReLU(), last)


UNIT_BOX = (torch.full((1, 2), -1.0), torch.full((1, 2), 1.0))
C_PM = torch.tensor([[1.0], [-1.0]])  # rows: y and -y


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0.0, atol=atol)


def test_hand_ibp_net_a() -> None:
    g = from_sequential(net_a(), (2,))
    lb, bounds = ibp(g, UNIT_BOX, C_PM)
    close(bounds[1][0], [[-1.5, -2.5]])
    close(bounds[1][1], [[2.5, 1.5]])
    close(bounds[2][0], [[0.0, 0.0]])
    close(bounds[2][1], [[2.5, 1.5]])
    # y in [0 + 0 - 1, 2.5 + 1.5 - 1] = [-1, 3]
    close(bounds[3][0], [[-1.0]])
    close(bounds[3][1], [[3.0]])
    close(lb, [[-1.0, -3.0]])


@pytest.mark.parametrize("intersect", [True, False])
def test_hand_crown_net_a(intersect: bool) -> None:
    g = from_sequential(net_a(), (2,))
    lb, state = crown(g, UNIT_BOX, C_PM, intersect=intersect)
    # y  >= z1 + 0 - 1 = x1 + x2 - 0.5                                   -> min -2.5 (worse than IBP's -1)
    # -y >= -(0.625 z1 + 0.9375) - (0.375 z2 + 0.9375) + 1 = -x1 - 0.25 x2 - 1 -> min -2.25 (IBP: -3)
    close(lb, [[-2.5, -2.25]])
    assert state.rows == {}  # the only pre-activation is one affine layer of the input: IBP is exact
    close(state.bounds[1][0], [[-1.5, -2.5]])


def test_hand_alpha_net_a() -> None:
    g = from_sequential(net_a(), (2,))
    _, state = crown(g, UNIT_BOX, C_PM)
    lb, _ = alpha_crown(g, UNIT_BOX, C_PM, state, AlphaOptions(iteration=30, early_stop=False))
    # Row y with slopes a1, a2 in [0, 1]:
    #   min_x a1 z1 + a2 z2 - 1 = 0.5 a1 - 0.5 a2 - |a1 + a2| - |a1 - a2| - 1,
    # maximal at a = (0, 0): -1 (the true minimum).  Row -y uses only upper lines: stays -2.25.
    close(lb[:, 0], [-1.0], atol=1e-3)
    close(lb[:, 1], [-2.25])


def test_hand_crown_net_b() -> None:
    g = from_sequential(net_b(), (2,))
    y_node = 3
    lb_t, st_t = crown(g, UNIT_BOX, C_PM, intersect=True)
    lb_f, st_f = crown(g, UNIT_BOX, C_PM, intersect=False)
    close(st_t.bounds[y_node][0], [[-1.0]])
    close(st_t.bounds[y_node][1], [[2.25]])
    close(st_f.bounds[y_node][0], [[-2.5]])
    close(st_f.bounds[y_node][1], [[2.25]])
    assert set(st_t.rows) == {y_node} and st_t.rows[y_node].tolist() == [0]
    # intersect=True: slope 1 -> out >= y >= -2.5; intersect=False: slope 0 -> out >= 0.  Tighter intermediate
    # bounds do not give a tighter final bound with the adaptive slope.
    close(lb_t, [[-2.5, -2.25]])
    close(lb_f, [[0.0, -2.25]])


@pytest.mark.parametrize("intersect", [True, False])
def test_hand_alpha_net_b(intersect: bool) -> None:
    g = from_sequential(net_b(), (2,))
    _, state = crown(g, UNIT_BOX, C_PM, intersect=intersect)
    lb, _ = alpha_crown(g, UNIT_BOX, C_PM, state, AlphaOptions(iteration=30, early_stop=False))
    # the optimum of the lower row is slope 0 on relu(y): out >= 0, the true minimum
    close(lb[:, 0], [0.0], atol=1e-3)
    close(lb[:, 1], [-2.25], atol=1e-5)


def test_alpha_zero_iterations_is_crown() -> None:
    g = from_sequential(net_b(), (2,))
    lb_c, state = crown(g, UNIT_BOX, C_PM)
    lb_a, _ = alpha_crown(g, UNIT_BOX, C_PM, state, AlphaOptions(iteration=0))
    close(lb_a, lb_c, atol=0.0)


# ---------------------------------------------------------------------------------------------------------
# Sampling soundness
# ---------------------------------------------------------------------------------------------------------


def random_box(
    shape: tuple[int, ...],
    batch: int,
    seed: int,
    lo: float = -1.0,
    hi: float = 1.0,
    rad: tuple[float, float] = (0.05, 0.5),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` boxes of per-sample ``shape`` with centres in [lo, hi] and radii in ``rad``."""
    gen = torch.Generator().manual_seed(seed)
    centre = lo + (hi - lo) * torch.rand(batch, *shape, generator=gen)
    radius = rad[0] + (rad[1] - rad[0]) * torch.rand(batch, *shape, generator=gen)
    return centre - radius, centre + radius


def sample_points(box, b: int, n: int, seed: int) -> torch.Tensor:
    """``n`` uniform points of box ``b`` plus all its corners when the input has at most 10 entries."""
    lo, hi = box[0][b], box[1][b]
    gen = torch.Generator().manual_seed(seed)
    x = lo + (hi - lo) * torch.rand(n, *lo.shape, generator=gen)
    if lo.numel() <= 10:
        bits = torch.tensor(list(itertools.product((0.0, 1.0), repeat=lo.numel()))).view(-1, *lo.shape)
        x = torch.cat([x, lo + (hi - lo) * bits])
    return x


def assert_sound(
    graph: Graph, box, C: torch.Tensor, lb: torch.Tensor, bounds: dict, what: str, n: int = 2000
) -> None:
    """Every sampled ``C @ y`` is >= lb - TOL and every node value lies in its bounds (± TOL)."""
    B = box[0].shape[0]
    assert lb.shape == (B, C.shape[0]), what
    with torch.no_grad():
        for b in range(B):
            x = sample_points(box, b, n, seed=1000 + b)
            y = graph(x)  # (N, n_out)
            gap = (y @ C.T - lb[b]).min().item()
            assert gap >= -TOL, f"{what}: sampled C@y below the bound by {-gap:.3g} (box {b})"
            for k, (lo, hi) in bounds.items():
                v = graph.forward(x, upto=k)
                below = (lo[b] - v).max().item()
                above = (v - hi[b]).max().item()
                name = graph.nodes[k].name
                assert below <= TOL and above <= TOL, (
                    f"{what}: node {k} ({name}) leaves its bounds by {max(below, above):.3g} (box {b})"
                )


def ulp_tol(lb: torch.Tensor) -> torch.Tensor:
    """1e-6, relative beyond magnitude 1: α-CROWN's first iteration recomputes CROWN's bound, which may come
    out a float32 rounding step lower (seen: 9.5e-7 on a bound of magnitude ~10)."""
    return 1e-6 * lb.abs().clamp(min=1.0)


def run_all_methods(graph: Graph, box, C: torch.Tensor, what: str) -> None:
    lb, bounds = ibp(graph, box, C)
    assert_sound(graph, box, C, lb, bounds, f"{what} IBP")
    for intersect in (True, False):
        lb, state = crown(graph, box, C, intersect=intersect)
        assert_sound(graph, box, C, lb, state.bounds, f"{what} CROWN(intersect={intersect})")
    lb_c, state = crown(graph, box, C)
    lb_a, state_a = alpha_crown(graph, box, C, state, ALPHA_FAST)
    assert_sound(graph, box, C, lb_a, state_a.bounds, f"{what} alpha-CROWN")
    assert (lb_a >= lb_c - ulp_tol(lb_c)).all(), f"{what}: alpha-CROWN below its CROWN start"
    # the output's slopes alone (input split asked for a proof): CROWN's intermediate bounds kept
    lb_o, state_o = alpha_crown(graph, box, C, state, dataclasses.replace(ALPHA_FAST, output_only=True))
    assert_sound(graph, box, C, lb_o, state_o.bounds, f"{what} alpha-CROWN, output slopes only")
    assert (lb_o >= lb_c - ulp_tol(lb_c)).all(), f"{what}: alpha-CROWN (output only) below its CROWN start"
    for k, (lo, hi) in state.bounds.items():
        assert torch.equal(state_o.bounds[k][0], lo) and torch.equal(state_o.bounds[k][1], hi), k


def random_spec(n_out: int, seed: int, rows: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n_out, generator=gen)


@pytest.mark.parametrize("sizes,seed", [([3, 8, 8, 3], 0), ([4, 12, 12, 12, 2], 1), ([6, 20, 16, 20, 4], 2)])
def test_sampling_soundness_mlp(sizes: list[int], seed: int) -> None:
    g = from_sequential(testing.mlp(sizes, seed), (sizes[0],))
    box = random_box((sizes[0],), batch=2, seed=seed)
    run_all_methods(g, box, random_spec(sizes[-1], seed), f"mlp{sizes}")


@pytest.mark.parametrize("input_shape", [(2, 8, 8), (1, 7, 7)])
def test_sampling_soundness_cnn(input_shape: tuple[int, ...]) -> None:
    g = from_sequential(testing.cnn(3, input_shape), input_shape)
    box = random_box(input_shape, batch=2, seed=4, rad=(0.02, 0.2))
    run_all_methods(g, box, random_spec(3, 5), f"cnn{input_shape}")


def test_sampling_soundness_residual_onnx(tmp_path: Path) -> None:
    g = load_model(testing.residual_onnx(tmp_path / "residual.onnx", seed=7))
    assert any(len(n.inputs) == 2 for n in g.nodes), "the residual Add should be a two-input node"
    box = random_box(testing.RESIDUAL_INPUT_SHAPE, batch=2, seed=8, lo=0.0, hi=1.0, rad=(0.01, 0.1))
    run_all_methods(g, box, random_spec(testing.RESIDUAL_OUTPUTS, 9), "residual")


def _stable_case(which: str, tmp_path: Path) -> tuple[Graph, tuple[int, ...]]:
    if which == "mlp":
        return from_sequential(testing.mlp([6, 20, 16, 4], 3), (6,)), (6,)
    if which == "cnn":
        return from_sequential(testing.cnn(3), testing.CNN_INPUT_SHAPE), testing.CNN_INPUT_SHAPE
    return load_model(testing.residual_onnx(tmp_path / "r.onnx", seed=7)), testing.RESIDUAL_INPUT_SHAPE


@pytest.mark.parametrize("which", ["mlp", "cnn", "residual"])
def test_crown_exact_when_every_relu_is_stable(which: str, tmp_path: Path) -> None:
    """On a box so small that no ReLU is unstable the network is affine there: CROWN must equal the exact
    minimum ``C f(c) - |C J| r`` (J the Jacobian at the centre c), which catches wrong biases, shifts and
    signs that a sampling test can miss."""
    graph, shape = _stable_case(which, tmp_path)
    gen = torch.Generator().manual_seed(1)
    centre = torch.rand(1, *shape, generator=gen)
    rad = torch.full_like(centre, 1e-4)
    box = (centre - rad, centre + rad)
    C = random_spec(graph.output_size, 2)
    lb, state = crown(graph, box, C)
    for k in graph.relu_nodes():
        lo, hi = state.bounds[graph.nodes[k].inputs[0]]
        assert not ((lo < 0) & (hi > 0)).any(), "pick another centre: a ReLU is unstable"
    J = torch.autograd.functional.jacobian(lambda x: graph(x) @ C.T, centre).reshape(C.shape[0], -1)  # (S, n)
    with torch.no_grad():
        exact = graph(centre) @ C.T - J.abs() @ rad.flatten()  # (1, S)
    torch.testing.assert_close(lb, exact, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# α-CROWN never ends below its CROWN start
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("intersect", [True, False])
@pytest.mark.parametrize("seed", [10, 11, 12])
def test_alpha_not_below_its_crown_start(intersect: bool, seed: int) -> None:
    sizes = [5, 16, 16, 16, 3]
    g = from_sequential(testing.mlp(sizes, seed), (sizes[0],))
    box = random_box((sizes[0],), batch=3, seed=seed, rad=(0.1, 0.6))
    C = random_spec(sizes[-1], seed, rows=5)
    lb_c, state = crown(g, box, C, intersect=intersect)
    lb_a, _ = alpha_crown(g, box, C, state, ALPHA_FAST)
    assert (lb_a >= lb_c - ulp_tol(lb_c)).all(), (lb_a - lb_c).min().item()


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_sparse_alpha_is_dense_alpha(kind: str) -> None:
    """α kept for the start's unstable neurons only (``general.sparse_alpha``) is the same optimisation as
    α over every neuron: the bounds of the first steps agree to float32 rounding, and the output's
    slopes handed to BaB are dense, equal on the kept neurons."""
    if kind == "mlp":
        g, shape = from_sequential(testing.mlp([5, 16, 16, 16, 3], 3), (5,)), (5,)
    else:
        g, shape = from_sequential(testing.cnn(3, (2, 8, 8)), (2, 8, 8)), (2, 8, 8)
    box = random_box(shape, batch=2, seed=3, rad=(0.1, 0.4))
    C = random_spec(3, 6)
    _, state = crown(g, box, C)
    runs = {}
    for sparse in (False, True):
        opts = AlphaOptions(iteration=5, early_stop=False, sparse=sparse)
        runs[sparse] = alpha_crown(g, box, C, state, opts)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-5)
    for j, dense in runs[False][1].out_alpha.items():
        assert runs[True][1].out_alpha[j].shape == dense.shape
        torch.testing.assert_close(runs[True][1].out_alpha[j], dense, rtol=1e-4, atol=1e-4)


def test_sparse_slopes_outside_their_index_stay_sound() -> None:
    """A :class:`Slopes` whose index misses unstable neurons (here: it holds none) gives those neurons the
    upper slope as lower slope, in [0, 1] through the origin: still a lower bound of every sample."""
    g = from_sequential(testing.mlp([4, 12, 12, 2], 8), (4,))
    box = random_box((4,), batch=2, seed=8, rad=(0.3, 0.8))
    C = random_spec(2, 9)
    _, state = crown(g, box, C)
    empty = torch.zeros(0, dtype=torch.long)
    relus = [k for k, n in enumerate(g.nodes) if n.op.is_relu]
    alphas = {j: Slopes(torch.zeros(C.shape[0], 2, 0), empty) for j in relus}
    lb, _ = final_bounds(g, state, box, C, alphas)
    x = box[0] + (box[1] - box[0]) * torch.rand(4000, 2, 4, generator=torch.Generator().manual_seed(0))
    y = torch.stack([g.forward(x[:, b]) for b in range(2)], 1) @ C.T  # (n, B, S)
    assert (y.min(0).values >= lb - 1e-5).all()


# ---------------------------------------------------------------------------------------------------------
# Conv backward = the dense matrix of the convolution
# ---------------------------------------------------------------------------------------------------------


def dense_matrix(op: Conv, in_shape: tuple[int, ...]) -> torch.Tensor:
    """(n_out, n_in): column i is the bias-free convolution of the i-th basis vector."""
    n_in = torch.Size(in_shape).numel()
    basis = torch.eye(n_in).view(n_in, *in_shape)
    bias, op.bias = op.bias, None
    try:
        cols = op.forward(basis).flatten(1)  # (n_in, n_out)
    finally:
        op.bias = bias
    return cols.T


@pytest.mark.parametrize(
    "hw,kernel,stride,padding,dilation",
    [
        ((5, 5), (3, 3), (2, 2), (1, 1), (1, 1)),  # odd: the strided conv reaches the last row
        ((6, 6), (3, 3), (2, 2), (1, 1), (1, 1)),  # even: one row/column never reached (output_padding 1)
        ((7, 6), (3, 3), (2, 2), (0, 0), (1, 1)),
        ((6, 7), (2, 2), (2, 2), (0, 0), (1, 1)),
        ((8, 5), (3, 2), (3, 2), (1, 0), (1, 1)),  # output_padding 2 on rows
        ((9, 8), (3, 3), (2, 2), (1, 1), (2, 2)),  # dilated
        ((6, 5), (3, 3), (1, 1), (1, 1), (1, 1)),
    ],
)
def test_conv_backward_equals_dense(hw, kernel, stride, padding, dilation) -> None:
    gen = torch.Generator().manual_seed(sum(hw) + kernel[0])
    c_in, c_out = 2, 3
    op = Conv(
        torch.randn(c_out, c_in, *kernel, generator=gen),
        torch.randn(c_out, generator=gen),
        stride,
        padding,
        dilation,
    )
    in_shape = (c_in, *hw)
    out_shape = tuple(op.forward(torch.zeros(1, *in_shape)).shape[1:])
    M = dense_matrix(op, in_shape)  # (n_out, n_in)
    S, B = 4, 2
    A = torch.randn(S, B, *out_shape, generator=gen)
    (A_in,), bias = op.backward(A, in_shape)
    assert A_in.shape == (S, B, *in_shape)
    torch.testing.assert_close(A_in.flatten(2), A.flatten(2) @ M, rtol=1e-5, atol=1e-5)
    expect_bias = (A * op.bias.view(-1, 1, 1)).flatten(2).sum(-1)
    torch.testing.assert_close(bias, expect_bias, rtol=1e-5, atol=1e-5)
    # and the linear function it represents agrees on a point: sum(A*conv(x)) = sum(A_in*x) + bias
    x = torch.randn(B, *in_shape, generator=gen)
    lhs = (A * op.forward(x)).flatten(2).sum(-1)
    rhs = (A_in * x).flatten(2).sum(-1) + bias
    torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# Window rows (conv neurons kept local) = dense rows
# ---------------------------------------------------------------------------------------------------------


def strided_residual_graph(seed: int = 0) -> Graph:
    """(2, 9, 9) -> conv 3x3 -> per-channel affine (BN) -> ReLU -> [conv 3x3 stride 2 | conv 1x1 stride 2]
    -> Add -> ReLU -> conv 3x3 dilation 2 -> -(x) affine -> ReLU -> Flatten -> Linear: every op a window
    goes through, padding on every border, odd sizes, a stride and a dilation."""
    gen = torch.Generator().manual_seed(seed)

    def conv(c_out, c_in, k, stride, pad, dil=1):
        W = torch.randn(c_out, c_in, k, k, generator=gen) * 0.5
        return Conv(W, torch.randn(c_out, generator=gen) * 0.1, (stride,) * 2, (pad,) * 2, (dil,) * 2)

    g = Graph()
    g.add("x", Input(), (), (2, 9, 9))
    g.add("c1", conv(3, 2, 3, 1, 1), (0,), (3, 9, 9))
    g.add(
        "bn",
        Affine(torch.rand(3, 1, 1, generator=gen) + 0.5, torch.randn(3, 1, 1, generator=gen)),
        (1,),
        (3, 9, 9),
    )
    g.add("r1", Relu(), (2,), (3, 9, 9))
    g.add("c2", conv(4, 3, 3, 2, 1), (3,), (4, 5, 5))
    g.add("sc", conv(4, 3, 1, 2, 0), (3,), (4, 5, 5))
    g.add("add", Add(), (4, 5), (4, 5, 5))
    g.add("r2", Relu(), (6,), (4, 5, 5))
    g.add("c3", conv(3, 4, 3, 1, 2, 2), (7,), (3, 5, 5))
    g.add("neg", Affine(-1.0, 0.2), (8,), (3, 5, 5))
    g.add("r3", Relu(), (9,), (3, 5, 5))
    g.add("flat", Flatten((75,)), (10,), (75,))
    g.add("fc", Linear(torch.randn(3, 75, generator=gen) * 0.2, torch.zeros(3)), (11,), (3,))
    return g


def test_window_rows_equal_dense_rows() -> None:
    g = strided_residual_graph()
    box = random_box((2, 9, 9), batch=2, seed=1, rad=(0.1, 0.5))
    _, state = crown(g, box, random_spec(3, 2))
    for k in pre_activation_nodes(g):
        n = torch.Size(g.nodes[k].shape).numel()
        every = torch.arange(n)
        dense = back_substitute(g, k, _unit_rows(every, 2, g.nodes[k].shape, False), state.bounds, box)
        window = back_substitute(g, k, _unit_rows(every, 2, g.nodes[k].shape, True), state.bounds, box)
        torch.testing.assert_close(window, dense, rtol=1e-5, atol=1e-5)
    run_all_methods(g, box, random_spec(3, 2), "strided residual")


def test_window_dense_and_union_by_hand() -> None:
    """A 1x1 window at the corner (0, 4) of a (1, 2, 5) map, and one of 2x2 sticking out at (-1, 3):
    dense() puts the values where they belong; accumulate() of two windows offset by (1, 1) is their
    sum on the union."""
    a = Window(torch.tensor([7.0]).view(1, 1, 1, 1, 1), torch.tensor([0]), torch.tensor([4]), (1, 2, 5))
    expected = torch.zeros(1, 1, 1, 2, 5)
    expected[..., 0, 4] = 7.0
    torch.testing.assert_close(a.dense(), expected)
    b = Window(torch.ones(1, 1, 1, 2, 2), torch.tensor([-1]), torch.tensor([3]), (1, 2, 5)).masked()
    assert b.values.flatten().tolist() == [0.0, 0.0, 1.0, 1.0]  # the row above the map is padding
    c = Window(torch.ones(1, 1, 1, 1, 1) * 2, torch.tensor([0]), torch.tensor([4]), (1, 2, 5))
    s = accumulate(b, c)
    assert isinstance(s, Window) and s.values.shape[3:] == (2, 2)
    torch.testing.assert_close(s.dense(), b.dense() + c.dense())


def test_window_rows_with_sparse_alpha_equal_dense_alpha() -> None:
    """α-CROWN with sparse α takes window rows (α looked up at every window entry); with dense α it
    takes dense rows: the same optimisation, to float32 rounding."""
    g = strided_residual_graph()
    box = random_box((2, 9, 9), batch=2, seed=1, rad=(0.1, 0.5))
    C = random_spec(3, 2)
    _, state = crown(g, box, C)
    lbs = [
        alpha_crown(g, box, C, state, AlphaOptions(iteration=3, early_stop=False, sparse=sparse))[0]
        for sparse in (False, True)
    ]
    torch.testing.assert_close(lbs[1], lbs[0], rtol=1e-5, atol=1e-4)


def test_linear_unit_rows_whose_bias_overflows_prove_nothing() -> None:
    """The rows of a Linear pre-activation start below it, and its bias is added after the walk: a lower
    bound that overflows there (1.5e38 + 2.5e38) is -inf (not proven), never +inf."""
    g = Graph()
    g.add("x", Input(), (), (1,))
    g.add("fc1", Linear(torch.ones(1, 1), torch.zeros(1)), (0,), (1,))
    g.add("r1", Relu(), (1,), (1,))
    g.add("fc2", Linear(torch.ones(1, 1), torch.full((1,), 2.5e38)), (2,), (1,))
    g.add("r2", Relu(), (3,), (1,))
    g.add("out", Linear(torch.ones(1, 1), torch.zeros(1)), (4,), (1,))
    box = (torch.full((1, 1), 1.5e38), torch.full((1, 1), 1.6e38))
    _, bounds = ibp(g, box, torch.ones(1, 1))
    lower, upper, _ = neuron_rows(g, 3, torch.tensor([0]), bounds, box, None, False)
    assert lower.item() == -torch.inf and upper.item() == torch.inf


@pytest.mark.parametrize("kind", ["none", "dense", "sparse"])
def test_relu_step_gradients_equal_autograd_of_the_relaxation(kind: str) -> None:
    """The ReLU step's own backward (``ops._ReluStep``) against autograd through the plain formula
    ``A⁺ · L + A⁻ · u_s``, ``Σ A⁻ · u_b`` in float64: gradients wrt A, the bounds (through the upper line)
    and α, with stable neurons, α outside [0, 1] (clamped: no gradient there) and, sparse, neurons
    outside the index (upper slope as lower slope)."""
    from complete_verifier_ext.bounds.ops import _ReluStep

    S, B, n = 5, 3, 7
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(S, B, n, dtype=torch.float64, generator=gen).requires_grad_(True)
    lo = torch.randn(B, n, dtype=torch.float64, generator=gen)
    hi = (lo + 2 * torch.rand(B, n, dtype=torch.float64, generator=gen)).requires_grad_(True)
    lo.requires_grad_(True)
    up, ub, lo_default = Relu.relaxation(lo, hi)
    unstable = ((lo < 0) & (hi > 0)).detach()
    index, alpha = None, None
    if kind != "none":
        index = torch.tensor([0, 2, 3, 6]) if kind == "sparse" else None
        m = n if index is None else len(index)
        alpha = (torch.rand(S, B, m, dtype=torch.float64, generator=gen) * 1.4 - 0.2).requires_grad_(True)
    L = lo_default.expand(S, B, n)
    if kind == "dense":
        L = torch.where(unstable, alpha.clamp(0, 1), lo_default)
    if kind == "sparse":
        L = up.expand(S, B, n).clone()
        L[:, :, index] = torch.where(unstable[:, index], alpha.clamp(0, 1), lo_default[:, index])
    ref_out, ref_bias = A.clamp(min=0) * L + A.clamp(max=0) * up, (A.clamp(max=0) * ub).sum(-1)
    out, bias = _ReluStep.apply(A, up, ub, alpha, lo_default.detach(), unstable, index)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(bias, ref_bias)
    g_out, g_bias = torch.randn_like(out), torch.randn_like(bias)
    inputs = [A, lo, hi] + ([alpha] if alpha is not None else [])
    mine = torch.autograd.grad((out * g_out).sum() + (bias * g_bias).sum(), inputs, retain_graph=True)
    ref = torch.autograd.grad((ref_out * g_out).sum() + (ref_bias * g_bias).sum(), inputs)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_the_walk_drops_each_a_matrix_once_pushed_through(monkeypatch) -> None:
    """No A-matrix waits beside the one in flight: by the time the ReLU's step runs, the start A given
    to the walk (the caller keeping none) is freed, as is the A that the Linear below produced."""
    import weakref

    g = Graph(source="drop")
    g.add("input", Input(), (), (3,))
    g.add("fc0", Linear(torch.randn(4, 3), torch.zeros(4)), (0,), (4,))
    g.add("relu0", Relu(), (1,), (4,))
    g.add("fc1", Linear(torch.randn(2, 4), torch.zeros(2)), (2,), (2,))
    box = (torch.zeros(1, 3) - 1, torch.zeros(1, 3) + 1)
    _, state = crown(g, box, torch.eye(2))
    refs: list[weakref.ref] = []
    alive_at_relu: list[bool] = []
    step = Relu.bound_backward

    def watched(self, A, *args, **kwargs):
        alive_at_relu.append(refs[0]() is not None)
        return step(self, A, *args, **kwargs)

    monkeypatch.setattr(Relu, "bound_backward", watched)
    held = [torch.randn(5, 1, 2)]
    refs.append(weakref.ref(held[0]))
    lb = back_substitute(g, 3, held.pop(), state.bounds, box)
    assert alive_at_relu == [False] and lb.shape == (5, 1)
