"""The VNN-LIB family: reading property files (1.x: :mod:`.v1`; 2.0, VNN-COMP 2026: :mod:`.v2`, through
the reference parser) into one data model (:mod:`.model`), cached (:mod:`.load`); the parts both readers
share (:mod:`.common`); float32 boxes (:mod:`.boxes`); the 2026 network-list argument
(:mod:`.networks`). Counterexamples are read, written and re-checked one floor up
(``complete_verifier_ext/witness.py``: it runs the networks).

The names below are the package's public face; everything else is imported from its module.
"""

from __future__ import annotations

from .boxes import as_float64, float32_box
from .common import Layout, NetworkSlots, Slot, SpecError
from .load import cache_root, load_vnnlib, read_text
from .model import ROUNDING, Clause, Clauses, Region, Spec

__all__ = [
    "ROUNDING",
    "Clause",
    "Clauses",
    "Layout",
    "NetworkSlots",
    "Region",
    "Slot",
    "Spec",
    "SpecError",
    "as_float64",
    "cache_root",
    "float32_box",
    "load_vnnlib",
    "read_text",
]
