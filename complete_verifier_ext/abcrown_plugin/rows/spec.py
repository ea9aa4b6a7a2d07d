"""The output node's spec rows dealt over the ranks in α-CROWN's iterations (``backward_general``), with
the output node's α kept by spec row (:mod:`.alpha`); at every P, passes of fewer spec rows where one
runs out of memory. The last back-substitution, without a gradient, runs whole on every rank: α,β-CROWN
reads its A-matrices (``lA``) for BaB, and they are gathered whole where a dealt pass left them split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...parallel import comm, oom
from ..run import Rows, Run
from .deal import in_lockstep, passes_per_rank, split_passes


def _spec_passes_possible(module, bound_node, C, plain: bool) -> bool:
    """Whether the back-substitution of ``bound_node`` can run in passes of spec rows: the output node,
    a plain C over several spec rows (``(batch, spec, ...)``), nothing else asked of it (no A-matrices
    returned, no cuts, no output constraints)."""
    return (
        plain
        and bound_node.name == module.final_name
        and isinstance(C, Tensor)
        and C.dim() >= 3
        and int(C.shape[1]) > 1
        and not module.return_A
        and not getattr(module, "cut_used", False)
        and not module.invprop_enabled()
    )


def _final_dealt(state: Rows, module, bound_node, C, plain: bool) -> bool:
    """Whether the output node's spec rows are dealt in this back-substitution: inside α-CROWN's
    iterations with a gradient (the last one, without, runs whole on every rank: α,β-CROWN reads its
    A-matrices, ``lA``, for BaB), for a plain C over several spec rows, nothing else asked of it."""
    return (
        state.active
        and comm.world_size() > 1
        and torch.is_grad_enabled()
        and type(bound_node).__name__ in ("BoundLinear", "BoundMatMul")  # its A-matrices stay dense
        and _spec_passes_possible(module, bound_node, C, plain)
        and _final_alpha_by_row(state, module)
    )


def whole_lA(state: Rows) -> None:
    """Every ``lA`` that the last back-substitution of the output node left as this rank's spec rows,
    all-gathered (detached), in the same order on every rank. Collective."""
    for node, counts in state.local_lA:
        lA = node.lA
        if not isinstance(lA, Tensor):
            raise RuntimeError(f"{node.name}: the output node's A-matrix is not a tensor; cannot gather it")
        local = lA.detach()[: counts[comm.rank()]]
        node.lA = comm.all_gather_cat(local.contiguous(), 0, sizes=counts)
    state.local_lA.clear()


def get_lA(run: Run, orig):
    """``LiRPANet.get_lA``: the ``lA`` it reads whole, where the last α-CROWN iteration left it dealt."""

    def get_lA(self, preserve_mask=None, tot_cells=None, transpose=True, device=None):
        whole_lA(run.rows)
        return orig(self, preserve_mask, tot_cells, transpose, device)

    return get_lA


def _final_alpha_by_row(state: Rows, module) -> bool:
    """Whether every α of the output node in use is kept by spec row (else the rows are not dealt)."""
    for relu in module.relus:
        if relu.opt_stage in ("opt", "reuse") and module.final_name in (relu.alpha or {}):
            layout = state.alpha.get(relu, {}).get(module.final_name)
            if layout is None or not layout.owns(relu.alpha[module.final_name]):
                return False
    return True


def backward_general(run: Run, orig):
    """``BoundedModule.backward_general`` of the output node, over a plain C of spec rows: at P > 1 in
    α-CROWN's iterations dealt by spec rows (C's rows, ``(batch, spec, ...)``) in contiguous blocks,
    with the α of the output node kept by spec row, the bounds all-gathered (differentiable); and at
    every P in passes of spec rows where a pass runs out of memory (:func:`_spec_passes`). Every other
    call is auto_LiRPA's."""
    state = run.rows

    def backward_general(self, bound_node, C, start_backpropagation_at_node=None, bound_lower=True,
                         bound_upper=True, average_A=False, need_A_only=False, unstable_idx=None,
                         update_mask=None, apply_output_constraints_to=None, initial_As=None,
                         initial_lb=None, initial_ub=None):  # fmt: skip
        args = (start_backpropagation_at_node, bound_lower, bound_upper, average_A, need_A_only,
                unstable_idx, update_mask, apply_output_constraints_to, initial_As, initial_lb,
                initial_ub)  # fmt: skip
        plain = start_backpropagation_at_node is None and not (average_A or need_A_only)
        plain = plain and unstable_idx is None and initial_As is None and initial_lb is None
        plain = plain and initial_ub is None and not apply_output_constraints_to
        if not _spec_passes_possible(self, bound_node, C, plain):
            if bound_node.name == self.final_name:
                state.local_lA.clear()  # a whole pass: every lA whole again
            return orig(self, bound_node, C, *args)
        S, batch = int(C.shape[1]), int(C.shape[0])
        if not _final_dealt(state, self, bound_node, C, plain):
            state.local_lA.clear()  # a whole pass: every lA whole again
            return _spec_passes(state, self, orig, bound_node, C, args, [S], 0)
        counts = comm.shard_sizes(S)
        state.dealing.append(bound_node.name)
        try:
            lb, ub = _spec_passes(state, self, orig, bound_node, C, args, counts, comm.rank())
        finally:
            state.dealing.pop()
        state.dealt[type(bound_node).__name__] += counts[comm.rank()]
        # what α,β-CROWN reads back (get_lA: BaB's branching, prune_after_crown's recover) is whole
        state.local_lA[:] = [(n, counts) for n in self.get_splittable_activations() if n.lA is not None]

        def gathered(t):
            return None if t is None else comm.all_gather_cat_grad(t, 1, sizes=counts).reshape(batch, S)

        return gathered(lb), gathered(ub)

    return backward_general


def _spec_passes(state: Rows, module, orig, bound_node, C, args: tuple, counts: list[int], me: int):
    """The output node's bounds over share ``me`` of the spec rows, shared out as ``counts`` (the
    ranks' dealt shares, or ``[S]``: every row), ``(batch, rows)`` each: one pass of them, as
    auto_LiRPA runs it, or where that runs out of memory, passes of fewer rows, each auto_LiRPA's
    back-substitution of its rows of C with ``unstable_idx`` naming them (by which auto_LiRPA, and
    :meth:`AlphaLayout.select` for a dealt share, pick the rows' α). At P = 1, and inside a BaB round
    (rank-local work), halved until the passes fit (:func:`.oom.halving_on_oom`); where the ranks
    run the pass together (α-CROWN, CROWN at P > 1), in lockstep (:func:`in_lockstep`: a rank's extra
    pass, or its share of no row, bounds one row and drops it). After several passes every node's
    ``lA`` / ``uA`` (spec rows first) is theirs put together, as one pass leaves them. The size that
    fitted is kept for the node's later bounds (``state.fits``)."""
    name, S = bound_node.name, int(C.shape[1])
    lo, mine = sum(counts[:me]), counts[me]
    bound_lower, bound_upper = args[1], args[2]

    def one_pass(part: Tensor):
        real = part >= 0
        n = int(real.sum())
        if n == mine:  # this rank's rows in one pass (no row: a one-row dummy), as before any ran out
            return (*orig(module, bound_node, C[:, lo : lo + max(1, mine)], *args)[:2], None)
        rows = torch.where(real, part, min(lo, S - 1)).to(C.device)  # a dummy: a row bounded, dropped
        lb, ub = orig(module, bound_node, C.index_select(1, rows), *args[:5], rows, *args[6:])[:2]
        As = {node: (node.lA, node.uA) for node in module.nodes() if (node.lA, node.uA) != (None, None)}
        return lb, ub, (As if n else None)

    share = torch.arange(lo, lo + mine)
    fits = state.fits.get(name)
    if state.active and comm.world_size() > 1:
        k = passes_per_rank(counts, fits or S)
        done = in_lockstep(state, name, split_passes(share, k), one_pass)
    else:

        def attempt(size: int) -> list:
            return [one_pass(part) for part in share.split(size)]

        done, size = oom.halving_on_oom(attempt, min(fits or mine, mine), name)
        if size < mine:
            state.fits[name] = size
    if len(done) == 1:
        lb, ub, _ = done[0]
    else:
        _put_together([As for _, _, As in done if As is not None])  # (none on a share of no row)
        lb = torch.cat([d[0] for d in done], 1) if bound_lower else None
        ub = torch.cat([d[1] for d in done], 1) if bound_upper else None

    def mine_of(t):
        return None if t is None else t.reshape(t.shape[0], -1)[:, :mine]

    return mine_of(lb), mine_of(ub)


def _put_together(kept: list[dict]) -> None:
    """Every node's ``lA`` / ``uA`` after several passes of spec rows (``kept``: each pass's), joined
    along the spec rows (dim 0)."""
    for node in kept[-1] if kept else ():
        for i, side in enumerate(("lA", "uA")):
            parts = [k[node][i] for k in kept if node in k]
            if len(parts) < len(kept) or any(t is None for t in parts):
                setattr(node, side, None)
            elif all(isinstance(t, Tensor) for t in parts):
                setattr(node, side, torch.cat(parts, 0))
            else:
                raise RuntimeError(f"{node.name}: an A-matrix of the output node is not a tensor; not joined")
