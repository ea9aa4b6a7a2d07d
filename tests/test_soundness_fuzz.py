"""Soundness under extreme numbers: no bound method, and no search, ever says ``unsat`` where a
counterexample exists, however large, small or degenerate the weights and the input box.

The networks are tiny random ReLU MLPs written as ONNX with their weights scaled by 1e-39 (denormal)
up to 1e30, zero or random biases, on boxes from zero width up to [-3e38, 3e38] (the widest a VNN-LIB
file can give in float32), with duplicated rows and duplicated clauses.  Ground truth is a dense sample
of the box (its corners, its centre and random points), run through the network in float32 as the
verifier's own counterexample check does: a point where some clause holds is a counterexample, so no
method may prove that clause's property.  Where float32 overflows, the bounds are NaN or infinite, and
the verifier must then prove nothing (``bounds.walk.proven_only``) instead of letting a NaN pass every
``<= 0`` test as the code before it did.

Three regression nets come from a hostile test of the CLI: a net with weights scaled by 1e30, a net
with zero biases on [-3e38, 3e38]^4 (both: x = 0 is a counterexample, and they ended ``unsat``), and a
net with one NaN weight (ended ``unsat``; now an ``error`` naming the initializer), at P = 1 and 2.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from complete_verifier_ext import testing
from complete_verifier_ext.bounds.walk import finite_batch
from complete_verifier_ext.cli import main
from complete_verifier_ext.config_load import load_config
from complete_verifier_ext.model.onnx_loader import ModelError, load_onnx
from complete_verifier_ext.spec import load_vnnlib
from complete_verifier_ext.verify import verify_instance

METHODS = {  # each with the attack off, so that only the bounds (and the checked BaB points) decide
    "ibp": ["--solver.bound_prop_method", "ibp", "--general.complete_verifier", "skip"],
    "crown": ["--solver.bound_prop_method", "crown", "--general.complete_verifier", "skip"],
    "alpha-crown": ["--solver.bound_prop_method", "alpha-crown", "--general.complete_verifier", "skip"],
    "bab": ["--general.complete_verifier", "bab"],
    "input-split": ["--general.complete_verifier", "bab", "--bab.branching.input_split.enable", "true"],
}
COMMON = [
    "--attack.pgd_order", "skip",
    "--solver.alpha-crown.iteration", "5",
    "--solver.beta-crown.iteration", "5",
    "--solver.batch_size", "16",
    "--bab.max_domains", "300",
]  # fmt: skip
SCALES = [1e-39, 1.0, 1e10, 1e20, 1e30]
BOXES = {  # name -> (lower, upper) of every input
    "unit": (-1.0, 1.0),
    "denormal": (-1e-40, 3e-40),
    "zero-width": (0.25, 0.25),
    "wide": (-1e30, 1e30),
    "float32-max": (-3e38, 3e38),
}


def scaled_mlp(path: Path, sizes, seed: int, scale: float, zero_bias: bool, nan_weight: bool = False) -> str:
    """``testing.mlp_onnx(sizes, seed)`` with every weight times ``scale`` (and the biases zero)."""
    testing.mlp_onnx(path, sizes, seed)
    model = onnx.load(path)
    for init in model.graph.initializer:
        a = numpy_helper.to_array(init).astype(np.float64)
        if init.name.startswith("W"):
            a = a * scale
            if nan_weight and init.name == "W1":
                a.flat[3] = np.nan
        elif zero_bias:
            a = a * 0
        init.CopyFrom(numpy_helper.from_array(a.astype(np.float32), init.name))
    onnx.save(model, path)
    return str(path)


def write_spec(path: Path, lower, upper, clauses: list[list[str]], n_out: int) -> str:
    """A VNN-LIB file: the box, then ``(or (and rows...) ...)`` with rows such as ``(>= Y_1 Y_0)``."""
    lines = [f"(declare-const X_{i} Real)" for i in range(len(lower))]
    lines += [f"(declare-const Y_{j} Real)" for j in range(n_out)]
    for i, (a, b) in enumerate(zip(lower, upper, strict=True)):
        lines += [f"(assert (>= X_{i} {float(a)!r}))", f"(assert (<= X_{i} {float(b)!r}))"]
    lines.append("(assert (or " + " ".join("(and " + " ".join(c) + ")" for c in clauses) + "))")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def sampled_counterexample(onnx_path: str, vnnlib_path: str, n: int = 4096, seed: int = 0) -> bool:
    """True when a corner, the centre or one of ``n`` random points of the box is a counterexample (the
    network in float32; margins in float64; a NaN margin is none)."""
    graph = load_onnx(onnx_path)
    region = load_vnnlib(vnnlib_path).regions[0]
    lo = np.asarray(region.lower, dtype=np.float64)
    hi = np.asarray(region.upper, dtype=np.float64)
    corners = np.array(list(itertools.product(*zip(lo, hi, strict=True))))
    rand = lo + (hi - lo) * np.random.default_rng(seed).random((n, lo.size))
    pts = np.clip(np.concatenate([corners, (lo / 2 + hi / 2)[None], rand]), lo, hi).astype(np.float32)
    pts = pts[(pts.astype(np.float64) >= lo).all(1) & (pts.astype(np.float64) <= hi).all(1)]
    with torch.no_grad(), np.errstate(all="ignore"):
        y = graph(torch.from_numpy(pts)).double().numpy()
        holds = np.zeros(len(pts), dtype=bool)
        for c in region.clauses:
            m = y @ np.asarray(c.C, dtype=np.float64).T - np.asarray(c.d, dtype=np.float64)
            holds |= np.where(np.isnan(m), np.inf, m).max(1) <= 0
    return bool(holds.any())


def run(onnx_path: str, vnnlib_path: str, extra: list[str]) -> str:
    cfg, _ = load_config(None, ["--general.device", "cpu", *COMMON, *extra])
    return verify_instance(cfg, onnx_path, vnnlib_path, timeout=20.0).verdict


def fuzz_cases():
    """(id, sizes, seed, scale, zero_bias, box, kind): a deterministic spread over the extremes."""
    rng = np.random.default_rng(2026)
    cases = []
    for i, (scale, box) in enumerate(itertools.product(SCALES, BOXES)):
        sizes = [int(rng.integers(2, 4)), int(rng.integers(2, 4)), int(rng.integers(2, 4)), 3]
        kind = ("robustness", "below", "above")[i % 3]
        cases.append((f"{scale:g}-{box}-{kind}", sizes, i, scale, i % 2 == 0, BOXES[box], kind))
    return cases


def clauses_for(kind: str, onnx_path: str, lower, upper) -> list[list[str]]:
    """``robustness``: Y_1 >= Y_0 (a row twice) or Y_2 >= Y_0, the first clause twice; ``below`` /
    ``above``: Y_0 <= t with t a tenth of the sampled spread of Y_0 below / above its sampled minimum
    (``below`` is often provable, ``above`` never)."""
    if kind == "robustness":
        first = ["(>= Y_1 Y_0)", "(>= Y_1 Y_0)"]
        return [first, ["(>= Y_2 Y_0)"], first]
    lo, hi = np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)
    pts = (lo + (hi - lo) * np.random.default_rng(1).random((1024, lo.size))).astype(np.float32)
    with torch.no_grad(), np.errstate(all="ignore"):
        y0 = load_onnx(onnx_path)(torch.from_numpy(pts))[:, 0].double().numpy()
    y0 = y0[np.isfinite(y0)]
    m, spread = (float(y0.min()), float(y0.max() - y0.min())) if len(y0) else (0.0, 0.0)
    t = m - 0.1 * spread if kind == "below" else m + 0.1 * spread
    return [[f"(<= Y_0 {t!r})"], [f"(<= Y_0 {t!r})"]]


@pytest.mark.parametrize("case", fuzz_cases(), ids=lambda c: c[0])
def test_no_method_proves_a_sampled_counterexample(tmp_path, case):
    _, sizes, seed, scale, zero_bias, (a, b), kind = case
    onnx_path = scaled_mlp(tmp_path / "net.onnx", sizes, seed, scale, zero_bias)
    clauses = clauses_for(kind, onnx_path, [a] * sizes[0], [b] * sizes[0])
    spec = write_spec(tmp_path / "p.vnnlib", [a] * sizes[0], [b] * sizes[0], clauses, sizes[-1])
    violated = sampled_counterexample(onnx_path, spec)
    for name, extra in METHODS.items():
        verdict = run(onnx_path, spec, extra)
        assert verdict in ("sat", "unsat", "unknown", "timeout"), (name, verdict)
        assert not (violated and verdict == "unsat"), f"{name} proved a property with a counterexample"


def test_some_extreme_cases_are_still_proven(tmp_path):
    """The guard is not "never prove anything": a tiny-weight net on a tiny box is still verified."""
    onnx_path = scaled_mlp(tmp_path / "net.onnx", [3, 3, 3, 3], 0, 1e-30, zero_bias=False)
    graph = load_onnx(onnx_path)
    with torch.no_grad():
        y = graph(torch.zeros(1, 3))[0].double().numpy()
    spec = write_spec(
        tmp_path / "p.vnnlib", [-1e-3] * 3, [1e-3] * 3, [[f"(<= Y_0 {float(y[0]) - 0.05!r})"]], 3
    )
    assert not sampled_counterexample(onnx_path, spec)
    assert run(onnx_path, spec, METHODS["crown"]) == "unsat"


def test_finite_bounds_whose_width_overflows_prove_nothing(tmp_path):
    """h = (2e38 x, x) on x in [-1, 1], y = -relu(h_0): h_0's bounds ±2e38 are finite but u − l
    overflows, which made the ReLU's upper slope u / (u − l) zero (the line y = 0 under relu) and every
    bound method proved y > -1, though x = 1 gives y = -2e38."""
    from onnx import TensorProto, helper

    inits = {"W1": [[2e38], [1.0]], "b1": [0.0, 0.0], "W2": [[-1.0, 0.0]], "b2": [0.0]}
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "overflowing_width",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [numpy_helper.from_array(np.array(v, dtype=np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx_path = str(tmp_path / "net.onnx")
    onnx.save(model, onnx_path)
    spec = write_spec(tmp_path / "p.vnnlib", [-1.0], [1.0], [["(<= Y_0 -1.0)"]], 1)
    assert sampled_counterexample(onnx_path, spec)
    for name, extra in METHODS.items():
        assert run(onnx_path, spec, extra) != "unsat", name
    lo, hi = torch.tensor([[-2e38, 0.0]]), torch.tensor([[2e38, 1.0]])
    assert not finite_batch((lo, hi)).item()
    assert finite_batch((lo / 2, hi / 2)).item()
    assert not finite_batch((lo / 2, torch.tensor([[torch.nan, 1.0]]))).item()


# ----------------------------------------------------------------------------------------------------------
# The three regression nets, through the CLI, at P = 1 and P = 2
# ----------------------------------------------------------------------------------------------------------


def regression_instances(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(onnx, vnnlib, expected verdict) for the three nets of the report."""
    unit = testing.write_vnnlib(tmp_path / "unit.vnnlib", [-1] * 4, [1] * 4, 0, 3)
    huge = testing.write_vnnlib(tmp_path / "huge.vnnlib", [-3e38] * 4, [3e38] * 4, 0, 3)
    scaled = scaled_mlp(tmp_path / "scaled.onnx", [4, 8, 8, 3], 0, 1e30, zero_bias=True)
    zero_bias = scaled_mlp(tmp_path / "zerob.onnx", [4, 8, 8, 3], 0, 1.0, zero_bias=True)
    nan = scaled_mlp(tmp_path / "nanw.onnx", [4, 8, 8, 3], 0, 1.0, zero_bias=False, nan_weight=True)
    return [(scaled, unit, "sat"), (zero_bias, huge, "sat"), (nan, unit, "error")]


def test_the_nan_weight_is_refused_naming_the_initializer(tmp_path):
    nan = scaled_mlp(tmp_path / "nanw.onnx", [4, 8, 8, 3], 0, 1.0, zero_bias=False, nan_weight=True)
    with pytest.raises(ModelError, match=r"initializer 'W1' holds 1 NaN or infinite value"):
        load_onnx(nan)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_three_regression_nets(tmp_path, world_size):
    cases = regression_instances(tmp_path)
    (tmp_path / "list.csv").write_text("".join(f"{o},{v},20\n" for o, v, _ in cases))
    results, summary = tmp_path / "results.csv", tmp_path / "summary.json"
    code = main(
        [
            "--general.root_path", str(tmp_path), "--general.csv_name", "list.csv",
            "--general.results_file", str(results), "--summary", str(summary), "--quiet",
            "--parallel.mode", "fsdp", "--parallel.world_size", str(world_size),
        ]
    )  # fmt: skip
    assert code == 0
    verdicts = [line.split(",")[2] for line in results.read_text().splitlines()]
    assert verdicts == [expected for _, _, expected in cases]
    data = json.loads(summary.read_text())  # strict JSON: no bare NaN or Infinity
    assert "W1" in data["instances"][2]["message"]
    for inst in data["instances"]:
        for vals in inst["bounds"].values():
            assert all(isinstance(v, float) or v in ("-inf", "inf", "nan") for v in vals)


def test_the_summary_is_strict_json_with_non_finite_bounds(tmp_path):
    """With the attack off, the scaled net's bounds are all -inf: written as "-inf", never bare."""
    onnx_path = scaled_mlp(tmp_path / "scaled.onnx", [4, 8, 8, 3], 0, 1e30, zero_bias=True)
    spec = testing.write_vnnlib(tmp_path / "unit.vnnlib", [-1] * 4, [1] * 4, 0, 3)
    summary = tmp_path / "s.json"
    args = ["--model.onnx_path", onnx_path, "--specification.vnnlib_path", spec, "--summary", str(summary)]
    code = main(
        [*args, "--general.results_file", str(tmp_path / "r.txt"), "--quiet", *COMMON, *METHODS["crown"]]
    )
    assert code == 0
    text = summary.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["verdict"] == "unknown" and data["bounds"]["crown"] == ["-inf", "-inf"]
