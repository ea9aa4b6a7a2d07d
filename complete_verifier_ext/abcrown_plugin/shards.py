"""Which weights inside α,β-CROWN are sharded: the registries :mod:`.fsdp` fills and both op wrappers
(:mod:`.fsdp`, :mod:`.tp`) read.

A sharded weight is a native :class:`~complete_verifier_ext.parallel.sharded.ShardedWeight` (mode
``fsdp`` or ``tp``; one shard type for both engines): ``local`` holds this rank's rows, ``fresh()``
gathers the whole into a new tensor (what auto_LiRPA's methods may keep while they run), and under
``tp`` the same object computes column-parallel products without ever building the whole.

* ``by_param``: auto_LiRPA ``BoundParams`` node → its ShardedWeight;
* ``by_model``: ``model_ori`` → ``{tensor name: (ShardedWeight, transposed)}``, its tensors that hold a
  sharded weight or a (transposed) copy of one;
* :func:`replicated`: every sharded weight whole on every rank for a while (BaB with
  ``parallel.bab_weights: replicated``); the wrappers pass through while inside.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from torch import Tensor, nn

from ..parallel.sharded import ShardedWeight

by_param: weakref.WeakKeyDictionary[nn.Module, ShardedWeight] = weakref.WeakKeyDictionary()
by_model: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[ShardedWeight, bool]]] = (
    weakref.WeakKeyDictionary()
)

NODE_ATTRS = ("_lower", "_upper", "forward_value", "interval")  # values a weight node caches

whole_layers: dict[str, str] = {}  # tp: layers it cannot shard, kept whole on every rank (why)
_replicated = False  # inside replicated(): every weight is whole, the wrappers pass through


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of ``model`` by name, shared ones under each of their names."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def is_replicated() -> bool:
    return _replicated


def weight_of(op) -> tuple[Any, ShardedWeight | None]:
    """The weight node (input 1) of a Linear/MatMul/Conv op and its ShardedWeight; ``(None, None)``
    when the op has no weight input or inside :func:`replicated`."""
    if len(op.inputs) < 2 or _replicated:
        return None, None
    w = op.inputs[1]
    return w, by_param.get(w)


@contextlib.contextmanager
def replicated():
    """Every sharded weight whole on every rank while inside (``parallel.bab_weights: replicated``:
    a rank's share of a BaB round is rank-local work and must issue no gathers). Collective on entry."""
    global _replicated
    if _replicated or not by_param:
        yield
        return
    unique: dict[int, ShardedWeight] = {}
    for s in by_param.values():  # the same order on every rank
        unique.setdefault(id(s), s)
    full = {k: s.fresh() for k, s in unique.items()}
    saved = []
    for w, s in list(by_param.items()):
        saved.append((w.param, w.param.data))
        w.param.data = full[id(s)]
    for model, table in list(by_model.items()):
        named = model_tensors(model)
        for name, (s, transposed) in table.items():
            saved.append((named[name], named[name].data))
            named[name].data = full[id(s)].t() if transposed else full[id(s)]
    _replicated = True
    try:
        yield
    finally:
        _replicated = False
        for t, local in saved:
            t.data = local
        for w in list(by_param):
            for attr in NODE_ATTRS:  # values computed from the whole weight
                if isinstance(getattr(w, attr, None), Tensor) and getattr(w, attr).shape != w.param.shape:
                    setattr(w, attr, None)
