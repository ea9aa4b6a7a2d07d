"""``abcrown_plugin/search/mip.py``: α,β-CROWN's MIP with the solves dealt over the ranks."""

from __future__ import annotations

import re

import pytest
from plugin_support import config, needs_abcrown, run

from complete_verifier_ext.parallel import launch

MIP_YAML = """general:
  device: cpu
  complete_verifier: {verifier}
solver:
  batch_size: 8
bab:
  timeout: 60
  max_iterations: 2
attack:
  pgd_order: skip
"""


def _instance(tmp_path, sizes: list[int] | None = None) -> list[str]:
    """A 30-48-48-3 MLP (30 inputs: ``auto`` picks ``bab-refine`` for it, not input BaB) and a box of
    radius 0.05 around a random point, its label's robustness (two clauses open after α-CROWN)."""
    import numpy as np
    import torch

    from complete_verifier_ext.testing import mlp, mlp_onnx, write_vnnlib

    sizes = sizes or [30, 48, 48, 3]
    onnx = mlp_onnx(tmp_path / "m.onnx", sizes, seed=5)
    x0 = np.random.default_rng(0).uniform(-0.5, 0.5, 30).astype(np.float32)
    label = int(mlp(sizes, seed=5)(torch.tensor(x0)[None]).argmax())
    spec = write_vnnlib(tmp_path / "p.vnnlib", x0 - 0.05, x0 + 0.05, label, 3)
    return ["--onnx_path", onnx, "--vnnlib_path", spec]


@needs_abcrown
def test_mip_or_labels_dealt_over_ranks(tmp_path):
    """``complete_verifier: mip`` under ``tp`` (each weight gathered only while the Gurobi model is
    built): the two labels α-CROWN leaves open are solved one per rank, the results gathered on every
    rank, and the verdict is P = 1's: sat (MIP finds label 1 violated; the counterexample checks on
    onnxruntime)."""
    cfg = config(tmp_path, MIP_YAML.format(verifier="mip"))
    proc, s, results = run(tmp_path, cfg, *_instance(tmp_path), P=2, mode="tp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.startswith("sat\n((X_0 ")
    assert len(re.findall(r"^solving MIP for ", proc.stdout, re.M)) == 1  # rank 0's share of the two
    assert "Verified unsafe-mip with OR-style specification!" in proc.stdout


@needs_abcrown
def test_auto_choosing_bab_refine_refines_with_neurons_dealt(tmp_path):
    """``complete_verifier: auto`` picks ``bab-refine`` for an MLP with 30 inputs (α,β-CROWN decides per
    instance, after the ranks started): the second layer's 27 unstable neurons are solved about half on
    each rank, the bounds gathered before α-CROWN runs on them; the refined bounds are P = 1's
    (-0.038495, -0.479036) up to Gurobi's MIP gap (1e-2, so a solve may stop at a different point)."""
    cfg = config(tmp_path, MIP_YAML.format(verifier="auto"))
    proc, s, results = run(tmp_path, cfg, *_instance(tmp_path), P=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "timeout"  # bab.max_iterations stops the BaB after the refinement
    assert "MIP improved 27 nodes out of 27 unstable nodes" in proc.stdout
    assert len(re.findall(r"^Solving MIP for lay", proc.stdout, re.M)) in (13, 14)  # rank 0's share
    lb = re.search(r"refined global lb: tensor\(\[\[\s*([-\d.e]+)\],\s*\[\s*([-\d.e]+)\]", proc.stdout)
    assert lb and [float(v) for v in lb.groups()] == pytest.approx([-0.038495, -0.479036], abs=1e-3)


def _patient(tmp: str) -> list:
    import time

    from complete_verifier_ext.parallel import comm

    if comm.rank() == 1:
        time.sleep(3.0)  # longer than the group's collective timeout (1 s)
    comm.wait_patiently()
    return comm.all_gather_object(comm.rank())


def test_wait_patiently_outlasts_the_collective_timeout(tmp_path):
    """A rank's share of MIP solves may take far longer than the collective timeout: the ranks wait
    for each other on the group's store, then exchange the results."""
    assert launch.run(_patient, 2, (str(tmp_path),), backend="gloo", timeout_s=1.0) == [0, 1]


def _dealt(tmp: str) -> list:
    from complete_verifier_ext.abcrown_plugin.search.mip import DealtPool

    with DealtPool(4) as pool:
        return pool.starmap(pow, [(i, 2) for i in range(7)])


def test_dealt_pool_gives_every_result_in_order(tmp_path):
    """Problems dealt round-robin, each rank's pool of half the processes, results back in order."""
    assert launch.run(_dealt, 2, (str(tmp_path),), backend="gloo") == [i * i for i in range(7)]


@needs_abcrown
def test_a_gurobi_licence_refusal_is_one_line(tmp_path):
    """pip's size-limited Gurobi licence refuses a MIP of over 2000 variables (a 30-800-800-3 MLP). At
    P = 2 that is one line and ``error``; unpatched α,β-CROWN (P = 1) prints it and then fails
    re-raising it across its solver pool."""
    yaml = MIP_YAML.format(verifier="mip").replace(
        "  batch_size: 8", "  batch_size: 8\n  alpha-crown:\n    iteration: 2"
    )
    proc, s, results = run(tmp_path, config(tmp_path, yaml), *_instance(tmp_path, [30, 800, 800, 3]), P=2)
    assert proc.returncode == 1 and results == "error\n", proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1].startswith("error: Gurobi: Model too large for size-limited license")
