"""A network as a topologically ordered list of bound operators."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..parallel.sharded import ShardedWeight
from .ops import Op


@dataclass
class Node:
    name: str
    op: Op
    inputs: tuple[int, ...]  # indices of earlier nodes
    shape: tuple[int, ...]  # per-sample output shape (no batch dimension)


@dataclass
class Graph:
    """Node 0 is the network input; ``nodes[-1]`` is the output.  Shapes exclude the batch axis."""

    nodes: list[Node] = field(default_factory=list)
    source: str = "<model>"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.nodes[0].shape

    @property
    def output_size(self) -> int:
        return int(torch.Size(self.nodes[-1].shape).numel())

    def add(self, name: str, op: Op, inputs: tuple[int, ...], shape) -> int:
        self.nodes.append(Node(name, op, tuple(inputs), tuple(int(s) for s in shape)))
        return len(self.nodes) - 1

    def forward(self, x: Tensor, upto: int | None = None) -> Tensor:
        """x: (B, *input_shape) -> (B, *output_shape) (or node ``upto``'s value)."""
        last = len(self.nodes) - 1 if upto is None else upto
        values: list[Tensor | None] = [x.reshape(x.shape[0], *self.input_shape)]
        for node in self.nodes[1 : last + 1]:
            values.append(node.op.forward(*(values[i] for i in node.inputs)))
        return values[last]

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(x).reshape(x.shape[0], -1)

    def relu_nodes(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.op.is_relu]

    def to(self, device: torch.device | str) -> Graph:
        """Move every operator's tensors (weight shards, biases, constants) to ``device``, in place.
        Call after ``shard`` so that only this rank's shards reach the device."""
        for node in self.nodes:
            for name, value in vars(node.op).items():
                if isinstance(value, torch.Tensor):
                    setattr(node.op, name, value.to(device))
                elif isinstance(value, ShardedWeight):
                    value.to(device)
        return self

    @property
    def sharded(self) -> bool:
        """True when some weight is really split over the ranks."""
        return any(n.op.weight is not None and n.op.weight.sharded for n in self.nodes)

    @contextlib.contextmanager
    def replicated(self) -> Iterator[Graph]:
        """Inside the block every sharded weight is held whole (gathered once, bitwise the original,
        mode ``none``: no collective per use); the shards are back on exit.  Collective: every rank
        enters together.  Only forward and back-substitution may run inside (IBP of a ``none`` weight
        assumes one process)."""
        saved = []
        for node in self.nodes:
            if node.op.weight is not None and node.op.weight.sharded:
                saved.append((node.op, node.op.weight))
                node.op.weight = ShardedWeight(node.op.weight.gathered().clone(), "none")
        try:
            yield self
        finally:
            for op, weight in saved:
                op.weight = weight

    def shard(self, mode: str) -> Graph:
        """Re-wrap every Linear/Conv weight as this rank's shard (``mode``: none|fsdp|tp), in place."""
        for node in self.nodes:
            if node.op.weight is not None and node.op.weight.mode != mode:
                full = node.op.weight.local
                node.op.weight = ShardedWeight(full, mode)
        return self
