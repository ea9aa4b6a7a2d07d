"""A β-CROWN BaB domain (its split decisions, intermediate bounds, α and β) and the batched β-CROWN
bound of a list of domains: shared by the search (``relu_split.py``) and the branching heuristics
(``branching.py``), which import this module and not each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..bounds.beta import optimise_alpha_beta, split_bound
from ..bounds.crown import ancestors_relus, pre_activation_nodes, spec_matrix
from ..bounds.graph import Graph
from ..bounds.walk import Bounds, Box
from ..spec import Clauses
from .common import BabOptions


@dataclass
class Domain:
    worst: float  # min over clauses of the margin lower bound: the priority (lowest first)
    bounds: dict[int, tuple[Tensor, Tensor]]  # pre-activation node -> (lo, hi), each (1, *shape) float32
    splits: dict[int, Tensor]  # pre-activation node -> (1, *shape) int8: +1 active, -1 inactive, 0 free
    alpha: dict[int, Tensor]  # ReLU node -> (S, 1, *shape), BabOptions.store_dtype
    beta: dict[int, Tensor]  # pre-activation node -> (S, 1, *shape), BabOptions.store_dtype
    branch: tuple[int, int] | None  # (pre-activation node, flat neuron) to split next
    depth: int = 0
    retries: int = 0  # times it came back unverified with nothing left to split
    history: tuple[tuple[int, int, int], ...] = ()  # its splits in order: (pre-activation node, neuron, sign)


MAX_RETRIES = 4  # a fully split domain is re-bounded (β keeps optimising) this often before giving up


class BetaCrown:
    """Batched β-CROWN bounding of domains (rows are not split: the domain axis is)."""

    def __init__(self, graph: Graph, box: Box, problem: Clauses, opts: BabOptions):
        self.graph, self.problem, self.opts = graph, problem, opts
        self.box = box  # (1, *in)
        self.out = len(graph.nodes) - 1
        self.pre = pre_activation_nodes(graph)
        self.relus = ancestors_relus(graph, self.out)
        self.relu_in = {j: graph.nodes[j].inputs[0] for j in self.relus}

    def bound(self, doms: list[Domain], expired: Callable[[], bool] = lambda: False):
        """Bound a batch (possibly empty).  Returns lb (B, S), α, β (float32, batched), the A-matrices
        at every ReLU of the best iteration (for branching), and the worst row's minimiser (B, *in).
        ``expired`` (collective) is asked before every optimisation step, so that a timeout is
        honoured within one step, not one round; the bounds so far are sound."""
        g, B = self.graph, len(doms)
        S = self.problem.C.shape[0]

        def stack(of: Callable[[Domain], Tensor], dim: int, empty: tuple, dtype=torch.float32) -> Tensor:
            return torch.cat([of(d) for d in doms], dim) if B else torch.zeros(*empty, dtype=dtype)

        bounds: Bounds = {
            k: tuple(stack(lambda d, k=k, s=s: d.bounds[k][s], 0, (0, *g.nodes[k].shape)) for s in (0, 1))
            for k in self.pre
        }
        split = {
            k: stack(lambda d, k=k: d.splits[k], 0, (0, *g.nodes[k].shape), torch.int8) for k in self.pre
        }
        alpha = {
            j: stack(lambda d, j=j: d.alpha[j], 1, (S, 0, *g.nodes[j].shape)).float().requires_grad_(True)
            for j in self.relus
        }
        beta = {
            k: stack(lambda d, k=k: d.beta[k], 1, (S, 0, *g.nodes[k].shape)).float().requires_grad_(True)
            for k in self.pre
        }
        box = (self.box[0].expand(B, *self.box[0].shape[1:]), self.box[1].expand(B, *self.box[1].shape[1:]))
        A = spec_matrix(self.problem.C, B, g.nodes[self.out].shape)
        best = torch.full((B, S), -torch.inf)
        best_record: dict[int, Tensor] = {}
        kept: dict[str, dict[int, Tensor]] = {}  # with a proof: α and β of each row's best bound

        def bound() -> Tensor:
            nonlocal best, best_record
            record: dict[int, Tensor] = {}
            lb = split_bound(g, self.out, A, bounds, box, alpha, split, beta, record)  # (S, B)
            lbT = lb.detach().T
            if self.opts.record:
                kept.update(_best_of(kept, lbT > best, alpha, beta))
            if not best_record or bool((lbT > best).any()):
                best = torch.maximum(best, lbT)
                best_record = {k: v.detach() for k, v in record.items()}
            return lb

        o = self.opts
        optimise_alpha_beta(alpha, beta, o.lr_alpha, o.lr_beta, o.lr_decay, o.iteration, bound, expired)
        x = self.minimiser(best_record.get(0), best, box)
        return (
            best,
            {j: a.detach() for j, a in alpha.items()},
            {k: b.detach() for k, b in beta.items()},
            best_record,
            x,
            kept or None,
        )

    def minimiser(self, A0: Tensor | None, lb: Tensor, box: Box) -> Tensor:
        """The box corner minimising the worst row's linear lower bound: (B, *in)."""
        lo, hi = box
        if A0 is None or lb.shape[0] == 0:
            return lo.clone()
        margins = self.problem.row_margins(lb)
        row = margins.argmin(1)  # (B,)
        a = A0[row, torch.arange(lb.shape[0])]  # (B, *in)
        return torch.where(a >= 0, lo, hi)


def _best_of(kept: dict, better: Tensor, alpha: dict, beta: dict) -> dict:
    """``kept``'s α and β (per row and box) where this bound (``better``: (B, S), above the best so
    far) improved on them."""
    mask = better.T  # (S, B)

    def pick(new: Tensor, old: Tensor | None) -> Tensor:
        if old is None:
            return new.detach().clone()
        return torch.where(mask.reshape(*mask.shape, *[1] * (new.dim() - 2)), new.detach(), old)

    return {
        "alpha": {j: pick(a, kept.get("alpha", {}).get(j)) for j, a in alpha.items()},
        "beta": {k: pick(t, kept.get("beta", {}).get(k)) for k, t in beta.items()},
    }
