"""Which weights inside α,β-CROWN are sharded, and sharding them: the run's registry
(:class:`~..run.Shards`), filled by :func:`shard_net` and read by both op wrappers (:mod:`.fsdp`,
:mod:`.tp`).

A sharded weight is a native :class:`~complete_verifier_ext.parallel.sharded.ShardedWeight` (mode
``fsdp`` or ``tp``; one shard type for both engines): ``local`` holds this rank's rows, ``fresh()``
gathers the whole into a new tensor (what auto_LiRPA's methods may keep while they run), and under
``tp`` the same object computes column-parallel products without ever building the whole.

* ``Shards.by_param``: auto_LiRPA ``BoundParams`` node → its ShardedWeight;
* ``Shards.by_model``: ``model_ori`` → ``{(module path, attribute): (ShardedWeight, transposed)}``, its
  tensors that hold a sharded weight or a (transposed) copy of one (keyed by the module's path as
  ``named_modules`` gives it, never by a dotted name: onnx2pytorch names modules after ONNX nodes, whose
  names hold dots, ``Gemm_/main/main.0/Gemm``);
* :func:`replicated`: every sharded weight whole on every rank for a while (BaB with
  ``parallel.bab_weights: replicated``); the wrappers pass through while inside.

How a mode computes with its shards is its :class:`Strategy` (``fsdp.FSDP``, ``tp.TP``): which layers
it must keep whole, and how ``model_ori``'s forward runs on sharded tensors.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...parallel import comm
from ...parallel.sharded import ShardedWeight
from ..run import Run, Shards

NODE_ATTRS = ("_lower", "_upper", "forward_value", "interval")  # values a weight node caches


@dataclass(frozen=True)
class Strategy:
    """How a mode computes with sharded weights."""

    mode: str  # the ShardedWeight mode: fsdp | tp
    whole_reason: Callable[[Any], str | None]  # why a layer must stay whole on every rank, or None
    model_forward: Callable[[Shards, nn.Module, dict], None]  # model_ori's forward on its shards


Key = tuple[str, str]
"""A tensor of a model: (its module's path as ``named_modules`` gives it, the attribute)."""


def model_tensors(model: nn.Module) -> dict[Key, Tensor]:
    """Every parameter and buffer of ``model`` by (module path, attribute), a shared one under each."""
    named = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                named[(path, attr)] = t
    return named


@contextlib.contextmanager
def swapped(model: nn.Module, tensors: dict[Key, Tensor]) -> Iterator[None]:
    """``model``'s tensors ``tensors`` (by :data:`Key`) replaced by the given ones while inside (what
    ``torch.func.functional_call`` does, without its dotted names)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    saved = []
    for (path, attr), t in tensors.items():
        module = modules[path]
        table = module._parameters if attr in module._parameters else module._buffers
        saved.append((table, attr, table[attr]))
        table[attr] = t
    try:
        yield
    finally:
        for table, attr, t in reversed(saved):
            table[attr] = t


def weight_of(reg: Shards, op) -> tuple[Any, ShardedWeight | None]:
    """The weight node (input 1) of a Linear/MatMul/Conv op and its ShardedWeight; ``(None, None)``
    when the op has no weight input, inside :func:`replicated`, or for a receiver that is not a node
    (auto_LiRPA merges the spec into the output's interval with ``BoundLinear.interval_propagate(None,
    ...)``)."""
    inputs = getattr(op, "inputs", None)
    if not inputs or len(inputs) < 2 or reg.replicated:
        return None, None
    w = inputs[1]
    return w, reg.by_param.get(w)


@contextlib.contextmanager
def replicated(reg: Shards) -> Iterator[None]:
    """Every sharded weight whole on every rank while inside (``parallel.bab_weights: replicated``:
    a rank's share of a BaB round is rank-local work and must issue no gathers). Collective on entry."""
    if reg.replicated or not reg.by_param:
        yield
        return
    unique: dict[int, ShardedWeight] = {}
    for s in reg.by_param.values():  # the same order on every rank
        unique.setdefault(id(s), s)
    full = {k: s.fresh() for k, s in unique.items()}
    saved = []
    for w, s in list(reg.by_param.items()):
        saved.append((w.param, w.param.data))
        w.param.data = full[id(s)]
    for model, table in list(reg.by_model.items()):
        named = model_tensors(model)
        for name, (s, transposed) in table.items():
            saved.append((named[name], named[name].data))
            named[name].data = full[id(s)].t() if transposed else full[id(s)]
    reg.replicated = True
    try:
        yield
    finally:
        reg.replicated = False
        for t, local in saved:
            t.data = local
        for w in list(reg.by_param):
            for attr in NODE_ATTRS:  # values computed from the whole weight
                if isinstance(getattr(w, attr, None), Tensor) and getattr(w, attr).shape != w.param.shape:
                    setattr(w, attr, None)


# ---------------------------------------------------------------------------------------------------------
# Sharding a LiRPANet
# ---------------------------------------------------------------------------------------------------------


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


def _kept_whole(reg: Shards, node, reason: str, mode: str) -> None:
    """``node``'s weight stays whole on every rank; said once."""
    if node.name not in reg.whole_layers:
        reg.whole_layers[node.name] = reason
        if comm.rank() == 0:
            warning = f"parallel.mode: {mode}: {node.name} is {reason}: kept whole on every rank"
            print(f"warning: {warning}", file=sys.stderr)


def shard_net(reg: Shards, net, strategy: Strategy) -> None:
    """Shard the weights of ``LiRPANet`` ``net``: its BoundedModule's ``BoundParams`` and every tensor of
    its ``model_ori`` that is one of them or a copy (same values, or transposed: onnx2pytorch keeps
    every ONNX initializer as a buffer beside the ``nn.Linear`` built from it). The tensors keep their
    identity (``.data`` becomes the local rows, or a transposed view of them), so whoever else holds
    them (α,β-CROWN keeps ``model_ori`` in several places) holds the shard too, and the full storage
    is freed. Layers the strategy cannot compute with stay whole."""
    from auto_LiRPA.operators import BoundConv, BoundLinear, BoundMatMul, BoundParams

    model = net.model_ori
    named = model_tensors(model)
    sharded = reg.by_model.setdefault(model, {})
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
        if type(w) is not BoundParams or w in reg.by_param:
            continue
        if id(w.param) in by_id:  # a second LiRPANet on an already sharded model_ori: the same shard
            reg.by_param[w] = by_id[id(w.param)]
        elif _shardable(w.param):
            reason = strategy.whole_reason(node)
            if reason is not None:
                _kept_whole(reg, node, reason, strategy.mode)
                continue
            full = w.param.detach()
            shard = ShardedWeight(full, strategy.mode)
            reg.by_param[w] = shard
            for name, t in named.items():
                if name in sharded or t.is_meta:
                    continue
                transposed = _copy_of(t, full)
                if transposed is not None:
                    sharded[name] = (shard, transposed)
                    t.data = shard.local.t() if transposed else shard.local
                    if not transposed:  # another node's parameter of the same values (an equal-to
                        by_id[id(t)] = shard  # network's copy): that node shares this shard
            w.param.data = shard.local
        else:
            continue
        for attr in NODE_ATTRS:  # stale full values, if any
            if getattr(w, attr, None) is not None:
                setattr(w, attr, None)
    if sharded and not getattr(model, "_cve_sharded_forward", False):
        strategy.model_forward(reg, model, sharded)
        model._cve_sharded_forward = True


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


def gathered(reg: Shards, model: nn.Module) -> dict[str, Tensor]:
    """Every sharded tensor of ``model`` in full (each weight gathered once)."""
    full: dict[int, Tensor] = {}
    out = {}
    for name, (shard, transposed) in reg.by_model[model].items():
        if id(shard) not in full:
            full[id(shard)] = shard.fresh()
        out[name] = full[id(shard)].t() if transposed else full[id(shard)]
    return out


def _unshard_model(reg: Shards, model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Put full weights back into ``model`` (for tracing a new BoundedModule); returns what to re-shard."""
    if model not in reg.by_model:
        return []
    named = model_tensors(model)
    done = []
    for name, full in gathered(reg, model).items():
        done.append((named[name], named[name].data))
        named[name].data = full
    return done


def lirpanet_init(run: Run, orig, strategy: Strategy):
    """``LiRPANet.__init__`` that builds on the whole model, then shards the new net's weights (and the
    model's, on its first build): :func:`shard_net`. Before a ``LiRPANet`` is built from an already
    sharded ``model_ori`` (BaB without incomplete verification builds a second one; gtrsb's attacker
    builds one to attack through), the model is gathered back for the build, traced with its own
    forward (:func:`replicated`'s flag: no collective inside the trace), and sharded again after it."""
    reg = run.shards

    def __init__(self, model_ori, in_size, c=None, device=None):
        if model_ori not in reg.by_model:
            share_copies(model_ori)
        regather = _unshard_model(reg, model_ori)
        was = reg.replicated
        reg.replicated = was or bool(regather)
        try:
            orig(self, model_ori, in_size, c, device)
        finally:
            reg.replicated = was
            for t, local in regather:
                t.data = local
        shard_net(reg, self, strategy)

    return __init__


def live_full_weights(reg: Shards) -> list[str]:
    """The shapes of live tensors (gc-tracked, or parameters and buffers of live modules) that hold a
    whole sharded weight: what must be empty outside a wrapped call. Collective (gathers each weight
    once to compare), so every rank calls it at the same point."""
    import gc

    wanted = [s.fresh() for s in reg.by_param.values()]
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
