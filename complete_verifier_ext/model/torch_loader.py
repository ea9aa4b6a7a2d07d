"""``torch.nn.Sequential`` -> :class:`Graph` (Linear, Conv2d, ReLU, Flatten, BatchNorm, Identity, Dropout)."""

from __future__ import annotations

import torch
from torch import nn

from ..bounds.graph import Graph
from ..bounds.ops import Affine, Conv, Flatten, Input, Linear, Relu, fold_affine_into
from .onnx_loader import ModelError, check_finite


def _convert(module: nn.Module, x_shape: tuple[int, ...]):
    if isinstance(module, nn.Linear):
        return Linear(module.weight, module.bias)
    if isinstance(module, nn.Conv2d):
        if module.groups != 1 or isinstance(module.padding, str):
            raise ModelError(f"{module}: grouped convolutions and string padding are not supported")
        return Conv(module.weight, module.bias, module.stride, module.padding, module.dilation)
    if isinstance(module, nn.ReLU):
        return Relu()
    if isinstance(module, nn.Flatten):
        return Flatten((int(torch.Size(x_shape).numel()),))
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
        s = module.weight.detach() / torch.sqrt(module.running_var + module.eps)
        t = module.bias.detach() - module.running_mean * s
        view = (-1,) + (1,) * (len(x_shape) - 1)
        return Affine(s.view(view), t.view(view))
    if isinstance(module, (nn.Identity, nn.Dropout)):
        return None
    raise ModelError(f"torch module {type(module).__name__} is not supported")


@torch.no_grad()
def from_sequential(model: nn.Sequential, input_shape: tuple[int, ...]) -> Graph:
    """Convert an ``nn.Sequential`` whose input has per-sample shape ``input_shape``."""
    g = Graph(source=type(model).__name__)
    g.add("input", Input(), (), input_shape)
    x = torch.zeros(1, *input_shape)
    for name, module in model.named_children():
        op = _convert(module, tuple(x.shape[1:]))
        if op is None:
            continue
        if isinstance(op, Affine) and fold_affine_into(g.nodes[-1].op, op):
            continue
        x = op.forward(x)
        g.add(name, op, (len(g.nodes) - 1,), x.shape[1:])
    return check_finite(g)
