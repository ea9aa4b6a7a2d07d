"""A stand-in for one CUDA device on a CPU-only machine: finds the tensors that would sit on the wrong
device, without a GPU.

Under :class:`FakeCuda`, ``cuda`` is a label: every tensor that would live on the GPU (made with
``device="cuda"`` or under ``torch.device("cuda")``, moved there with ``.to`` / ``.cuda()``, or computed
from such a tensor) is a CPU tensor marked as on ``cuda:0``, and reports ``cuda:0`` as its ``device``.
Where CUDA would raise, so does the stand-in: an operator that mixes a marked tensor with an unmarked one
of at least one dimension (CUDA lets a 0-dim CPU tensor through as a scalar, indexes a GPU tensor
with CPU indices and ``copy_`` copies across devices), ``numpy()`` of a marked tensor, or a CPU
generator drawing on ``cuda``. The values are the CPU's, so a run under it gives the CPU's results.

    with FakeCuda():
        verify_instance(cfg_with_device_cuda, ...)

``torch.cuda``'s memory counters are not faked: patch them where the code under test reads them.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
_MARK = "_fake_cuda"
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMismatch(RuntimeError):
    """Where CUDA would raise: tensors on two devices in one operator."""


def on_cuda(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _mark(out: object, value: bool) -> object:
    def one(t: object) -> object:
        if isinstance(t, torch.Tensor):
            setattr(t, _MARK, value)
        return t

    return tree_map(one, out)


def _target(device: object) -> bool | None:
    """Whether a ``device`` argument means the (fake) GPU; None for no device."""
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        return on_cuda(device)
    if isinstance(device, str | torch.device):
        return torch.device(device).type == "cuda"
    return None


def _to_target(args: tuple, kwargs: dict) -> bool | None:
    """The device that ``Tensor.to(*args, **kwargs)`` moves to (None: the tensor's own)."""
    for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        t = _target(a)
        if t is not None:
            return t
    return None


class FakeCuda(TorchFunctionMode):
    """Run ``cuda`` on the CPU, marking what would be on the GPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:
            return CUDA if on_cuda(args[0]) else torch.device("cpu")
        if func == torch.Tensor.is_cuda.__get__:
            return on_cuda(args[0])
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and on_cuda(args[0]):
            raise DeviceMismatch("can't convert cuda:0 device type tensor to numpy (fake cuda)")
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if func is torch.Tensor.copy_:  # copies across devices, as CUDA does
            return _mark(func(*args, **kwargs), on_cuda(args[0]))
        return self._op(func, args, kwargs)

    def _move(self, func, args: tuple, kwargs: dict):
        src = args[0]
        if func is torch.Tensor.cuda:
            dest = True
        elif func is torch.Tensor.cpu:
            dest = False
        else:
            dest = _to_target(args, kwargs)
        if dest is None:
            return _mark(func(*args, **kwargs), on_cuda(src))
        args = tuple("cpu" if _target(a) is not None and not isinstance(a, torch.Tensor) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            func, args, kwargs = torch.Tensor.to, (src, "cpu"), {}
        out = func(*args, **kwargs)
        if out is src and dest != on_cuda(src):  # a real move makes a new tensor
            out = src.clone()
        return _mark(out, dest)

    def _op(self, func, args: tuple, kwargs: dict):
        dest = _target(kwargs.get("device"))
        if dest:
            kwargs["device"] = "cpu"
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type != "cuda":
                found = gen.device.type
                raise DeviceMismatch(f"Expected a 'cuda' device type for generator but found '{found}'")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in _INDEXING:  # indices may be CPU tensors; a value must be on the indexed tensor's device
            base = args[0]
            value = args[2] if func is torch.Tensor.__setitem__ else None
            others = [value] if isinstance(value, torch.Tensor) else []
            if not on_cuda(base) and any(on_cuda(t) for t in tree_flatten(args[1])[0]):
                raise DeviceMismatch("indices on cuda:0 for a CPU tensor (fake cuda)")
            tensors = [base, *others]
        marked = [on_cuda(t) for t in tensors]
        if any(marked) and not all(m or t.dim() == 0 for m, t in zip(marked, tensors, strict=True)):
            shapes = [(tuple(t.shape), "cuda" if m else "cpu") for m, t in zip(marked, tensors, strict=True)]
            raise DeviceMismatch(f"{getattr(func, '__name__', func)}: tensors on two devices {shapes}")
        out = func(*args, **kwargs)
        if dest is None:
            dest = any(marked)
        return _mark(out, dest) if dest or any(marked) else out
