"""Leaves and bounds nodes of a proof as one :class:`~.bounds.Batch` (their regions, phases, evidence and
the verified claims above them), for the checker's bound passes."""

from __future__ import annotations

import numpy as np

from . import bounds, tree
from .onnx_net import Net


def claim_inputs(net: Net) -> dict:
    """The node a claim of each layer bounds, by the layer's key: a ReLU layer's id, a Sigmoid's ``sID``."""
    out = {r.id: net.nodes[r.node].src for r in net.relu_layers if r.node >= 0}
    return out | {f"s{r.id}": net.nodes[r.node].src for r in net.sigmoid_layers if r.node >= 0}


def of(net: Net, items: list, k: int, verified: dict | None) -> bounds.Batch:
    """Leaves (or a bounds node) as arrays over ReLU nodes: regions, evidence, the verified claims of the
    bounds nodes above them (at ReLUs' and Sigmoids' inputs; ``None``: none used); the row weightings
    tried: each of the ``k`` rows, the sum, and the leaf's ``lambda`` (else the sum)."""
    B = len(items)
    layers, inputs = {r.id: r for r in net.relu_layers if r.node >= 0}, claim_inputs(net)
    batch = bounds.Batch(np.stack([x.lower for x in items]), np.stack([x.upper for x in items]), {}, {}, {},
                         np.concatenate([np.eye(k), np.ones((2, k))])[None].repeat(B, axis=0))  # fmt: skip

    def put(store: dict, node: int, n: int, fill: float, dtype=np.float64) -> np.ndarray:
        return store.setdefault(node, np.full((B, n), fill, dtype=dtype))

    lows: dict = {}
    highs: dict = {}
    for i, x in enumerate(items):
        for layer, j, sign in (p for p in x.phases if p[0] in layers):
            put(batch.phase, layers[layer].node, layers[layer].size, 0, np.int8)[i, j] = sign
        for key in x.claims if verified is not None else ():
            for layer, (lo, hi) in ((c, v) for c, v in verified[key].items() if c in inputs):
                z = inputs[layer]
                low, high = put(lows, z, len(lo), -np.inf), put(highs, z, len(lo), np.inf)
                low[i], high[i] = np.maximum(low[i], lo), np.minimum(high[i], hi)
        ev = x.evidence if isinstance(x, tree.Leaf) else tree.Evidence()
        for layer, a in ((c, v) for c, v in ev.alpha.items() if c in layers):
            put(batch.alpha, layers[layer].node, layers[layer].size, np.nan)[i] = a
        for layer, by_neuron in ((c, v) for c, v in ev.beta.items() if c in layers):
            for j, value in by_neuron.items():
                put(batch.beta, layers[layer].node, layers[layer].size, 0.0)[i, j] = value
        if ev.lam is not None:
            batch.lam[i, -1] = ev.lam
    batch.claims = {z: (low, highs[z]) for z, low in lows.items()}
    return batch
