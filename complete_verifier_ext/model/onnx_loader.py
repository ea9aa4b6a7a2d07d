"""ONNX (also ``.onnx.gz``) -> :class:`Graph` of bound operators.

Constant sub-graphs (Shape/Gather/Concat/... chains feeding a Reshape, say) are evaluated once with
onnx's reference evaluator; every other node maps to one operator class through ``_CONVERTERS``.
An operator that is not there is an error naming the op type and the node.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..bounds.graph import Graph
from ..bounds.ops import Add, Affine, Conv, Flatten, Input, Linear, Relu, fold_affine_into
from ..errors import UserError


class ModelError(UserError):
    """A model the verifier cannot read; the message names the file and the node."""


def read_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ModelError(f"{path}: the file is empty")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return onnx.load_model_from_string(f.read())
        return onnx.load(path)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except Exception as e:
        raise ModelError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None


def finite(value: np.ndarray, where: str) -> np.ndarray:
    """``value``, or a :class:`ModelError` naming ``where`` if it holds a NaN or an infinity: no bound
    computed from such a weight means anything."""
    if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
        bad = int(np.size(value) - np.isfinite(value).sum())
        raise ModelError(f"{where} holds {bad} NaN or infinite value(s)")
    return value


def check_finite(graph: Graph) -> Graph:
    """Every weight and constant of every operator is finite (also after folding, e.g. a BatchNorm
    with a zero variance and epsilon); else a :class:`ModelError` naming the node."""
    for node in graph.nodes:
        for name, v in vars(node.op).items():
            t = getattr(v, "local", v)  # a ShardedWeight holds its tensor in .local
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ModelError(f"{graph.source}: node '{node.name}': its {name} is not finite (NaN or inf)")
    return graph


class _Builder:
    """Walks the ONNX nodes in order, keeping for every tensor name either a constant or a node."""

    def __init__(self, model: onnx.ModelProto, path: str):
        self.path = path
        self.graph = Graph(source=path)
        self.consts: dict[str, np.ndarray] = {}
        for i in model.graph.initializer:
            self.consts[i.name] = finite(numpy_helper.to_array(i), f"{path}: initializer '{i.name}'")
        self.node_of: dict[str, int] = {}
        self.sample: dict[int, torch.Tensor] = {}  # one example value per node, to infer shapes
        self.opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=13)
        self.unbatched = False  # the model's input is one vector without a batch axis (W @ x models)

    def error(self, node: onnx.NodeProto, msg: str) -> ModelError:
        return ModelError(f"{self.path}: node '{node.name or node.output[0]}' ({node.op_type}): {msg}")

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name)

    def add(self, node: onnx.NodeProto, op, inputs: tuple[int, ...]) -> None:
        value = op.forward(*(self.sample[i] for i in inputs))
        idx = self.graph.add(node.name or node.output[0], op, inputs, value.shape[1:])
        self.sample[idx] = value
        self.node_of[node.output[0]] = idx

    def alias(self, node: onnx.NodeProto, idx: int) -> None:
        self.node_of[node.output[0]] = idx

    def per_sample_const(self, c: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """A constant broadcast against (B, *shape): drop leading axes of size 1 beyond len(shape)."""
        t = torch.as_tensor(np.array(c, dtype=np.float32))
        while t.dim() > len(shape) and t.shape[0] == 1:
            t = t[0]
        if t.dim() > len(shape):
            raise ValueError(f"constant of shape {tuple(c.shape)} does not broadcast to {shape}")
        return t


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _gemm(b: _Builder, node, x: int) -> None:
    a = _attrs(node)
    if a.get("transA", 0):
        raise b.error(node, "transA=1 is not supported")
    W = b.const(node.input[1])
    if W is None:
        raise b.error(node, "the second input must be a constant weight")
    W = W.T if not a.get("transB", 0) else W  # -> (out, in)
    W = torch.as_tensor(np.array(W, dtype=np.float32)) * float(a.get("alpha", 1.0))
    bias = None
    if len(node.input) > 2 and node.input[2]:
        c = b.const(node.input[2])
        if c is None:
            raise b.error(node, "the bias must be a constant")
        bias = torch.as_tensor(np.array(c, dtype=np.float32)).reshape(-1).expand(W.shape[0])
        bias = bias * float(a.get("beta", 1.0))
    if len(b.graph.nodes[x].shape) != 1:
        raise b.error(node, f"expects a flat input, got shape {b.graph.nodes[x].shape}")
    b.add(node, Linear(W, bias), (x,))


def _matmul(b: _Builder, node, x: int) -> None:
    """``x @ W`` (batched rows x) or ``W @ x`` (a model whose input is one 1-D vector, as the ACAS Xu
    nets of VNN-COMP: ``W`` of shape (out, in) times ``x`` of shape (in,)), W a constant 2-D matrix:
    both are one Linear layer with weight (out, in)."""
    W_right, W_left = b.const(node.input[1]), b.const(node.input[0])
    if len(b.graph.nodes[x].shape) != 1:
        raise b.error(node, f"expects a flat input, got shape {b.graph.nodes[x].shape}")
    if W_right is not None and W_right.ndim == 2:
        weight = W_right.T
    elif W_left is not None and W_left.ndim == 2 and b.unbatched:
        weight = W_left  # W @ x on a vector
    else:
        raise b.error(node, "only x @ W, or W @ x on a 1-D model input, with a constant 2-D W is supported")
    b.add(node, Linear(torch.as_tensor(np.array(weight, dtype=np.float32)), None), (x,))


def _conv(b: _Builder, node, x: int) -> None:
    a = _attrs(node)
    if a.get("group", 1) != 1:
        raise b.error(node, "grouped convolutions are not supported")
    W = b.const(node.input[1])
    if W is None or W.ndim != 4:
        raise b.error(node, "only 2-D convolutions with a constant weight are supported")
    pads = list(a.get("pads", [0, 0, 0, 0]))
    if pads[0] != pads[2] or pads[1] != pads[3]:
        raise b.error(node, f"asymmetric padding {pads} is not supported")
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise b.error(node, "auto_pad is not supported")
    bias = None
    if len(node.input) > 2 and node.input[2]:
        bias = torch.as_tensor(np.array(b.const(node.input[2]), dtype=np.float32))
    op = Conv(
        torch.as_tensor(np.array(W, dtype=np.float32)),
        bias,
        a.get("strides", [1, 1]),
        pads[:2],
        a.get("dilations", [1, 1]),
    )
    b.add(node, op, (x,))


def _relu(b: _Builder, node, x: int) -> None:
    b.add(node, Relu(), (x,))


def _flatten(b: _Builder, node, x: int) -> None:
    axis = _attrs(node).get("axis", 1)
    shape = b.graph.nodes[x].shape
    if axis not in (1, -len(shape) - 1 + 1) and axis != 1:
        raise b.error(node, f"Flatten axis {axis} would mix the batch axis")
    b.add(node, Flatten((int(np.prod(shape)),)), (x,))


def _reshape(b: _Builder, node, x: int) -> None:
    target = b.const(node.input[1])
    if target is None:
        raise b.error(node, "the target shape must be constant")
    target = [int(t) for t in target]
    if _attrs(node).get("allowzero", 0) and 0 in target:
        raise b.error(node, "allowzero=1 with a 0 in the target shape is not supported")
    shape = b.graph.nodes[x].shape
    if target and target[0] in (1, -1, 0):
        target = target[1:]  # the batch axis
    else:
        raise b.error(node, f"target shape {target} must keep the batch axis first")
    full = [shape[i] if t == 0 and i < len(shape) else t for i, t in enumerate(target)]
    if -1 in full:
        known = int(np.prod([t for t in full if t != -1]))
        full[full.index(-1)] = int(np.prod(shape)) // max(known, 1)
    if int(np.prod(full)) != int(np.prod(shape)):
        raise b.error(node, f"cannot reshape {shape} to {full}")
    b.add(node, Flatten(tuple(full)), (x,))


def _identity(b: _Builder, node, x: int) -> None:
    b.alias(node, x)


def _binary(kind: str) -> Callable:
    def convert(b: _Builder, node, _x: int) -> None:
        n0, n1 = node.input[0], node.input[1]
        c0, c1 = b.const(n0), b.const(n1)
        shape = None
        if c0 is None and c1 is None:
            if kind not in ("Add", "Sub"):
                raise b.error(node, "products of two network tensors are not supported")
            i, j = b.node_of[n0], b.node_of[n1]
            if b.graph.nodes[i].shape != b.graph.nodes[j].shape:
                raise b.error(node, "broadcasting between two network tensors is not supported")
            b.add(node, Add(1.0 if kind == "Add" else -1.0), (i, j))
            return
        x = b.node_of[n1 if c0 is not None else n0]
        shape = b.graph.nodes[x].shape
        try:
            c = b.per_sample_const(c0 if c0 is not None else c1, shape)
        except ValueError as e:
            raise b.error(node, str(e)) from None
        const_first = c0 is not None
        if kind == "Add":
            op = Affine(1.0, c)
        elif kind == "Sub":
            op = Affine(-1.0, c) if const_first else Affine(1.0, -c)
        elif kind == "Mul":
            op = Affine(c, 0.0)
        elif kind == "Div":
            if const_first:
                raise b.error(node, "division by a network tensor is not supported")
            op = Affine(1.0 / c, 0.0)
        else:  # pragma: no cover
            raise b.error(node, "unsupported")
        prev = b.graph.nodes[x].op
        if (
            kind in ("Add", "Sub")
            and not const_first
            and isinstance(prev, Linear)
            and _is_vector(op.shift, shape)
        ):
            _merge_bias(b, node, x, op.shift)  # MatMul + Add -> one Linear
            return
        b.add(node, op, (x,))

    return convert


def _is_vector(t: torch.Tensor, shape) -> bool:
    return len(shape) == 1 and (t.dim() == 0 or tuple(t.shape) == tuple(shape))


def _merge_bias(b: _Builder, node, x: int, shift: torch.Tensor) -> None:
    lin: Linear = b.graph.nodes[x].op
    users = [n for n in b.graph.nodes if x in n.inputs]
    if users:  # the MatMul output is used elsewhere: keep a separate op
        b.add(node, Affine(1.0, shift), (x,))
        return
    add = shift.expand(lin.out_features)
    lin.bias = add.clone() if lin.bias is None else lin.bias + add
    b.sample[x] = lin.forward(b.sample[b.graph.nodes[x].inputs[0]])
    b.alias(node, x)


def _neg(b: _Builder, node, x: int) -> None:
    b.add(node, Affine(-1.0, 0.0), (x,))


def _batchnorm(b: _Builder, node, x: int) -> None:
    if _attrs(node).get("training_mode", 0):
        raise b.error(node, "training_mode=1 is not supported (inference only)")
    eps = _attrs(node).get("epsilon", 1e-5)
    scale, bias, mean, var = (np.array(b.const(n), dtype=np.float64) for n in node.input[1:5])
    s = scale / np.sqrt(var + eps)
    t = bias - mean * s
    shape = b.graph.nodes[x].shape
    view = (-1,) + (1,) * (len(shape) - 1)
    op = Affine(
        torch.tensor(s, dtype=torch.float32).view(view), torch.tensor(t, dtype=torch.float32).view(view)
    )
    prev = b.graph.nodes[x].op
    users = [n for n in b.graph.nodes if x in n.inputs]
    if not users and fold_affine_into(prev, op):
        b.sample[x] = prev.forward(b.sample[b.graph.nodes[x].inputs[0]])
        b.alias(node, x)
        return
    b.add(node, op, (x,))


OPSETS = (8, 21)  # the default-domain opsets whose semantics of the operators below this loader follows
FOLDED = ("Constant", "Shape")  # evaluated when loading (as is any node whose inputs are all constant)

_CONVERTERS: Mapping[str, Callable] = MappingProxyType(
    {
        "Gemm": _gemm,
        "MatMul": _matmul,
        "Conv": _conv,
        "Relu": _relu,
        "Flatten": _flatten,
        "Reshape": _reshape,
        "Identity": _identity,
        "Dropout": _identity,
        "Add": _binary("Add"),
        "Sub": _binary("Sub"),
        "Mul": _binary("Mul"),
        "Div": _binary("Div"),
        "Neg": _neg,
        "BatchNormalization": _batchnorm,
    }
)
OPERATORS = tuple(_CONVERTERS)  # what a model's nodes may be (``complete-verifier-ext supports``)


def _fold_constant(b: _Builder, node: onnx.NodeProto) -> bool:
    """Evaluate a node whose inputs are all constants (or a Shape of a known tensor)."""
    if node.op_type == "Constant":
        value = numpy_helper.to_array(_attrs_raw(node))
        b.consts[node.output[0]] = finite(value, f"{b.path}: Constant node '{node.name or node.output[0]}'")
        return True
    if node.op_type == "Shape" and node.input[0] in b.node_of:
        shape = (1,) + b.graph.nodes[b.node_of[node.input[0]]].shape
        b.consts[node.output[0]] = np.array(shape, dtype=np.int64)
        return True
    if not all((n == "" or n in b.consts) for n in node.input):
        return False
    from onnx.reference import ReferenceEvaluator

    g = onnx.helper.make_graph(
        [node],
        "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in node.input if n],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in node.output],
    )
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", b.opset)])
    try:
        outs = ReferenceEvaluator(m).run(None, {n: b.consts[n] for n in node.input if n})
    except Exception as e:
        raise b.error(node, f"cannot evaluate constant node ({e})") from None
    for name, val in zip(node.output, outs, strict=True):
        b.consts[name] = np.asarray(val)
    return True


def _attrs_raw(node: onnx.NodeProto):
    for a in node.attribute:
        if a.name == "value":
            return a.t
    raise ModelError(f"Constant node '{node.name}' has no tensor 'value'")


def load_onnx(path: str | os.PathLike) -> Graph:
    """Read an ONNX model into a :class:`Graph` (unsharded; call ``graph.shard(mode)`` afterwards)."""
    path = os.fspath(path)
    model = read_onnx(path)
    b = _Builder(model, path)
    if not OPSETS[0] <= b.opset <= OPSETS[1]:
        raise ModelError(f"{path}: opset {b.opset} is outside the supported {OPSETS[0]}..{OPSETS[1]}")
    inputs = [i for i in model.graph.input if i.name not in b.consts]
    if len(inputs) != 1:
        raise ModelError(f"{path}: expected one network input, found {len(inputs)}")
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in inputs[0].type.tensor_type.shape.dim]
    shape = tuple(dims[1:]) if len(dims) > 1 else tuple(dims)
    b.unbatched = len(dims) == 1
    idx = b.graph.add(inputs[0].name, Input(), (), shape)
    b.node_of[inputs[0].name] = idx
    b.sample[idx] = torch.rand(1, *shape)
    for node in model.graph.node:
        if _fold_constant(b, node):
            continue
        conv = _CONVERTERS.get(node.op_type)
        if conv is None:
            raise b.error(node, f"operator '{node.op_type}' is not supported")
        x = next((b.node_of[n] for n in node.input if n in b.node_of), None)
        if x is None:
            raise b.error(node, "no input depends on the network input")
        try:
            conv(b, node, x)
        except KeyError as e:
            raise b.error(node, f"unknown input tensor {e}") from None
    out = model.graph.output[0].name
    if out not in b.node_of:
        raise ModelError(f"{path}: the output '{out}' does not depend on the input")
    if b.node_of[out] != len(b.graph.nodes) - 1:
        raise ModelError(f"{path}: the output must be the last computed node")
    return check_finite(b.graph)


def load_model(path: str | os.PathLike) -> Graph:
    """Entry point for model files (ONNX, optionally gzipped)."""
    p = os.fspath(path)
    if not (p.endswith(".onnx") or p.endswith(".onnx.gz")):
        raise ModelError(f"{p}: expected an .onnx or .onnx.gz file")
    return load_onnx(p)
