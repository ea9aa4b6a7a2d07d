"""A CNN7-shaped ONNX model (the certified-training CNN7 of CTRAIN, VNN-COMP 2026's
``challenging_certified_training_2026``) with folded BatchNorm and fixed-seed random weights.

The shape: five 3x3 convolutions with ``c, c, 2c (stride 2), 2c, 2c`` channels, a 512-unit fully
connected layer and the classifier, ReLU after every layer but the last, BatchNorm after each conv and
linear layer in training (folded here into the weights). ``c = 64`` is ``cnn7``, ``c = 128``
``wide_cnn7``; CIFAR-10 inputs are 3x32x32 (10 classes), TinyImageNet 3x64x64 (200 classes).

Weights are He-normal with a fixed seed; every BatchNorm normalises its layer's output on a calibration
batch (random images, fixed seed), so about half of each layer's neurons are active there. How many are
unstable on an L∞ ball is set by its radius (``benchmarks/conv_scale.py`` picks two regimes).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch
from onnx import helper

from .resnet import Builder

CIFAR, TINY = (3, 32, 32), (3, 64, 64)


def build(
    path: Path, width: int = 64, shape: tuple[int, int, int] = CIFAR, classes: int = 10, seed: int = 0
) -> tuple[Path, int]:
    """Write a CNN7 with ``width`` (``c``) channels for inputs ``shape`` as ONNX (input ``x`` (batch,
    *shape), output ``y`` (batch, classes)): its path and number of parameters."""
    calib = torch.rand(64, *shape, generator=torch.Generator().manual_seed(seed + 1))
    m = Builder(seed)
    cur, v = "x", calib
    for i, (c_out, stride) in enumerate([(1, 1), (1, 1), (2, 2), (2, 1), (2, 1)]):
        cur, v = m.relu(*m.conv(f"conv{i + 1}", cur, v, c_out * width, 3, stride))
    m.nodes.append(helper.make_node("Flatten", [cur], ["flat"], name="flatten"))
    cur, v = m.relu(*m.linear("fc1", "flat", v.flatten(1), 512))
    m.linear("y", cur, v, classes)
    graph = helper.make_graph(
        m.nodes,
        f"cnn7_c{width}_{shape[1]}",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", *shape])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", classes])],
        m.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="cnn7.py")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path, m.n_params
