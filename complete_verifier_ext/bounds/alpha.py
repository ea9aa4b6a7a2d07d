"""α-CROWN: optimise the lower ReLU slopes of every (start node, ReLU) pair by gradient ascent.

For each start node s (every pre-activation node refined by CROWN, and the output) and each ReLU j
that s depends on, ``alpha[s][j]`` has shape ``(rows_s, B, *shape_j)``: one slope per row of s's
A-matrix, so rows are independent and can live on different ranks.  Rows are sharded exactly as in
CROWN, so each rank owns the α (and Adam state) of its own rows and never sends them anywhere; the
intermediate bounds flow between ranks through the autograd-aware all-gather, whose backward sums
every rank's gradient.

Loop (as in α,β-CROWN): Adam(lr_alpha) with ExponentialLR(lr_decay), ``iteration`` steps; α starts
from the adaptive CROWN slopes, so iteration 0 reproduces CROWN; the best bound of every output row
is kept.  Intermediate bounds are intersected with the best ones found so far (sound, and later
layers profit from every earlier improvement) by a straight-through step, so the gradient always
reaches the fresh bound.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..parallel import comm, memory
from .crown import CrownState, Fits, ancestors_relus, final_bounds, gather_rows, sweep, unstable_index
from .graph import Graph
from .ops import Relu, Slopes
from .walk import Alphas, Box


@dataclass(frozen=True)
class AlphaOptions:
    iteration: int = 100
    lr_alpha: float = 0.1
    lr_decay: float = 0.98
    early_stop: bool = True  # stop once every output row is positive
    chunk: int | None = None  # neurons per back-substitution pass of an intermediate layer (None: all)
    sparse: bool = True  # α only for the neurons unstable at the start (``general.sparse_alpha``)
    output_only: bool = False  # optimise the output's α alone: the intermediate bounds stay the state's
    claim_alpha: bool = False  # keep each intermediate row's α of its best bound (a proof's evidence)


def init_alphas(
    graph: Graph, state: CrownState, n_rows: dict[int, int], sparse: bool = True
) -> dict[int, Alphas]:
    """α for every start node in ``n_rows`` (start -> local rows), from CROWN's adaptive slopes:
    ``(rows, B, *shape_j)`` per ReLU j, or with ``sparse`` :class:`Slopes` over the neurons of j that
    are unstable in ``state`` for some batch element (later bounds only tighten, so no neuron
    outside them becomes unstable)."""
    alphas: dict[int, Alphas] = {}
    for s, rows in n_rows.items():
        alphas[s] = {}
        for j in ancestors_relus(graph, s):
            lo, hi = state.bounds[graph.nodes[j].inputs[0]]
            slope = Relu.relaxation(lo, hi)[2]  # (B, *shape_j)
            if sparse:
                idx = unstable_index(lo, hi)
                values = slope.flatten(1)[:, idx].unsqueeze(0).repeat(rows, 1, 1).requires_grad_(True)
                alphas[s][j] = Slopes(values, idx)
            else:
                alphas[s][j] = slope.unsqueeze(0).repeat(rows, *[1] * slope.dim()).requires_grad_(True)
    return alphas


def _param(a: Tensor | Slopes) -> Tensor:
    return a.values if isinstance(a, Slopes) else a


def local_rows(state: CrownState, graph: Graph, n_spec: int) -> dict[int, int]:
    """Rows of every start node held by this rank (2 per neuron for intermediate nodes)."""
    rows = {k: 2 * (lambda r: r[1] - r[0])(comm.shard_range(len(idx))) for k, idx in state.rows.items()}
    s0, s1 = comm.shard_range(n_spec)
    rows[len(graph.nodes) - 1] = s1 - s0
    return rows


def alpha_crown(
    graph: Graph,
    box: Box,
    C: Tensor,
    state: CrownState,
    opts: AlphaOptions,
    should_stop: Callable[[], bool] = lambda: False,
    on_step: Callable[[int, Tensor], None] | None = None,
) -> tuple[Tensor, CrownState]:
    """Optimised lower bounds (B, S) of ``C @ y``, never below CROWN's; and the last sweep's state."""
    out = len(graph.nodes) - 1
    n_rows = local_rows(state, graph, C.shape[0])
    alphas = init_alphas(graph, state, {out: n_rows[out]} if opts.output_only else n_rows, opts.sparse)
    params = [_param(a) for per_start in alphas.values() for a in per_start.values()]
    memory.load_optimizer_libraries()  # once per process: not the bound computation's memory
    opt = torch.optim.Adam(params, lr=opts.lr_alpha)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, opts.lr_decay)
    for p in params:
        p.register_post_accumulate_grad_hook(functools.partial(_step_in_backward, opt))
    best: Tensor | None = None
    s0, s1 = comm.shard_range(C.shape[0])  # this rank's output rows
    best_alpha = {j: _param(a).detach().clone() for j, a in alphas.get(out, {}).items()}
    last = state
    ref = dict(state.bounds)  # best intermediate bounds so far, (lo, hi) per node
    claim_best = _claims_start(alphas, state, opts)
    fits: Fits = {}  # passes that ran out of memory: their size that fitted, for the next iterations
    for it in range(opts.iteration):
        cur = state
        if not opts.output_only:
            cur = sweep(graph, box, reference=ref, rows=state.rows, alphas=alphas, grad=True,
                        chunk=opts.chunk, fits=fits)  # fmt: skip
            _tighten_reference(ref, cur, state, alphas, claim_best)
        lb, lb_local = final_bounds(graph, cur, box, C, alphas.get(out), True, fits)  # (B, S), (S_r, B)
        better = lb_local.detach() > (-torch.inf if best is None else best[:, s0:s1].T)  # (S_r, B)
        best = lb.detach() if best is None else torch.maximum(best, lb.detach())
        _keep_better(best_alpha, alphas.get(out, {}), better)
        last = cur
        if on_step is not None:
            on_step(it, best)
        # The zero terms keep every gathered tensor in this rank's graph, so that every rank runs the
        # same all-reduces in backward even when it holds no rows of some layer.
        loss = -lb_local.sum() + sum(0.0 * g.sum() for g in cur.gathered)
        done = (opts.early_stop and bool((best > 0).all())) or it == opts.iteration - 1
        if comm.all_reduce_flag(done or should_stop(), "or"):
            break
        loss.backward()  # steps every α as soon as its gradient is complete (_step_in_backward)
        sched.step()
    if best is None:  # zero iterations requested
        best, _ = final_bounds(graph, state, box, C, fits=fits)
    out_alpha = {
        j: _dense_out(graph, state, j, alphas[out][j], gather_rows(a, 0, False, C.shape[0]))
        for j, a in best_alpha.items()
    }
    claim_alpha = {
        k: {j: _all_rows(a, len(state.rows[k]), alphas[k][j]) for j, a in per_j.items()}
        for k, per_j in claim_best.items()
    }
    bounds = {k: (lo.detach(), hi.detach()) for k, (lo, hi) in last.bounds.items()}
    return best, CrownState(bounds, state.rows, [], out_alpha, claim_alpha if claim_best else None)


def _keep_better(best_alpha: dict, alphas: Alphas, better: Tensor) -> None:
    """The output rows' best α take the current one where ``better`` (S_r, B): their bound improved."""
    for j, a in alphas.items():
        a = _param(a)
        mask = better.view(*better.shape, *[1] * (a.dim() - 2))
        best_alpha[j] = torch.where(mask, a.detach(), best_alpha[j])


def _claims_start(alphas: dict[int, Alphas], state: CrownState, opts: AlphaOptions) -> dict:
    """With ``opts.claim_alpha``: a copy of every intermediate start node's α (iteration 0's: CROWN's
    slopes), which :func:`_keep_improved` keeps at each row's best bound; else nothing."""
    if not opts.claim_alpha or opts.output_only:
        return {}
    return {k: {j: _param(a).detach().clone() for j, a in alphas[k].items()} for k in state.rows}


def _tighten_reference(ref: dict, cur: CrownState, state: CrownState, alphas: dict, claim_best: dict) -> None:
    """The best intermediate bounds so far (``ref``) become this sweep's (intersected with them already),
    and ``claim_best`` takes the α of the rows they improved."""
    for k in state.rows:
        new = (cur.bounds[k][0].detach(), cur.bounds[k][1].detach())
        if k in claim_best:
            _keep_improved(claim_best[k], alphas[k], state.rows[k], ref[k], new)
        ref[k] = new


def _keep_improved(best: dict, alphas: Alphas, idx: Tensor, old: Box, new: Box) -> None:
    """``best[j]`` (this rank's ``2 r`` rows of a start node's neurons ``idx``, lower rows then upper
    ones) takes the current α where the row's bound improved on ``old``."""
    r0, r1 = comm.shard_range(len(idx))
    mine = idx[r0:r1]
    lower = new[0].flatten(1)[:, mine] > old[0].flatten(1)[:, mine]  # (B, r)
    upper = new[1].flatten(1)[:, mine] < old[1].flatten(1)[:, mine]
    mask = torch.cat([lower, upper], 1).T  # (2r, B)
    if bool(mask.any()):
        for j, a in alphas.items():
            best[j][mask] = _param(a).detach()[mask]  # the improved rows only


def _all_rows(local: Tensor, R: int, kept: Tensor | Slopes) -> tuple[Slopes, Slopes]:
    """Every rank's rows of one start node's α (``2 r`` local rows, lower then upper) gathered: the
    lower rows and the upper rows, each ``Slopes`` of values ``(R, B, n)`` (a dense α: every neuron)."""
    r = local.shape[0] // 2
    flat = local.flatten(2)
    index = kept.index if isinstance(kept, Slopes) else torch.arange(flat.shape[2], device=flat.device)
    return tuple(Slopes(gather_rows(half, 0, False, R), index) for half in (flat[:r], flat[r:]))


def _step_in_backward(opt: torch.optim.Optimizer, p: Tensor) -> None:
    """Adam's step of one α, clamped to [0, 1], as soon as backward has its whole gradient, which is
    then freed: the gradients of all α are never held at once. Adam's step of a tensor depends on that
    tensor alone and skips tensors without a gradient (every other α here), so this is the step
    ``opt.step()`` would take after backward. Backward no longer reads α then: its every use is
    upstream of its gradient (autograd's version counter would refuse the change otherwise)."""
    opt.step()
    p.grad = None
    with torch.no_grad():
        p.clamp_(0.0, 1.0)


def _dense_out(graph: Graph, state: CrownState, j: int, kept: Tensor | Slopes, values: Tensor) -> Tensor:
    """The output rows' best α of ReLU j as a dense ``(S, B, *shape_j)`` (what BaB starts from)."""
    if not isinstance(kept, Slopes):
        return values
    lo, hi = state.bounds[graph.nodes[j].inputs[0]]
    return Slopes(values, kept.index).dense(Relu.relaxation(lo, hi)[2])
