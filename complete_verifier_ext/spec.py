"""Reader for VNN-LIB 1.0 property files, as used in VNN-COMP 2021-2024.

A property file declares input variables ``X_i`` and output variables ``Y_j`` with ``declare-const`` and
asserts a conjunction of formulas built from ``and``, ``or`` and linear comparisons. The file describes
the *counterexample* set: an input ``x`` inside an input box whose network output ``y`` satisfies the
output constraints.

:func:`load_vnnlib` turns the file into a :class:`Spec`: a disjunction of :class:`Region` objects, each
an input box plus a disjunction of :class:`Clause` objects, each a conjunction of linear constraints
``C @ y <= d`` on the outputs.

Files ending in ``.gz`` (or starting with the gzip magic bytes) are decompressed transparently. Parsed
specs are cached in-process and on disk (see :func:`load_vnnlib`).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Union

import numpy as np
import torch
from torch import Tensor

from . import vnnlib2
from .vnnlib_common import Dnf as _Dnf
from .vnnlib_common import Layout, NetworkSlots, Slot, SpecError
from .vnnlib_common import Row as _Row
from .vnnlib_common import Source as _Source
from .vnnlib_common import Var as _Var

__all__ = ["Clause", "Layout", "NetworkSlots", "Region", "Slot", "Spec", "SpecError", "load_vnnlib"]

_CACHE_FORMAT_VERSION = 2  # 2: VNN-LIB 2.0 specs (with a layout) are not stored on disk
_MAX_DISJUNCTS = 100_000
_MEMORY_CACHE_SIZE = 128

_TOKEN_RE = re.compile(r";[^\n]*|[()]|[^\s();]+")
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_VAR_RE = re.compile(r"([XY])_(\d+)")
_NUMBER_START = frozenset("0123456789+-.")
_COMPARISONS = frozenset({"<=", ">=", "<", ">", "="})
_IGNORED_COMMANDS = frozenset({"check-sat", "get-model", "exit", "set-logic", "set-info", "set-option"})


# ---------------------------------------------------------------------------------------------------------
# Public data model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    """Conjunction of ``k`` linear output constraints: holds at output ``y`` iff ``all(C @ y <= d)``."""

    C: np.ndarray  # (k, n_outputs) float64
    d: np.ndarray  # (k,) float64


@dataclass(frozen=True)
class Region:
    """Input box plus a disjunction of output clauses (a counterexample satisfies any one clause)."""

    lower: np.ndarray  # (n_inputs,) float64
    upper: np.ndarray  # (n_inputs,) float64
    clauses: tuple[Clause, ...]


ROUNDING = 2.0**-20  # about 8 float32 ulps: what float32 evaluation order can move an output by


def _nan_to(m: Tensor, value: float) -> Tensor:
    return torch.where(torch.isnan(m), value, m)


@dataclass(frozen=True, eq=False)
class Clauses:
    """The clauses of a region with their rows stacked: the one definition of a clause margin, used by
    the attack, the bounds, BaB and the verdict.

    A clause holds at an output ``y`` iff every one of its rows has ``C[r] · y <= d[r]``; its margin is
    the max over its rows of ``C[r] · y − d[r]``, so ``<= 0`` means it holds (a counterexample) and a
    clause without rows always holds (``-inf``). Bounds propagate ``C`` (float32); concrete outputs are
    checked against the rows as the VNN-LIB file wrote them (``C64``)."""

    C: Tensor  # (S, n_out) float32: the spec matrix that bound propagation bounds
    d: Tensor  # (S,) float64
    owner: Tensor  # (S,) long: the clause of each row
    n_clauses: int
    C64: Tensor | None = None  # (S, n_out) float64; None: ``C``

    @classmethod
    def of(cls, clauses: Sequence[Clause], n_out: int | None = None) -> Clauses:
        """Stack ``clauses``; ``n_out``: the model's outputs, checked against every clause."""
        Cs, ds = [], []
        for i, clause in enumerate(clauses):
            C = np.asarray(clause.C, dtype=np.float64)
            C = C.reshape(1, -1) if C.ndim == 1 else C
            d = np.asarray(clause.d, dtype=np.float64).reshape(-1)
            if C.shape[0] != d.size:
                raise ValueError(f"clause {i} has {C.shape[0]} rows in C but {d.size} entries in d")
            if C.shape[0] and n_out is not None and C.shape[1] != n_out:
                raise ValueError(f"clause {i} expects {C.shape[1]} outputs, the model has {n_out}")
            Cs.append(C)
            ds.append(d)
        width = n_out if n_out is not None else max((C.shape[1] for C in Cs if C.shape[0]), default=0)
        C = np.concatenate([C.reshape(-1, width) for C in Cs], 0) if Cs else np.zeros((0, width))
        owner = np.repeat(np.arange(len(Cs)), [len(d) for d in ds])
        C64 = torch.from_numpy(C)
        d = torch.from_numpy(np.concatenate(ds) if ds else np.zeros(0))
        return cls(C64.float(), d, torch.from_numpy(owner), len(Cs), C64)

    def to(self, device: torch.device | str) -> Clauses:
        """The same clauses with ``C``, the matrix that bound propagation bounds, on ``device`` (the
        rest stays on the host: every method moves what it needs to its argument's device)."""
        return replace(self, C=self.C.to(device))

    def row_margins(self, lb: Tensor) -> Tensor:
        """Lower bounds ``(B, S)`` of ``C y`` -> lower bounds of ``C y − d`` (float64), safe to compare
        with 0: a row counts as proven only when its bound clears the threshold by more than float32
        rounding, ``ROUNDING * (|lb| + |d|)`` (the network itself, run in float32 by torch or onnxruntime
        in another order, can land that far from where the bound was computed: on a zero-width box the
        bound *is* one such evaluation); NaN proves nothing (``-inf``). For ``d = 0`` (robustness rows)
        the sign never changes."""
        lb, d = lb.double(), self.d.to(lb.device)
        return _nan_to(lb - d - ROUNDING * (lb.abs() + d.abs()), -torch.inf)

    def margins(self, lb: Tensor) -> Tensor:
        """Lower bounds ``(B, S)`` of ``C y`` -> lower bounds ``(B, n_clauses)`` of the clause margins."""
        return self.per_clause(self.row_margins(lb))

    def bound(self, lb: Tensor) -> np.ndarray:
        """Lower bounds ``(1, S)`` of ``C y`` (one box) -> the lower bound of each clause's margin,
        ``(n_clauses,)`` float64: a clause is proven (cannot hold) where it is ``> 0``."""
        return self.margins(lb.detach().cpu())[0].numpy()

    def point_rows(self, y: Tensor) -> Tensor:
        """Outputs ``(B, n_out)`` of concrete points -> ``C y − d`` ``(B, S)`` (float64); a NaN (a NaN
        output, or inf − inf) is no counterexample: ``+inf``."""
        C = self.C64 if self.C64 is not None else self.C.double()
        return _nan_to(y.double() @ C.T.to(y.device) - self.d.to(y.device), torch.inf)

    def point_margins(self, y: Tensor) -> Tensor:
        """Outputs ``(B, n_out)`` of concrete points -> their clause margins ``(B, n_clauses)``."""
        return self.per_clause(self.point_rows(y))

    def per_clause(self, m: Tensor) -> Tensor:
        """Row values ``(B, S)`` -> the max over each clause's rows ``(B, n_clauses)`` (``-inf`` for a
        clause without rows)."""
        out = torch.full((m.shape[0], self.n_clauses), -torch.inf, dtype=m.dtype, device=m.device)
        return out.scatter_reduce(1, self.owner.to(m.device).expand(m.shape[0], -1), m, "amax")

    def violated(self, y: Tensor) -> Tensor:
        """Outputs ``(B, n_out)`` -> ``(B,)`` True where some clause holds (a counterexample)."""
        return (self.point_margins(y) <= 0).any(1)


@dataclass(frozen=True)
class Spec:
    """A parsed VNN-LIB file: the counterexample set is the union of its regions. ``layout``: a
    VNN-LIB 2.0 file's networks and tensors (None for 1.x)."""

    path: str
    n_inputs: int
    n_outputs: int
    regions: tuple[Region, ...]
    layout: Layout | None = None


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
    return _freeze(Clause(C, d))


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


def _build_spec(text: str, file: str, path: str) -> Spec:
    """Parse a VNN-LIB ``text`` (1.x, or 2.x: :mod:`complete_verifier_ext.vnnlib2`)."""
    src = _Source(file, text)
    if vnnlib2.is_vnnlib2(text):
        q = vnnlib2.read(src)
        return assemble(src, path, q.n_inputs, q.n_outputs, q.asserts, q.where, q.layout)
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
    return _make_spec(path, n_inputs, n_outputs, regions.values(), layout)


def _make_spec(
    path: str,
    n_inputs: int,
    n_outputs: int,
    regions: Iterable[tuple[np.ndarray, np.ndarray, list[Clause]]],
    layout: Layout | None = None,
) -> Spec:
    """Assemble a :class:`Spec` with read-only arrays from ``(lower, upper, clauses)`` triples."""
    built = tuple(Region(_readonly(lo), _readonly(hi), tuple(clauses)) for lo, hi, clauses in regions)
    return Spec(path, n_inputs, n_outputs, built, layout)


def _readonly(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float64)
    array.flags.writeable = False
    return array


def _freeze(clause: Clause) -> Clause:
    return Clause(_readonly(clause.C), _readonly(clause.d))


# ---------------------------------------------------------------------------------------------------------
# File reading and caching
# ---------------------------------------------------------------------------------------------------------


def read_text(path: str) -> str:
    """The text of a VNN-LIB file (gzip-compressed or not); a file that is not UTF-8 text, or a broken
    gzip, is a :class:`SpecError` naming it."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        if path.endswith(".gz") or data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        return data.decode("utf-8")
    except (OSError, EOFError, zlib.error) as e:
        raise SpecError(f"{path}: not a readable gzip file ({e})") from None
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{path}: not a UTF-8 text file (byte {e.start}: {data[e.start : e.start + 1]!r})"
        ) from None


def cache_root() -> Path:
    """This package's cache folder: ``$XDG_CACHE_HOME/complete_verifier_ext`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "complete_verifier_ext"


def _cache_dir() -> Path:
    return cache_root() / "specs"


def _disk_key(key: tuple[str, int, int]) -> str:
    text = f"v{_CACHE_FORMAT_VERSION}\0{key[0]}\0{key[1]}\0{key[2]}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _save_disk(spec: Spec, file: Path) -> None:
    """Store ``spec`` as an ``.npz`` file (no pickle); any failure is silently ignored."""
    regions = spec.regions
    clauses = [c for r in regions for c in r.clauses]
    arrays = {
        "meta": np.array([_CACHE_FORMAT_VERSION, spec.n_inputs, spec.n_outputs], dtype=np.int64),
        "path": np.array(spec.path),
        "lower": np.stack([r.lower for r in regions]),
        "upper": np.stack([r.upper for r in regions]),
        "clauses_per_region": np.array([len(r.clauses) for r in regions], dtype=np.int64),
        "rows_per_clause": np.array([len(c.d) for c in clauses], dtype=np.int64),
        "C": np.concatenate([c.C for c in clauses]).reshape(-1, spec.n_outputs),
        "d": np.concatenate([c.d for c in clauses]),
    }
    tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, file)
    except Exception:
        with contextlib.suppress(Exception):
            tmp.unlink(missing_ok=True)


def _load_disk(file: Path) -> Spec | None:
    """Read a spec written by :func:`_save_disk`; ``None`` if absent or unreadable."""
    try:
        with np.load(file, allow_pickle=False) as data:
            version, n_inputs, n_outputs = (int(v) for v in data["meta"])
            if version != _CACHE_FORMAT_VERSION:
                return None
            row_ends = np.cumsum(data["rows_per_clause"])
            C, d = data["C"], data["d"]
            clauses = [
                _freeze(Clause(C[end - k : end], d[end - k : end]))
                for k, end in zip(data["rows_per_clause"], row_ends, strict=True)
            ]
            clause_ends = np.cumsum(data["clauses_per_region"])
            regions = [
                (data["lower"][i], data["upper"][i], clauses[end - k : end])
                for i, (k, end) in enumerate(zip(data["clauses_per_region"], clause_ends, strict=True))
            ]
            return _make_spec(str(data["path"]), n_inputs, n_outputs, regions)
    except Exception:
        return None


class _MemoryCache:
    """Small bounded in-process cache of parsed specs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple[str, int, int], Spec] = {}

    def get(self, key: tuple[str, int, int]) -> Spec | None:
        return self.entries.get(key)

    def put(self, key: tuple[str, int, int], spec: Spec) -> None:
        if len(self.entries) >= self.size:
            self.entries.pop(next(iter(self.entries)))
        self.entries[key] = spec


_MEMORY = _MemoryCache(_MEMORY_CACHE_SIZE)


def load_vnnlib(path: str | os.PathLike, cache: bool = True) -> Spec:
    """Load a VNN-LIB 1.0 file (optionally gzip-compressed) into a :class:`Spec`.

    With ``cache=True`` results are memoised in-process and on disk under
    ``$XDG_CACHE_HOME/complete_verifier_ext/specs`` (default ``~/.cache/...``), keyed by the absolute
    path, modification time and size of the file. Arrays in the returned spec are read-only.

    Raises:
        SpecError: the file is malformed or outside the supported fragment; the message starts with
            ``"<file>:<line>: "``.
        OSError: the file cannot be read.
    """
    file = os.fspath(path)
    abs_path = os.path.abspath(file)
    if not cache:
        return _build_spec(read_text(file), file, abs_path)
    stat = os.stat(abs_path)
    key = (abs_path, stat.st_mtime_ns, stat.st_size)
    spec = _MEMORY.get(key)
    if spec is not None:
        return spec
    disk_file = _cache_dir() / f"{_disk_key(key)}.npz"
    spec = _load_disk(disk_file)
    if spec is None:
        spec = _build_spec(read_text(file), file, abs_path)
        if spec.layout is None:  # a 2.0 spec is parsed again (the reference parser is fast)
            _save_disk(spec, disk_file)
    _MEMORY.put(key, spec)
    return spec


# ----------------------------------------------------------------------------------------------------
# Float32 boxes
# ----------------------------------------------------------------------------------------------------


def _as_float64(a: Any, name: str) -> np.ndarray:
    """Return ``a`` as a flat float64 array, rejecting NaN."""
    arr = np.asarray(a, dtype=np.float64).reshape(-1)
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN")
    return arr


def float32_box(lower: Any, upper: Any, inward: bool) -> tuple[np.ndarray, np.ndarray]:
    """Round the real box ``[lower, upper]`` to a float32 box.

    ``inward=True`` rounds ``lower`` up and ``upper`` down, so every float32 point of the result lies in
    the real box (used for attacks).  ``inward=False`` rounds ``lower`` down and ``upper`` up, so the result
    contains the real box (used for sound bounds).  Values beyond the float32 range round to ``±inf``
    outward and to ``±float32_max`` inward.

    If inward rounding empties a dimension (the real interval holds no float32 value, as a pinned
    ``X = 0.1``), that dimension is the float32 nearest to the interval's midpoint: the value the
    float32 network reads for those real inputs (the VNN-COMP checkers cast a witness to the model's
    input type and accept it within their input tolerance).

    Raises ``ValueError`` on NaN, on shape mismatch, or when ``lower > upper`` somewhere.
    """
    lo = _as_float64(lower, "lower")
    hi = _as_float64(upper, "upper")
    if lo.shape != hi.shape:
        raise ValueError(f"lower and upper have different sizes: {lo.size} != {hi.size}")
    if (lo > hi).any():
        raise ValueError("lower > upper in some dimension")
    with np.errstate(over="ignore"):
        lo32 = lo.astype(np.float32)
        hi32 = hi.astype(np.float32)
    if inward:
        lo32 = np.where(lo32.astype(np.float64) < lo, np.nextafter(lo32, np.float32(np.inf)), lo32)
        hi32 = np.where(hi32.astype(np.float64) > hi, np.nextafter(hi32, np.float32(-np.inf)), hi32)
        empty = lo32 > hi32
        if empty.any():
            with np.errstate(over="ignore"):
                mid32 = (0.5 * (lo[empty] + hi[empty])).astype(np.float32)
            lo32[empty] = mid32
            hi32[empty] = mid32
    else:
        lo32 = np.where(lo32.astype(np.float64) > lo, np.nextafter(lo32, np.float32(-np.inf)), lo32)
        hi32 = np.where(hi32.astype(np.float64) < hi, np.nextafter(hi32, np.float32(np.inf)), hi32)
    return lo32.astype(np.float32), hi32.astype(np.float32)
