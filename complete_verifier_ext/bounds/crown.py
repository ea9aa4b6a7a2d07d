"""IBP and CROWN drivers: one forward sweep over the graph.

Every node gets IBP bounds from its inputs' current bounds; the input of every ReLU (a
*pre-activation* node) is then tightened by CROWN on its unstable neurons, so later IBP boxes and
ReLU relaxations use the tightest bounds known.  Row sharding: the unstable neurons of a layer (and
the output spec rows) are split over the ranks with ``comm.shard_range``; each rank back-substitutes
only its rows and one all-gather of the ``(B, rows)`` bounds gives every rank the whole layer.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from ..parallel import comm, oom
from .graph import Graph
from .ops import Slopes
from .walk import Alphas, Bounds, Box, back_substitute, concretize, finite_batch, proven_only
from .window import Window

T = TypeVar("T")
Fits = dict[str, int]
"""Where a pass ran out of memory: node name -> the most rows per pass since (the same on every rank);
α-CROWN keeps one across its iterations, so that a layer is not run out of memory on again each time."""


@dataclass
class CrownState:
    """What a CROWN sweep leaves behind: bounds of every node and the rows it refined."""

    bounds: Bounds
    rows: dict[int, Tensor]  # pre-activation node -> flat indices of the neurons bounded by CROWN
    gathered: list[Tensor]  # all-gathered tensors of this sweep (α-CROWN keeps them in every loss)
    # α-CROWN's best output slopes, every spec row on every rank: ReLU node -> (S, B, *shape).
    # BaB starts its root domain from them (any α in [0, 1] is sound).
    out_alpha: dict[int, Tensor] | None = None
    # With ``AlphaOptions.claim_alpha`` (a proof's evidence): per pre-activation node k and ReLU j, the α
    # of every row of ``rows[k]`` (all ranks') from the iteration that gave that row its best bound, as
    # ``(lower rows, upper rows)``, each ``Slopes`` of values ``(R, B, n)``.
    claim_alpha: dict[int, dict[int, tuple]] | None = None


def pre_activation_nodes(graph: Graph) -> list[int]:
    return sorted({graph.nodes[j].inputs[0] for j in graph.relu_nodes()})


def exact_by_ibp(graph: Graph, k: int) -> bool:
    """True when node k is one affine layer (plus elementwise affine ops) of the input: IBP is exact."""
    layers = 0
    while k != 0:
        node = graph.nodes[k]
        if node.op.is_relu or len(node.inputs) != 1 or not node.op.affine:
            return False
        layers += node.op.weight is not None
        if layers > 1:
            return False
        k = node.inputs[0]
    return True


def interval(node, bounds: Bounds) -> Box:
    """IBP bounds of ``node`` from its inputs' bounds, a NaN (inf - inf, 0 * inf) widened to ``∓inf``."""
    lo, hi = node.op.ibp(*(bounds[i] for i in node.inputs))
    return torch.where(torch.isnan(lo), -torch.inf, lo), torch.where(torch.isnan(hi), torch.inf, hi)


def unstable_index(lo: Tensor, hi: Tensor) -> Tensor:
    """Flat indices of neurons with l < 0 < u for some batch element.  lo/hi: (B, *shape)."""
    return ((lo < 0) & (hi > 0)).flatten(1).any(0).nonzero().flatten()


def gather_rows(x: Tensor, dim: int, grad: bool, n: int, sizes: list[int] | None = None) -> Tensor:
    """All-gather the row blocks of ``n`` rows split by ``shard_range``, or of ``sizes[q]`` rows on rank q
    (sizes known on every rank: one collective)."""
    sizes = comm.shard_sizes(n) if sizes is None else sizes
    return comm.all_gather_cat_grad(x, dim, sizes=sizes) if grad else comm.all_gather_cat(x, dim, sizes=sizes)


def ancestors_relus(graph: Graph, k: int) -> list[int]:
    """ReLU nodes that node k depends on."""
    seen, stack, out = set(), [k], []
    while stack:
        i = stack.pop()
        for j in graph.nodes[i].inputs:
            if j not in seen:
                seen.add(j)
                stack.append(j)
                if graph.nodes[j].op.is_relu:
                    out.append(j)
    return sorted(out)


def neuron_rows(
    graph: Graph,
    k: int,
    idx: Tensor,
    bounds: Bounds,
    box: Box,
    alphas: Alphas | None,
    grad: bool,
    chunk: int | None = None,
    keep: Tensor | None = None,
    fits: Fits | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """CROWN lower and upper bounds of neurons ``idx`` of node k, this rank's share computed here.

    Rows ``[+e_i; -e_i]`` of the local share of idx go back together, at most ``chunk`` neurons
    (``2 chunk`` A-matrix rows) at a time (``solver.crown.batch_size``; None: all in one pass), so
    the A-matrices in flight never exceed ``(2 chunk, B, n)`` however wide the layer.  Every rank
    makes the same number of passes (the largest share decides; a rank with fewer rows passes empty
    ones), since a pass issues the collectives of sharded weights.  ``keep`` (bool over idx, the same
    on every rank): bound only those neurons; each rank's share, and the layout of α (``2 r`` rows of
    its whole share of idx), stay those of idx.  The gathered result is ``(lower (B, R), upper (B, R),
    gathered)`` for the R neurons bounded, in the order of idx.
    """
    r0, r1 = comm.shard_range(len(idx))
    r = r1 - r0
    if keep is None:
        pos: Tensor | None = None  # the whole share, in contiguous slices (views of α)
        sizes = comm.shard_sizes(len(idx))
    else:
        pos = keep[r0:r1].nonzero().flatten()
        ranges = [comm.shard_range(len(idx), q) for q in range(comm.world_size())]
        sizes = [int(keep[a:b].sum()) for a, b in ranges]
    most = max(sizes)
    step = max(1, min(chunk or most, most))
    lower, upper = [], []

    def one_pass(c0: int, end: int, s: int) -> list[tuple[Tensor, Tensor]]:
        """Positions ``c0 .. end`` of this rank's share in sub-passes of ``s`` neurons."""
        out = []
        for a0 in range(c0, end, s):
            a1 = min(a0 + s, end)
            rows = slice(a0, min(a1, r)) if pos is None else pos[a0:a1]
            part = idx[r0:r1][rows]
            m = len(part)
            a = None if alphas is None else {j: _alpha_rows(t, r, rows) for j, t in alphas.items()}
            lb = _bound_unit_rows(graph, k, part, bounds, box, a)  # (2m, B)
            out.append((lb[:m], lb[m:]))
        return out

    mine = r if pos is None else len(pos)
    for lo, up in in_passes(one_pass, max(most, 1), step, mine, graph.nodes[k].name, fits):
        lower.append(lo)
        upper.append(up)
    both = torch.stack([torch.cat(lower).T, -torch.cat(upper).T])  # (2, B, rows bounded here)
    gathered = gather_rows(both, 2, grad, len(idx), sizes)  # (2, B, R)
    return gathered[0], gathered[1], gathered


def in_passes(
    run: Callable[[int, int, int], list[T]],
    end: int,
    step: int,
    mine: int,
    where: str,
    fits: Fits | None = None,
    what: str = "rows",
    steps: bool = False,
) -> list[T]:
    """``run(c0, c1, s)``: positions ``c0 .. c1`` of this rank's rows (``what``: what they are, in the
    warnings) in sub-passes of ``s`` (positions past its ``mine`` rows: a pass of no row, as a rank
    with fewer rows than another makes), a list of one result per sub-pass; here over positions
    ``0 .. end`` (the same on every rank) in passes of ``step``. Out of memory: at P = 1 that pass
    again in halves, and the next ones as small (:func:`.oom.halving_on_oom`); at P > 1 every rank
    runs that pass and the next ones in halves, in lockstep (:func:`.oom.passes_in_lockstep`);
    ``fits[where]`` then keeps the size that fitted for the next call, and caps ``step``. ``steps``: a
    pass takes gradient steps itself (β-CROWN in BaB), so the dummy pass at P > 1 does too (else it
    runs without autograd: the caller's backward, if any, comes after every pass). Returns the
    results of every sub-pass, in order."""
    fits = {} if fits is None else fits
    step = max(1, min(step, fits.get(where, step)))
    out: list[T] = []
    if comm.world_size() == 1:
        c0, start = 0, step
        while c0 < end:
            n = min(step, end - c0)
            parts, step = oom.halving_on_oom(lambda s, c0=c0, n=n: run(c0, c0 + n, s), n, where, what=what)
            out += parts
            c0 += n
        if step < start:
            fits[where] = step
        return out

    def shadow() -> object:
        with contextlib.nullcontext() if steps else torch.no_grad():  # positions past every rank's rows:
            return run(end, end + 1, 1)  # a pass of no row

    def halve(p: tuple[int, int]) -> list[tuple[int, int]]:
        h = p[1] - p[1] // 2
        return [q for q in ((p[0], h), (p[0] + h, p[1] // 2)) if q[1] > 0]

    def failed(n: int) -> None:  # the same n on every rank: so are the passes after it
        fits[where] = max(1, min(fits.get(where, n), n // 2))

    passes = [(c, min(step, end - c)) for c in range(0, end, step)]
    done = oom.passes_in_lockstep(
        passes, lambda p: run(p[0], p[0] + p[1], p[1]), shadow,
        lambda p: max(0, min(p[0] + p[1], mine) - p[0]), halve, where, what, failed,
    )  # fmt: skip
    return [one for parts in done for one in parts]


def _bound_unit_rows(
    graph: Graph, k: int, part: Tensor, bounds: Bounds, box: Box, a: Alphas | None
) -> Tensor:
    """Lower bounds (2m, B) of ``[+e_part; -e_part] · value(k)``: the walk starts below node k when its
    op gives those rows' backward without a product (a Linear layer), else at k."""
    node, B = graph.nodes[k], box[0].shape[0]
    short = node.op.unit_rows(part) if len(node.inputs) == 1 else None
    if short is None:
        windows = a is None or all(isinstance(t, Slopes) for t in a.values())
        return back_substitute(graph, k, _unit_rows(part, B, node.shape, windows), bounds, box, a)
    rows, b = short
    del short
    bias = torch.cat([b, -b])[:, None].expand(-1, B)  # added after the walk: an overflow proves nothing
    A_in = _signed(rows, B)
    hooks = None
    if torch.is_grad_enabled():  # α: backward needs A_in again, rebuilt from W (P = 1) or from ``rows``
        kept = None if node.op.weight.mode == "none" else rows  # W at hand: rebuilding needs no collective

        def again() -> Tensor:
            return _signed(node.op.unit_rows(part)[0] if kept is None else kept, B)

        hooks = _rebuilt_when_saved(A_in, again)
    held = [A_in]  # handed over so that no frame here keeps an A-sized tensor alive during the walk
    del rows, A_in
    with hooks or contextlib.nullcontext():
        return proven_only(back_substitute(graph, node.inputs[0], held.pop(), bounds, box, a) + bias)


def _signed(rows: Tensor, B: int) -> Tensor:
    """``[+rows; -rows]`` as A-matrix rows ``(2m, B, *in)``, the batch a broadcast view."""
    return torch.cat([rows, -rows]).unsqueeze(1).expand(-1, B, *rows.shape[1:])


def _rebuilt_when_saved(A: Tensor, rebuild: Callable[[], Tensor]):
    """Saved-tensor hooks under which autograd keeps, for any tensor saved for backward that is a view of
    ``A``'s storage, only its geometry, and rebuilds it with ``rebuild()`` (the same values in the same
    layout) when backward needs it: the first A of every row of α-CROWN is a gather of W's rows, which
    is cheaper to redo than to keep (``(2 m, in)`` per start node and pass). Only while ``A`` itself is
    alive: once freed, its address may be reused by another tensor, which must be kept as it is."""
    storage, alive = A.untyped_storage().data_ptr(), weakref.ref(A)

    def pack(t: Tensor):
        if alive() is not None and t.untyped_storage().data_ptr() == storage:
            return ("rebuild", t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(x):
        if isinstance(x, tuple):
            return rebuild().as_strided(x[1], x[2], x[3])
        return x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _unit_rows(part: Tensor, B: int, shape, windows: bool) -> Tensor | Window:
    """Rows ``[+e_i; -e_i]`` for the neurons ``part`` of a node of ``shape``: ``(2m, B, *shape)``, or
    for a conv feature map (without α, or with sparse α) 1x1 :class:`Window` rows, which stay local as
    they go back."""
    m = len(part)
    neurons, signs = torch.cat([part, part]), torch.cat([torch.ones(m), -torch.ones(m)])
    if windows and len(shape) == 3:
        return Window.of_neurons(neurons, signs, B, tuple(shape))
    C = torch.zeros(2 * m, B, math.prod(shape))  # (2m, B, n)
    C[torch.arange(2 * m), :, neurons] = signs[:, None]
    return C.view(2 * m, B, *shape)


def _alpha_rows(alpha: Tensor | Slopes, r: int, rows: slice | Tensor) -> Tensor | Slopes:
    """The α of the neurons ``rows`` (a slice or positions) of a start node's ``[+e; -e]`` layout of
    ``2 r`` rows."""
    if isinstance(alpha, Slopes):
        return Slopes(_alpha_rows(alpha.values, r, rows), alpha.index)
    if isinstance(rows, slice):
        if rows.stop - rows.start == r:
            return alpha
        return torch.cat([alpha[rows], alpha[r + rows.start : r + rows.stop]])
    return torch.cat([alpha[rows], alpha[r + rows]])


def _straight_through(fresh: Tensor, value: Tensor) -> Tensor:
    """``value`` in the forward pass, the gradient of ``fresh`` in the backward pass.

    Used to intersect α-CROWN's fresh bounds with older ones: a plain max would give zero gradient
    to every neuron where the old bound wins, freezing its α for good.
    """
    if not fresh.requires_grad:
        return value
    return fresh + (value - fresh).detach()


def tighten(box: Box, idx: Tensor, lo_rows: Tensor, hi_rows: Tensor, intersect: bool = True) -> Box:
    """Set the bounds of neurons ``idx`` to new ones (intersected with the old ones if ``intersect``).

    Out of place, so autograd sees it.  ``intersect=False`` is auto_LiRPA's CROWN, which replaces
    the IBP bounds of the neurons it recomputes even where IBP was tighter.
    """
    lo, hi = box
    shape = lo.shape
    lo, hi = lo.flatten(1), hi.flatten(1)
    if intersect:
        lo_rows = _straight_through(lo_rows, torch.maximum(lo[:, idx], lo_rows))
        hi_rows = _straight_through(hi_rows, torch.minimum(hi[:, idx], hi_rows))
    return lo.index_copy(1, idx, lo_rows).view(shape), hi.index_copy(1, idx, hi_rows).view(shape)


def _still_unstable(box: Box, idx: Tensor) -> Tensor | None:
    """Bool over ``idx``: l < 0 < u for some batch element (None when all are: no subset needed)."""
    lo, hi = box
    keep = ((lo.detach() < 0) & (hi.detach() > 0)).flatten(1)[:, idx].any(0)
    return None if bool(keep.all()) else keep


def _within(box: Box, reference: Box) -> Box:
    """``box`` intersected with ``reference``, its gradient ``box``'s own (:func:`_straight_through`)."""
    lo, hi = box
    return (
        _straight_through(lo, torch.maximum(lo, reference[0])),
        _straight_through(hi, torch.minimum(hi, reference[1])),
    )


def _as_if_alone(box: Box, idx: Tensor, lo_rows: Tensor, hi_rows: Tensor) -> tuple[Tensor, Tensor]:
    """CROWN's rows ``idx`` of a layer, where a box has the neuron stable by IBP, replaced by its IBP
    bounds, as when the box is bounded alone. Else a neuron unstable in *another* box of the batch gets
    CROWN's bounds here too, which moves this box's bounds in the layers after it: a box's bound would
    depend on its batch, and a proof's leaf must be bounded as a checker bounds it, alone."""
    lo, hi = (b.flatten(1)[:, idx] for b in box)
    stable = (lo >= 0) | (hi <= 0)
    return torch.where(stable, lo, lo_rows), torch.where(stable, hi, hi_rows)


def sweep(
    graph: Graph,
    box: Box,
    *,
    reference: Bounds | None = None,
    rows: dict[int, Tensor] | None = None,
    alphas: dict[int, Alphas] | None = None,
    grad: bool = False,
    intersect: bool = True,
    chunk: int | None = None,
    on_layer: Callable[[int, int, Box], None] | None = None,
    fits: Fits | None = None,
    per_box: bool = False,
) -> CrownState:
    """IBP for every node, CROWN for every pre-activation node.

    ``reference``: bounds to intersect with (e.g. CROWN's, inside α-CROWN); ``rows``: fixed neuron
    sets per pre-activation node (else the unstable ones; with a ``reference``, only those of them
    still unstable are bounded again, as auto_LiRPA's optimised bounds do: a neuron that became stable
    keeps its bound, which fixes its relaxation exactly); ``alphas[k]``: α of start node k;
    ``intersect``: keep the IBP bound of a neuron where it is tighter than CROWN's (sound, and much
    tighter on deep networks; ``False`` reproduces auto_LiRPA's CROWN); ``chunk``: neurons per
    back-substitution pass (see :func:`neuron_rows`); ``on_layer(k, rows, bounds of k)`` is told of every
    layer refined (progress); ``fits``: passes that ran out of memory (:data:`Fits`); ``per_box``: see
    :func:`_as_if_alone`.

    Under autograd (α-CROWN) IBP runs without it: a bound's gradient goes to the CROWN rows that set it
    (:func:`tighten`); the neurons without rows are stable (their ReLU exact whatever their bounds), so
    a gradient through IBP would be zero and keep every layer's IBP tensors (and ``|W|``) alive."""
    bounds: Bounds = {0: box}
    pre = set(pre_activation_nodes(graph))
    used_rows: dict[int, Tensor] = {}
    gathered: list[Tensor] = []
    for k in range(1, len(graph.nodes)):
        with torch.no_grad():  # see below: α's gradient never needs to pass through IBP
            bounds[k] = interval(graph.nodes[k], bounds)
        if k not in pre:
            continue
        if reference is not None:
            bounds[k] = _within(bounds[k], reference[k])
        if exact_by_ibp(graph, k):
            continue
        idx = rows[k] if rows is not None else unstable_index(*bounds[k])
        used_rows[k] = idx
        keep = _still_unstable(bounds[k], idx) if rows is not None and reference is not None else None
        if len(idx) == 0 or (keep is not None and not bool(keep.any())):  # every rank knows it
            continue
        lo_rows, hi_rows, g = neuron_rows(
            graph, k, idx, bounds, box, None if alphas is None else alphas[k], grad, chunk, keep, fits
        )
        gathered.append(g)
        if per_box and keep is None:  # each box as if alone
            lo_rows, hi_rows = _as_if_alone(bounds[k], idx, lo_rows, hi_rows)
        bounds[k] = tighten(bounds[k], idx if keep is None else idx[keep], lo_rows, hi_rows, intersect)
        if on_layer is not None:
            on_layer(k, len(idx), bounds[k])
    return CrownState(bounds, used_rows, gathered)


def spec_matrix(C: Tensor, B: int, out_shape) -> Tensor:
    """(S, n_out) -> (S, B, *out_shape)."""
    return (
        C.to(torch.float32)[:, None, :].expand(C.shape[0], B, C.shape[1]).reshape(C.shape[0], B, *out_shape)
    )


def final_bounds(
    graph: Graph,
    state: CrownState,
    box: Box,
    C: Tensor,
    alphas: Alphas | None = None,
    grad: bool = False,
    fits: Fits | None = None,
) -> tuple[Tensor, Tensor]:
    """Lower bounds of ``C @ y`` over the box: (B, S); the output rows are split over the ranks.

    Returns ``(gathered lb (B, S), local lb (S_r, B))``.
    """
    out = len(graph.nodes) - 1
    s0, s1 = comm.shard_range(C.shape[0])
    B, mine = box[0].shape[0], s1 - s0

    def run(c0: int, c1: int, s: int) -> list[Tensor]:
        """This rank's spec rows ``c0 .. c1`` in sub-passes of ``s``: (rows, B) each."""
        parts = []
        for a0 in range(c0, c1, s):
            a1 = max(a0, min(a0 + s, c1, mine))  # past this rank's rows: a pass of none
            a = None if alphas is None else {j: _spec_rows(t, a0, a1) for j, t in alphas.items()}
            A = spec_matrix(C[s0 + a0 : s0 + a1], B, graph.nodes[out].shape)
            parts.append(back_substitute(graph, out, A, state.bounds, box, a))
        return parts

    most = max(comm.shard_sizes(C.shape[0]))  # every rank runs the passes of the largest share
    lb_local = torch.cat(
        in_passes(run, max(most, 1), max(most, 1), mine, graph.nodes[out].name, fits)
    )  # (S_r, B)
    return gather_rows(lb_local, 0, grad, C.shape[0]).T, lb_local


def _spec_rows(alpha: Tensor | Slopes, a0: int, a1: int) -> Tensor | Slopes:
    """Rows ``a0 .. a1`` of an output α (a view: its gradient reaches the whole)."""
    if isinstance(alpha, Slopes):
        return Slopes(alpha.values[a0:a1], alpha.index)
    return alpha[a0:a1]


def ibp_final(graph: Graph, bounds: Bounds, C: Tensor) -> Tensor:
    """IBP lower bounds (B, S) of ``C @ y``, with C merged into the last Linear when there is one;
    ``-inf`` for a batch element with a non-finite bound anywhere (:func:`proven_only`)."""
    out = len(graph.nodes) - 1
    node = graph.nodes[out]
    B = bounds[0][0].shape[0]
    ok = functools.reduce(torch.logical_and, (finite_batch(b) for b in bounds.values()))
    A = spec_matrix(C, B, node.shape)
    if node.op.folds_spec:
        A_in, bias = node.op.backward(A, graph.nodes[node.inputs[0]].shape)
        return proven_only(concretize(A_in[0], bounds[node.inputs[0]]) + bias, ok).T
    return proven_only(concretize(A, bounds[out]), ok).T


def ibp(graph: Graph, box: Box, C: Tensor) -> tuple[Tensor, Bounds]:
    """Interval bound propagation: (lb (B, S), bounds of every node)."""
    bounds: Bounds = {0: box}
    for k in range(1, len(graph.nodes)):
        bounds[k] = interval(graph.nodes[k], bounds)
    return ibp_final(graph, bounds, C), bounds


@torch.no_grad()
def crown(
    graph: Graph, box: Box, C: Tensor, intersect: bool = True, chunk: int | None = None, per_box: bool = False
) -> tuple[Tensor, CrownState]:
    """CROWN with CROWN intermediate bounds and the adaptive lower ReLU slope: (lb (B, S), state).
    ``chunk``: neurons per back-substitution pass of an intermediate layer (None: all at once);
    ``per_box``: see :func:`sweep`."""
    state = sweep(graph, box, intersect=intersect, chunk=chunk, per_box=per_box)
    lb, _ = final_bounds(graph, state, box, C)
    return lb, state
