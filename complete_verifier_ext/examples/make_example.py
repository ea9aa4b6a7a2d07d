"""Regenerate the bundled example: ``python -m complete_verifier_ext.examples.make_example``.

A 16-48-48-5 ReLU network (``testing.mlp_onnx``, seed 5) and an L∞ robustness property of radius
0.109 around a fixed point, chosen so that CROWN cannot prove it but α-CROWN (20 iterations) can.
"""

from __future__ import annotations

from pathlib import Path

import torch

from complete_verifier_ext import testing
from complete_verifier_ext.model.onnx_loader import load_onnx

SEED, EPS, SIZES = 5, 0.109, [16, 48, 48, 5]
HERE = Path(__file__).resolve().parent


def main() -> None:
    onnx_path = testing.mlp_onnx(HERE / "example.onnx", SIZES, SEED)
    x0 = torch.rand(1, SIZES[0], generator=torch.Generator().manual_seed(SEED))
    label = int(load_onnx(onnx_path)(x0).argmax())
    lo, hi = (x0 - EPS).clamp(0, 1)[0].numpy(), (x0 + EPS).clamp(0, 1)[0].numpy()
    testing.write_vnnlib(HERE / "example.vnnlib", lo, hi, label, SIZES[-1])
    print(f"wrote {onnx_path} and example.vnnlib (label {label}, eps {EPS})")


if __name__ == "__main__":
    main()
