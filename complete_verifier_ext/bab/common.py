"""Shared pieces of branch and bound: options, results, the rebalancing plan (the round loop is
:mod:`bab.search`, the clause margins :class:`spec.Clauses`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import Config

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
    store_dtype: torch.dtype = torch.float16  # α and β of the domains between rounds (alpha_dtype)
    record: bool = False  # keep every verified leaf (its box or split history), for a proof


@dataclass
class BabResult:
    verdict: str  # unsat | sat | unknown | timeout
    counterexample: np.ndarray | None = None  # flat float32 input point, checked on the model
    domains: int = 0  # domains bounded, all ranks together
    rounds: int = 0
    max_queue: list[int] | None = None  # largest queue seen, per rank
    bound: float = -np.inf  # unsat: the least clause margin bound of a verified leaf (> 0); else -inf
    reason: str = ""  # unknown: why the search stopped before its time was up, in one line
    leaves: list | None = None  # unsat with ``BabOptions.record``: every rank's verified leaves (proofs.py)

    def add_work(self, other: BabResult) -> None:
        """Count another search's work in this one: domains and rounds add up, and the largest
        queue of every rank is kept."""
        self.domains += other.domains
        self.rounds += other.rounds
        if other.max_queue:
            self.max_queue = [
                max(a, b) for a, b in zip(self.max_queue or other.max_queue, other.max_queue, strict=True)
            ]


def rebalance_plan(sizes: list[int]) -> list[tuple[int, int, int]]:
    """Moves ``(src, dst, count)`` that even out the queue sizes (to within one), in a fixed order.

    A pure function of ``sizes``: every rank computes the same plan from the same gathered numbers.
    """
    p, total = len(sizes), sum(sizes)
    target = [total // p + (1 if r < total % p else 0) for r in range(p)]
    surplus = [[r, sizes[r] - target[r]] for r in range(p) if sizes[r] > target[r]]
    deficit = [[r, target[r] - sizes[r]] for r in range(p) if sizes[r] < target[r]]
    moves: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(surplus) and j < len(deficit):
        count = min(surplus[i][1], deficit[j][1])
        moves.append((surplus[i][0], deficit[j][0], count))
        surplus[i][1] -= count
        deficit[j][1] -= count
        i += surplus[i][1] == 0
        j += deficit[j][1] == 0
    return moves


def spread_positions(n: int, count: int) -> list[int]:
    """``count`` positions spread evenly over ``0 .. n-1`` (``count <= n``): the domains a rebalancing
    sender gives away from its queue sorted by bound, so that it keeps a fair share of its hard ones."""
    return [(2 * i + 1) * n // (2 * count) for i in range(count)]
