"""Small ONNX models written node by node with ``onnx.helper``, one per shape of layer that the field's
models put in front of a sharded verifier (VNN-COMP's nn4sys, tllverifybench, linearizenn, dist_shift,
ml4acopf, ...): Gemm in every form, MatMul with the constant on either side, layers with fewer output
rows than ranks, Slice / Concat / Split / Reshape between linear layers, Sigmoid and Tanh, a residual sum,
ConvTranspose, BatchNorm after Gemm, and onnx2pytorch's module names with dots in them.

Each model has one input ``X`` of shape ``(1, *in_shape)`` and one output ``Y`` of shape ``(1, n)``;
:func:`write` saves it with a VNN-LIB spec whose every output has a bound no sound bound can cross
(``Y_0 <= -1e4``: unsat wherever the bounds are finite), so that every run computes CROWN's bounds of
``Y_0`` and the verdict is ``unsat`` at every P."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Net:
    """A graph under construction: ``Net(in_shape)``, then layers, then :meth:`model`."""

    def __init__(self, in_shape: tuple[int, ...], seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.in_shape = in_shape
        self.nodes: list = []
        self.inits: list = []
        self.last = "X"
        self.count = 0

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}_{self.count}"

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        name = name or self._name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name))
        return name

    def ints(self, *values: int) -> str:
        name = self._name("i")
        self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def rand(self, *shape: int, scale: float | None = None) -> np.ndarray:
        fan = shape[-1] if len(shape) == 2 else int(np.prod(shape[1:]) or 1)
        return self.rng.normal(0.0, scale or (1.0 / np.sqrt(max(fan, 1))), shape).astype(np.float32)

    def node(
        self, op: str, inputs: list[str], name: str | None = None, out: str | None = None, **attrs
    ) -> str:
        out = out or self._name(f"{op.lower()}_out")
        self.nodes.append(helper.make_node(op, inputs, [out], name=name or self._name(op), **attrs))
        self.last = out
        return out

    def gemm(self, n_in: int, n_out: int, x: str | None = None, trans_b: int = 1, alpha: float = 1.0,
             beta: float = 1.0, name: str | None = None, out: str | None = None) -> str:  # fmt: skip
        w = self.rand(n_out, n_in) if trans_b else self.rand(n_in, n_out)
        attrs = {"transB": trans_b} if trans_b else {}
        if alpha != 1.0:
            attrs["alpha"] = alpha
        if beta != 1.0:
            attrs["beta"] = beta
        b = self.rand(n_out, scale=0.1)
        return self.node("Gemm", [x or self.last, self.const(w), self.const(b)], name=name, out=out, **attrs)

    def matmul(self, n_in: int, n_out: int, x: str | None = None, bias: bool = True) -> str:
        y = self.node("MatMul", [x or self.last, self.const(self.rand(n_in, n_out))])
        return self.node("Add", [self.const(self.rand(n_out, scale=0.1)), y]) if bias else y

    def relu(self, x: str | None = None) -> str:
        return self.node("Relu", [x or self.last])

    def model(self, n_out: int) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Identity", [self.last], ["Y"], name="output"))
        graph = helper.make_graph(
            self.nodes,
            "zoo",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, *self.in_shape])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n_out])],
            self.inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        return model


def gemm_forms() -> tuple[onnx.ModelProto, int]:
    """Gemm with transB = 0 (the weight stored (in, out)), alpha and beta other than 1, then the usual."""
    n = Net((6,))
    n.gemm(6, 8, trans_b=0, alpha=0.5, beta=2.0)
    n.relu()
    n.gemm(8, 7, trans_b=1, alpha=1.5)
    n.relu()
    n.gemm(7, 3, trans_b=0)
    return n.model(3), 3


def gemm_trans_a() -> tuple[onnx.ModelProto, int]:
    """Gemm with transA = 1: its input transposed (the model's (1, 6) input made (6, 1) first). Not in
    :data:`BUILDERS`: onnx2pytorch refuses it ("Not implemented for attr.name=transA"), so α,β-CROWN
    cannot load it in one process either."""
    n = Net((6,))
    t = n.node("Transpose", ["X"], perm=[1, 0])
    n.node("Gemm", [t, n.const(n.rand(6, 8)), n.const(n.rand(8, scale=0.1))], transA=1)
    n.relu()
    n.gemm(8, 2)
    return n.model(2), 2


def matmul_right() -> tuple[onnx.ModelProto, int]:
    """MatMul with the constant on the right (``x @ W``, W stored (in, out)), with and without a bias
    Add after it. (A constant on the left is onnx2pytorch's ``nn.Linear`` of the wrong orientation:
    α,β-CROWN fails on it in one process too.)"""
    n = Net((6,))
    n.matmul(6, 9)
    n.relu()
    n.matmul(9, 5, bias=False)
    n.relu()
    n.gemm(5, 2)
    return n.model(2), 2


def narrow_rows(rows: int) -> Callable[[], tuple[onnx.ModelProto, int]]:
    """Linear layers with ``rows`` output rows (1, or P - 1: fewer than the ranks), hidden and last."""

    def build() -> tuple[onnx.ModelProto, int]:
        n = Net((5,))
        n.gemm(5, 12)
        n.relu()
        n.gemm(12, rows)
        n.relu()
        n.gemm(rows, 6)
        n.relu()
        n.matmul(6, rows)
        n.relu()
        n.gemm(rows, 1)
        return n.model(1), 1

    build.__name__ = f"rows_{rows}"
    return build


def slices_between() -> tuple[onnx.ModelProto, int]:
    """Slice, Split, Concat and Reshape between Linear layers (nn4sys's pensieve and mscn shapes)."""
    n = Net((8,))
    h = n.relu(n.gemm(8, 12))
    a = n.node("Slice", [h, n.ints(0), n.ints(5), n.ints(1)])
    b = n.node("Slice", [h, n.ints(5), n.ints(12), n.ints(1)])
    a2 = n.relu(n.gemm(5, 6, x=a))
    b2 = n.relu(n.matmul(7, 6, x=b))
    cat = n.node("Concat", [a2, b2], axis=1)  # (1, 12)
    outs = ["split_0", "split_1"]
    n.nodes.append(helper.make_node("Split", [cat], outs, name="split", axis=-1))  # two halves
    r = n.node("Reshape", [outs[1], n.ints(-1, 2, 3)])
    r = n.node("Reshape", [r, n.ints(-1, 6)])
    both = n.node("Concat", [outs[0], r], axis=1)  # (1, 12)
    n.relu(n.gemm(12, 7, x=both))
    n.gemm(7, 2)
    return n.model(2), 2


def smooth_between() -> tuple[onnx.ModelProto, int]:
    """Sigmoid and Tanh between Linear layers (dist_shift's generator, ml4acopf)."""
    n = Net((6,))
    n.node("Sigmoid", [n.gemm(6, 10)])
    n.relu(n.gemm(10, 9))
    n.node("Tanh", [n.gemm(9, 8)])
    n.gemm(8, 3)
    return n.model(3), 3


def residual() -> tuple[onnx.ModelProto, int]:
    """A residual sum over sharded layers: ``h + W2 relu(W1 h)``."""
    n = Net((6,))
    h = n.relu(n.gemm(6, 10))
    inner = n.relu(n.gemm(10, 10, x=h))
    s = n.node("Add", [h, n.gemm(10, 10, x=inner)])
    n.relu(s)
    n.gemm(10, 3)
    return n.model(3), 3


def conv_transpose() -> tuple[onnx.ModelProto, int]:
    """Conv, ReLU, ConvTranspose (cGAN's upsampling), Flatten, Gemm."""
    n = Net((2, 5, 5))
    n.node("Conv", ["X", n.const(n.rand(4, 2, 3, 3)), n.const(n.rand(4, scale=0.1))],
           pads=[1, 1, 1, 1], kernel_shape=[3, 3])  # fmt: skip
    n.relu()
    n.node("ConvTranspose", [n.last, n.const(n.rand(4, 3, 2, 2)), n.const(n.rand(3, scale=0.1))],
           strides=[2, 2], kernel_shape=[2, 2])  # fmt: skip
    n.relu()
    n.node("Flatten", [n.last], axis=1)
    n.gemm(3 * 10 * 10, 3)
    return n.model(3), 3


def batchnorm_after_gemm() -> tuple[onnx.ModelProto, int]:
    """BatchNormalization on a Gemm's output (traffic_signs_recognition's dense part)."""
    n = Net((6,))
    n.gemm(6, 10)
    scale, shift = n.rng.uniform(0.5, 1.5, 10), n.rng.normal(0, 0.1, 10)
    mean, var = n.rng.normal(0, 0.1, 10), n.rng.uniform(0.5, 1.5, 10)
    n.node("BatchNormalization", [n.last, *(n.const(v) for v in (scale, shift, mean, var))])
    n.relu()
    n.gemm(10, 3)
    return n.model(3), 3


def dotted_names() -> tuple[onnx.ModelProto, int]:
    """Nodes and outputs named as PyTorch's exporter names them (``/main/main.0/Gemm``, ``input.1``):
    onnx2pytorch's module names then hold dots (linearizenn, dist_shift)."""
    n = Net((6,))
    n.gemm(6, 9, name="/main/main.0/Gemm", out="/main/main.0/Gemm_output_0")
    n.node("Relu", [n.last], name="/main/main.1/Relu", out="input.1")
    n.gemm(9, 8, name="Gemm_3", out="input.4")
    n.node("Relu", [n.last], name="Relu_4", out="onnx::Gemm_8")
    n.gemm(8, 2, name="/main/main.4/Gemm", out="/main/main.4/Gemm_output_0")
    return n.model(2), 2


def nonlinear_output() -> tuple[onnx.ModelProto, int]:
    """An output that is a sum of two branches, not a linear layer: IBP cannot merge the spec into it
    (auto_LiRPA's ``BoundLinear.interval_propagate(None, ...)``)."""
    n = Net((6,))
    h = n.relu(n.gemm(6, 8))
    n.node("Add", [n.gemm(8, 2, x=h), n.gemm(6, 2, x="X")])
    return n.model(2), 2


BUILDERS: tuple[Callable[[], tuple[onnx.ModelProto, int]], ...] = (
    gemm_forms,
    matmul_right,
    narrow_rows(1),
    narrow_rows(2),
    slices_between,
    smooth_between,
    residual,
    conv_transpose,
    batchnorm_after_gemm,
    dotted_names,
    nonlinear_output,
)


def _box(in_shape: tuple[int, ...], seed: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    x0 = np.random.default_rng(seed + 1).uniform(-0.5, 0.5, int(np.prod(in_shape)))
    return x0 - eps, x0 + eps


def spec_text(lo: np.ndarray, hi: np.ndarray, n_out: int, threshold: float) -> str:
    """The box ``[lo, hi]`` and the unsafe set ``Y_0 <= threshold``."""
    lines = [f"(declare-const X_{i} Real)" for i in range(lo.size)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_out)]
    for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
        lines += [f"(assert (>= X_{i} {a:.6f}))", f"(assert (<= X_{i} {b:.6f}))"]
    lines.append(f"(assert (<= Y_0 {threshold:.6f}))")
    return "\n".join(lines) + "\n"


def thresholds(model: onnx.ModelProto, lo: np.ndarray, hi: np.ndarray, in_shape, seed: int) -> dict:
    """The specs' thresholds on ``Y_0``: ``easy``, below any bound (unsat, proved by the first bound);
    ``hard``, a little below the least sampled value (most likely unsat, and not by the first bound:
    BaB or an attack decides); ``sat``, the median sampled value (an attack finds a counterexample)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    xs = rng.uniform(lo, hi, (512, lo.size)).astype(np.float32)
    ys = np.array([sess.run(None, {"X": x.reshape(1, *in_shape)})[0].reshape(-1)[0] for x in xs])
    spread = float(ys.max() - ys.min()) or 1.0
    return {"easy": -1e4, "hard": float(ys.min() - 0.05 * spread), "sat": float(np.median(ys))}


def write(folder: Path, builders=BUILDERS, kinds=("easy",), eps: float = 0.1) -> list[tuple[str, Path, Path]]:
    """Every model, and its spec of each kind (:func:`thresholds`), in ``folder``: ``[(name, onnx,
    vnnlib)]``, the name ``MODEL`` or ``MODEL-KIND``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, build in enumerate(builders):
        model, n_out = build()
        shape = tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:])
        onnx_path = folder / f"{build.__name__}.onnx"
        onnx.save(model, onnx_path)
        lo, hi = _box(shape, i, eps)
        limits = thresholds(model, lo, hi, shape, i)
        for kind in kinds:
            name = build.__name__ if kinds == ("easy",) else f"{build.__name__}-{kind}"
            spec_path = folder / f"{name}.vnnlib"
            spec_path.write_text(spec_text(lo, hi, n_out, limits[kind]))
            out.append((name, onnx_path, spec_path))
    return out
