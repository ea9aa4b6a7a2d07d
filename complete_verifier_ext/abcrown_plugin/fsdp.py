"""FSDP weights inside auto_LiRPA: every rank keeps 1/P of the rows (dim 0) of each Linear, MatMul and
Conv weight, and a layer is gathered only while one of its methods runs.

After α,β-CROWN builds a ``LiRPANet``, :func:`shard_net` replaces the data of every ``BoundParams``
that is the weight (input 1) of a ``BoundLinear``/``BoundMatMul``/``BoundConv`` by its local rows, and
does the same to the tensors of ``model_ori`` (the PyTorch model it keeps for PGD and for the output
of the clean input) that are those weights or copies of them (:func:`live_full_weights` audits that
none is left). The op's ``forward``, ``interval_propagate``,
``bound_backward`` and ``build_solver`` are wrapped (class attributes, no subclass): the wrapper
all-gathers the weight into a fresh tensor, hands it to the original method in place of the shard,
and drops it when the method returns. Autograd never keeps it: a ``saved_tensors_hooks`` pair saves a
token instead and gathers again in backward (the TP/FSDP paper's fork kept every gathered weight
alive through the α-CROWN graph).

``model_ori``'s forward runs through ``torch.func.functional_call`` with the gathered weights (PGD's
graph keeps them only until its backward). Before a ``LiRPANet`` is built from an
already sharded ``model_ori`` (BaB without incomplete verification builds a second one), the model
is gathered back for the build and sharded again after it.

Every rank must call each wrapped method in the same order: α,β-CROWN's control flow is replicated
(same inputs, same seed, the synced clock of :mod:`.patches`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from ..parallel import comm
from ..parallel.sharded import ShardedWeight
from . import shards
from .tp import column_parallel_forward, whole_reason


def _shardable(t: Tensor) -> bool:
    return t.dim() >= 2 and t.shape[0] >= comm.world_size()


def _copy_of(t: Tensor, full: Tensor) -> bool | None:
    """Whether ``t`` is ``full`` (or holds the same values), ``full.T``, or neither (None)."""
    if t.shape == full.shape and (
        t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() or torch.equal(t.detach(), full)
    ):
        return False
    if full.dim() == 2 and t.shape == full.shape[::-1] and torch.equal(t.detach().t(), full):
        return True
    return None


def shard_net(net, tp: bool = False) -> None:
    """Shard the weights of ``LiRPANet`` ``net``: its BoundedModule's ``BoundParams`` and every tensor of
    its ``model_ori`` that is one of them or a copy (same values, or transposed: onnx2pytorch keeps
    every ONNX initializer as a buffer beside the ``nn.Linear`` built from it). The tensors keep their
    identity (``.data`` becomes the local rows, or a transposed view of them), so whoever else holds
    them (α,β-CROWN keeps ``model_ori`` in several places) holds the shard too, and the full storage
    is freed. ``tp``: the shards compute column-parallel (:mod:`.tp`), which refuses layers it cannot
    compute with."""
    from auto_LiRPA.operators import BoundConv, BoundLinear, BoundMatMul, BoundParams

    model = net.model_ori
    named = shards.model_tensors(model)
    sharded = shards.by_model.setdefault(model, {})
    by_id = {id(named[name]): shard for name, (shard, transposed) in sharded.items() if not transposed}
    for node in net.net.nodes():
        if type(node) not in (BoundLinear, BoundMatMul, BoundConv) or len(node.inputs) < 2:
            continue
        w = node.inputs[1]
        if type(w) is not BoundParams and not w.perturbed and comm.rank() == 0:
            # e.g. onnx2pytorch's Transpose of an initializer in front of a MatMul
            print(
                f"warning: the weight of {node.name} ({type(node).__name__}) is computed by "
                f"{type(w).__name__} {w.name}, not a parameter: kept whole on every rank",
                file=sys.stderr,
            )
        if type(w) is not BoundParams or w in shards.by_param:
            continue
        if id(w.param) in by_id:  # a second LiRPANet on an already sharded model_ori: the same shard
            shards.by_param[w] = by_id[id(w.param)]
        elif _shardable(w.param):
            reason = whole_reason(node) if tp else None
            if reason is not None:  # kept whole on every rank, said once
                if node.name not in shards.whole_layers:
                    shards.whole_layers[node.name] = reason
                    if comm.rank() == 0:
                        warning = f"parallel.mode: tp: {node.name} is {reason}: kept whole on every rank"
                        print(f"warning: {warning}", file=sys.stderr)
                continue
            full = w.param.detach()
            shard = ShardedWeight(full, "tp" if tp else "fsdp")
            shards.by_param[w] = shard
            for name, t in named.items():
                if name in sharded or t.is_meta:
                    continue
                transposed = _copy_of(t, full)
                if transposed is not None:
                    sharded[name] = (shard, transposed)
                    t.data = shard.local.t() if transposed else shard.local
            w.param.data = shard.local
        else:
            continue
        for attr in shards.NODE_ATTRS:  # stale full values, if any
            if getattr(w, attr, None) is not None:
                setattr(w, attr, None)
    if sharded and not getattr(model, "_cve_fsdp_forward", False):
        if tp:
            column_parallel_forward(model, sharded)
            model._cve_fsdp_forward = True
        else:
            _gather_on_forward(model)


def share_copies(model: nn.Module) -> None:
    """Buffers of ``model`` that hold a copy of one of its 2-D parameters (the same values, or their
    transpose: onnx2pytorch's initializer buffers) become views of it, before the first ``LiRPANet``
    is built: the build deep-copies the state dict twice, and a copy of a view costs nothing more."""
    by_shape: dict[tuple[int, ...], list[tuple[Tensor, bool]]] = {}
    for p in model.parameters():
        if p.dim() == 2:
            by_shape.setdefault(tuple(p.shape), []).append((p, False))
            by_shape.setdefault(tuple(p.shape[::-1]), []).append((p, True))
    for b in model.buffers():
        for p, transposed in by_shape.get(tuple(b.shape), []):
            view = p.detach().t() if transposed else p.detach()
            if b.untyped_storage().data_ptr() != view.untyped_storage().data_ptr() and torch.equal(b, view):
                b.data = view
                break


def _gathered(model: nn.Module) -> dict[str, Tensor]:
    """Every sharded tensor of ``model`` in full (each weight gathered once)."""
    full: dict[int, Tensor] = {}
    out = {}
    for name, (shard, transposed) in shards.by_model[model].items():
        if id(shard) not in full:
            full[id(shard)] = shard.fresh()
        out[name] = full[id(shard)].t() if transposed else full[id(shard)]
    return out


def _gather_on_forward(model: nn.Module) -> None:
    """``model(x)`` runs with every sharded tensor gathered, through ``torch.func.functional_call``: the
    gathered tensors are what autograd saves (PGD's backward gets the right ones) and they are freed
    with the graph; the module's own tensors stay shards."""
    orig_forward = model.forward

    def forward(*args, **kwargs):
        if model._cve_in_call or shards.is_replicated():
            return orig_forward(*args, **kwargs)
        model._cve_in_call = True
        try:
            return torch.func.functional_call(
                model, _gathered(model), args, kwargs, tie_weights=False, strict=False
            )
        finally:
            model._cve_in_call = False

    model._cve_in_call = False
    model._cve_fsdp_forward = True
    model.forward = forward


def unshard_model(model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Put full weights back into ``model`` (for tracing a new BoundedModule); returns what to re-shard."""
    if model not in shards.by_model:
        return []
    named = shards.model_tensors(model)
    done = []
    for name, full in _gathered(model).items():
        done.append((named[name], named[name].data))
        named[name].data = full
    return done


def reshard_model(done: list[tuple[Tensor, Tensor]]) -> None:
    for t, local in done:
        t.data = local


# ---------------------------------------------------------------------------------------------------------
# The op wrappers
# ---------------------------------------------------------------------------------------------------------


class _Token:
    __slots__ = ("shard", "size", "stride", "offset")

    def __init__(self, shard: ShardedWeight, t: Tensor, full: Tensor) -> None:
        self.shard, self.size, self.stride = shard, t.size(), t.stride()
        self.offset = t.storage_offset() - full.storage_offset()


class _NoFullWeightSaved:
    """Autograd saves a token for the gathered weight (or any view of it) and gathers it again when the
    backward pass needs it."""

    def __init__(self, shard: ShardedWeight, full: Tensor) -> None:
        self.shard, self.full = shard, full
        self.ptr = full.untyped_storage().data_ptr()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: Tensor) -> Any:
        if t.device == self.full.device and t.untyped_storage().data_ptr() == self.ptr:
            return _Token(self.shard, t, self.full)
        return t

    @staticmethod
    def unpack(saved: Any) -> Tensor:
        if isinstance(saved, _Token):
            full = saved.shard.fresh()
            return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)
        return saved

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.full = None  # type: ignore[assignment]


def _set_full(w, full: Tensor) -> dict:
    """The weight node's ``lower``/``upper``/``forward_value``/``interval`` become the gathered weight
    while the original method runs; returns what :func:`_restore` puts back. (No per-call class or
    closure: those live in reference cycles, which kept every gathered weight until the cyclic GC ran.)"""
    from auto_LiRPA.operators.base import Interval

    saved = {a: getattr(w, a, None) for a in shards.NODE_ATTRS}
    w._lower = w._upper = w.forward_value = full
    w.interval = Interval(full, full)
    return saved


def _restore(w, saved: dict) -> None:
    for a, v in saved.items():
        setattr(w, a, v)


def _wrap_arg(orig, as_arg):
    """Wrap ``orig(self, *args, **kwargs)`` whose ``args[1]`` is the weight: it gets ``as_arg(full)``."""

    def wrapper(self, *args, **kwargs):
        _, shard = shards.weight_of(self)
        if shard is None or len(args) < 2:
            return orig(self, *args, **kwargs)
        full = shard.fresh()
        args = (args[0], as_arg(full), *args[2:])
        with _NoFullWeightSaved(shard, full):
            return orig(self, *args, **kwargs)

    wrapper.__wrapped__ = orig
    return wrapper


def wrap_positional(orig):
    """``forward(self, x, w, ...)`` / ``build_solver(self, *v, ...)``: argument 1 is the weight."""
    return _wrap_arg(orig, lambda full: full)


def wrap_interval(orig):
    """``interval_propagate(self, *v, ...)``: ``v[1]`` is the weight's interval."""

    def as_interval(full: Tensor):
        from auto_LiRPA.operators.base import Interval

        return Interval(full, full)

    return _wrap_arg(orig, as_interval)


def wrap_node_args(orig):
    """``bound_backward(self, last_lA, last_uA, *x, ...)``: the weight is read from the node ``x[1]``."""

    def wrapper(self, last_lA, last_uA, *x, **kwargs):
        w, shard = shards.weight_of(self)
        if shard is None:
            return orig(self, last_lA, last_uA, *x, **kwargs)
        full = shard.fresh()
        saved = _set_full(w, full)
        try:
            with _NoFullWeightSaved(shard, full):
                return orig(self, last_lA, last_uA, *x, **kwargs)
        finally:
            _restore(w, saved)
            del full, saved

    wrapper.__wrapped__ = orig
    return wrapper


WRAPPED = {
    "auto_LiRPA.operators.BoundLinear.forward": wrap_positional,
    "auto_LiRPA.operators.BoundLinear.bound_backward": wrap_node_args,
    "auto_LiRPA.operators.BoundLinear.interval_propagate": wrap_interval,
    "auto_LiRPA.operators.BoundLinear.build_solver": wrap_positional,
    "auto_LiRPA.operators.BoundMatMul.forward": wrap_positional,
    "auto_LiRPA.operators.BoundMatMul.bound_backward": wrap_node_args,
    "auto_LiRPA.operators.BoundMatMul.interval_propagate": wrap_interval,
    "auto_LiRPA.operators.BoundConv.forward": wrap_positional,
    "auto_LiRPA.operators.BoundConv.bound_backward": wrap_node_args,
    "auto_LiRPA.operators.BoundConv.interval_propagate": wrap_interval,
    "auto_LiRPA.operators.BoundConv.build_solver": wrap_positional,
}


def wrap_lirpanet_init(tp: bool):
    """``LiRPANet.__init__`` that builds on the whole model, then shards the new net's weights (and the
    model's, on its first build): :func:`shard_net`."""

    def wrap(orig):
        def __init__(self, model_ori, in_size, c=None, device=None):
            if model_ori not in shards.by_model:
                share_copies(model_ori)
            regather = unshard_model(model_ori)
            try:
                orig(self, model_ori, in_size, c, device)
            finally:
                reshard_model(regather)
            shard_net(self, tp)

        return __init__

    return wrap


def live_full_weights() -> list[tuple[int, ...]]:
    """The shapes of live tensors (gc-tracked, or parameters and buffers of live modules) that hold a
    whole sharded weight: what must be empty outside a wrapped call. Collective (gathers each weight
    once to compare), so every rank calls it at the same point."""
    import gc

    wanted = [s.fresh() for s in shards.by_param.values()]
    mine = {t.untyped_storage().data_ptr() for t in wanted}  # the gathered views and their bases
    by_shape: dict[tuple[int, ...], list[Tensor]] = {}
    for t in wanted:
        by_shape.setdefault(tuple(t.shape), []).append(t)
        if t.dim() == 2:  # a transposed copy counts too
            by_shape.setdefault(tuple(t.shape[::-1]), []).append(t.t())

    def holds(t: Tensor) -> bool:
        if tuple(t.shape) not in by_shape or t.is_meta or t.untyped_storage().data_ptr() in mine:
            return False
        return any(torch.equal(t.detach(), w) for w in by_shape[tuple(t.shape)])

    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, Tensor):
                cands, where = [obj], "tensor"
            elif isinstance(obj, nn.Module):
                cands = list(obj.parameters(recurse=False)) + list(obj.buffers(recurse=False))
                where = type(obj).__name__
            else:
                continue
            found += [f"{where}{tuple(t.shape)}" for t in cands if holds(t)]
        except (ReferenceError, RuntimeError):
            continue
    return found
