"""``abcrown_plugin/mip_split.py``: α,β-CROWN's MIP with the solves dealt over the ranks."""

from __future__ import annotations

import re

import pytest
from plugin_support import BAB_YAML, VENDOR, config, instance, needs_abcrown, run

from complete_verifier_ext.parallel import launch


def _abcrown_yaml(rel: str) -> str:
    """One of α,β-CROWN's own configs as a user runs it here: no ``root_path``/``csv_name``, the CPU."""
    import yaml

    data = yaml.safe_load((VENDOR / "complete_verifier/exp_configs" / rel).read_text())
    general = {k: v for k, v in data.get("general", {}).items() if k not in ("root_path", "csv_name")}
    data["general"] = {**general, "device": "cpu"}
    return yaml.safe_dump(data)


@needs_abcrown
def test_mip_or_labels_dealt_over_ranks(tmp_path):
    """``vnncomp22/mnistfc_small.yaml`` (``complete_verifier: mip``) on 256x2 prop_9_0.05 under ``tp``
    (each weight gathered only while the Gurobi model is built): the two labels α-CROWN leaves open are
    solved one per rank, and every rank gets both bounds: the MIP lower bounds of P = 1 (0.14279,
    0.09765), unsat."""
    cfg = config(tmp_path, _abcrown_yaml("vnncomp22/mnistfc_small.yaml"))
    args = instance("mnist-net_256x2", "prop_9_0.05.vnnlib")
    proc, s, results = run(tmp_path, cfg, *args, "--timeout", "120", P=2, mode="tp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "unsat"
    assert len(re.findall(r"^solving MIP for ", proc.stdout, re.M)) == 1  # rank 0's share of the two
    lbs = re.search(r"MIP solved lower bound: tensor\(\[\[([-\d.e]+)\],\s*\[([-\d.e]+)\]", proc.stdout)
    assert lbs and [float(v) for v in lbs.groups()] == pytest.approx([0.14279, 0.09765], abs=1e-4)


@needs_abcrown
def test_auto_choosing_bab_refine_refines_with_neurons_dealt(tmp_path):
    """``complete_verifier: auto`` picks ``bab-refine`` for an MLP with 784 inputs (α,β-CROWN decides
    per instance, after the ranks started): each layer's unstable neurons are solved half on each
    rank, the bounds gathered before the next layer; the refined lower bound is P = 1's (0.28262) and
    proves the property."""
    cfg = config(tmp_path, BAB_YAML.replace("complete_verifier: bab", "complete_verifier: auto"))
    args = instance("mnist-net_256x2", "prop_9_0.05.vnnlib")
    proc, s, results = run(tmp_path, cfg, *args, P=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "unsat"
    assert re.search(r"MIP improved \d+ nodes out of 46 unstable nodes", proc.stdout)
    assert 15 <= len(re.findall(r"^Solving MIP for lay", proc.stdout, re.M)) <= 31  # rank 0: about half
    lb = re.search(r"refined global lb: tensor\(\[\[([-\d.e]+)\]", proc.stdout)
    assert lb and float(lb.group(1)) == pytest.approx(0.28262, abs=1e-4)


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
    from complete_verifier_ext.abcrown_plugin.mip_split import DealtPool

    with DealtPool(4) as pool:
        return pool.starmap(pow, [(i, 2) for i in range(7)])


def test_dealt_pool_gives_every_result_in_order(tmp_path):
    """Problems dealt round-robin, each rank's pool of half the processes, results back in order."""
    assert launch.run(_dealt, 2, (str(tmp_path),), backend="gloo") == [i * i for i in range(7)]
