"""The query as the checker reads it: a VNN-LIB 1.x file, or a 2.0 file of one network (plain or
``.gz``), with its own s-expression reader, expanded to disjunctive normal form.

The file describes counterexamples: ``x`` in an input box whose output ``y = f(x)`` meets output rows.
Each term of the DNF of the asserts' conjunction is an :class:`Obligation`: its box rounded outward
from the decimal text (computed exactly with ``fractions.Fraction``: the lower end the largest float64
``<=`` the number, the upper end the smallest ``>=``) and its clause, rows ``C y <= d``. A comparison
``a <= b`` (``<``, ``>=``, ``>``, ``=`` alike, chained ones pairwise; strict read as non-strict, which
only adds counterexamples) is the row ``a - b <= 0`` with its constant moved right, as the verifier
reads it. A row's floats are the nearest to its exact rationals (what a proof's rows are matched
against); its radii bound the distance (zero for the usual coefficients ``±1``). Linear terms are
``(+ ...)``, ``(- ...)`` and ``(* c v)``; an input row bounds one variable. A term whose box is empty
holds no counterexample and is dropped; an unbounded input is :class:`Unsupported`.

VNN-LIB 2.0 (``(vnnlib-version <2.0>)``): ``declare-network``s, each with one ``declare-input`` and
one ``declare-output`` tensor (``equal-to`` / ``isomorphic-to`` are read and need nothing: every network
is given its own file), of any element type (read as reals: a typed tensor's values are among them,
which only adds counterexamples); ``==`` is ``=``. The query is over one *joint* input and output
(:class:`Network` says where each network sits in them):

* an assert ``(= A[i] B[j])`` of two input elements, outside any ``or`` (in asserts and ``and``s only),
  ties them: they are one variable. The joint input is the input elements, network by network,
  row-major, an element tied to one before it left out (it is that one's variable);
* the joint output is every network's output elements, network by network, row-major.

One network whose input is not tied is its input and output as they are (a 1.x file alike).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .files import Unsupported

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_NAME = re.compile(r"([XY])_(\d+)")
_IGNORED = frozenset({"set-logic", "set-info", "set-option", "check-sat", "get-model", "exit"})
_INDEX = re.compile(r"\s*\[([\d\s,]*)\]")  # a 2.0 shape or element index, glued to the name before it
_TENSOR = re.compile(r"(\w+)\[([\d,]*)\]")
_MAX_TERMS = 100_000


@dataclass(frozen=True)
class Rows:
    """Rows ``C y <= d``: the real coefficients lie within ``C ± C_rad``, ``d ± d_rad``."""

    C: np.ndarray  # (k, n_out)
    d: np.ndarray  # (k,)
    C_rad: np.ndarray
    d_rad: np.ndarray

    def take(self, idx: list[int]) -> Rows:
        return Rows(self.C[idx], self.d[idx], self.C_rad[idx], self.d_rad[idx])


@dataclass(frozen=True)
class Obligation:
    lower: np.ndarray  # (n_in,), outward
    upper: np.ndarray
    rows: Rows


@dataclass(frozen=True)
class Network:
    """A declared network (``name`` None: a 1.x file's one network): the joint input's position of each
    of its input elements (row-major), the first of its outputs' positions in the joint output, how
    many it has."""

    name: str | None
    inputs: tuple[int, ...]
    out_start: int
    n_out: int


@dataclass(frozen=True)
class Query:
    n_inputs: int
    n_outputs: int
    obligations: tuple[Obligation, ...]
    networks: tuple[Network, ...] = ()


def sexprs(data: bytes, what: str = "query") -> list:
    """The s-expressions of a file (comments dropped): nested lists of tokens; a bracketed index or
    shape is glued to the token before it, without spaces (``X [0, 1]`` is ``X[0,1]``)."""
    text = re.sub(r";[^\n]*", " ", data.decode("utf-8", errors="replace"))
    text = _INDEX.sub(lambda m: "[" + re.sub(r"\s", "", m[1]) + "]", text)
    tokens = re.findall(r"[()]|[^\s()]+", text)
    stack: list[list] = [[]]
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) == 1:
                raise Unsupported(f"{what}: unbalanced ')'")
            stack[-2].append(stack.pop())
        else:
            stack[-1].append(tok)
    if len(stack) != 1:
        raise Unsupported(f"{what}: unbalanced '('")
    return stack[0]


def parse(data: bytes) -> Query:
    """The query of a VNN-LIB file's bytes (1.x or 2.0); :class:`Unsupported` for what this reader does
    not take."""
    names, declared, asserts = _commands(sexprs(data))
    if declared:
        names, networks, asserts = _joint(declared, asserts)
    n_in, n_out = (_count(names, kind) for kind in "XY")
    if not declared:
        networks = [Network(None, tuple(range(n_in)), 0, n_out)]
    terms = _dnf(["and", *asserts], names) if asserts else [[]]
    obligations = [o for o in (_obligation(t, n_in, n_out) for t in terms) if o is not None]
    return Query(n_in, n_out, tuple(obligations), tuple(networks))


def _commands(items: list) -> tuple[dict[str, tuple[str, int]], list, list]:
    """The 1.x variables, the 2.0 networks (name, input elements, output elements) and the asserts."""
    names: dict[str, tuple[str, int]] = {}
    declared: list[tuple[str, list[str], list[str]]] = []
    asserts = []
    for cmd in items:
        head = cmd[0] if isinstance(cmd, list) and cmd and isinstance(cmd[0], str) else None
        if head == "declare-const" and len(cmd) == 3 and _NAME.fullmatch(str(cmd[1])) and cmd[2] == "Real":
            m = _NAME.fullmatch(cmd[1])
            names[cmd[1]] = (m.group(1), int(m.group(2)))
        elif head == "vnnlib-version" and cmd[1:] == ["<2.0>"]:
            continue
        elif head == "declare-network":
            declared.append(_network(cmd))
        elif head == "assert" and len(cmd) == 2:
            asserts.append(cmd[1])
        elif head not in _IGNORED:
            why = "1.x: declare-const X_i/Y_j Real, assert; 2.0: declare-network, assert"
            raise Unsupported(f"query: command {_show(cmd)} ({why})")
    if names and declared:
        raise Unsupported("query: both 1.x variables and 2.0 networks")
    return names, declared, asserts


def _network(cmd: list) -> tuple[str, list[str], list[str]]:
    """A 2.0 network: its name, its input and its output elements (``"X[0,1]"``) in row-major order."""
    name = cmd[1] if len(cmd) > 1 and isinstance(cmd[1], str) else "?"
    decls = [d for d in cmd[2:] if isinstance(d, list) and d and isinstance(d[0], str)]
    kinds = [d[0] for d in decls if d[0] not in ("equal-to", "isomorphic-to") or len(d) != 2]
    if len(decls) != len(cmd) - 2 or sorted(kinds) != ["declare-input", "declare-output"]:
        why = ", ".join(sorted(set(kinds) - {"declare-input", "declare-output"})) or "its declarations"
        raise Unsupported(f"query: network {name}: {why} (one input and one output tensor here)")
    out: dict[str, list[str]] = {}
    for head, *decl in (d for d in decls if d[0] in kinds):
        m = _TENSOR.fullmatch(decl[1]) if len(decl) == 2 and isinstance(decl[1], str) else None
        if m is None or not isinstance(decl[0], str):
            raise Unsupported(f"query: ({head} {' '.join(map(_show, decl))})")
        shape = [int(n) for n in m[2].split(",") if n]
        out[head] = [f"{decl[0]}[{','.join(map(str, i))}]" for i in itertools.product(*map(range, shape))]
    return name, out["declare-input"], out["declare-output"]


def _joint(declared: list, asserts: list) -> tuple[dict, list[Network], list]:
    """The 2.0 variables at their joint positions, the networks, the asserts without their ties."""
    inputs = {e for _, ins, _ in declared for e in ins}
    elements = [e for _, ins, outs in declared for e in (*ins, *outs)]
    if len({n for n, _, _ in declared}) != len(declared) or len(set(elements)) != len(elements):
        raise Unsupported("query: a network or tensor name declared twice")
    root: dict[str, str] = {}

    def find(e: str) -> str:
        while root.get(e, e) != e:
            e = root[e]
        return e

    def untied(e):  # e without its ties (recorded); None where nothing is left
        if isinstance(e, list) and e and e[0] == "and":
            kept = [x for x in (untied(x) for x in e[1:]) if x is not None]
            return ["and", *kept] if kept else None
        if isinstance(e, list) and len(e) == 3 and e[0] in ("=", "==") and {*e[1:]} <= inputs:
            a, b = sorted((find(e[1]), find(e[2])), key=order.get)
            root[b] = a  # a class's root: its first element
            return None
        return e

    order = {e: k for k, e in enumerate(e for _, ins, _ in declared for e in ins)}
    asserts = [x for x in (untied(a) for a in asserts) if x is not None]
    names: dict[str, tuple[str, int]] = {}
    for e in order:  # an element tied to one before it is that one's variable
        names[e] = names[find(e)] if find(e) != e else ("X", len(set(names.values())))
    networks, start = [], 0
    for name, ins, outs in declared:
        networks.append(Network(name, tuple(names[e][1] for e in ins), start, len(outs)))
        names.update((e, ("Y", start + j)) for j, e in enumerate(outs))
        start += len(outs)
    return names, networks, asserts


def _count(names: dict, kind: str) -> int:
    idx = sorted({i for k, i in names.values() if k == kind})
    if idx != list(range(len(idx))) or not idx:
        raise Unsupported(f"query: the {kind} variables are not declared as {kind}_0 ... {kind}_n")
    return len(idx)


def _show(e) -> str:
    return e if isinstance(e, str) else "(" + " ".join(_show(x) for x in e) + ")"


def _lin(e, names: dict) -> tuple[dict, Fraction]:
    """A linear term: coefficients by variable, constant; exact."""
    if isinstance(e, str):
        if e in names:
            return {names[e]: Fraction(1)}, Fraction(0)
        if not _NUMBER.fullmatch(e):
            raise Unsupported(f"query: {e!r} is neither a declared variable nor a number")
        return {}, Fraction(e)
    args = [_lin(a, names) for a in e[1:]]
    if not e or e[0] not in ("+", "-", "*") or not args:
        raise Unsupported(f"query: term {_show(e)}")
    if e[0] == "-":
        args = [_neg(args[0])] if len(args) == 1 else [args[0], *map(_neg, args[1:])]
    if e[0] == "*":
        if sum(1 for a in args if a[0]) > 1:
            raise Unsupported(f"query: a product of variables {_show(e)}")
        f = math.prod(a[1] for a in args if not a[0])
        v = next((a for a in args if a[0]), ({}, Fraction(1)))
        return {k: c * f for k, c in v[0].items()}, v[1] * f
    coefs: dict = {}
    for a, _ in args:
        for k, c in a.items():
            coefs[k] = coefs.get(k, 0) + c
    return coefs, sum((a[1] for a in args), Fraction(0))


def _neg(a: tuple[dict, Fraction]) -> tuple[dict, Fraction]:
    return {k: -c for k, c in a[0].items()}, -a[1]


def _dnf(e, names: dict) -> list[list[tuple[dict, Fraction]]]:
    """Terms (conjunctions of rows ``Σ c_v v <= bound``) of a formula."""
    if isinstance(e, str) or not e:
        raise Unsupported(f"query: formula {_show(e)}")
    if e[0] in ("and", "or"):
        parts = [_dnf(x, names) for x in e[1:]]
        if e[0] == "or":
            return [t for p in parts for t in p]
        out: list = [[]]
        for p in parts:
            if len(out) * len(p) > _MAX_TERMS:
                raise Unsupported(f"query: more than {_MAX_TERMS} disjunctive terms")
            out = [a + b for a in out for b in p]
        return out
    if e[0] == "==":
        e = ["=", *e[1:]]
    if e[0] not in ("<=", "<", ">=", ">", "=") or len(e) < 3:
        raise Unsupported(f"query: formula {_show(e)}")
    terms = [_lin(x, names) for x in e[1:]]
    rows = []
    for a, b in zip(terms, terms[1:], strict=False):
        for small, large in [(a, b)] * (e[0] in ("<=", "<", "=")) + [(b, a)] * (e[0] in (">=", ">", "=")):
            coefs = {k: small[0].get(k, 0) - large[0].get(k, 0) for k in {*small[0], *large[0]}}
            rows.append(({k: c for k, c in coefs.items() if c != 0}, large[1] - small[1]))
    return [rows]


def _obligation(term: list, n_in: int, n_out: int) -> Obligation | None:
    lo: list = [None] * n_in
    hi: list = [None] * n_in
    ys = []
    for coefs, bound in term:
        kinds = {k for k, _ in coefs}
        if not coefs:
            if bound < 0:
                return None  # a false comparison of constants: no counterexample here
        elif kinds == {"Y"}:
            ys.append((coefs, bound))
        elif kinds == {"X"} and len(coefs) == 1:
            ((_, i), c), value = next(iter(coefs.items())), bound / next(iter(coefs.values()))
            if c > 0:
                hi[i] = value if hi[i] is None else min(hi[i], value)
            else:
                lo[i] = value if lo[i] is None else max(lo[i], value)
        else:
            raise Unsupported("query: a row mixing inputs and outputs, or over several inputs")
    if None in lo or None in hi:
        raise Unsupported(f"query: input X_{(lo + hi).index(None) % n_in} is unbounded")
    if any(a > b for a, b in zip(lo, hi, strict=True)):
        return None
    C, C_rad = _nearest(
        [[c.get(("Y", j), Fraction(0)) for j in range(n_out)] for c, _ in ys], (len(ys), n_out)
    )
    d, d_rad = _nearest([b for _, b in ys], (len(ys),))
    box = np.array([outward(v, -1) for v in lo]), np.array([outward(v, 1) for v in hi])
    return Obligation(*box, Rows(C, d, C_rad, d_rad))


def outward(v: Fraction, side: int) -> float:
    """The float64 nearest ``v`` on the side ``side`` (-1: below, 1: above)."""
    try:
        f = float(v)  # correctly rounded
    except OverflowError:
        raise Unsupported(f"query: the bound {v} is beyond float64") from None
    return math.nextafter(f, side * math.inf) if (Fraction(f) - v) * side < 0 else f


def _nearest(values: list, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Nearest floats, and radii rounded up; ``values``: nested lists of Fractions."""
    exact = np.array(values, dtype=object).reshape(shape)
    near = np.array([float(v) for v in exact.ravel()], dtype=np.float64).reshape(shape)
    rad = [outward(abs(Fraction(f) - v), 1) for f, v in zip(near.ravel(), exact.ravel(), strict=True)]
    return near, np.array(rad, dtype=np.float64).reshape(shape)
