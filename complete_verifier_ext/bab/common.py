"""Shared pieces of branch and bound: options, results, clause margins, lockstep round decisions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..bounds.walk import margin
from ..config import Config
from ..parallel import comm

_DEFAULT = Config()  # the one source of the defaults below: the config's


@dataclass(frozen=True)
class BabOptions:
    batch_size: int = _DEFAULT.solver.batch_size  # domains bounded together per rank per round
    max_domains: int = _DEFAULT.bab.max_domains  # all ranks together; beyond this: "unknown"
    branching: str = _DEFAULT.bab.branching.method  # babsr | fsb | kfsb
    candidates: int = _DEFAULT.bab.branching.candidates
    reduceop: str = _DEFAULT.bab.branching.reduceop  # how FSB scores a split from its two children
    iteration: int = _DEFAULT.solver.beta_crown.iteration  # β-CROWN optimisation steps per round
    lr_alpha: float = _DEFAULT.solver.beta_crown.lr_alpha
    lr_beta: float = _DEFAULT.solver.beta_crown.lr_beta
    lr_decay: float = _DEFAULT.solver.beta_crown.lr_decay
    input_split: bool = _DEFAULT.bab.branching.input_split.enable
    pgd_steps: int = 10  # sign-gradient steps from the candidate points of each round (0: corners only)
    pgd_points: int = 256  # how many candidates (lowest bounds first) take those steps


@dataclass
class BabResult:
    verdict: str  # unsat | sat | unknown | timeout
    counterexample: np.ndarray | None = None  # flat float32 input point, checked on the model
    domains: int = 0  # domains bounded, all ranks together
    rounds: int = 0
    max_queue: list[int] | None = None  # largest queue seen, per rank
    bound: float = -np.inf  # unsat: the least clause margin bound of a verified leaf (> 0); else -inf

    def add_work(self, other: BabResult) -> None:
        """Count another search's work in this one: domains and rounds add up, and the largest
        queue of every rank is kept."""
        self.domains += other.domains
        self.rounds += other.rounds
        if other.max_queue:
            self.max_queue = [
                max(a, b) for a, b in zip(self.max_queue or other.max_queue, other.max_queue, strict=True)
            ]


def _nan_to(m: Tensor, value: float) -> Tensor:
    return torch.where(torch.isnan(m), value, m)


@dataclass(frozen=True)
class Problem:
    """One region of a spec, as BaB sees it: counterexample iff some clause has all rows C y <= d."""

    C: Tensor  # (S, n_out) float32
    d: Tensor  # (S,) float64
    owner: Tensor  # (S,) clause index of each row
    n_clauses: int

    def margins(self, lb: Tensor) -> Tensor:
        """Lower bounds (B, S) of C y -> per-clause margins (B, n_clauses): max over rows of lb - d
        (``bounds.walk.margin``: less float32 rounding; a NaN bound proves nothing, ``-inf``)."""
        return self._per_clause(margin(lb, self.d))

    def point_margins(self, y: Tensor) -> Tensor:
        """Outputs (B, n_out) of concrete points -> their clause margins (B, n_clauses); a NaN output
        is no counterexample: its margin counts as ``+inf``."""
        m = (y @ self.C.T.to(y.dtype)).double() - self.d
        return self._per_clause(_nan_to(m, torch.inf))

    def _per_clause(self, m: Tensor) -> Tensor:
        out = torch.full((m.shape[0], self.n_clauses), -torch.inf, dtype=torch.float64)
        return out.scatter_reduce(1, self.owner.expand(m.shape[0], -1), m, "amax")

    def violated(self, y: Tensor) -> Tensor:
        """Outputs (B, n_out) -> (B,) True where some clause holds (a counterexample)."""
        return (self.point_margins(y) <= 0).any(1)


def agree_round(
    found: bool, n_local: int, worst: float, expired: Callable[[], bool]
) -> tuple[bool, int, float, bool]:
    """The per-round collective decision: (anyone found a counterexample, domains left on all ranks,
    global worst bound, out of time).  Every rank calls it once per round, whatever its data."""
    t = torch.tensor([float(found), float(n_local), -worst], dtype=torch.float64)
    s = comm.all_reduce(t[:2].clone(), "sum")
    w = comm.all_reduce(t[2:].clone(), "max")
    return bool(s[0] > 0), int(s[1]), float(-w[0]), expired()


def share_counterexample(x: np.ndarray | None) -> np.ndarray | None:
    """The counterexample of the lowest rank that has one, on every rank."""
    has = comm.all_gather_cat(torch.tensor([float(x is not None)]), 0)
    owners = has.nonzero().flatten().tolist()
    if not owners:
        return None
    return comm.broadcast_object(x, src=owners[0])
