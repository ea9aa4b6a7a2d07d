"""Bounds against reference runs of auto_LiRPA and α,β-CROWN (``shared/reference``, see its README.md).

(a) IBP and CROWN (``intersect=False``, auto_LiRPA's CROWN) on every line of ``auto_lirpa_bounds.jsonl``:
    fully connected, conv and residual (BatchNorm) networks;
(b) CROWN clause bounds on every distinct mnist_fc instance of ``abcrown_cpu_mnist_fc.csv`` against its
    ``initial_crown_lb``;
(c) α-CROWN (100 iterations, lr 0.1, decay 0.98) at least as tight as ``initial_alpha_crown_lb`` (up to
    5e-3 relative per clause, 1e-3 on the mean) on the 256x2 / 256x4 instances of that file.

Every test skips when the shared folder is absent.
"""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown, ibp
from complete_verifier_ext.bounds.graph import Graph
from complete_verifier_ext.model.onnx_loader import load_model
from complete_verifier_ext.spec import Clauses, Region, load_vnnlib
from complete_verifier_ext.verify import input_box

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REFERENCE = SHARED / "reference"
RTOL, ATOL = 1e-4, 1e-5
ALPHA_100 = AlphaOptions(iteration=100, lr_alpha=0.1, lr_decay=0.98, early_stop=False)


def _jsonl_lines() -> list[dict]:
    path = REFERENCE / "auto_lirpa_bounds.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _abcrown_instances() -> list[dict]:
    """Distinct (onnx, vnnlib) rows of the α,β-CROWN csv that carry ``initial_crown_lb``, first row kept."""
    path = REFERENCE / "abcrown_cpu_mnist_fc.csv"
    if not path.is_file():
        return []
    seen: dict[tuple[str, str], dict] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["initial_crown_lb"].strip():
                seen.setdefault((row["onnx"], row["vnnlib"]), row)
    return list(seen.values())


def _floats(text: str) -> np.ndarray:
    return np.array([float(t) for t in text.split()])


def _params(items: list[dict], id_of) -> list:
    return [pytest.param(item, id=id_of(item)) for item in items] or [pytest.param(None, id="no-reference")]


JSONL = _jsonl_lines()
ABCROWN = _abcrown_instances()
ABCROWN_ALPHA = [
    r
    for r in ABCROWN
    if r["initial_alpha_crown_lb"].strip() and ("256x2" in r["onnx"] or "256x4" in r["onnx"])
][:6]


def _instance_id(onnx_name: str, vnnlib_name: str) -> str:
    return f"{Path(onnx_name).stem}:{Path(vnnlib_name).stem}"


def _line_id(line: dict) -> str:
    return f"{line['benchmark']}:{_instance_id(line['onnx'], line['vnnlib'])}"


@functools.cache
def _graph(path: str) -> Graph:
    return load_model(path)


def _region(path: Path) -> Region:
    spec = load_vnnlib(path, cache=False)
    assert len(spec.regions) == 1
    return spec.regions[0]


def _require(shared_dir: Path, item) -> None:
    if item is None:
        pytest.skip(f"no reference data under {shared_dir / 'reference'}")


def _nearest_box(region: Region, graph: Graph) -> tuple[torch.Tensor, torch.Tensor]:
    """The VNN-LIB box rounded to the nearest float32, as auto_LiRPA received it.

    ``verify.input_box`` rounds outward (sound for the float64 box); on sri_resnet_a that alone moves CROWN
    by about 3e-5, more than the tolerance allows on bounds near 0, so the comparison uses auto_LiRPA's box.
    """
    shape = (1, *graph.input_shape)
    return (
        torch.tensor(region.lower, dtype=torch.float32).view(shape),
        torch.tensor(region.upper, dtype=torch.float32).view(shape),
    )


# ---------------------------------------------------------------------------------------------------------
# (a) auto_LiRPA IBP and CROWN
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line", _params(JSONL, _line_id))
def test_auto_lirpa_ibp_and_crown(shared_dir: Path, line: dict | None) -> None:
    _require(shared_dir, line)
    bench = shared_dir / "benchmarks" / line["benchmark"]
    graph = _graph(str(bench / "onnx" / line["onnx"]))
    region = _region(bench / "vnnlib" / line["vnnlib"])
    C = torch.zeros(len(line["pairs"]), graph.output_size)
    for k, (label, j) in enumerate(line["pairs"]):  # clause k: Y_j >= Y_label; bound Y_label - Y_j
        C[k, label] += 1.0
        C[k, j] -= 1.0
    spec = Clauses.of(region.clauses)
    assert torch.equal(spec.C, C) and not spec.d.any(), "the pairs should be the spec's clauses in file order"
    box = _nearest_box(region, graph)
    lb_ibp, _ = ibp(graph, box, C)
    np.testing.assert_allclose(lb_ibp[0].numpy(), line["ibp"], rtol=RTOL, atol=ATOL, err_msg="IBP")
    lb_crown, _ = crown(graph, box, C, intersect=False)
    np.testing.assert_allclose(lb_crown[0].numpy(), line["crown"], rtol=RTOL, atol=ATOL, err_msg="CROWN")


# ---------------------------------------------------------------------------------------------------------
# (b), (c) α,β-CROWN's initial CROWN and α-CROWN bounds on mnist_fc
# ---------------------------------------------------------------------------------------------------------


def _clause_bounds(shared_dir: Path, row: dict, alpha: bool) -> tuple[np.ndarray, np.ndarray]:
    """(CROWN clause bounds, α-CROWN clause bounds or an empty array), computed as ``verify.bound_region``
    does (outward-rounded float32 box), but with auto_LiRPA's CROWN (``intersect=False``)."""
    bench = shared_dir / "benchmarks" / "mnist_fc"
    graph = _graph(str(bench / row["onnx"]))
    region = _region(bench / row["vnnlib"])
    clauses = Clauses.of(region.clauses)
    box = input_box(region, graph)
    lb, state = crown(graph, box, clauses.C, intersect=False)
    cb = clauses.bound(lb)
    if not alpha:
        return cb, np.array([])
    lb_a, _ = alpha_crown(graph, box, clauses.C, state, ALPHA_100)
    return cb, clauses.bound(lb_a)


@pytest.mark.parametrize("row", _params(ABCROWN, lambda r: _instance_id(r["onnx"], r["vnnlib"])))
def test_abcrown_initial_crown(shared_dir: Path, row: dict | None) -> None:
    _require(shared_dir, row)
    cb, _ = _clause_bounds(shared_dir, row, alpha=False)
    np.testing.assert_allclose(cb, _floats(row["initial_crown_lb"]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("row", _params(ABCROWN_ALPHA, lambda r: _instance_id(r["onnx"], r["vnnlib"])))
def test_abcrown_initial_alpha_crown(shared_dir: Path, row: dict | None) -> None:
    _require(shared_dir, row)
    cb, ab = _clause_bounds(shared_dir, row, alpha=True)
    ref = _floats(row["initial_alpha_crown_lb"])
    assert ab.shape == ref.shape
    assert (ab >= cb - 1e-6).all(), "α-CROWN ended below its CROWN start"
    gap = (ab - ref) / np.maximum(1.0, np.abs(ref))  # < 0: looser than α,β-CROWN
    worst = int(gap.argmin())
    assert gap[worst] >= -5e-3, f"clause {worst}: {ab[worst]:.6f} vs reference {ref[worst]:.6f}"
    assert ab.mean() >= ref.mean() - 1e-3, f"mean {ab.mean():.6f} vs reference {ref.mean():.6f}"
