"""Reader for VNN-LIB 2.0 (the VNN-COMP 2026 format), on the reference parser, the PyPI package
``vnnlib``.

A 2.0 file declares one or more networks (``declare-network``), each with typed tensor inputs and
outputs (``X Real [5]``, ``[]`` for a scalar), and asserts formulas over their elements (``X[0]``,
``A[1,2]``). The query is turned into the same :class:`~complete_verifier_ext.spec.Spec` as a 1.x
file, over one *joint* model:

* its input is the query's free input elements: an assert ``(== X_f[i] X_g[j])`` (outside any ``or``)
  ties two inputs into one, every other input constraint bounds a single element;
* its output is every network's outputs concatenated, network by network, tensor by tensor, each
  row-major, so that a relational property (a net and its pruned copy within ±0.05) is an ordinary
  linear output constraint.

The spec's :class:`~complete_verifier_ext.spec.Layout` says where each declared tensor sits in that
joint input and output; :mod:`complete_verifier_ext.model.compose` builds the joint model from it and
:mod:`.witness` writes a counterexample in the 2.0 form. What the joint model cannot
express (a constraint relating inputs to outputs, or two inputs other than by equality, ``!=``, hidden
tensors, non-real tensors) is a :class:`SpecError` naming the line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from .common import Dnf, Layout, NetworkSlots, Row, Slot, Source, SpecError

__all__ = ["Query", "is_vnnlib2", "read"]

_VERSION_RE = re.compile(r"^\s*\(\s*(vnnlib-version|declare-network)\b", re.MULTILINE)
_COMMENT_RE = re.compile(r";[^\n]*")
# the float types, as a witness names them (Unknown: a tensor declared ``real``)
_TYPE_NAMES = MappingProxyType(
    {"F16": "float16", "F32": "float32", "F64": "float64", "Real": "real", "Unknown": "real"}
)


def is_vnnlib2(text: str) -> bool:
    """Whether ``text`` is a VNN-LIB 2.x file (it declares its version or a network)."""
    return bool(_VERSION_RE.search(_COMMENT_RE.sub("", text)))


def _package() -> Any:
    try:
        import vnnlib
    except ImportError:
        raise SpecError(
            "VNN-LIB 2.0 files need the 'vnnlib' package (pip install vnnlib; CPython 3.10-3.13)"
        ) from None
    return vnnlib


def _parse_error(src: Source, e: Exception) -> SpecError:
    """The reference parser's complaint as ``file:line: message``."""
    text = str(e).strip()
    try:
        first = json.loads(text)["errors"][0]
        hint = f" ({first['hint']})" if first.get("hint") else ""
        if first.get("offendingSymbol"):
            hint = f": {first['offendingSymbol']!r}{hint}"
        return SpecError(f"{src.file}:{first.get('line', '?')}: {first.get('message', 'error')}{hint}")
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    m = re.search(r"at line (\d+), column (\d+): '([^']*)'", text)
    if m:
        return SpecError(
            f"{src.file}:{m.group(1)}: VNN-LIB 2.0 syntax error at column {m.group(2)} near {m.group(3)!r} "
            "(formulas are prefix s-expressions, e.g. (< Y_f[1] Y_g[1]))"
        )
    return SpecError(f"{src.file}: {text.splitlines()[0] if text else type(e).__name__}")


def _assert_positions(src: Source) -> list[int]:
    """Offsets of the ``(assert`` commands, in order (comments blanked out, offsets kept)."""
    text = _COMMENT_RE.sub(lambda m: " " * len(m.group()), src.text)
    return [m.start() for m in re.finditer(r"\(\s*assert\b", text)]


class _Elements:
    """The declared tensors' elements: which are inputs and outputs, the ties between inputs and the
    joint positions that result."""

    def __init__(self, query: Any, src: Source) -> None:
        self.src = src
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.kinds: dict[str, str] = {}
        self.networks = []
        for net in query.networks:
            if len(net.hidden):
                raise src.error(
                    self.decl_pos(net.hidden[0].name), "hidden tensors (declare-hidden) are not supported"
                )
            for d in (*net.inputs, *net.outputs):
                if d.dtype.name not in _TYPE_NAMES:
                    raise src.error(
                        self.decl_pos(d.name),
                        f"tensor {d.name!r} has type {d.dtype.name}: only real tensors are supported",
                    )
                self.shapes[d.name] = tuple(int(s) for s in d.shape)
            self.kinds.update({d.name: "X" for d in net.inputs})
            self.kinds.update({d.name: "Y" for d in net.outputs})
            self.networks.append(net)
        self.parent: dict[tuple[str, int], tuple[str, int]] = {}

    def decl_pos(self, name: str) -> int:
        m = re.search(r"\(\s*declare-(input|output|hidden)\s+" + re.escape(name) + r"\b", self.src.text)
        return m.start() if m else 0

    def key(self, var: Any) -> tuple[str, int]:
        shape = self.shapes[var.name]
        flat = int(np.ravel_multi_index(tuple(var.indices), shape)) if shape else 0
        return var.name, flat

    def find(self, k: tuple[str, int]) -> tuple[str, int]:
        while self.parent.get(k, k) != k:
            k = self.parent[k]
        return k

    def tie(self, a: tuple[str, int], b: tuple[str, int]) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def layout(self) -> tuple[Layout, dict[tuple[str, int], int], dict[tuple[str, int], int], list[str]]:
        """The layout, the joint input position of every input element, the joint output position of
        every output element, and a name for each joint input."""
        joint_in: dict[tuple[str, int], int] = {}
        names: list[str] = []
        joint_out: dict[tuple[str, int], int] = {}
        nets = []
        for net in self.networks:
            ins = []
            for d in net.inputs:
                index = []
                for flat in range(int(np.prod(self.shapes[d.name], dtype=np.int64))):
                    root = self.find((d.name, flat))
                    if root not in joint_in:
                        joint_in[root] = len(names)
                        names.append(_element_name(root, self.shapes[root[0]]))
                    index.append(joint_in[root])
                ins.append(self._slot(d, tuple(index)))
            outs = []
            for d in net.outputs:
                n = int(np.prod(self.shapes[d.name], dtype=np.int64))
                start = len(joint_out)
                joint_out.update({(d.name, flat): start + flat for flat in range(n)})
                outs.append(self._slot(d, tuple(range(start, start + n))))
            nets.append(NetworkSlots(net.name, tuple(ins), tuple(outs), net.equal_to or ""))
        positions = {k: joint_in[self.find(k)] for k in self._input_keys()}
        return Layout(tuple(nets)), positions, joint_out, names

    def _slot(self, d: Any, index: tuple[int, ...]) -> Slot:
        return Slot(d.name, self.shapes[d.name], index, _TYPE_NAMES[d.dtype.name], d.onnx_name or None)

    def _input_keys(self):
        for net in self.networks:
            for d in net.inputs:
                for flat in range(int(np.prod(self.shapes[d.name], dtype=np.int64))):
                    yield d.name, flat


def _element_name(key: tuple[str, int], shape: tuple[int, ...]) -> str:
    name, flat = key
    if not shape:
        return name
    return f"{name}[{','.join(str(int(i)) for i in np.unravel_index(flat, shape))}]"


_LESS = ("LessEqual", "LessThan")
_GREATER = ("GreaterEqual", "GreaterThan")


def _difference(
    c: Any, elements: _Elements, src: Source, pos: int
) -> tuple[dict[tuple[str, int], float], float]:
    """``lhs − rhs`` of a comparison as (coefficients by element, constant); a product of variables
    (the POLY theory, which the 2.0 grammar admits) is a :class:`SpecError` at ``pos``."""
    coefs: dict[tuple[str, int], float] = {}
    const = 0.0
    for side, sign in ((c.lhs, 1.0), (c.rhs, -1.0)):
        try:
            lin = side.to_linear_expr()
        except _package().VNNLibException:
            raise src.error(
                pos, "a product of variables is not supported (linear constraints only: BND, OUTC, LIN)"
            ) from None
        const += sign * float(lin.constant)
        for t in lin.terms:
            k = elements.key(t.var)
            coefs[k] = coefs.get(k, 0.0) + sign * float(t.coeff)
    return coefs, const


def _is_tie(
    c: Any, elements: _Elements, src: Source, pos: int
) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The two input elements an ``(== a b)`` equates, else None."""
    if type(c).__name__ != "Equal":
        return None
    coefs, const = _difference(c, elements, src, pos)
    coefs = {k: v for k, v in coefs.items() if v != 0.0}
    if const != 0.0 or len(coefs) != 2 or any(elements.kinds[k[0]] != "X" for k in coefs):
        return None
    (a, ca), (b, cb) = coefs.items()
    return (a, b) if ca == -cb else None


def _rows(
    c: Any, pos: int, elements: _Elements, src: Source, joint_in: dict, joint_out: dict
) -> list[Row] | None:
    """The rows ``coefs · v <= bound`` of one comparison over the joint variables; None when the
    comparison is a constant that is false (its conjunction cannot hold), [] when constantly true."""
    op = type(c).__name__
    coefs, const = _difference(c, elements, src, pos)
    if op == "NotEqual":
        raise src.error(pos, "'!=' is not supported (it is not a convex constraint)")
    joint: dict[tuple[str, int], float] = {}
    for (name, flat), v in coefs.items():
        kind = elements.kinds[name]
        var = (kind, (joint_in if kind == "X" else joint_out)[(name, flat)])
        joint[var] = joint.get(var, 0.0) + v
    joint = {k: v for k, v in joint.items() if v != 0.0}
    if not joint:
        holds = {
            "LessEqual": const <= 0,
            "LessThan": const < 0,
            "GreaterEqual": const >= 0,
            "GreaterThan": const > 0,
            "Equal": const == 0,
        }[op]
        return [] if holds else None
    kinds = {k[0] for k in joint}
    if len(kinds) > 1:
        raise src.error(pos, "a constraint relating inputs to outputs is not supported")
    if "X" in kinds and len(joint) > 1:
        raise src.error(
            pos,
            "an input constraint relating several inputs is not supported (only bounds on one input, "
            "and (== a b) between two inputs outside any 'or')",
        )
    rows = []
    if op in _LESS or op == "Equal":
        rows.append(Row(dict(joint), -const, pos))
    if op in _GREATER or op == "Equal":
        rows.append(Row({k: -v for k, v in joint.items()}, const, pos))
    return rows


class Query(NamedTuple):
    """A 2.0 query as the spec assembler takes it: the asserts' DNFs over the joint variables (each
    with its offset), the joint sizes, the names of the joint inputs and the layout."""

    asserts: list[tuple[Dnf, int]]
    n_inputs: int
    n_outputs: int
    where: Callable[[int], tuple[str, int]]
    layout: Layout


def read(src: Source) -> Query:
    """Parse the VNN-LIB 2.0 text of ``src``."""
    vnnlib = _package()
    try:
        query = vnnlib.parse_query_string(src.text)
        dnfs = [a.expr.to_dnf() for a in query.assertions]
    except vnnlib.VNNLibException as e:
        raise _parse_error(src, e) from None
    elements = _Elements(query, src)
    starts = _assert_positions(src)
    ties = set()
    for k, dnf in enumerate(dnfs):
        if len(dnf) != 1:
            continue
        for c in dnf[0]:
            pair = _is_tie(c, elements, src, starts[k] if k < len(starts) else 0)
            if pair is not None:
                elements.tie(*pair)
                ties.add(id(c))
    layout, joint_in, joint_out, names = elements.layout()
    asserts: list[tuple[Dnf, int]] = []
    for k, dnf in enumerate(dnfs):
        pos = starts[k] if k < len(starts) else 0
        disjuncts: Dnf = []
        for conj in dnf:
            rows: list[Row] | None = []
            for c in conj:
                more = [] if id(c) in ties else _rows(c, pos, elements, src, joint_in, joint_out)
                if more is None:
                    rows = None
                    break
                rows.extend(more)
            if rows is not None:
                disjuncts.append(rows)
        if not disjuncts:
            raise src.error(pos, "an assertion that can never hold (the property holds trivially)")
        if any(not d for d in disjuncts):
            continue  # one disjunct always holds: the assertion constrains nothing
        asserts.append((disjuncts, pos))

    def where(i: int) -> tuple[str, int]:
        return names[i], elements.decl_pos(names[i].split("[")[0])

    return Query(asserts, len(names), len(joint_out), where, layout)
