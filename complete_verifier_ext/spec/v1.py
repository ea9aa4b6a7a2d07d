"""Reader for VNN-LIB 1.0 property files, as used in VNN-COMP 2021-2024.

A property file declares input variables ``X_i`` and output variables ``Y_j`` with ``declare-const`` and
asserts a conjunction of formulas built from ``and``, ``or`` and linear comparisons. The file describes
the *counterexample* set: an input ``x`` inside an input box whose network output ``y`` satisfies the
output constraints. :func:`parse` turns its text into a :class:`~.model.Spec`; :func:`assemble` builds
the spec of asserts in disjunctive normal form (the 2.0 reader's too).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple, Union

import numpy as np

from .common import Dnf as _Dnf
from .common import Layout
from .common import Row as _Row
from .common import Source as _Source
from .common import Var as _Var
from .model import Clause, Spec, freeze, make_spec

_MAX_DISJUNCTS = 100_000

_TOKEN_RE = re.compile(r";[^\n]*|[()]|[^\s();]+")
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_VAR_RE = re.compile(r"([XY])_(\d+)")
_NUMBER_START = frozenset("0123456789+-.")
_COMPARISONS = frozenset({"<=", ">=", "<", ">", "="})
_IGNORED_COMMANDS = frozenset({"check-sat", "get-model", "exit", "set-logic", "set-info", "set-option"})


# ---------------------------------------------------------------------------------------------------------
# Tokenizer and s-expressions
# ---------------------------------------------------------------------------------------------------------


class _Tok(NamedTuple):
    text: str
    pos: int


class _List(NamedTuple):
    items: list[_Node]
    pos: int


_Node = Union[_Tok, _List]


def _tokenize(text: str) -> Iterator[_Tok]:
    """Yield tokens (parentheses and atoms) with their offsets; comments are dropped."""
    for match in _TOKEN_RE.finditer(text):
        token = match.group()
        if token[0] != ";":
            yield _Tok(token, match.start())


def _parse_sexprs(src: _Source) -> list[_Node]:
    """Parse the whole text into a list of top-level s-expressions."""
    stack: list[_List] = [_List([], 0)]
    for tok in _tokenize(src.text):
        if tok.text == "(":
            stack.append(_List([], tok.pos))
        elif tok.text == ")":
            if len(stack) == 1:
                raise src.error(tok.pos, "unbalanced parentheses: unexpected ')'")
            node = stack.pop()
            stack[-1].items.append(node)
        else:
            stack[-1].items.append(tok)
    if len(stack) > 1:
        raise src.error(stack[-1].pos, "unbalanced parentheses: '(' is never closed")
    return stack[0].items


# ---------------------------------------------------------------------------------------------------------
# Linear expressions and atoms
# ---------------------------------------------------------------------------------------------------------

# A variable is ("X", i) or ("Y", j); a linear expression is (coefficients, constant).
_Lin = tuple[dict[_Var, float], float]


class _Context(NamedTuple):
    src: _Source
    declared: dict[str, _Var]


_NON_FINITE = frozenset({"nan", "inf", "infinity"})


def _parse_number(tok: _Tok, ctx: _Context) -> float:
    if tok.text.lower().lstrip("+-") in _NON_FINITE:
        raise ctx.src.error(tok.pos, f"{tok.text!r} is not a finite number: bounds must be finite")
    if not _NUMBER_RE.fullmatch(tok.text):
        raise ctx.src.error(tok.pos, f"malformed number {tok.text!r}")
    return float(tok.text)


def _head(node: _List, ctx: _Context) -> str:
    if not node.items or not isinstance(node.items[0], _Tok):
        raise ctx.src.error(node.pos, "expected an operator after '('")
    return node.items[0].text


def _linear(node: _Node, ctx: _Context) -> _Lin:
    """Evaluate a linear arithmetic expression."""
    if isinstance(node, _Tok):
        if node.text[0] in _NUMBER_START or node.text.lower() in _NON_FINITE:
            return {}, _parse_number(node, ctx)
        var = ctx.declared.get(node.text)
        if var is None:
            raise ctx.src.error(node.pos, f"undeclared variable {node.text!r}")
        return {var: 1.0}, 0.0
    op = _head(node, ctx)
    args = [_linear(arg, ctx) for arg in node.items[1:]]
    if not args:
        raise ctx.src.error(node.pos, f"operator {op!r} needs at least one operand")
    if op == "+":
        return _lin_sum(args)
    if op == "-":
        if len(args) == 1:
            return _lin_scale(args[0], -1.0)
        return _lin_sum([args[0]] + [_lin_scale(a, -1.0) for a in args[1:]])
    if op == "*":
        return _lin_product(args, node, ctx)
    if op == "/":
        return _lin_divide(args, node, ctx)
    raise ctx.src.error(node.pos, f"unknown arithmetic operator {op!r}")


def _lin_sum(args: list[_Lin]) -> _Lin:
    coefs: dict[_Var, float] = {}
    const = 0.0
    for a_coefs, a_const in args:
        for var, c in a_coefs.items():
            coefs[var] = coefs.get(var, 0.0) + c
        const += a_const
    return coefs, const


def _lin_scale(arg: _Lin, factor: float) -> _Lin:
    return {var: c * factor for var, c in arg[0].items()}, arg[1] * factor


def _lin_product(args: list[_Lin], node: _List, ctx: _Context) -> _Lin:
    """Product of operands of which at most one may contain variables."""
    variable = [a for a in args if a[0]]
    if len(variable) > 1:
        raise ctx.src.error(node.pos, "non-linear product: more than one factor contains variables")
    factor = math.prod(a[1] for a in args if not a[0])
    return _lin_scale(variable[0], factor) if variable else ({}, factor)


def _lin_divide(args: list[_Lin], node: _List, ctx: _Context) -> _Lin:
    """Division of an expression by non-zero constants."""
    if len(args) < 2 or any(a[0] for a in args[1:]):
        raise ctx.src.error(node.pos, "division needs a dividend and constant divisors")
    divisor = math.prod(a[1] for a in args[1:])
    if divisor == 0.0:
        raise ctx.src.error(node.pos, "division by zero")
    return _lin_scale(args[0], 1.0 / divisor)


def _atom_rows(node: _List, op: str, ctx: _Context) -> list[_Row]:
    """Rows ``lhs - rhs <= 0`` (with the constant moved to the right) for a possibly chained comparison."""
    operands = [_linear(arg, ctx) for arg in node.items[1:]]
    if len(operands) < 2:
        raise ctx.src.error(node.pos, f"comparison {op!r} needs at least two operands")
    rows = []
    for a, b in itertools.pairwise(operands):
        if op in ("<=", "<", "="):
            rows.append(_make_row(a, b, node, ctx))
        if op in (">=", ">", "="):
            rows.append(_make_row(b, a, node, ctx))
    return rows


def _make_row(small: _Lin, large: _Lin, node: _List, ctx: _Context) -> _Row:
    """The row for ``small <= large``."""
    coefs, const = _lin_sum([small, _lin_scale(large, -1.0)])
    coefs = {var: c for var, c in coefs.items() if c != 0.0}
    if not coefs and (small[0] or large[0]):
        raise ctx.src.error(
            node.pos, "the variables cancel out: the comparison is always true or always false"
        )
    if not coefs:
        raise ctx.src.error(node.pos, "comparison does not involve any variable")
    kinds = {var[0] for var in coefs}
    if len(kinds) > 1:
        raise ctx.src.error(node.pos, "constraint mixes input (X) and output (Y) variables")
    if "X" in kinds and len(coefs) > 1:
        raise ctx.src.error(node.pos, "input constraint must bound a single input variable")
    return _Row(coefs, -const, node.pos)


# ---------------------------------------------------------------------------------------------------------
# Formulas to DNF
# ---------------------------------------------------------------------------------------------------------


def _dnf(node: _Node, ctx: _Context) -> _Dnf:
    """Disjunctive normal form of a formula: a list of disjuncts, each a list of rows (conjunction)."""
    if isinstance(node, _Tok):
        raise ctx.src.error(node.pos, f"expected a formula, got {node.text!r}")
    op = _head(node, ctx)
    if op in _COMPARISONS:
        return [_atom_rows(node, op, ctx)]
    if op not in ("and", "or"):
        raise ctx.src.error(node.pos, f"unknown operator {op!r}")
    if len(node.items) < 2:
        raise ctx.src.error(node.pos, f"{op!r} needs at least one operand")
    children = [_dnf(child, ctx) for child in node.items[1:]]
    if op == "or":
        return [disjunct for child in children for disjunct in child]
    return _conjoin(children, node.pos, ctx)


def _conjoin(children: list[_Dnf], pos: int, ctx: _Context) -> _Dnf:
    """DNF of a conjunction; single-disjunct children are merged first to avoid quadratic copying."""
    common: list[_Row] = []
    multi: list[_Dnf] = []
    for child in children:
        if len(child) == 1:
            common.extend(child[0])
        else:
            multi.append(child)
    result: _Dnf = [common]
    for child in multi:
        if len(result) * len(child) > _MAX_DISJUNCTS:
            raise ctx.src.error(pos, f"formula expands to more than {_MAX_DISJUNCTS} disjuncts")
        result = [left + right for left in result for right in child]
    return result


# ---------------------------------------------------------------------------------------------------------
# Assembling the spec
# ---------------------------------------------------------------------------------------------------------


class _Declarations(NamedTuple):
    names: dict[str, _Var]
    positions: dict[_Var, int]
    n_inputs: int
    n_outputs: int


def _declare(node: _List, decls: dict[str, _Var], positions: dict[_Var, int], src: _Source) -> None:
    """Record one ``(declare-const X_i Real)`` command."""
    if len(node.items) != 3 or not all(isinstance(i, _Tok) for i in node.items[1:]):
        raise src.error(node.pos, "expected (declare-const <name> <sort>)")
    name_tok = node.items[1]
    match = _VAR_RE.fullmatch(name_tok.text)
    if match is None:
        raise src.error(name_tok.pos, f"variable name {name_tok.text!r} is not X_<i> or Y_<j>")
    if name_tok.text in decls:
        raise src.error(name_tok.pos, f"variable {name_tok.text!r} declared twice")
    var = (match.group(1), int(match.group(2)))
    decls[name_tok.text] = var
    positions[var] = name_tok.pos


def _split_commands(nodes: list[_Node], src: _Source) -> tuple[_Declarations, list[_List]]:
    """Collect declarations and assert bodies from the top-level commands."""
    names: dict[str, _Var] = {}
    positions: dict[_Var, int] = {}
    asserts: list[_List] = []
    for node in nodes:
        if isinstance(node, _Tok):
            raise src.error(node.pos, f"unexpected token {node.text!r} outside a command")
        command = node.items[0].text if node.items and isinstance(node.items[0], _Tok) else ""
        if command == "declare-const":
            _declare(node, names, positions, src)
        elif command == "assert":
            if len(node.items) != 2:
                raise src.error(node.pos, "assert takes exactly one formula")
            asserts.append(node)
        elif command not in _IGNORED_COMMANDS:
            raise src.error(node.pos, f"unknown command {command!r}")
    counts = {kind: _count_declared(kind, positions, src) for kind in ("X", "Y")}
    if counts["X"] == 0:
        raise src.error(0, "no input variables (X_<i>) declared")
    return _Declarations(names, positions, counts["X"], counts["Y"]), asserts


def _count_declared(kind: str, positions: dict[_Var, int], src: _Source) -> int:
    """Number of declared ``kind`` variables; they must be numbered 0, 1, ..., n-1."""
    indices = {i for k, i in positions if k == kind}
    n = len(indices)
    if indices != set(range(n)):
        missing = min(set(range(n + 1)) - indices)
        last = max(pos for (k, _), pos in positions.items() if k == kind)
        raise src.error(last, f"{kind} variables are not numbered contiguously: {kind}_{missing} missing")
    return n


class _BoxBuilder:
    """Accumulates simple bounds on input variables into lower/upper arrays."""

    def __init__(self, n_inputs: int) -> None:
        self.lower = np.full(n_inputs, -np.inf)
        self.upper = np.full(n_inputs, np.inf)
        self.pos: dict[int, int] = {}  # input -> position of the last assert that tightened its bounds

    def copy(self) -> _BoxBuilder:
        other = _BoxBuilder(0)
        other.lower, other.upper, other.pos = self.lower.copy(), self.upper.copy(), dict(self.pos)
        return other

    def add(self, row: _Row) -> None:
        (_, index), coef = next(iter(row.coefs.items()))
        value = row.bound / coef
        if coef > 0 and value < self.upper[index]:
            self.upper[index], self.pos[index] = value, row.pos
        elif coef < 0 and value > self.lower[index]:
            self.lower[index], self.pos[index] = value, row.pos


def _clause(rows: list[_Row], n_outputs: int) -> Clause:
    """Dense read-only :class:`Clause` from output rows."""
    C = np.zeros((len(rows), n_outputs))
    d = np.empty(len(rows))
    for r, row in enumerate(rows):
        for (_, index), coef in row.coefs.items():
            C[r, index] = coef
        d[r] = row.bound
    return freeze(Clause(C, d))


def _finish_box(box: _BoxBuilder, src: _Source, pos: int, where: Callable[[int], tuple[str, int]]) -> None:
    """Check that every input has finite, consistent bounds; ``where(i)``: input ``i``'s name and the
    offset of its declaration."""
    for bounds, which in ((box.lower, "lower"), (box.upper, "upper")):
        unbounded = np.flatnonzero(~np.isfinite(bounds))
        if unbounded.size:
            name, at = where(int(unbounded[0]))
            raise src.error(at, f"input variable {name} has no {which} bound")
    empty = np.flatnonzero(box.lower > box.upper)
    if empty.size:
        i = int(empty[0])
        at = box.pos.get(i, pos)  # the assert that emptied the interval
        raise src.error(at, f"input variable {where(i)[0]} has empty bounds [{box.lower[i]}, {box.upper[i]}]")


def _is_input(row: _Row) -> bool:
    """Whether ``row`` constrains inputs (rows never mix inputs and outputs)."""
    return next(iter(row.coefs))[0] == "X"


def parse(src: _Source, path: str) -> Spec:
    """The :class:`~.model.Spec` of a VNN-LIB 1.x text (``src``); ``path``: the file, absolute."""
    decls, asserts = _split_commands(_parse_sexprs(src), src)
    ctx = _Context(src, decls.names)
    dnfs = [(_dnf(node.items[1], ctx), node.pos) for node in asserts]

    def where(i: int) -> tuple[str, int]:
        return f"X_{i}", decls.positions[("X", i)]

    return assemble(src, path, decls.n_inputs, decls.n_outputs, dnfs, where)


def assemble(
    src: _Source,
    path: str,
    n_inputs: int,
    n_outputs: int,
    asserts: list[tuple[_Dnf, int]],
    where: Callable[[int], tuple[str, int]],
    layout: Layout | None = None,
) -> Spec:
    """The :class:`Spec` of a conjunction of asserts, each in DNF (with its offset): plain conjunctive
    asserts apply to every disjunct of the remaining asserts' DNF; inputs are ``("X", i)``, outputs
    ``("Y", j)``, rows never mix them and an input row bounds one input. ``where(i)``: input ``i``'s
    name and declaration offset, for the messages."""
    base_box = _BoxBuilder(n_inputs)
    base_y: list[_Row] = []
    multi: list[_Dnf] = []
    for dnf, _ in asserts:
        if len(dnf) == 1:
            for row in dnf[0]:
                if _is_input(row):
                    base_box.add(row)
                else:
                    base_y.append(row)
        else:
            multi.append(dnf)
    last_pos = asserts[-1][1] if asserts else 0
    disjuncts = _conjoin(multi, last_pos, _Context(src, {})) if multi else [[]]
    if not base_y and not any(not _is_input(r) for d in disjuncts for r in d):
        raise src.error(last_pos, "the property has no output constraints")

    regions: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray, list[Clause]]] = {}
    for disjunct in disjuncts:
        box = base_box.copy()
        y_rows = list(base_y)
        for row in disjunct:
            if _is_input(row):
                box.add(row)
            else:
                y_rows.append(row)
        _finish_box(box, src, disjunct[0].pos if disjunct else last_pos, where)
        key = (box.lower.tobytes(), box.upper.tobytes())
        regions.setdefault(key, (box.lower, box.upper, []))[2].append(_clause(y_rows, n_outputs))
    return make_spec(path, n_inputs, n_outputs, regions.values(), layout)
