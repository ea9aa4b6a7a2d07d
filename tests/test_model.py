"""Tests for complete_verifier_ext.model: the ONNX loader (against onnxruntime) and the torch converter."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from complete_verifier_ext import testing
from complete_verifier_ext.bounds.graph import Graph
from complete_verifier_ext.model.onnx_loader import ModelError, load_model
from complete_verifier_ext.model.torch_loader import from_sequential

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
BENCHMARK_MODELS = sorted(
    str(p.relative_to(SHARED / "benchmarks"))
    for pattern in ("*/onnx/*.onnx", "*/onnx/*.onnx.gz")
    for p in (SHARED / "benchmarks").glob(pattern)
) or ["<no benchmark models>"]


def onnxruntime_outputs(path: str | Path, x: np.ndarray) -> np.ndarray:
    """Run ``x`` (N, *input_shape) through onnxruntime, one sample at a time when the batch axis is fixed."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    dims = list(inp.shape)
    if isinstance(dims[0], str) or dims[0] is None:  # a symbolic batch axis: one call
        return sess.run(None, {inp.name: x.reshape(x.shape[0], *dims[1:])})[0].reshape(x.shape[0], -1)
    shape = [1 if not isinstance(d, int) else d for d in dims]
    return np.concatenate([sess.run(None, {inp.name: xi.reshape(shape)})[0].reshape(1, -1) for xi in x])


def graph_outputs(graph: Graph, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return graph(torch.from_numpy(x)).numpy()


def random_inputs(shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.0, 1.0, size=(n, *shape)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# ONNX models against onnxruntime
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BENCHMARK_MODELS)
def test_benchmark_model_matches_onnxruntime(shared_dir: Path, name: str) -> None:
    path = shared_dir / "benchmarks" / name
    if not path.is_file():
        pytest.skip(f"no ONNX models under {shared_dir / 'benchmarks'}")
    graph = load_model(path)
    x = random_inputs(graph.input_shape, 4, seed=0)
    expected = onnxruntime_outputs(path, x)
    actual = graph_outputs(graph, x)
    assert actual.shape == expected.shape == (4, graph.output_size)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_mlp_onnx_matches_onnxruntime_and_torch(tmp_path: Path) -> None:
    sizes = [7, 12, 10, 9, 4]
    path = testing.mlp_onnx(tmp_path / "mlp.onnx", sizes, seed=3)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count("MatMul") == 1 and ops.count("Gemm") == len(sizes) - 2
    graph = load_model(path)
    x = random_inputs((sizes[0],), 4, seed=1)
    np.testing.assert_allclose(graph_outputs(graph, x), onnxruntime_outputs(path, x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch_y = testing.mlp(sizes, seed=3)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(graph_outputs(graph, x), torch_y, rtol=1e-5, atol=1e-5)


def test_residual_onnx_matches_onnxruntime(tmp_path: Path) -> None:
    path = testing.residual_onnx(tmp_path / "res.onnx", seed=5)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"Sub", "Div", "Conv", "BatchNormalization", "Relu", "Add", "Flatten", "Gemm"} <= ops
    graph = load_model(path)
    assert graph.input_shape == testing.RESIDUAL_INPUT_SHAPE
    assert graph.output_size == testing.RESIDUAL_OUTPUTS
    x = random_inputs(testing.RESIDUAL_INPUT_SHAPE, 4, seed=2)
    np.testing.assert_allclose(graph_outputs(graph, x), onnxruntime_outputs(path, x), rtol=1e-5, atol=1e-5)


def test_factories_are_deterministic(tmp_path: Path) -> None:
    a = testing.residual_onnx(tmp_path / "a.onnx", seed=1)
    b = testing.residual_onnx(tmp_path / "b.onnx", seed=1)
    c = testing.residual_onnx(tmp_path / "c.onnx", seed=2)
    inits = [[numpy_helper.to_array(t) for t in onnx.load(p).graph.initializer] for p in (a, b, c)]
    assert all(np.array_equal(u, v) for u, v in zip(inits[0], inits[1], strict=True))
    assert not all(np.array_equal(u, v) for u, v in zip(inits[0], inits[2], strict=True))
    m1, m2 = testing.cnn(4), testing.cnn(4)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))


def test_gzipped_onnx_loads(tmp_path: Path) -> None:
    path = Path(testing.mlp_onnx(tmp_path / "mlp.onnx", [5, 8, 3], seed=0))
    gz = tmp_path / "mlp.onnx.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    x = random_inputs((5,), 4, seed=3)
    np.testing.assert_array_equal(graph_outputs(load_model(gz), x), graph_outputs(load_model(path), x))


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


def _write_model(path: Path, nodes, inits, n_in: int = 4, n_out: int = 3) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, str(path))
    return path


def _gemm_inits(n_in: int = 4, n_out: int = 3) -> list:
    rng = np.random.default_rng(0)
    return [
        numpy_helper.from_array(rng.normal(size=(n_out, n_in)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(size=(n_out,)).astype(np.float32), "b"),
    ]


def _vector_model(path: Path, batch: bool) -> Path:
    """``y = W1 @ relu(W0 @ x + b0) + b1`` on a 1-D input ``x`` (the ACAS Xu nets' form), or on a batched
    one (``batch``: there ``W @ x`` would mix the batch into the product)."""
    rng = np.random.default_rng(3)
    dims = ["batch", 5] if batch else [5]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3] if batch else [3])
    inits = [
        numpy_helper.from_array(rng.normal(size=(8, 5)).astype(np.float32), "W0"),
        numpy_helper.from_array(rng.normal(size=(8,)).astype(np.float32), "b0"),
        numpy_helper.from_array(rng.normal(size=(3, 8)).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.normal(size=(3,)).astype(np.float32), "b1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["W0", "x"], ["m0"], name="M0"),
        helper.make_node("Add", ["m0", "b0"], ["h0"]),
        helper.make_node("Relu", ["h0"], ["r0"]),
        helper.make_node("MatMul", ["W1", "r0"], ["m1"], name="M1"),
        helper.make_node("Add", ["m1", "b1"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 13)]
    )
    onnx.save(model, str(path))
    return path


def test_weight_times_vector_matches_onnxruntime(tmp_path: Path) -> None:
    """``W @ x`` with a constant W on a 1-D model input is one Linear layer (VNN-COMP's ACAS Xu nets)."""
    path = _vector_model(tmp_path / "wx.onnx", batch=False)
    graph = load_model(path)
    x = random_inputs(graph.input_shape, 6, seed=1)
    np.testing.assert_allclose(graph_outputs(graph, x), onnxruntime_outputs(path, x), rtol=1e-5, atol=1e-5)
    assert [type(n.op).__name__ for n in graph.nodes] == ["Input", "Linear", "Relu", "Linear"]


def test_weight_times_batched_input_names_node(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="'M0' \\(MatMul\\): only x @ W, or W @ x on a 1-D model input"):
        load_model(_vector_model(tmp_path / "wxb.onnx", batch=True))


def test_unsupported_op_names_op_and_node(tmp_path: Path) -> None:
    path = _write_model(
        tmp_path / "sigmoid.onnx",
        [
            helper.make_node("Gemm", ["x", "W", "b"], ["z"], name="dense", transB=1),
            helper.make_node("Sigmoid", ["z"], ["y"], name="my_squash"),
        ],
        _gemm_inits(),
    )
    with pytest.raises(ModelError) as err:
        load_model(path)
    msg = str(err.value)
    assert "Sigmoid" in msg and "my_squash" in msg and str(path) in msg


def test_product_of_two_tensors_names_node(tmp_path: Path) -> None:
    path = _write_model(
        tmp_path / "square.onnx",
        [
            helper.make_node("Gemm", ["x", "W", "b"], ["z"], name="dense", transB=1),
            helper.make_node("Mul", ["z", "z"], ["y"], name="square_it"),
        ],
        _gemm_inits(),
    )
    with pytest.raises(ModelError, match="square_it") as err:
        load_model(path)
    assert "Mul" in str(err.value)


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.onnx"
    with pytest.raises(ModelError) as err:
        load_model(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("content", [b"this is not an ONNX model\n", b"\xff\xfe\x00garbage\x12\x34"])
def test_non_onnx_file_names_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bogus.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelError) as err:
        load_model(path)
    assert str(path) in str(err.value)


def test_wrong_extension_names_path(tmp_path: Path) -> None:
    path = Path(testing.mlp_onnx(tmp_path / "mlp.onnx", [3, 4, 2], seed=0))
    other = tmp_path / "mlp.txt"
    other.write_bytes(path.read_bytes())
    with pytest.raises(ModelError) as err:
        load_model(other)
    assert str(other) in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# torch.nn.Sequential
# ---------------------------------------------------------------------------------------------------------


def _bn_net() -> nn.Sequential:
    gen = torch.Generator().manual_seed(6)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.BatchNorm1d(6),
        nn.Identity(),
        nn.ReLU(),
        nn.Linear(6, 3),
    )
    with torch.no_grad():
        for m in net:
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                n = m.num_features
                m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
    return net.eval()


@pytest.mark.parametrize("which", ["mlp", "cnn", "cnn_odd", "batchnorm"])
def test_from_sequential_matches_torch(which: str) -> None:
    net, shape = {
        "mlp": (testing.mlp([6, 10, 10, 4], seed=1), (6,)),
        "cnn": (testing.cnn(2), testing.CNN_INPUT_SHAPE),
        "cnn_odd": (testing.cnn(3, (3, 7, 9)), (3, 7, 9)),
        "batchnorm": (_bn_net(), (2, 8, 8)),
    }[which]
    graph = from_sequential(net, shape)
    assert graph.input_shape == tuple(shape)
    x = torch.from_numpy(random_inputs(shape, 5, seed=4)) * 2 - 1
    with torch.no_grad():
        expected = net(x).reshape(5, -1)
    torch.testing.assert_close(graph(x), expected, rtol=1e-5, atol=1e-5)


def test_from_sequential_unsupported_module() -> None:
    with pytest.raises(ModelError, match="Sigmoid"):
        from_sequential(nn.Sequential(nn.Linear(3, 3), nn.Sigmoid()), (3,))


def test_what_the_loader_does_not_follow_is_one_line(tmp_path: Path) -> None:
    """Opsets outside ``OPSETS``, ``Reshape`` with ``allowzero=1`` and a 0, ``BatchNormalization`` in
    training mode: each a ModelError naming the file or node (what ``supports`` claims is what loads)."""
    path = testing.mlp_onnx(tmp_path / "m.onnx", [2, 3, 2], 0)
    for opset in (7, 22):
        model = onnx.load(path)
        model.opset_import[0].version = opset
        onnx.save(model, tmp_path / f"o{opset}.onnx")
        with pytest.raises(ModelError, match=f"opset {opset} is outside the supported 8..21"):
            load_model(tmp_path / f"o{opset}.onnx")
    shape = numpy_helper.from_array(np.array([0, 4], dtype=np.int64), "s")
    reshape = helper.make_node("Reshape", ["x", "s"], ["y"], name="rs", allowzero=1)
    io = helper.make_tensor_value_info
    graph = helper.make_graph([reshape], "g", [io("x", TensorProto.FLOAT, [1, 4])],
                              [io("y", TensorProto.FLOAT, [1, 4])], [shape])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), tmp_path / "r.onnx")
    with pytest.raises(ModelError, match="rs.*allowzero=1"):
        load_model(tmp_path / "r.onnx")
    consts = [numpy_helper.from_array(np.ones(2, dtype=np.float32), n) for n in ("sc", "b", "m", "v")]
    bn = helper.make_node("BatchNormalization", ["x", "sc", "b", "m", "v"], ["y"], name="bn", training_mode=1)
    graph = helper.make_graph([bn], "g", [io("x", TensorProto.FLOAT, [1, 2, 2, 2])],
                              [io("y", TensorProto.FLOAT, [1, 2, 2, 2])], consts)  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)]), tmp_path / "b.onnx")
    with pytest.raises(ModelError, match="bn.*training_mode=1"):
        load_model(tmp_path / "b.onnx")
