"""A CIFAR ResNet18-shaped ONNX model with folded BatchNorm and fixed-seed random weights.

The shape of VNN-COMP 2024's cifar100 ResNet-large (its files are not available here): a 3x3 stem,
four stages of two BasicBlocks (1x1 projection shortcuts where the shape changes), a fully connected
layer and the class outputs; the input is normalised inside the model (Sub, Div), as the benchmark's
models do. With the default arguments: 16 + 1 convolutions, 2 fully connected layers, 15.4M
parameters (``benchmarks/resnet_large.py``). Tests build it with 1/8 of the channels.

Weights are He-normal with a fixed seed; every convolution carries a folded BatchNorm whose statistics
are those of its output on a calibration batch (random images, fixed seed), so every pre-activation has
mean 0 and variance 1 there: about half of each layer's neurons are active.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

STAGES = (64, 128, 256, 512)
CLASSES = 100
MEAN = torch.tensor([0.507, 0.487, 0.441]).view(1, 3, 1, 1)  # CIFAR-100's channel statistics
STD = torch.tensor([0.267, 0.256, 0.276]).view(1, 3, 1, 1)


class Builder:
    """ONNX nodes and initialisers, with each conv's BatchNorm folded from a calibration batch."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.nodes: list = []
        self.inits: list = []
        self.n_params = 0

    def _const(self, name: str, t: torch.Tensor) -> str:
        self.inits.append(numpy_helper.from_array(t.detach().numpy().astype(np.float32), name))
        self.n_params += t.numel()
        return name

    def conv(
        self, name: str, x: str, xv: torch.Tensor, c_out: int, k: int, stride: int
    ) -> tuple[str, torch.Tensor]:
        """Conv + folded BatchNorm (normalising its output on the calibration batch)."""
        c_in = xv.shape[1]
        W = torch.randn(c_out, c_in, k, k, generator=self.gen) * (2.0 / (c_in * k * k)) ** 0.5
        y = F.conv2d(xv, W, stride=stride, padding=k // 2)
        mean, std = y.mean((0, 2, 3)), y.std((0, 2, 3)) + 1e-5
        W, b = W / std.view(-1, 1, 1, 1), -mean / std
        yv = F.conv2d(xv, W, b, stride=stride, padding=k // 2)
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, self._const(f"{name}.W", W), self._const(f"{name}.b", b)],
                [name],
                name=name,
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[k // 2] * 4,
            )
        )
        return name, yv

    def relu(self, x: str, xv: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.nodes.append(helper.make_node("Relu", [x], [f"{x}.relu"], name=f"{x}.relu"))
        return f"{x}.relu", torch.relu(xv)

    def add(self, name: str, a: str, b: str, av: torch.Tensor, bv: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.nodes.append(helper.make_node("Add", [a, b], [name], name=name))
        return name, av + bv

    def linear(self, name: str, x: str, xv: torch.Tensor, n_out: int) -> tuple[str, torch.Tensor]:
        n_in = xv.shape[1]
        W = torch.randn(n_out, n_in, generator=self.gen) * (2.0 / n_in) ** 0.5
        y = xv @ W.T
        b = -y.mean(0)
        W_name, b_name = self._const(f"{name}.W", W), self._const(f"{name}.b", b)
        self.nodes.append(helper.make_node("Gemm", [x, W_name, b_name], [name], name=name, transB=1))
        return name, y + b


def _block(
    m: Builder, name: str, x: str, xv: torch.Tensor, c_out: int, stride: int
) -> tuple[str, torch.Tensor]:
    """BasicBlock: relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))."""
    h, hv = m.relu(*m.conv(f"{name}.conv1", x, xv, c_out, 3, stride))
    h, hv = m.conv(f"{name}.conv2", h, hv, c_out, 3, 1)
    if stride != 1 or xv.shape[1] != c_out:
        s, sv = m.conv(f"{name}.short", x, xv, c_out, 1, stride)
    else:
        s, sv = x, xv
    return m.relu(*m.add(f"{name}.add", h, s, hv, sv))


def build(
    path: Path,
    seed: int = 0,
    stages: tuple[int, ...] = STAGES,
    side: int = 32,
    fc: int = 512,
    classes: int = CLASSES,
    normalise: bool = True,
) -> tuple[Path, int]:
    """Write the model as ONNX (input ``x`` (batch, 3, side, side), output ``y`` (batch, classes)): its path
    and number of parameters. ``stages`` are the channels of the four stages (the ResNet-large shape:
    64/128/256/512; a scaled-down one for tests: 8/16/32/64). ``normalise``: the input normalisation
    as the model's first nodes (``Sub``, ``Div``), or none."""
    shape = (3, side, side)
    calib = torch.rand(64, *shape, generator=torch.Generator().manual_seed(seed + 1))
    m = Builder(seed)
    if normalise:
        m.nodes += [
            helper.make_node("Sub", ["x", m._const("mean", MEAN)], ["centred"], name="sub_mean"),
            helper.make_node("Div", ["centred", m._const("std", STD)], ["normed"], name="div_std"),
        ]
        m.n_params -= 6  # the normalisation constants are not parameters
        calib = (calib - MEAN) / STD
    cur, v = m.relu(*m.conv("stem", "normed" if normalise else "x", calib, stages[0], 3, 1))
    for s, c in enumerate(stages):
        for b in range(2):
            cur, v = _block(m, f"layer{s + 1}.{b}", cur, v, c, 2 if (s and not b) else 1)
    m.nodes.append(helper.make_node("Flatten", [cur], ["flat"], name="flatten"))
    cur, v = m.relu(*m.linear("fc1", "flat", v.flatten(1), fc))
    m.linear("y", cur, v, classes)
    batch = ["batch", *shape]
    graph = helper.make_graph(
        m.nodes,
        "cifar100_resnet_large_shape",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, batch)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", classes])],
        m.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="resnet_large.py"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path, m.n_params
