"""The data model of a parsed VNN-LIB file, 1.x or 2.0: a :class:`Spec` is a disjunction of
:class:`Region` objects, each an input box plus a disjunction of :class:`Clause` objects, each a
conjunction of linear constraints ``C @ y <= d`` on the outputs; :class:`Clauses` stacks a region's
clauses for the attack, the bounds, BaB and the verdict (the one definition of a clause margin)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from .common import Layout


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


def make_spec(
    path: str,
    n_inputs: int,
    n_outputs: int,
    regions: Iterable[tuple[np.ndarray, np.ndarray, list[Clause]]],
    layout: Layout | None = None,
) -> Spec:
    """Assemble a :class:`Spec` with read-only arrays from ``(lower, upper, clauses)`` triples."""
    built = tuple(Region(readonly(lo), readonly(hi), tuple(clauses)) for lo, hi, clauses in regions)
    return Spec(path, n_inputs, n_outputs, built, layout)


def readonly(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array, dtype=np.float64)
    array.flags.writeable = False
    return array


def freeze(clause: Clause) -> Clause:
    return Clause(readonly(clause.C), readonly(clause.d))
