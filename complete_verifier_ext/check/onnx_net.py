"""The network as the checker reads it: an ONNX graph as a DAG of affine maps, sums, ReLUs and
sigmoids on flat float64 vectors.

Every tensor is a flat vector in row-major order, batch dimension 1 (a symbolic dimension counts as
1). Node 0 is the input; the others follow the graph's (topological) order:

* :class:`Affine` ``z = W x_src + b``: Gemm, MatMul with one constant side, Conv as its matrix
  (groups 1; a sparse one, ``scipy.sparse`` CSR: each output reads one kernel's taps), and a constant
  Add / Sub / BatchNormalization composed with the affine node before it (a sparse matrix stays sparse:
  a zero coefficient times anything is an exact zero);
* :class:`Relu` ``h = max(z, 0)`` elementwise;
* :class:`Sigmoid` ``h = 1 / (1 + e^-z)`` elementwise (``sigmoid.py``);
* :class:`Sum` ``z = x_a + sign·x_b``: Add or Sub of two tensors of one shape (a residual connection).

Flatten, Reshape, Identity and Dropout only rename a vector; constant subgraphs (Shape, Gather,
Concat, …) are folded by ``onnx.reference``. The weights are the file's (float32 to float64 is exact).
Where composing rounds (Gemm's ``alpha``, ``scale / √(var + ε)``, a bias added to a bias), the node
carries radii: the real map's coefficients lie in ``W ± W_rad``, ``b ± b_rad``. Anything else is
:class:`Unsupported`, naming the node and its op.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import onnx
import scipy.sparse as sp
from onnx import helper, numpy_helper

from .files import Unsupported
from .rounding import ETA, U, gamma, up

F64 = np.float64
_FOLDABLE = frozenset("Identity Reshape Flatten Transpose Unsqueeze Squeeze Concat Gather Slice Cast".split())
_FOLDABLE = _FOLDABLE | {"ConstantOfShape", "Range"}


@dataclass(frozen=True)
class Input:
    size: int


@dataclass(frozen=True, eq=False)
class Affine:
    """``z = W x_src + b``; ``E = up(γ |W| + W_rad)`` and ``eb = up(γ |b| + b_rad)``, with ``γ`` =
    ``gamma(2 n_in + n_out)``: per unit of ``|x|``, a bound on the rounding error of ``W x + b`` (or of
    ``a W`` in a backward pass) plus the radii. ``W`` is a dense array or a CSR matrix; ``W_rad``, ``E``,
    ``Wp`` and ``Wn`` are then CSR matrices with ``W``'s entries (:func:`matmul` takes either). A
    product over a sparse matrix sums fewer terms than the dense one, the others exact zeros: the same
    error bound holds."""

    src: int
    W: np.ndarray | sp.csr_array  # (n_out, n_in)
    b: np.ndarray  # (n_out,)
    W_rad: np.ndarray | sp.csr_array | None
    b_rad: np.ndarray | None
    E: np.ndarray | sp.csr_array
    eb: np.ndarray
    Wp: np.ndarray | sp.csr_array  # max(W, 0)^T and min(W, 0)^T: interval propagation's
    Wn: np.ndarray | sp.csr_array


def affine(src: int, W, b, W_rad=None, b_rad=None) -> Affine:
    b = np.ascontiguousarray(b, dtype=F64)
    g = gamma(2 * W.shape[1] + W.shape[0] + 2)
    eb = up(g * np.abs(b) + b_rad) if b_rad is not None else g * np.abs(b)
    if sp.issparse(W):
        E = _like(W, up(g * np.abs(W.data) + W_rad.data) if W_rad is not None else g * np.abs(W.data))
        Wp, Wn = (_like(W, f(W.data, 0.0)).T.tocsr() for f in (np.maximum, np.minimum))
        return Affine(src, W, b, W_rad, b_rad, E, eb, Wp, Wn)
    W = np.ascontiguousarray(W, dtype=F64)
    E = up(g * np.abs(W) + W_rad) if W_rad is not None else g * np.abs(W)
    Wp, Wn = np.ascontiguousarray(np.maximum(W, 0.0).T), np.ascontiguousarray(np.minimum(W, 0.0).T)
    return Affine(src, W, b, W_rad, b_rad, E, eb, Wp, Wn)


def _like(W: sp.csr_array, data: np.ndarray) -> sp.csr_array:
    """A CSR matrix with ``W``'s entries (positions) and the values ``data``."""
    return sp.csr_array((np.asarray(data, dtype=F64), W.indices, W.indptr), shape=W.shape)


def matmul(x: np.ndarray, M) -> np.ndarray:
    """``x @ M`` for ``x`` of shape ``(..., n)`` and ``M`` ``(n, m)``, dense or sparse: ``(..., m)``."""
    if not sp.issparse(M):
        return x @ M
    flat = x.reshape(-1, x.shape[-1])
    return np.asarray(M.T @ flat.T).T.reshape(*x.shape[:-1], M.shape[1])


def entries(node: Affine) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row, column, coefficient and radius of every entry of ``node.W`` that is non-zero or has a
    radius: a sparse matrix's stored entries, a dense one's non-zeros."""
    if sp.issparse(node.W):
        i = np.repeat(np.arange(node.W.shape[0]), np.diff(node.W.indptr))
        rad = np.zeros(len(i)) if node.W_rad is None else node.W_rad.data
        return i, node.W.indices, node.W.data, rad
    W_rad = np.zeros_like(node.W) if node.W_rad is None else node.W_rad
    i, j = np.nonzero((node.W != 0) | (W_rad != 0))
    return i, j, node.W[i, j], W_rad[i, j]


@dataclass(frozen=True)
class Relu:
    src: int
    layer: int  # position among the graph's Relu nodes


@dataclass(frozen=True)
class Sigmoid:
    src: int


@dataclass(frozen=True)
class Sum:
    a: int
    b: int
    sign: float


@dataclass(frozen=True)
class ReluLayer:
    """A Relu node of the graph as proofs name it (a Sigmoid node, in :attr:`Net.sigmoid_layers`):
    ``id`` (its position among the Relu, or Sigmoid, nodes), its output tensor's name, its size;
    ``node``: its index in :attr:`Net.nodes` (-1: it does not reach the output)."""

    id: int
    output: str
    size: int
    node: int
    network: str | None = None  # a 2.0 query's network it is in (its output is named in that file)


@dataclass(frozen=True)
class Net:
    nodes: tuple
    sizes: tuple[int, ...]
    output: int
    relu_layers: tuple[ReluLayer, ...]
    sigmoid_layers: tuple[ReluLayer, ...] = ()


def sources(node) -> tuple[int, ...]:
    return (node.a, node.b) if isinstance(node, Sum) else () if isinstance(node, Input) else (node.src,)


@dataclass
class _Var:
    node: int
    shape: tuple[int, ...]


def parse(data: bytes, name: str) -> Net:
    """The network of an ONNX file's bytes (``name``: the file, for messages); :class:`Unsupported` for
    what it cannot read."""
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError
        raise Unsupported(f"{name}: not an ONNX model ({type(e).__name__})") from None
    g = model.graph
    env: dict = {t.name: _finite(numpy_helper.to_array(t), f"initializer {t.name}") for t in g.initializer}
    inputs = [i for i in g.input if i.name not in env]
    if len(inputs) != 1 or len(g.output) != 1 or not inputs[0].type.tensor_type.HasField("shape"):
        raise Unsupported(f"graph {g.name}: one input with a shape and one output are needed")
    shape = tuple(max(d.dim_value, 1) for d in inputs[0].type.tensor_type.shape.dim)
    env[inputs[0].name] = _Var(0, shape)
    b = _Builder([Input(math.prod(shape))], env, [], [], list(model.opset_import))
    for node in g.node:
        b.add(node)
    out = env.get(g.output[0].name)
    if not isinstance(out, _Var):
        raise Unsupported(f"{g.output[0].name} output (a constant)")
    return _prune(b.nodes, out.node, b.relus, b.sigmoids)


def joint(parts: list[tuple[str | None, Net, tuple[int, ...], int]], n_in: int, n_out: int) -> Net:
    """The networks of a query as one net from its joint input to its joint output (``parts``: each
    network's name, net, the joint input's position of each of its inputs, the first position of its
    outputs): a network's input picked from the joint input by a 0/1 affine node (none where it is the
    joint input in order), its output placed by one, the placed outputs summed. Its ReLU layers are the
    networks' in order, numbered on, each named by its network (``None``: a 1.x query's one network);
    its Sigmoid layers alike."""
    nodes: list = [Input(n_in)]
    layers: list[ReluLayer] = []
    smooth: list[ReluLayer] = []
    placed = []
    for name, net, index, start in parts:
        at = 0
        if index != tuple(range(n_in)):
            pick = np.zeros((len(index), n_in))
            pick[np.arange(len(index)), list(index)] = 1.0
            nodes.append(affine(0, pick, np.zeros(len(index))))
            at = len(nodes) - 1
        base, first = len(nodes) - 1, len(layers)
        new = [at] + [base + k for k in range(1, len(net.nodes))]
        for node in map(lambda n: _moved(n, new), net.nodes[1:]):
            nodes.append(
                dataclasses.replace(node, layer=node.layer + first) if isinstance(node, Relu) else node
            )
        for listed, into in ((net.relu_layers, layers), (net.sigmoid_layers, smooth)):
            into += [
                dataclasses.replace(
                    r, id=r.id + len(into), node=new[r.node] if r.node >= 0 else -1, network=name
                )
                for r in listed
            ]
        m, out = net.sizes[net.output], new[net.output]
        if (start, m) != (0, n_out):
            embed = np.zeros((n_out, m))
            embed[start + np.arange(m), np.arange(m)] = 1.0
            nodes.append(affine(out, embed, np.zeros(n_out)))
            out = len(nodes) - 1
        placed.append(out)
    out = placed[0]
    for other in placed[1:]:
        nodes.append(Sum(out, other, 1.0))
        out = len(nodes) - 1
    sizes = tuple(_size(nodes, k) for k in range(len(nodes)))
    return Net(tuple(nodes), sizes, out, tuple(layers), tuple(smooth))


def _finite(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise Unsupported(f"{what} (not finite)")
    return a


def _size(nodes: list, k: int) -> int:
    node = nodes[k]
    if isinstance(node, Input):
        return node.size
    return node.W.shape[0] if isinstance(node, Affine) else _size(nodes, sources(node)[0])


def _prune(nodes: list, out: int, relus: list[ReluLayer], sigmoids: list[ReluLayer]) -> Net:
    """Only the nodes the output depends on (a composed affine node leaves the one before it unused)."""
    live = {0, out}
    for k in range(len(nodes) - 1, -1, -1):
        if k in live:
            live.update(sources(nodes[k]))
    new = {k: i for i, k in enumerate(sorted(live))}
    kept = [_moved(nodes[k], new) for k in sorted(live)]
    layers, smooth = (
        tuple(dataclasses.replace(r, node=new.get(r.node, -1)) for r in x) for x in (relus, sigmoids)
    )
    sizes = tuple(_size(kept, k) for k in range(len(kept)))
    return Net(tuple(kept), sizes, new[out], tuple(layers), tuple(smooth))


def _moved(node, new):
    """``node`` reading its sources at their new indices (``new[old]``)."""
    if isinstance(node, Sum):
        return dataclasses.replace(node, a=new[node.a], b=new[node.b])
    return node if isinstance(node, Input) else dataclasses.replace(node, src=new[node.src])


def _times(a, a_rad, s, s_rad):
    """``a·s`` with the radius of the real product (``a``, ``s`` within their radii)."""
    p = a * s
    if s_rad is None and np.all(np.abs(s) == 1.0):
        return p, a_rad
    t = 2 * U * np.abs(p) + (0.0 if a_rad is None else np.abs(s) * a_rad)
    t = t + (0.0 if s_rad is None else (np.abs(a) + (0.0 if a_rad is None else a_rad)) * s_rad)
    zero = (a == 0) if a_rad is None else (a == 0) & (a_rad == 0)  # exactly 0: so is the product
    return p, np.where(zero, 0.0, up(t * (1 + 8 * U) + 4 * ETA))


def _plus(a, a_rad, c, c_rad):
    """``a + c`` with its radius: the rounding error exactly (TwoSum) plus the operands' radii."""
    s = a + c
    bb = s - a
    e = np.abs((a - (s - bb)) + (c - bb))
    if a_rad is None and c_rad is None and not e.any():
        return s, None
    t = e + (0.0 if a_rad is None else a_rad) + (0.0 if c_rad is None else c_rad)
    return s, up(t * (1 + 4 * U))


@dataclass
class _Builder:
    nodes: list
    env: dict
    relus: list[ReluLayer]
    sigmoids: list[ReluLayer]
    opsets: list

    def add(self, node: onnx.NodeProto) -> None:
        missing = [n for n in node.input if n and n not in self.env]
        if missing:
            raise _unsupported(node, f"reads {missing[0]!r}, which nothing computes")
        ins = [self.env[n] if n else None for n in node.input]
        at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Constant":
            out = _constant(node, at)
        elif not any(isinstance(x, _Var) for x in ins):
            out = self._fold(node, ins)
        else:
            handler = getattr(self, f"_op_{node.op_type.lower()}", None)
            if handler is None or node.domain not in ("", "ai.onnx"):
                raise _unsupported(node)
            out = handler(node, ins, at)
        self.env[node.output[0]] = out

    def _push(self, node, shape: tuple[int, ...]) -> _Var:
        self.nodes.append(node)
        return _Var(len(self.nodes) - 1, tuple(shape))

    def _fold(self, node, ins: list) -> np.ndarray:
        """A node of constants, evaluated by ``onnx.reference`` (shape arithmetic: exact ops only)."""
        if node.op_type not in _FOLDABLE:
            raise _unsupported(node, "of constants")
        return self._evaluate(node, ins)

    def _evaluate(self, node, ins: list) -> np.ndarray:
        from onnx.reference import ReferenceEvaluator

        init = [numpy_helper.from_array(np.asarray(x), n) for n, x in zip(node.input, ins, strict=True) if n]
        outs = [helper.make_value_info(node.output[0], onnx.TypeProto())]
        model = helper.make_model(
            helper.make_graph([node], "fold", [], outs, init), opset_imports=self.opsets
        )
        out = np.asarray(ReferenceEvaluator(model).run(None, {})[0])
        if node.op_type == "Cast" and not np.array_equal(out.astype(np.asarray(ins[0]).dtype), ins[0]):
            raise _unsupported(node, "(a cast that rounds)")
        return out

    def _compose(self, x: _Var, s, s_rad, c, c_rad) -> _Var:
        """``z = s ⊙ x + c`` (flat vectors), composed with ``x``'s affine node when it has one."""
        node = self.nodes[x.node]
        if isinstance(node, Affine):
            W, b, W_rad, b_rad, src = node.W, node.b, node.W_rad, node.b_rad, node.src
        else:
            n = math.prod(x.shape)
            eye = sp.csr_array((np.ones(n), np.arange(n), np.arange(n + 1)), shape=(n, n))
            W, b, W_rad, b_rad, src = eye, np.zeros(n), None, None, x.node
        if sp.issparse(W):  # each entry times its row's scale
            r = np.repeat(np.arange(W.shape[0]), np.diff(W.indptr))
            rad = None if W_rad is None else W_rad.data
            d, d_rad = _times(W.data, rad, s[r], None if s_rad is None else s_rad[r])
            W2, W2_rad = _like(W, d), None if d_rad is None else _like(W, d_rad)
        else:
            W2, W2_rad = _times(W, W_rad, s[:, None], None if s_rad is None else s_rad[:, None])
        b2, b2_rad = _plus(*_times(b, b_rad, s, s_rad), c, c_rad)
        return self._push(affine(src, W2, b2, W2_rad, b2_rad), x.shape)

    def _op_gemm(self, node, ins, at) -> _Var:
        x, B = ins[0], _const(node, ins[1])
        if at.get("transA", 0) or len(x.shape) != 2 or x.shape[0] != 1 or B.ndim != 2:
            raise _unsupported(node, "(only a row of one batch times a constant matrix)")
        W = (B if at.get("transB", 0) else B.T).astype(F64)
        if W.shape[1] != x.shape[1]:
            raise _unsupported(node, f"(shapes {x.shape} and {B.shape})")
        C = _const(node, ins[2]) if len(ins) > 2 and ins[2] is not None else np.zeros(1)
        b = np.broadcast_to(C.astype(F64), (1, W.shape[0])).reshape(-1)
        W, W_rad = _times(W, None, F64(at.get("alpha", 1.0)), None)
        b, b_rad = _times(b, None, F64(at.get("beta", 1.0)), None)
        return self._push(affine(x.node, W, b, W_rad, b_rad), (1, W.shape[0]))

    def _op_matmul(self, node, ins, at) -> _Var:
        a, b = ins
        if isinstance(a, _Var) and isinstance(b, np.ndarray) and b.ndim == 2:
            if a.shape and a.shape[-1] == b.shape[0] and math.prod(a.shape[:-1]) == 1:
                return self._push(affine(a.node, b.T, np.zeros(b.shape[1])), (*a.shape[:-1], b.shape[1]))
        if isinstance(b, _Var) and isinstance(a, np.ndarray) and a.ndim == 2:
            if b.shape in ((a.shape[1],), (a.shape[1], 1)):
                return self._push(affine(b.node, a, np.zeros(a.shape[0])), (a.shape[0], *b.shape[1:]))
        raise _unsupported(node, "(only a vector times a constant matrix)")

    def _op_add(self, node, ins, at, sign: float = 1.0) -> _Var:
        a, b = ins
        if isinstance(a, _Var) and isinstance(b, _Var):
            if a.shape != b.shape:
                raise _unsupported(node, f"(shapes {a.shape} and {b.shape})")
            return self._push(Sum(a.node, b.node, sign), a.shape)
        x, c = (
            (a, sign * _spread(node, b, a.shape)) if isinstance(a, _Var) else (b, _spread(node, a, b.shape))
        )
        s = np.full(c.size, 1.0 if isinstance(a, _Var) else sign)
        return self._compose(x, s, None, c, None)

    def _op_sub(self, node, ins, at) -> _Var:
        return self._op_add(node, ins, at, -1.0)

    def _op_batchnormalization(self, node, ins, at) -> _Var:
        x, (scale, bias, mean, var) = ins[0], [_const(node, v).astype(F64) for v in ins[1:5]]
        if at.get("training_mode", 0) or len(x.shape) < 2 or x.shape[0] != 1:
            raise _unsupported(node, "(inference mode, batch 1)")
        v = var + F64(at.get("epsilon", 1e-5))
        if not (v > 0).all():
            raise _unsupported(node, "(variance + epsilon <= 0)")
        s = scale / np.sqrt(v)  # three roundings, one halved by the root: within 3.5u of scale/√(var+ε)
        s_rad = up(5 * U * np.abs(s) + 4 * ETA)
        t = bias - mean * s
        t_rad = up((np.abs(mean) * s_rad + 4 * U * (np.abs(bias) + np.abs(mean * s))) * (1 + 8 * U) + 4 * ETA)
        per = math.prod(x.shape[2:])
        s, s_rad, t, t_rad = (np.repeat(a, per) for a in (s, s_rad, t, t_rad))
        return self._compose(x, s, s_rad, t, t_rad)

    def _op_conv(self, node, ins, at) -> _Var:
        x, K = ins[0], _const(node, ins[1]).astype(F64)
        pads = [0, 0, 0, 0] if at.get("auto_pad", b"NOTSET") == b"VALID" else list(at.get("pads", [0] * 4))
        ok = len(x.shape) == 4 and x.shape[0] == 1 and K.ndim == 4 and K.shape[1] == x.shape[1]
        if not ok or at.get("group", 1) != 1 or at.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
            raise _unsupported(node, "(2-D, one group, explicit pads)")
        W, oh, ow = _conv_matrix(K, x.shape[1:], pads, at.get("strides", [1, 1]), at.get("dilations", [1, 1]))
        bias = _const(node, ins[2]).astype(F64) if len(ins) > 2 and ins[2] is not None else np.zeros(len(K))
        return self._push(affine(x.node, W, np.repeat(bias, oh * ow)), (1, K.shape[0], oh, ow))

    def _op_relu(self, node, ins, at) -> _Var:
        x = ins[0]
        out = self._push(Relu(x.node, len(self.relus)), x.shape)
        self.relus.append(ReluLayer(len(self.relus), node.output[0], math.prod(x.shape), out.node))
        return out

    def _op_sigmoid(self, node, ins, at) -> _Var:
        out = self._push(Sigmoid(ins[0].node), ins[0].shape)
        self.sigmoids.append(ReluLayer(len(self.sigmoids), node.output[0], math.prod(ins[0].shape), out.node))
        return out

    def _op_flatten(self, node, ins, at) -> _Var:
        x = ins[0]
        axis = at.get("axis", 1)
        axis = axis + len(x.shape) if axis < 0 else axis
        return _Var(x.node, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))

    def _op_reshape(self, node, ins, at) -> _Var:
        x, target = ins[0], [int(d) for d in _const(node, ins[1])]
        dims = [x.shape[i] if d == 0 and not at.get("allowzero", 0) else d for i, d in enumerate(target)]
        if -1 in dims:
            dims[dims.index(-1)] = math.prod(x.shape) // max(1, -math.prod(dims))
        if math.prod(dims) != math.prod(x.shape) or min(dims, default=0) < 0:
            raise _unsupported(node, f"(shape {x.shape} to {target})")
        return _Var(x.node, tuple(dims))

    def _op_slice(self, node, ins, at) -> _Var:
        """An op that only moves elements (Slice, Gather of constant indices, Transpose, Squeeze,
        Unsqueeze): evaluated by ``onnx.reference`` on its input's flat positions, it says which input
        element each output element is; a 0/1 affine node picks them."""
        x = ins[0]
        if any(isinstance(v, _Var) for v in ins[1:]):
            raise _unsupported(node, "(with computed indices)")
        n = math.prod(x.shape)
        pos = self._evaluate(node, [np.arange(n).reshape(x.shape), *ins[1:]])
        if np.array_equal(pos.ravel(), np.arange(n)):  # every element where it was: a reshape
            return _Var(x.node, pos.shape)
        return self._push(affine(x.node, _pick(node, pos.ravel(), n), np.zeros(pos.size)), pos.shape)

    _op_gather = _op_transpose = _op_squeeze = _op_unsqueeze = _op_slice

    def _op_concat(self, node, ins, at) -> _Var:
        """Tensors and constants side by side: each output element's source found as in ``_op_slice``
        (on every input's positions, numbered on), each tensor placed by its own 0/1 affine node (the
        constants in the first one's bias), the placed parts summed."""
        sizes = [math.prod(v.shape) if isinstance(v, _Var) else np.asarray(v).size for v in ins]
        start = np.cumsum([0, *sizes])
        tags = [np.arange(start[i], start[i + 1]).reshape(v.shape if isinstance(v, _Var) else np.shape(v))
                for i, v in enumerate(ins)]  # fmt: skip
        pos = self._evaluate(node, tags)
        flat = pos.ravel()
        values = np.concatenate([np.zeros(n) if isinstance(v, _Var) else np.asarray(v, F64).ravel()
                                 for v, n in zip(ins, sizes, strict=True)])  # fmt: skip
        bias, out = values[flat], None
        for i, v in enumerate(ins):
            if isinstance(v, _Var):
                mine = (flat >= start[i]) & (flat < start[i + 1])
                W = _pick(node, np.where(mine, flat - start[i], -1), sizes[i])
                part = self._push(affine(v.node, W, bias if out is None else np.zeros(flat.size)), pos.shape)
                out = part if out is None else self._push(Sum(out.node, part.node, 1.0), pos.shape)
        return out

    def _op_identity(self, node, ins, at) -> _Var:
        return ins[0]

    _op_dropout = _op_identity

    def _op_shape(self, node, ins, at) -> np.ndarray:
        return np.array(ins[0].shape, dtype=np.int64)[at.get("start", 0) : at.get("end", None)]


def _pick(node, pos: np.ndarray, n_in: int) -> sp.csr_array:
    """The 0/1 matrix (CSR) whose row ``j`` picks input element ``pos[j]`` (none where ``pos[j] < 0``)."""
    rows = np.flatnonzero(pos >= 0)
    return sp.csr_array((np.ones(rows.size), (rows, pos[rows])), shape=(pos.size, n_in))


def _unsupported(node, why: str = "") -> Unsupported:
    return Unsupported(" ".join(s for s in (node.name or node.output[0], node.op_type, why) if s))


def _const(node, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise _unsupported(node, "(a tensor where a constant is needed)")
    return x


def _spread(node, c, shape: tuple[int, ...]) -> np.ndarray:
    """Constant ``c`` broadcast to a tensor of ``shape`` (which it must not widen), flat, float64."""
    c = _const(node, c)
    if np.broadcast_shapes(c.shape, shape) != tuple(shape):
        raise _unsupported(node, f"(a constant of shape {c.shape} widens {shape})")
    return np.broadcast_to(c.astype(F64), shape).reshape(-1)


def _constant(node, at: dict) -> np.ndarray:
    if "value" in at:
        return _finite(numpy_helper.to_array(at["value"]), f"{node.output[0]} Constant")
    for key in ("value_float", "value_floats", "value_int", "value_ints"):
        if key in at:
            return _finite(np.asarray(at[key]), f"{node.output[0]} Constant")
    raise _unsupported(node, "(no value)")


def _conv_matrix(K: np.ndarray, chw, pads, strides, dil) -> tuple[sp.csr_array, int, int]:
    """The matrix (CSR) of a 2-D convolution without bias, on a ``(C, H, W)`` input (row-major):
    output ``(m, oh, ow)`` reads input ``(c, oh·s0 - p0 + i·d0, ow·s1 - p1 + j·d1)`` with weight
    ``K[m, c, i, j]`` (each pair of positions meets at most one kernel tap: an exact copy)."""
    M, C, kh, kw = K.shape
    _, H, Wd = chw
    oh = (H + pads[0] + pads[2] - dil[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (Wd + pads[1] + pads[3] - dil[1] * (kw - 1) - 1) // strides[1] + 1
    m, y, x = np.meshgrid(np.arange(M), np.arange(oh), np.arange(ow), indexing="ij")
    rows = (m * oh + y) * ow + x
    at: list = [[], [], []]  # rows, columns, values
    for c, i, j in itertools.product(range(C), range(kh), range(kw)):
        iy, ix = y * strides[0] - pads[0] + i * dil[0], x * strides[1] - pads[1] + j * dil[1]
        ok = (iy >= 0) & (iy < H) & (ix >= 0) & (ix < Wd)
        for into, part in zip(at, (rows[ok], (c * H + iy[ok]) * Wd + ix[ok], K[m[ok], c, i, j]), strict=True):
            into.append(part)
    r, col, v = (np.concatenate(p) for p in at)
    return sp.csr_array((v.astype(F64), (r, col)), shape=(M * oh * ow, C * H * Wd)), oh, ow
