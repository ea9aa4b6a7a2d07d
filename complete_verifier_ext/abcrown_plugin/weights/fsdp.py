"""FSDP weights inside auto_LiRPA: every rank keeps 1/P of the rows (dim 0) of each Linear, MatMul and
Conv weight, and a layer is gathered only while one of its methods runs.

After α,β-CROWN builds a ``LiRPANet``, :func:`~.shards.shard_net` (with :data:`FSDP`) replaces the
data of every ``BoundParams`` that is the weight (input 1) of a ``BoundLinear``/``BoundMatMul``/
``BoundConv`` by its local rows, and does the same to the tensors of ``model_ori`` (the PyTorch model
it keeps for PGD and for the output of the clean input) that are those weights or copies of them
(:func:`~.shards.live_full_weights` audits that none is left). The op's ``forward``,
``interval_propagate``, ``bound_backward`` and ``build_solver`` are wrapped (class attributes, no
subclass): the wrapper all-gathers the weight into a fresh tensor, hands it to the original method in
place of the shard, and drops it when the method returns. Autograd never keeps it: a
``saved_tensors_hooks`` pair saves a token instead and gathers again in backward (the TP/FSDP paper's
fork kept every gathered weight alive through the α-CROWN graph).

``model_ori``'s forward runs with the gathered weights in place of its shards (PGD's graph keeps them
only until its backward).

Every rank must call each wrapped method in the same order: α,β-CROWN's control flow is replicated
(same inputs, same seed, the synced clock of :mod:`..clocks`). Every replacement here is a
``make(run, original)`` (:mod:`..table`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ...parallel.sharded import ShardedWeight
from ..run import Run, Shards
from . import shards


def gather_on_forward(reg: Shards, model: nn.Module, table: dict) -> None:
    """``model(x)`` runs with every sharded tensor gathered in place of its shard (:func:`.shards.swapped`,
    as ``torch.func.functional_call`` would): the gathered tensors are what autograd saves (PGD's
    backward gets the right ones) and they are freed with the graph; the module's own tensors stay
    shards."""
    orig_forward = model.forward

    def forward(*args, **kwargs):
        if model._cve_in_call or reg.replicated:
            return orig_forward(*args, **kwargs)
        model._cve_in_call = True
        try:
            with shards.swapped(model, shards.gathered(reg, model)):
                return orig_forward(*args, **kwargs)
        finally:
            model._cve_in_call = False

    model._cve_in_call = False
    model.forward = forward


FSDP = shards.Strategy("fsdp", whole_reason=lambda node: None, model_forward=gather_on_forward)


def lirpanet_init(run: Run, orig):
    """``LiRPANet.__init__``: built on the whole model, then its weights sharded (fsdp)."""
    return shards.lirpanet_init(run, orig, FSDP)


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


@contextlib.contextmanager
def _calling(reg: Shards, op) -> Iterator[None]:
    """``op``'s wrapped method runs: a wrapped method it calls on itself (``BoundMatMul``'s methods call
    ``BoundLinear``'s, which are wrapped too, on the weight they were handed) passes through."""
    reg.calling.add(id(op))
    try:
        yield
    finally:
        reg.calling.discard(id(op))


def _wrap_arg(reg: Shards, orig, index: int, as_arg):
    """Wrap ``orig(self, *args, **kwargs)`` whose ``args[index]`` is the weight: it gets ``as_arg(full)``."""

    def wrapper(self, *args, **kwargs):
        _, shard = shards.weight_of(reg, self)
        if shard is None or len(args) <= index or id(self) in reg.calling:
            return orig(self, *args, **kwargs)
        full = shard.fresh()
        args = (*args[:index], as_arg(full), *args[index + 1 :])
        with _NoFullWeightSaved(shard, full), _calling(reg, self):
            return orig(self, *args, **kwargs)

    wrapper.__wrapped__ = orig
    return wrapper


def _interval(full: Tensor):
    from auto_LiRPA.operators.base import Interval

    return Interval(full, full)


def _linear_bound(full: Tensor):
    """A constant's forward-mode bound, as auto_LiRPA's ``BoundParams.bound_forward`` makes it."""
    from auto_LiRPA.linear_bound import LinearBound

    return LinearBound(None, full, None, full, full, full)


def positional(run: Run, orig):
    """``forward(self, x, w, ...)`` / ``build_solver(self, *v, ...)``: argument 1 is the weight."""
    return _wrap_arg(run.shards, orig, 1, lambda full: full)


def interval(run: Run, orig):
    """``interval_propagate(self, *v, ...)``: ``v[1]`` is the weight's interval."""
    return _wrap_arg(run.shards, orig, 1, _interval)


def forward_mode(run: Run, orig):
    """``bound_forward(self, dim_in, x, w, ...)``: argument 2 is the weight's forward-mode bound."""
    return _wrap_arg(run.shards, orig, 2, _linear_bound)


def dynamic_forward(run: Run, orig):
    """``bound_dynamic_forward(self, x, w, ...)``: argument 1 is the weight's forward-mode bound."""
    return _wrap_arg(run.shards, orig, 1, _linear_bound)


def node_args(run: Run, orig):
    """``bound_backward(self, last_lA, last_uA, *x, ...)``: the weight is read from the node ``x[1]``."""
    reg = run.shards

    def wrapper(self, last_lA, last_uA, *x, **kwargs):
        w, shard = shards.weight_of(reg, self)
        if shard is None or id(self) in reg.calling:
            return orig(self, last_lA, last_uA, *x, **kwargs)
        full = shard.fresh()
        saved = _set_full(w, full)
        try:
            with _NoFullWeightSaved(shard, full), _calling(reg, self):
                return orig(self, last_lA, last_uA, *x, **kwargs)
        finally:
            _restore(w, saved)
            del full, saved

    wrapper.__wrapped__ = orig
    return wrapper
