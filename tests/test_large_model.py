"""The large-model path on a scaled-down ResNet-large shape (``examples.resnet`` with 1/8 of the channels,
16x16 inputs, BatchNorm folded, ONNX): conv rows as windows, CROWN in chunks of neurons, sparse α.

* chunked CROWN gives the bounds of one pass, at every node, to float32 rounding: a pass of another
  number of rows can take another conv kernel, whose rounding (1e-8 of the layer's scale) grows with
  depth (3.7e-6 of it at the 17th layer here);
* CROWN and α-CROWN are sound by sampling: every sampled pre-activation lies within its bounds and every
  sampled spec row above its lower bound;
* α-CROWN never ends below CROWN.
"""

from __future__ import annotations

import pytest
import torch

from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown, pre_activation_nodes
from complete_verifier_ext.examples.resnet import build
from complete_verifier_ext.model.onnx_loader import load_onnx

SIDE, STAGES, CLASSES = 16, (8, 16, 32, 64), 10
EPS = 1e-4  # random weights: at 1/255 every later neuron is unstable; here layers are mixed
CHUNK = 97  # neurons per pass: several passes per layer, the last one short


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    path, n_params = build(
        tmp_path_factory.mktemp("resnet") / "r.onnx", stages=STAGES, side=SIDE, fc=64, classes=10
    )
    assert n_params > 150_000
    graph = load_onnx(path)
    assert sum(1 for n in graph.nodes if len(n.inputs) == 2) == 8  # the residual Adds
    x0 = torch.rand(1, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    box = ((x0 - EPS).clamp(0, 1), (x0 + EPS).clamp(0, 1))
    C = torch.eye(CLASSES)[1:] - torch.eye(CLASSES)[0]
    return graph, box, C


def _sampled(graph, box, n: int = 300) -> torch.Tensor:
    lo, hi = box
    u = torch.rand(n, *lo.shape[1:], generator=torch.Generator().manual_seed(1))
    return lo + (hi - lo) * u


def _assert_sound(graph, box, C, lb, bounds) -> None:
    x = _sampled(graph, box)
    with torch.no_grad():
        for k in pre_activation_nodes(graph):
            v = graph.forward(x, upto=k)
            lo, hi = bounds[k]
            slack = 1e-5 * (1 + v.abs())
            assert bool((v >= lo - slack).all() and (v <= hi + slack).all()), graph.nodes[k].name
        y = graph(x) @ C.T
    assert bool((y >= lb - 1e-5 * (1 + lb.abs())).all())


def test_chunked_crown_equals_one_pass_and_is_sound(problem):
    graph, box, C = problem
    lb_one, one = crown(graph, box, C)
    lb, state = crown(graph, box, C, chunk=CHUNK)
    assert max(len(r) for r in state.rows.values()) > 3 * CHUNK  # layers of several passes
    for k in pre_activation_nodes(graph):
        for a, b in zip(state.bounds[k], one.bounds[k], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
    torch.testing.assert_close(lb, lb_one, rtol=0, atol=1e-5 * float(lb_one.abs().max()))
    assert bool(torch.isfinite(lb).all())
    _assert_sound(graph, box, C, lb, state.bounds)


def test_alpha_crown_with_sparse_alpha_is_sound_and_not_below_crown(problem):
    graph, box, C = problem
    lb_c, state = crown(graph, box, C, chunk=CHUNK)
    opts = AlphaOptions(iteration=2, early_stop=False, chunk=CHUNK, sparse=True)
    with torch.enable_grad():
        lb_a, state_a = alpha_crown(graph, box, C, state, opts)
    assert bool((lb_a >= lb_c - 1e-6 * lb_c.abs().clamp(min=1)).all())
    _assert_sound(graph, box, C, lb_a, state_a.bounds)
