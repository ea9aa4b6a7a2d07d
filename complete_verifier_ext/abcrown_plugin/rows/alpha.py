"""Row-sharded α: each rank keeps the α of its own rows.

A ReLU's α for an intermediate start node (auto_LiRPA's ``alpha[start]``, ``(2, R, batch,
*relu_shape)``) has one slope set per start-node row, or, for a conv start node with
``full_conv_alpha`` off or more than ``use_full_conv_alpha_thresh`` unstable neurons, one per channel,
shared by the channel's rows. Every start row is bounded on one rank, and every α row is used only by
rows of one rank (a channel's rows are dealt together where α is per channel). So right after
``BoundRelu.init_opt_parameters`` creates it, each rank keeps only the α rows its own start rows use,
plus one default slot (row 0, the initial slope): ``(2, 1 + held, batch, *relu_shape)``
(:class:`AlphaLayout`). Adam's state follows (it is created from these tensors). While rank r deals a
start node's rows, ``select_alpha_by_idx`` hands auto_LiRPA its local α with a local lookup table (in
patches mode auto_LiRPA unfolds the whole α it is given, so this also shrinks every pass); any other
use of that α (every rank bounding the same rows) gets the whole α, all-gathered with autograd, so the
ranks stay identical. An α row gets its whole gradient on the rank that holds it, so the optimiser
sums only the shared slot 0 (:mod:`.grads`).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from ...parallel import comm
from ..run import Rows, Run
from .deal import even_blocks, flat_positions, start_kind, start_owners
from .spec import whole_lA


class AlphaLayout:
    """How one (ReLU, start node) α is kept on this rank: the α rows used by its own start rows (as
    :func:`start_owners` deals them), in global order, after a default slot 0.

    ``owners``: the rank of every start neuron (flat position; -1: not dealt to anyone, a stable
    neuron). ``alpha_row``: the global α row of every start neuron: auto_LiRPA's lookup table where it
    has one (sparse-spec α; 0: its default slot, held by no one), else the neuron itself. Where α is
    per channel, ``channel_row`` is the global α row of every channel, and each neuron's is its
    channel's. The local lookup table is shaped like the one auto_LiRPA selects with
    (``lookup_shape``: the channels, ``(c, h, w)`` of a conv start node, or the neurons)."""

    def __init__(self, owners: Tensor, alpha_row: Tensor, sparse: bool, n_alpha: int,
                 lookup_shape: tuple[int, ...], channel_row: Tensor | None = None,
                 final: bool = False) -> None:  # fmt: skip
        P, me = comm.world_size(), comm.rank()
        self.n_alpha, self.final = n_alpha, final
        self.held = []  # the global α rows each rank holds, sorted
        for q in range(P):
            used = alpha_row[owners == q]
            self.held.append(torch.unique(used[used > 0] if sparse else used))
        self.sizes = [int(h.numel()) for h in self.held]
        self.order = torch.cat(self.held)  # the global α row of every gathered row
        local_of = torch.zeros(n_alpha, dtype=torch.long)  # global α row -> local row (0: slot 0)
        local_of[self.held[me]] = torch.arange(1, self.sizes[me] + 1)
        rows = channel_row if channel_row is not None else alpha_row
        self.lookup = local_of[rows].view(lookup_shape)  # for maybe_unfold_patches / selection
        self.flat_lookup = local_of[alpha_row]  # by flat neuron position
        # a rank whose local α would have the global α's shape would be taken for whole
        self.ambiguous = any(1 + n == n_alpha for n in self.sizes)

    def to(self, device) -> AlphaLayout:
        self.lookup, self.flat_lookup = self.lookup.to(device), self.flat_lookup.to(device)
        return self

    def split(self, alpha: Tensor) -> Tensor:
        """auto_LiRPA's α (``(2, n_alpha, batch, ...)``) -> this rank's ``(2, 1 + held, batch, ...)``.
        Every row starts from the same initial slope, so slot 0, a copy of row 0, stands for the rows
        this rank does not hold (auto_LiRPA's own slot 0, and the rows of stable neurons, never
        trained: their gradient is 0)."""
        rows = self.held[comm.rank()].to(alpha.device)
        local = torch.cat([alpha[:, :1], alpha.index_select(1, rows)], 1).detach().clone()
        return local.requires_grad_(alpha.requires_grad)

    def owns(self, alpha: Tensor) -> bool:
        return alpha.shape[1] == 1 + self.sizes[comm.rank()]

    def whole(self, local: Tensor) -> Tensor:
        """The α as auto_LiRPA laid it out, from every rank's rows (differentiable)."""
        rows = comm.all_gather_cat_grad(local[:, 1:], 1, sizes=self.sizes)  # (2, held rows, batch, ...)
        base = local[:, :1].expand(-1, self.n_alpha, *local.shape[2:])
        return base.index_copy(1, self.order.to(local.device), rows)

    def select(self, local: Tensor, last_lA, last_uA, unstable_idx, shape: list[int]):
        """What auto_LiRPA's ``select_alpha_by_idx`` returns for the rows ``unstable_idx`` of a dealt
        pass, from the local α: in patches mode the α and its lookup table, which
        ``maybe_unfold_patches`` selects with; with matrices the rows' own α."""
        if self.final and unstable_idx is not None:  # a pass of some spec rows (after running out)
            return local.index_select(1, self.flat_lookup[unstable_idx]), None
        if self.final:  # the rank's spec rows, in order: its local rows (none: a dummy row, slot 0)
            return (local[:, 1:] if local.shape[1] > 1 else local[:, :1]), None
        patches = not isinstance(last_lA, Tensor) and not isinstance(last_uA, Tensor)
        if isinstance(unstable_idx, tuple) and patches:
            return local, self.lookup
        rows = self.flat_lookup[flat_positions(unstable_idx, shape)]
        return local.index_select(1, rows), self.lookup


def alpha_rows(lookup: Tensor | None, shape: list[int], per_channel: bool) -> tuple[Tensor, Tensor | None]:
    """The α row of every flat neuron of a start node of ``shape`` (without the batch), and where α is
    per channel (``per_channel``) each channel's: auto_LiRPA's lookup table where it has one (0: its
    default slot, for no neuron of its own), else the neuron (or channel) itself."""
    if per_channel:
        channel_row = lookup.cpu() if lookup is not None else torch.arange(shape[0])
        return channel_row.repeat_interleave(math.prod(shape) // shape[0]), channel_row
    return (lookup.cpu().reshape(-1) if lookup is not None else torch.arange(math.prod(shape))), None


def _layout(relu, start, module, state: Rows) -> AlphaLayout | None:
    """The row layout of ``relu.alpha[start]``, or None: kept whole (the final node, shared α, a
    layout this code does not know, or one where some rank would hold every row)."""
    name, out_shape, _, final = start[:4]
    opts = relu.options
    if name not in relu.alpha or opts["optimize_bound_args"].get("use_shared_alpha", False):
        return None
    if final:  # one α row per spec row, dealt as the spec rows are (final_rows)
        S = int(relu.alpha[name].shape[1])
        if S != (out_shape if isinstance(out_shape, int) else math.prod(out_shape)):
            return None
        layout = AlphaLayout(even_blocks(S), torch.arange(S), False, S, (S,), final=True)
        return None if layout.ambiguous else layout.to(relu.alpha[name].device)
    node = module[name]
    shape = [int(s) for s in node.output_shape[1:]]
    n = math.prod(shape)
    n_alpha = int(relu.alpha[name].shape[1])
    lookup = (relu.alpha_lookup_idx or {}).get(name)
    owners = state.owners.get(name)
    if owners is None:  # α without a lookup table on a conv start node in patches mode: bounded densely
        dense = lookup is None and start_kind(node) in ("patches", "sum") and name in state.dense
        owners = start_owners(state, module, node, dense)
    alpha_row, channel_row = alpha_rows(lookup, shape, isinstance(out_shape, int) and len(shape) == 3)
    if channel_row is not None:
        lookup_shape: tuple[int, ...] = (shape[0],)
    else:
        lookup_shape = (
            tuple(shape) if len(shape) == 3 and isinstance(lookup, Tensor) and lookup.dim() == 3 else (n,)
        )
        if lookup is None and len(shape) == 3 and start_kind(node) in ("patches", "sum"):
            lookup_shape = tuple(shape)
    if alpha_row.numel() != n or owners.numel() != n or int(alpha_row.max()) >= n_alpha:
        return None
    layout = AlphaLayout(owners, alpha_row, lookup is not None, n_alpha, lookup_shape, channel_row)
    return None if layout.ambiguous else layout.to(relu.alpha[name].device)


def init_opt_parameters(run: Run, orig):
    """``BoundRelu.init_opt_parameters``: each rank keeps the α rows of its own start rows."""
    state = run.rows

    def init_opt_parameters(self, start_nodes):
        orig(self, start_nodes)
        module = state.module() if state.module is not None else None
        if not state.active or comm.world_size() == 1 or module is None:
            return
        table = {}
        for start in start_nodes:  # (the list can name a start node more than once)
            if start[0] in table:
                continue
            layout = _layout(self, start, module, state)
            if layout is not None:
                self.alpha[start[0]] = layout.split(self.alpha[start[0]])
                table[start[0]] = layout
        state.alpha[self] = table

    return init_opt_parameters


def select_alpha_by_idx(run: Run, orig):
    """``BoundRelu.select_alpha_by_idx``: a rank reads its local α rows."""
    state = run.rows

    def select_alpha_by_idx(self, last_lA, last_uA, unstable_idx, start_node):
        name = start_node.name
        layout = state.alpha.get(self, {}).get(name)
        local = self.alpha.get(name) if layout is not None else None
        if state.dense_pass is not None and unstable_idx is None and state.dealing[-1] == name:
            return _dense_alpha(self, orig, layout, local, last_lA, last_uA, start_node, state.dense_pass)
        if local is None or not layout.owns(local):
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        if state.dealing and state.dealing[-1] == name and (unstable_idx is not None or layout.final):
            shape = [int(d) for d in start_node.output_shape[1:]]
            return layout.select(local, last_lA, last_uA, unstable_idx, shape)
        self.alpha[name] = layout.whole(local)  # every rank bounds these rows: the whole α everywhere
        try:
            return orig(self, last_lA, last_uA, unstable_idx, start_node)
        finally:
            self.alpha[name] = local

    return select_alpha_by_idx


def _dense_alpha(relu, orig, layout, local, last_lA, last_uA, start_node, dense_pass: tuple):
    """The α of a dense pass over some channels of a conv start node (:func:`_dense_passes`): those
    channels' α rows, in order: one per channel (α per channel) or one per neuron (full conv α)."""
    channels, C, HW = dense_pass
    flat = (channels[:, None] * HW + torch.arange(HW, device=channels.device)).reshape(-1)
    if layout is not None and local is not None and layout.owns(local):
        per_channel = layout.lookup.dim() == 1 and int(layout.lookup.numel()) == C
        rows = layout.lookup[channels] if per_channel else layout.flat_lookup[flat]
        return local.index_select(1, rows), None
    selected, lookup = orig(relu, last_lA, last_uA, None, start_node)
    if isinstance(selected, Tensor) and selected.dim() > 1 and lookup is None:
        if int(selected.shape[1]) == C:  # α per channel, whole on every rank
            selected = selected.index_select(1, channels)
        elif int(selected.shape[1]) == C * HW:  # full conv α, whole on every rank
            selected = selected.index_select(1, flat)
    return selected, lookup


def whole_alpha_dict(state: Rows, alphas: dict | None, only: str | None = None) -> None:
    """α as α,β-CROWN hands it around (``{relu: {start: α}}``, or ``{relu: {"alpha": {start: α},
    ...}}`` as ``get_alpha(full_info=True)`` lays it out) made whole where it was kept by row, in place
    (``only``: that start node alone). Collective: call it on every rank at the same point."""
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        entry = (alphas or {}).get(relu.name)
        if entry is None:
            continue
        per_start = entry["alpha"] if isinstance(entry.get("alpha"), dict) else entry
        for name, layout in table.items():
            a = per_start.get(name)
            if (only is None or name == only) and isinstance(a, Tensor) and layout.owns(a):
                # α,β-CROWN stores α in float16 by default (``alpha_dtype``): gathered in float32 at
                # least, float64 kept (``double_fp`` with ``alpha_dtype: auto``)
                wide = torch.promote_types(a.dtype, torch.float32)
                whole = layout.whole(a.detach().to(comm.device(), wide))
                per_start[name] = whole.to(a.device, a.dtype)


def whole_alphas(state: Rows, reference: dict | None) -> None:
    """The α that α,β-CROWN saved after α-CROWN (``reference["alphas"]``) made whole where it was kept
    by row, in place, before BaB stores it per domain (input BaB, ``enable_opt_interm_bounds``).
    Collective: call it on every rank, before :func:`inactive`."""
    whole_alpha_dict(state, (reference or {}).get("alphas"))


def _whole_final(state: Rows, final: str) -> list:
    """The output node's α whole again on every ReLU (its layout dropped); returns those ReLUs."""
    relus = []
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        layout = table.pop(final, None)
        a = (relu.alpha or {}).get(final)
        if layout is not None and a is not None and layout.owns(a):
            relu.alpha[final] = layout.whole(a).detach().requires_grad_(a.requires_grad)
            relus.append(relu)
    return relus


def prune_after_crown(run: Run, orig):
    """``prune.PruneAfterCROWN.__init__``: α,β-CROWN drops the spec rows CROWN already verified from the
    output node's α, which it takes whole: the α is made whole for it, then kept by the new spec rows."""
    state = run.rows

    def __init__(self, net, x, c, rhs, lb, aux_reference_bounds, stop_criterion, or_spec_size=None):
        relus = _whole_final(state, net.final_name) if state.active and comm.world_size() > 1 else []
        orig(self, net, x, c, rhs, lb, aux_reference_bounds, stop_criterion, or_spec_size)
        for relu in relus:
            start = (net.final_name, int(relu.alpha[net.final_name].shape[1]), None, True)
            layout = _layout(relu, start, None, state)
            if layout is not None:
                relu.alpha[net.final_name] = layout.split(relu.alpha[net.final_name])
                state.alpha[relu][net.final_name] = layout

    return __init__


def prune_recover(run: Run, orig):
    """``prune.PruneAfterCROWN.recover``: puts the pruned spec rows of the output node's α (among
    others) back in place, on the whole α: made whole for it."""
    state = run.rows

    def recover(self, lb, ub, lA, alphas, mask, input_split_idx, full_alpha_info):
        if state.active and comm.world_size() > 1:
            whole_alpha_dict(state, alphas, only=self.net.final_name)
        return orig(self, lb, ub, lA, alphas, mask, input_split_idx, full_alpha_info)

    return recover


@contextlib.contextmanager
def inactive(state: Rows):
    """Rows not dealt while inside (a rank's share of a BaB round is rank-local work). On entry the α
    kept by row become whole again on every rank (collective)."""
    for relu, table in list(state.alpha.items()):  # the same order on every rank
        for name, layout in table.items():
            a = relu.alpha.get(name) if relu.alpha else None
            if a is not None and layout.owns(a):
                relu.alpha[name] = layout.whole(a).detach().requires_grad_(a.requires_grad)
    whole_lA(state)
    state.alpha.clear()
    state.owners.clear()
    was, state.active = state.active, False
    try:
        yield
    finally:
        state.active = was
