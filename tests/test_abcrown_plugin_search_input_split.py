"""``abcrown_plugin/search/input_split.py``: α,β-CROWN's input-split BaB with the box list split over the
ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from plugin_support import INPUT_SPLIT_YAML, VENDOR, config, needs_abcrown, run

from complete_verifier_ext.parallel import launch


@needs_abcrown
def test_input_bab_with_boxes_split_over_ranks(tmp_path):
    """Input-split BaB with α-CROWN bounds, clip-and-verify on the boxes and the attack on the worst
    boxes every round, on a 4-96-96-3 MLP at P = 2 (``fsdp``, the weights replicated for the search;
    sharded weights are served as in activation BaB): each rank holds its share of the box list, every
    box with its α (the intermediate layers' too) and its clip constraints. While α-CROWN ran, those α
    were kept by row (half on each rank: ``alpha_elements``); at BaB entry they are made whole on every
    rank (without that step the ranks index α rows they do not hold). The search is P = 1's: unsat
    after 1752 boxes; every rank issues the same collectives each round. (ACAS Xu with α,β-CROWN's own
    ``acasxu.yaml``: ``benchmarks/abcrown_own_configs.py``.)"""
    from complete_verifier_ext.testing import mlp_onnx, write_vnnlib

    onnx = mlp_onnx(tmp_path / "m.onnx", [4, 96, 96, 3], seed=3)
    x0 = [0.1, -0.2, 0.3, 0.05]
    spec = write_vnnlib(tmp_path / "p.vnnlib", [v - 0.1 for v in x0], [v + 0.1 for v in x0], 0, 3)
    cfg = config(tmp_path, INPUT_SPLIT_YAML)
    proc, s, results = run(tmp_path, cfg, "--onnx_path", onnx, "--vnnlib_path", spec, P=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "unsat" and s["bab"]["domains"] == 1752
    assert s["alpha_elements"] == [541568, 541568]  # P = 1: 1083136
    rounds = s["bab_collectives"]
    assert len(rounds) == 2 and rounds[0] == rounds[1] and len(rounds[0]) > 1, rounds
    assert set(rounds[0]) <= {2, 3}  # counts, agreement (+ one rebalance)


def _boxes(n: int, first: int, spec: int = 2):
    """``n`` boxes whose every tensor carries the box's id (``first + i``)."""
    import torch

    ids = torch.arange(first, first + n, dtype=torch.float32)
    col = ids.view(n, 1)
    return dict(
        lb=col.expand(n, spec) - 1000.0,  # all unverified
        dm_l=col.expand(n, 3).clone(),
        dm_u=col.expand(n, 3) + 1.0,
        alpha={"relu": {"out": ids.view(1, 1, n, 1).expand(2, spec, n, 5).clone()}},
        cs=col.view(n, 1, 1).expand(n, spec, 4).clone(),
        threshold=col.expand(n, spec).clone(),
        split_idx=ids.view(n, 1).long(),
    )


def _ids_consistent(picked) -> list[int]:
    """The ids of picked boxes, after checking that every tensor of a box carries the same id."""
    alpha, lb, dm_l, dm_u, cs, threshold, constraints, spec_sizes, split_idx = picked
    ids = dm_l[:, 0]
    assert (dm_u[:, 0] == ids + 1).all() and (lb[:, 0] == ids - 1000).all() and (split_idx[:, 0] == ids).all()
    assert (cs[:, 0, 0] == ids).all() and (threshold[:, 0] == ids).all()
    assert (alpha["relu"]["out"][0, 0, :, 0] == ids).all()
    if constraints is not None:
        assert (constraints[1][:, 0] == ids).all()
    return [int(v) for v in ids.tolist()]


def _lists_moved(me: int, out: dict, run) -> tuple:
    """A box list (7 boxes on rank 0, 2 on rank 1, with the clip-and-verify constraints) and a list per
    number of ANDs (boxes with 2 and with 1 clause(s), padded when picked together) evened out over the
    ranks, and a pick that ran out of memory undone (search/oom.py); the two lists."""
    import torch
    from input_split.branching_domains import UnsortedInputDomainList, UnsortedMultiSpecInputDomainList

    from complete_verifier_ext.abcrown_plugin.search import input_split, oom, rounds

    dl = UnsortedInputDomainList(1, "cpu", use_alpha=True)
    n = 7 if me == 0 else 2
    b = _boxes(n, 100 * me)
    constraints = (torch.zeros(n, 2, 3), b["threshold"].clone())
    dl.add(**b, constraints=constraints, check_dm_lbs=False, check_input_boxes=False)
    volume = dl.volume
    counts = rounds.even_out(rounds.ListQueue(dl, input_split.take, input_split.put), [7, 2])
    out["counts"], out["volume"] = counts, (volume, dl.volume)
    out["ids"] = _ids_consistent(dl.pick_out_batch(len(dl), device="cpu"))
    ml = UnsortedMultiSpecInputDomainList(torch.tensor([2, 1]), (3,), 4, 1, "cpu", use_alpha=True,
                                          alpha_final_name="out")  # fmt: skip
    if me == 0:
        ml.add(
            **_boxes(6, 0), spec_sizes=torch.tensor([2, 1] * 3), check_dm_lbs=False, check_input_boxes=False
        )
    rounds.even_out(rounds.ListQueue(ml, input_split.take, input_split.put), [6, 0])
    volumes = [sub.volume for sub in ml.spec_domain_lists]
    oom.pick_out_batch(run, type(ml).pick_out_batch)(ml, 2, device="cpu")
    undo = run.rounds.undo
    out["undo"] = (len(ml), undo.intact(ml))
    undo.restore(ml)
    out["undo"] += (len(ml), [sub.volume for sub in ml.spec_domain_lists] == volumes)
    picked = ml.pick_out_batch(len(ml), device="cpu")
    out["multi"] = (_ids_consistent(picked), picked[7].tolist())
    return dl, ml


def _worker(vendor: str, tmp: str) -> dict:
    from complete_verifier_ext.abcrown_plugin import bridge, locate
    from complete_verifier_ext.abcrown_plugin.run import Run
    from complete_verifier_ext.abcrown_plugin.search import input_split
    from complete_verifier_ext.config import ParallelConfig
    from complete_verifier_ext.parallel import comm

    bridge.import_abcrown(locate.find(vendor))
    import arguments

    sys.argv = ["abcrown"]
    arguments.Config.parse_config()
    me, out = comm.rank(), {}
    run = Run(ParallelConfig(mode="fsdp", world_size=2), 2, tmp, 0.0)
    dl, _ = _lists_moved(me, out, run)
    # the attack: rank 1 alone finds a counterexample; rank 0 (the user's file) gets it
    arguments.Config["attack"]["cex_path"] = f"{tmp}/cex{me}.txt"

    def attack(model, domains, stage, vnnlib):
        if me == 1:
            with open(arguments.Config["attack"]["cex_path"], "w") as f:
                f.write("((X_0 1.5))")
        return me == 1

    wrapped = input_split.pgd_attack_on_domains(run, attack)
    dl.add(**_boxes(1, 5), check_dm_lbs=False, check_input_boxes=False)
    dl._split = True
    out["found"] = wrapped(None, dl, "bab", None)
    out["cex"] = (Path(tmp) / f"cex{me}.txt").read_text()
    out["none"] = input_split.pgd_attack_on_domains(run, lambda *a: False)(None, dl, "bab", None)
    return comm.all_gather_object(out)


@needs_abcrown
def test_boxes_move_between_ranks_whole_and_attack_agreed(tmp_path, monkeypatch):
    """Rebalancing α,β-CROWN's input box lists between two gloo ranks: every box arrives once with all
    it carries (bounds, spec, threshold, split dimension, α with the boxes on dim 2, clip-and-verify
    constraints), the volume moves with it, and the multi-spec list keeps each box's number of ANDs.
    Boxes picked off a multi-spec list by a round that then ran out of memory go back as they were.
    A counterexample found on rank 1 alone is every rank's, and rank 0's file holds it."""
    monkeypatch.setenv("ABCROWN_PATH", str(VENDOR))
    r0, r1 = launch.run(_worker, 2, (str(VENDOR), str(tmp_path)), backend="gloo")
    assert r0["counts"] == r1["counts"] and sorted(r0["counts"]) == [4, 5]
    assert sorted(r0["ids"] + r1["ids"]) == [0, 1, 2, 3, 4, 5, 6, 100, 101]
    assert sum(r["volume"][1] for r in (r0, r1)) == pytest.approx(sum(r["volume"][0] for r in (r0, r1)))
    both = sorted(p for part in (zip(*r["multi"], strict=True) for r in (r0, r1)) for p in part)
    assert both == [(0, 2), (1, 1), (2, 2), (3, 1), (4, 2), (5, 1)], json.dumps([r0["multi"], r1["multi"]])
    assert r0["undo"] == r1["undo"] == (1, True, 3, True)  # then every box picked once, as it was
    assert r0["found"] and r1["found"] and r0["cex"] == r1["cex"] == "((X_0 1.5))"
    assert not r0["none"] and not r1["none"]
