"""β-CROWN's joint optimisation of the ReLU slopes α and the split multipliers β.

Any α in [0, 1] and β >= 0 give a sound lower bound, so the loop only has to keep them in range:
Adam (one learning rate for α, one for β) with an exponential learning-rate decay, maximising the
sum of the bounds; after every step α is clamped to [0, 1] and β to [0, inf).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..parallel import memory
from .graph import Graph
from .walk import Alphas, Bounds, Box, back_substitute


def split_bound(
    graph: Graph,
    start: int,
    A: Tensor,
    bounds: Bounds,
    box: Box,
    alpha: Alphas,
    split: dict[int, Tensor],
    beta: dict[int, Tensor],
    record: dict[int, Tensor] | None = None,
) -> Tensor:
    """β-CROWN's lower bounds (S, B) of ``sum(A * value(start))`` under ReLU splits: the
    back-substitution with the split term ``-split · β⁺`` at every pre-activation node of ``beta``
    (``split``: +1 where the neuron is split active, z >= 0; -1 inactive, z <= 0; 0 free; β: the
    constraint's multiplier, (S, B, *shape)). It is the Lagrangian of the split constraints: sound for
    every β >= 0 (and α in [0, 1]); ``optimise_alpha_beta`` tightens it. The one split bound of BaB,
    its branching and the split refinement."""
    coef = {k: -split[k].to(b.dtype) * b.clamp(min=0) for k, b in beta.items()}
    return back_substitute(graph, start, A, bounds, box, alpha, coef, record)


def optimise_alpha_beta(
    alpha: dict[int, Tensor],
    beta: dict[int, Tensor],
    lr_alpha: float,
    lr_beta: float,
    lr_decay: float,
    iteration: int,
    bound: Callable[[], Tensor],
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Run ``bound()`` (the lower bounds under the current α and β, with their graph) up to
    ``iteration`` times (at least once), stepping α and β between the calls.  ``bound`` keeps
    whatever it needs of each result (the best bound so far, say); ``stop()`` is asked before every
    call after the first."""
    memory.load_optimizer_libraries()  # once per process: not the bound computation's memory
    opt = torch.optim.Adam(
        [{"params": list(alpha.values()), "lr": lr_alpha}, {"params": list(beta.values()), "lr": lr_beta}]
    )
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, lr_decay)
    for it in range(max(1, iteration)):
        if it > 0 and stop():
            break
        lb = bound()
        if it >= iteration - 1:
            break
        (-lb.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # no gradient is held through the next bound
        sched.step()
        with torch.no_grad():
            for a in alpha.values():
                a.clamp_(0.0, 1.0)
            for b in beta.values():
                b.clamp_(min=0.0)
