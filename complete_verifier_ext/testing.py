"""Small deterministic models and properties for the tests and the bundled example.

Every factory is a pure function of its ``seed`` (a private ``torch.Generator``; the global RNG is
never touched), so a test can rebuild the same network anywhere:

* :func:`mlp` / :func:`cnn`: ``torch.nn.Sequential`` ReLU networks (He-normal weights, small biases);
* :func:`mlp_onnx`: the network of ``mlp(sizes, seed)`` written as ONNX (first layer MatMul + Add,
  the others Gemm), so the torch and ONNX paths can be compared;
* :func:`residual_onnx`: Sub/Div normalisation -> Conv -> BatchNormalization -> Relu -> Conv ->
  Add (residual) -> Relu -> Flatten -> Gemm, written with ``onnx.helper``;
* :func:`write_vnnlib`: an L∞ robustness property (a counterexample is an input in the box where some
  ``Y_j >= Y_label``).

ONNX models have a symbolic batch axis (``"batch"``), so onnxruntime accepts any batch size.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

__all__ = [
    "CNN_INPUT_SHAPE",
    "RESIDUAL_INPUT_SHAPE",
    "RESIDUAL_OUTPUTS",
    "cnn",
    "mlp",
    "mlp_onnx",
    "residual_onnx",
    "write_vnnlib",
]

CNN_INPUT_SHAPE = (2, 8, 8)
RESIDUAL_INPUT_SHAPE = (2, 6, 6)
RESIDUAL_OUTPUTS = 3
_OPSET = 13
_BIAS_STD = 0.1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _he(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """He-normal weights: std sqrt(2 / fan_in), fan_in = prod(shape[1:])."""
    fan_in = math.prod(shape[1:])
    return torch.randn(*shape, generator=gen) * math.sqrt(2.0 / fan_in)


def _small(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(n, generator=gen) * _BIAS_STD


@torch.no_grad()
def _init(module: nn.Module, gen: torch.Generator) -> nn.Module:
    module.weight.copy_(_he(gen, *module.weight.shape))
    module.bias.copy_(_small(gen, module.bias.shape[0]))
    return module


def mlp(sizes: Sequence[int], seed: int) -> nn.Sequential:
    """``sizes[0] -> sizes[1] -> ... -> sizes[-1]``: Linear layers with a ReLU between two of them."""
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least an input and an output size, got {list(sizes)}")
    gen = _gen(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        if i:
            layers.append(nn.ReLU())
        layers.append(_init(nn.Linear(n_in, n_out), gen))
    return nn.Sequential(*layers).eval()


def cnn(
    seed: int,
    input_shape: Sequence[int] = CNN_INPUT_SHAPE,
    channels: int = 3,
    hidden: int = 8,
    n_out: int = 3,
) -> nn.Sequential:
    """Conv(3x3, stride 2, pad 1) -> ReLU -> Conv(3x3, stride 2, pad 1) -> ReLU -> Flatten -> Linear -> ReLU
    -> Linear, for per-sample input ``input_shape = (C, H, W)``."""
    c, h, w = input_shape
    gen = _gen(seed)

    def down(n: int) -> int:  # output size of a 3x3, stride 2, padding 1 convolution
        return (n + 2 - 3) // 2 + 1

    flat = channels * down(down(h)) * down(down(w))
    return nn.Sequential(
        _init(nn.Conv2d(c, channels, 3, stride=2, padding=1), gen),
        nn.ReLU(),
        _init(nn.Conv2d(channels, channels, 3, stride=2, padding=1), gen),
        nn.ReLU(),
        nn.Flatten(),
        _init(nn.Linear(flat, hidden), gen),
        nn.ReLU(),
        _init(nn.Linear(hidden, n_out), gen),
    ).eval()


def _const(name: str, value: np.ndarray | torch.Tensor) -> TensorProto:
    if isinstance(value, torch.Tensor):
        value = value.detach().numpy()
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _value_info(name: str, dims: Sequence[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))


def _save(path: str | os.PathLike, graph: onnx.GraphProto) -> str:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="complete_verifier_ext.testing"
    )
    model.ir_version = 8  # readable by every onnxruntime this project supports
    onnx.checker.check_model(model)
    path = os.fspath(path)
    onnx.save(model, path)
    return path


def mlp_onnx(path: str | os.PathLike, sizes: Sequence[int], seed: int) -> str:
    """Write ``mlp(sizes, seed)`` as ONNX: layer 0 as MatMul + Add, the others as Gemm (alternating
    ``transB`` 1 and 0).  Input ``"x"`` of shape ``(batch, sizes[0])``, output ``"y"``; returns the path."""
    net = mlp(sizes, seed)
    linears = [m for m in net if isinstance(m, nn.Linear)]
    nodes, inits = [], []
    cur = "x"
    for i, lin in enumerate(linears):
        W, b = lin.weight.detach(), lin.bias.detach()  # (out, in), (out,)
        out = "y" if i == len(linears) - 1 else f"z{i}"
        if i == 0:
            inits += [_const("W0", W.T), _const("b0", b)]
            nodes += [
                helper.make_node("MatMul", [cur, "W0"], ["mm0"], name="matmul_0"),
                helper.make_node("Add", ["mm0", "b0"], [out], name="add_0"),
            ]
        else:
            trans = i % 2
            inits += [_const(f"W{i}", W if trans else W.T), _const(f"b{i}", b)]
            nodes.append(
                helper.make_node("Gemm", [cur, f"W{i}", f"b{i}"], [out], name=f"gemm_{i}", transB=trans)
            )
        if out != "y":
            nodes.append(helper.make_node("Relu", [out], [f"h{i}"], name=f"relu_{i}"))
            cur = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp", [_value_info("x", ["batch", sizes[0]])], [_value_info("y", ["batch", sizes[-1]])], inits
    )
    return _save(path, graph)


def cnn_onnx(path: str | os.PathLike, seed: int, input_shape: Sequence[int] = CNN_INPUT_SHAPE, **kw) -> str:
    """Write ``cnn(seed, input_shape, **kw)`` as ONNX (Conv, Relu, Flatten, Gemm): input ``"x"`` of shape
    ``(batch, *input_shape)``, output ``"y"``; returns the path."""
    net = cnn(seed, input_shape, **kw)
    nodes, inits, cur = [], [], "x"
    for i, m in enumerate(net):
        out = "y" if i == len(net) - 1 else f"t{i}"
        if isinstance(m, nn.Conv2d):
            inits += [_const(f"W{i}", m.weight), _const(f"b{i}", m.bias)]
            node = helper.make_node("Conv", [cur, f"W{i}", f"b{i}"], [out], kernel_shape=list(m.kernel_size),
                                    strides=list(m.stride), pads=[*m.padding, *m.padding])  # fmt: skip
        elif isinstance(m, nn.Linear):
            inits += [_const(f"W{i}", m.weight), _const(f"b{i}", m.bias)]
            node = helper.make_node("Gemm", [cur, f"W{i}", f"b{i}"], [out], transB=1)
        elif isinstance(m, nn.Flatten):
            node = helper.make_node("Flatten", [cur], [out], axis=1)
        else:
            node = helper.make_node("Relu", [cur], [out])
        nodes.append(node)
        cur = out
    n_out = net[-1].out_features
    graph = helper.make_graph(
        nodes, "cnn", [_value_info("x", ["batch", *input_shape])], [_value_info("y", ["batch", n_out])], inits
    )
    return _save(path, graph)


def wx_onnx(path: str | os.PathLike, sizes: Sequence[int], seed: int) -> str:
    """``mlp(sizes, seed)`` written as the ACAS Xu nets are: a 1-D input ``X`` (no batch axis) and
    ``W @ x``; returns the path."""
    lin = [m for m in mlp(sizes, seed) if isinstance(m, nn.Linear)]
    nodes, inits, cur = [], [], "X"
    for i, m in enumerate(lin):
        inits += [numpy_helper.from_array(m.weight.detach().numpy(), f"W{i}"),
                  numpy_helper.from_array(m.bias.detach().numpy(), f"B{i}")]  # fmt: skip
        out = "Y" if i == len(lin) - 1 else f"H{i}"
        nodes += [
            helper.make_node("MatMul", [f"W{i}", cur], [f"M{i}"]),
            helper.make_node("Add", [f"M{i}", f"B{i}"], [out]),
        ]
        if out != "Y":
            nodes.append(helper.make_node("Relu", [out], [f"R{i}"]))
            cur = f"R{i}"
    graph = helper.make_graph(
        nodes, "wx", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [sizes[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [sizes[-1]])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, os.fspath(path))
    return os.fspath(path)


def _residual_weights(gen, c: int, n_flat: int, k: int) -> list:
    """The initializers of :func:`residual_onnx`'s graph."""
    weights = {
        "mean": torch.rand(1, c, 1, 1, generator=gen) * 0.5,
        "std": 0.5 + torch.rand(1, c, 1, 1, generator=gen),
        "W1": _he(gen, k, c, 3, 3),
        "b1": _small(gen, k),
        "gamma": 0.5 + torch.rand(k, generator=gen),
        "beta": _small(gen, k),
        "run_mean": _small(gen, k),
        "run_var": 0.5 + torch.rand(k, generator=gen),
        "W2": _he(gen, k, k, 3, 3) * 0.5,
        "b2": _small(gen, k),
        "W3": _he(gen, RESIDUAL_OUTPUTS, n_flat),
        "b3": _small(gen, RESIDUAL_OUTPUTS),
    }
    return [_const(name, value) for name, value in weights.items()]


def residual_onnx(path: str | os.PathLike, seed: int) -> str:
    """Write a small residual conv net as ONNX: input ``"x"`` ``(batch, *RESIDUAL_INPUT_SHAPE)``, output
    ``"y"`` ``(batch, RESIDUAL_OUTPUTS)``.

    ``n = (x - mean) / std`` (per channel) -> Conv(3x3, pad 1) -> BatchNormalization -> Relu (``h``) ->
    Conv(3x3, pad 1) -> Add(``h``) -> Relu -> Flatten -> Gemm.  Returns the path.
    """
    c, hgt, wid = RESIDUAL_INPUT_SHAPE
    k = 4  # channels of both convolutions
    inits = _residual_weights(_gen(seed), c, k * hgt * wid, k)
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    node = helper.make_node
    nodes = [
        node("Sub", ["x", "mean"], ["centred"], name="sub_mean"),
        node("Div", ["centred", "std"], ["normed"], name="div_std"),
        node("Conv", ["normed", "W1", "b1"], ["c1"], name="conv_1", **conv),
        node(
            "BatchNormalization",
            ["c1", "gamma", "beta", "run_mean", "run_var"],
            ["bn1"],
            name="bn_1",
            epsilon=1e-5,
        ),  # fmt: skip
        node("Relu", ["bn1"], ["h1"], name="relu_1"),
        node("Conv", ["h1", "W2", "b2"], ["c2"], name="conv_2", **conv),
        node("Add", ["c2", "h1"], ["res"], name="add_residual"),
        node("Relu", ["res"], ["h2"], name="relu_2"),
        node("Flatten", ["h2"], ["flat"], name="flatten", axis=1),
        node("Gemm", ["flat", "W3", "b3"], ["y"], name="gemm_out", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [_value_info("x", ["batch", c, hgt, wid])],
        [_value_info("y", ["batch", RESIDUAL_OUTPUTS])],
        inits,
    )
    return _save(path, graph)


def write_vnnlib(path: str | os.PathLike, lower, upper, label: int, n_outputs: int) -> str:
    """Write a robustness property over the box ``[lower, upper]`` (flattened): a counterexample is an input
    in the box whose output has ``Y_j >= Y_label`` for some ``j != label``.  Returns the path."""
    lo = np.asarray(lower, dtype=np.float64).reshape(-1)
    hi = np.asarray(upper, dtype=np.float64).reshape(-1)
    if lo.shape != hi.shape:
        raise ValueError(f"lower {lo.shape} and upper {hi.shape} differ in size")
    if not 0 <= label < n_outputs:
        raise ValueError(f"label {label} is not an output index (n_outputs={n_outputs})")
    lines = [f"; robustness of label {label} on a box of {lo.size} inputs"]
    lines += [f"(declare-const X_{i} Real)" for i in range(lo.size)]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_outputs)]
    for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
        lines += [f"(assert (>= X_{i} {float(a)!r}))", f"(assert (<= X_{i} {float(b)!r}))"]
    clauses = " ".join(f"(and (>= Y_{j} Y_{label}))" for j in range(n_outputs) if j != label)
    lines.append(f"(assert (or {clauses}))")
    path = os.fspath(path)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# Exact answers for tiny ReLU networks (ground truth for the branch-and-bound tests)
# ----------------------------------------------------------------------------------------------------------

__all__ += ["exact_min_linear"]

_EXACT_MAX_RELUS = 12


def _affine_range(
    M: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Range of ``M x + v`` over the box ``[lo, hi]`` (exact for an affine map), rows of M."""
    mid, rad = (hi + lo) / 2, (hi - lo) / 2
    centre = M @ mid + v
    spread = np.abs(M) @ rad
    return centre - spread, centre + spread


class _Patterns:
    """The activation-pattern enumeration of :func:`exact_min_linear` over the box ``[lo, hi]``: the
    network's float64 weights, the objective ``c`` and the best value found with its point."""

    def __init__(self, Ws: list, bs: list, lo: np.ndarray, hi: np.ndarray, c: np.ndarray) -> None:
        self.Ws, self.bs, self.lo, self.hi, self.c = Ws, bs, lo, hi, c
        self.box = list(zip(lo.tolist(), hi.tolist(), strict=True))
        # incumbent from real points (the centre and seeded random points): prunes patterns whose
        # affine map cannot go below it anywhere in the box; an LP only replaces it when strictly lower
        rand = np.random.default_rng(0).random((512, len(lo)))
        pts = np.concatenate([(lo + hi)[None] / 2, lo + (hi - lo) * rand])
        vals = self.value(pts)
        self.best: list = [float(vals.min()), pts[int(vals.argmin())]]

    def value(self, x: np.ndarray) -> np.ndarray:
        """``c · net(x)`` in float64, ``x``: (N, n)."""
        for i, (W, b) in enumerate(zip(self.Ws, self.bs, strict=True)):
            x = x @ W.T + b
            x = np.maximum(x, 0) if i < len(self.Ws) - 1 else x
        return x @ self.c

    def ibp_min(self, layer: int, zlo: np.ndarray, zhi: np.ndarray) -> float:
        """Interval lower bound of ``c · y`` from bounds of the pre-activation of layer ``layer``."""
        for W, b in zip(self.Ws[layer + 1 :], self.bs[layer + 1 :], strict=True):
            zlo, zhi = _affine_range(W, b, np.maximum(zlo, 0), np.maximum(zhi, 0))
        return float(_affine_range(self.c[None], np.zeros(1), zlo, zhi)[0][0])

    def solve(self, obj: np.ndarray, A: np.ndarray, b: np.ndarray):
        from scipy.optimize import linprog

        A_ub, b_ub = (A, b) if len(A) else (None, None)
        res = linprog(obj, A_ub=A_ub, b_ub=b_ub, bounds=self.box, method="highs")
        return res if res.status == 0 else None

    def visit(self, layer: int, M: np.ndarray, v: np.ndarray, A: np.ndarray, b: np.ndarray) -> None:
        """``M x + v``: the pre-activation of hidden layer ``layer`` (or the output) on this pattern's
        polyhedron ``A x <= b``."""
        import itertools

        zlo, zhi = _affine_range(M, v, self.lo, self.hi)
        if self.ibp_min(layer, zlo, zhi) > self.best[0]:
            return  # c · y stays above the incumbent on the whole box under this partial pattern
        if layer == len(self.Ws) - 1:
            res = self.solve(self.c @ M, A, b)
            if res is not None and res.fun + self.c @ v < self.best[0]:
                self.best = [float(res.fun + self.c @ v), res.x]
            return
        free = np.nonzero((zlo < 0) & (zhi > 0))[0]
        for signs in itertools.product((1.0, -1.0), repeat=len(free)):
            on = (zlo >= 0).astype(np.float64)
            on[free] = np.asarray(signs) > 0
            s = np.where(on > 0, -1.0, 1.0)[free]  # active: -z <= 0; inactive: z <= 0
            A2 = np.concatenate([A, s[:, None] * M[free]]) if len(free) else A
            b2 = np.concatenate([b, -s * v[free]]) if len(free) else b
            if (
                len(free)
                and layer + 1 < len(self.Ws) - 1
                and self.solve(np.zeros(len(self.lo)), A2, b2) is None
            ):
                continue  # empty polyhedron: no need to enumerate the next layer under it
            W, bias = self.Ws[layer + 1], self.bs[layer + 1]
            self.visit(layer + 1, W @ (on[:, None] * M), W @ (on * v) + bias, A2, b2)


def exact_min_linear(net: nn.Sequential, lower, upper, c) -> tuple[float, np.ndarray]:
    """The exact minimum of ``c · net(x)`` over the box ``lower <= x <= upper``, and a minimiser.

    ``net`` alternates ``nn.Linear`` and ``nn.ReLU`` (e.g. :func:`mlp`), with at most
    ``_EXACT_MAX_RELUS`` ReLUs.  Every activation pattern fixes the network to an affine map on the
    polyhedron {x in box, every pre-activation has the pattern's sign}; one LP (scipy/HiGHS, float64)
    per pattern minimises ``c · y`` there, and the smallest LP value over the feasible patterns is the
    global minimum (the polyhedra cover the box).  Layer by layer, neurons whose sign is fixed over the
    box by the affine map of the pattern so far are not enumerated, and a partial pattern whose
    polyhedron is empty is dropped (:class:`_Patterns`).  Returns ``(value, argmin)`` (float64).
    """
    mods = [m for m in net if not isinstance(m, (nn.Identity, nn.Dropout))]
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    expected = [nn.Linear if i % 2 == 0 else nn.ReLU for i in range(2 * len(linears) - 1)]
    if [type(m) for m in mods] != expected:
        raise ValueError("exact_min_linear needs Linear, ReLU, Linear, ..., Linear")
    if sum(m.out_features for m in linears[:-1]) > _EXACT_MAX_RELUS:
        raise ValueError(f"more than {_EXACT_MAX_RELUS} ReLUs: too many activation patterns")
    Ws = [m.weight.detach().double().numpy() for m in linears]
    bs = [m.bias.detach().double().numpy() for m in linears]
    lo = np.asarray(lower, dtype=np.float64).reshape(-1)
    hi = np.asarray(upper, dtype=np.float64).reshape(-1)
    search = _Patterns(Ws, bs, lo, hi, np.asarray(c, dtype=np.float64).reshape(-1))
    search.visit(0, Ws[0], bs[0], np.zeros((0, len(lo))), np.zeros(0))
    return search.best[0], np.clip(search.best[1], lo, hi)


@functools.lru_cache(maxsize=16)
def _exact_ranges(sizes: tuple[int, ...], seed: int, lower: tuple, upper: tuple) -> tuple:
    net = mlp(sizes, seed).double()
    ranges = []
    for i in range(len(sizes) - 2):
        cut, n = net[: 2 * i + 1], sizes[i + 1]
        lo = [exact_min_linear(cut, lower, upper, np.eye(n)[j])[0] for j in range(n)]
        hi = [-exact_min_linear(cut, lower, upper, -np.eye(n)[j])[0] for j in range(n)]
        ranges.append((np.array(lo), np.array(hi)))
    return tuple(ranges)


def exact_mlp_ranges(sizes: Sequence[int], seed: int, lower, upper) -> list[tuple[np.ndarray, np.ndarray]]:
    """The exact range ``(min, max)`` over the box of every hidden pre-activation neuron of
    ``mlp(sizes, seed)``, layer by layer (:func:`exact_min_linear` per neuron, float64). Cached: tests
    that bound the same network in several ways enumerate its patterns once."""
    lo, hi = (tuple(np.asarray(b, dtype=np.float64).reshape(-1).tolist()) for b in (lower, upper))
    return list(_exact_ranges(tuple(sizes), seed, lo, hi))


# ---------------------------------------------------------------------------------------------------------
# VNN-LIB 2.0 witnesses, checked independently of the verifier's own reading of the spec
# ---------------------------------------------------------------------------------------------------------


def _eval_arith(e, values: dict) -> float:
    kind = type(e).__name__
    if kind == "Var":
        v = values[e.name]
        return float(v[tuple(e.indices)] if v.ndim else v)
    if kind in ("Float", "Int"):
        return float(e.value)
    if kind == "Literal":
        return float(e.lexeme)
    if kind == "Negate":
        return -_eval_arith(e.expr, values)
    if kind == "Plus":
        return sum(_eval_arith(a, values) for a in e.args)
    if kind == "Minus":
        return _eval_arith(e.head, values) - sum(_eval_arith(a, values) for a in e.rest)
    if kind == "Multiply":
        return math.prod(_eval_arith(a, values) for a in e.args)
    raise ValueError(f"unknown arithmetic node {kind}")


def _eval_bool(e, values: dict, tol: float) -> bool:
    kind = type(e).__name__
    if kind == "And":
        return all(_eval_bool(a, values, tol) for a in e.args)
    if kind == "Or":
        return any(_eval_bool(a, values, tol) for a in e.args)
    lhs, rhs = _eval_arith(e.lhs, values), _eval_arith(e.rhs, values)
    ops = {
        "LessEqual": lambda: lhs <= rhs + tol,
        "LessThan": lambda: lhs < rhs + tol,
        "GreaterEqual": lambda: lhs >= rhs - tol,
        "GreaterThan": lambda: lhs > rhs - tol,
        "Equal": lambda: abs(lhs - rhs) <= tol,
        "NotEqual": lambda: abs(lhs - rhs) > tol,
    }
    return ops[kind]()


def check_vnnlib2_witness(
    text: str, vnnlib_path: str, networks: dict[str, str], input_tol: float = 1e-4
) -> str:
    """Judge a VNN-LIB 2.0 ``sat`` result as the VNN-COMP 2026 checker does, with code of its own: the
    textual assignment read tensor by tensor in declaration order, every input cast to float32 and each
    network's outputs recomputed with onnxruntime from its own file, then every assertion evaluated on
    the reference parser's syntax tree. Returns ``"correct"`` (no tolerance), ``"correct_up_to_tolerance"``
    (input-only assertions within ``input_tol``) or ``"wrong: <why>"``."""
    import onnxruntime as ort
    import vnnlib

    with open(vnnlib_path) as f:
        query = vnnlib.parse_query_string(f.read())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0] != "sat":
        return "wrong: not a sat result"
    lines, values = lines[1:], {}
    for net in query.networks:
        for d in (*net.inputs, *net.outputs):
            head = lines.pop(0).split(maxsplit=2) if lines else []
            shape = [int(s) for s in head[2].strip("[]").split(",") if s.strip()] if len(head) == 3 else None
            if not head or head[0] != d.name or shape != list(d.shape):
                return f"wrong: expected the header of {d.name} {list(d.shape)}, got {head}"
            n = math.prod(shape)
            values[d.name] = np.array([float(v) for v in lines[:n]]).reshape(shape)
            lines = lines[n:]
    if lines:
        return f"wrong: {len(lines)} lines left over"
    inputs = set()
    for net in query.networks:
        session = ort.InferenceSession(networks[net.name], providers=["CPUExecutionProvider"])
        feeds = {}
        for d, v in zip(net.inputs, session.get_inputs(), strict=True):
            x32 = values[d.name].astype(np.float32)
            values[d.name] = x32.astype(np.float64)
            inputs.add(d.name)
            dims = [s if isinstance(s, int) and s > 0 else 1 for s in v.shape]
            feeds[v.name] = x32.reshape(dims)
        outs = session.run(None, feeds)
        for d, y in zip(net.outputs, outs, strict=True):
            values[d.name] = np.asarray(y, dtype=np.float64).reshape(list(d.shape))

    def holds(tol: float) -> bool:
        for a in query.assertions:
            only_inputs = all(name in inputs for name in _names(a.expr))
            if not _eval_bool(a.expr, values, tol if only_inputs else 0.0):
                return False
        return True

    if holds(0.0):
        return "correct"
    return "correct_up_to_tolerance" if holds(input_tol) else "wrong: the assertions do not all hold"


def _names(e) -> set[str]:
    if type(e).__name__ == "Var":
        return {e.name}
    found: set[str] = set()
    for attr in ("expr", "lhs", "rhs", "head"):
        if hasattr(e, attr):
            found |= _names(getattr(e, attr))
    for attr in ("args", "rest"):
        for child in getattr(e, attr, ()):
            found |= _names(child)
    return found
