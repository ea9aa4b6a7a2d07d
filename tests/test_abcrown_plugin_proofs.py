"""``general.proof`` on the α,β-CROWN engine (``abcrown_plugin/proofs.py`` records, ``proof_write.py``
writes): real α,β-CROWN runs on real gloo ranks whose proofs the independent checker
(``complete_verifier_ext/check``) decides. An unsat that α-CROWN proves, one that activation BaB proves
(at P = 1 and P = 2: the same tree), one that input-split BaB with clip-and-verify proves (P = 2, and
P = 1 with α,β-CROWN's ACAS Xu settings, α-CROWN or forward-mode bounds) are ``valid``; a proof with a
leaf removed is ``invalid``. The tree builders of ``complete_verifier_ext/proofs.py`` on cases worked
out by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from plugin_support import BAB_YAML, BENCH, INPUT_SPLIT_YAML, MNIST, VENDOR, config, needs_abcrown, run

from complete_verifier_ext import proofs
from complete_verifier_ext.check import check_proof
from complete_verifier_ext.check.tree import share_tables

NET = MNIST / "onnx" / "mnist-net_256x2.onnx"

ALPHA_YAML = """general:
  device: cpu
  complete_verifier: skip
solver:
  alpha-crown:
    iteration: 20
attack:
  pgd_order: skip
"""

# α,β-CROWN's exp_configs/vnncomp21/acasxu.yaml: naive input splits, reordered BaB, clip-and-verify
REORDERED_YAML = """general:
  device: cpu
solver:
  batch_size: 64
  bound_prop_method: crown
bab:
  timeout: 60
  branching:
    method: naive
    input_split:
      enable: True
      reorder_bab: True
  clip_n_verify:
    clip_input_domain:
      enabled: True
attack:
  pgd_order: skip
"""


def _proved(
    tmp_path: Path, yaml: str, onnx: Path | dict, vnnlib: Path, name: str, P: int = 1, mode="fsdp"
) -> dict:
    """One run with ``--general.proof``: unsat, no note, the checker says valid; the proof's document.
    ``onnx``: a file, or a VNN-LIB 2.0 query's networks (name -> file)."""
    path = tmp_path / f"{name}.json"
    arg = repr([(k, str(v)) for k, v in onnx.items()]) if isinstance(onnx, dict) else str(onnx)
    args = ["--onnx_path", arg, "--vnnlib_path", str(vnnlib), "--general.proof", str(path)]
    proc, _, results = run(tmp_path, config(tmp_path, yaml, f"{name}.yaml"), *args, P=P, name=name, mode=mode)
    assert results and results.startswith("unsat"), (results, proc.stderr[-3000:])
    assert "note:" not in proc.stderr, proc.stderr[-3000:]
    networks = {k: str(v) for k, v in onnx.items()} if isinstance(onnx, dict) else {"net": str(onnx)}
    r = check_proof(str(vnnlib), networks, str(path))
    assert r.status == "valid", r
    doc = json.loads(path.read_text())
    share_tables(doc)  # (the shared bounds tables in place)
    return doc


def _kinds(node: dict) -> set[str]:
    """The kinds of node in a tree."""
    kind = next(k for k in ("leaf", "input", "clip", "relu", "bounds") if k in node)
    return {kind}.union(*(_kinds(c) for c in node.get("children", [])))


def _shape(node: dict) -> dict:
    """A tree without its claims' values and its leaves' slopes and multipliers (α-CROWN's bounds at P = 2
    are P = 1's to float32 rounding, and so are the slopes)."""
    if "bounds" in node:
        return {"bounds": sorted(node["bounds"]), "children": [_shape(c) for c in node["children"]]}
    if "leaf" in node:
        return {"leaf": sorted(node["leaf"])}
    return {**node, "children": [_shape(c) for c in node["children"]]} if "children" in node else node


def _leaves(node: dict) -> list[dict]:
    return [node["leaf"]] if "leaf" in node else [x for c in node.get("children", []) for x in _leaves(c)]


@needs_abcrown
def test_an_unsat_alpha_crown_proves_has_a_valid_proof(tmp_path):
    """256x2 prop_0_0.03: α-CROWN proves every clause; each is a leaf under its pre-activation bounds,
    with its evidence: the proving row (``lambda``, one of the clause's) and α-CROWN's output slopes
    for it, at neurons the claims leave unstable, in [0, 1]. At P = 2 (each rank holds the output α of
    its own spec rows) the leaves carry the same rows and neurons."""
    vnnlib = MNIST / "vnnlib" / "prop_0_0.03.vnnlib"
    docs = [_proved(tmp_path, ALPHA_YAML, NET, vnnlib, f"alpha{P}", P=P) for P in (1, 2)]
    assert docs[0]["producer"] == {
        "engine": "abcrown",
        "world_size": 1,
        "mode": "none",
        "method": "incomplete",
    }
    assert [r["size"] for r in docs[0]["relu_layers"]] == [256, 256]
    evidence = []
    for doc in docs:
        assert all(_kinds(o["tree"]) == {"bounds", "leaf"} for o in doc["obligations"])
        evidence.append([])
        for o in doc["obligations"]:
            claims, leaf = o["tree"]["bounds"], o["tree"]["children"][0]["leaf"]
            assert sorted(leaf["lambda"]) == [0.0] * (len(o["rows"]["d"]) - 1) + [1.0], leaf["lambda"]
            assert leaf["alpha"], o["rows"]
            for layer, slopes in leaf["alpha"].items():
                lo, hi = (np.array(claims[layer][k]) for k in ("lower", "upper"))
                neurons = np.array([int(j) for j in slopes])
                assert ((lo[neurons] < 0) & (hi[neurons] > 0)).all()
                assert all(0 <= v <= 1 for v in slopes.values())
            evidence[-1].append((leaf["lambda"], {k: sorted(v) for k, v in leaf["alpha"].items()}))
    assert evidence[0] == evidence[1]


@needs_abcrown
def test_a_resnet_proof_of_alpha_crown_is_checked_without_an_lp(tmp_path, monkeypatch):
    """sri_resnet_a idx 4836 with α,β-CROWN's own ``vnncomp22/resnet_A.yaml``: α-CROWN proves it. Its
    claims carry the slopes of the neurons that its iteration 0 leaves unstable (auto_LiRPA records
    its best iteration only where the output improved, from iteration 1 or later: the neurons stable
    by then had no slopes, and 18 claims went to LPs of 5-13 s each); the claims' sides that decide no
    phase are not proved (18 more LPs); the leaves carry the output slopes of their row (a leaf that
    the checker's own slopes leave open took an every-neuron pass and an LP, 50 s). The checker
    solves no LP and takes no second pass."""
    import yaml

    from complete_verifier_ext import check as checker

    data = yaml.safe_load((VENDOR / "complete_verifier/exp_configs/vnncomp22/resnet_A.yaml").read_text())
    data["general"] = {"device": "cpu"}
    folder = BENCH / "sri_resnet_a"
    onnx = folder / "onnx" / "resnet_3b2_bn_mixup_adv_4.0_bs128_lr-1.onnx"
    vnnlib = folder / "vnnlib" / "cifar10_spec_idx_4836_eps_0.00350.vnnlib"
    lps, second = [], []
    monkeypatch.setattr(checker.lp.Solver, "minimum", lambda *a, **k: lps.append(a) or (-np.inf, "optimal"))
    real = checker._every_neuron
    monkeypatch.setattr(checker, "_every_neuron", lambda *a: second.append(1) or real(*a))
    doc = _proved(tmp_path, yaml.safe_dump(data), onnx, vnnlib, "resnet")
    assert doc["producer"]["method"] == "incomplete"
    assert not lps and not second, (len(lps), len(second))


@needs_abcrown
def test_activation_bab_proofs_at_one_and_two_ranks_are_one_tree(tmp_path, monkeypatch):
    """256x2 prop_9_0.05 with ``BAB_YAML``: the clauses α-CROWN leaves open are proved by β-CROWN BaB
    (16 domains); at P = 1 and P = 2 (fsdp) the checker says valid and the trees are the same. Every
    BaB leaf carries its proving row, slopes and multipliers: none needs the LP (the leaves α-CROWN
    proved carry none: some do). The claims carry the slopes of their best α-CROWN iteration (at P = 2
    each rank's rows, joined): of the 42 the checker's own bounds miss, a few go to the LP. With a leaf
    removed (a phase split left with one child) the proof is invalid."""
    from complete_verifier_ext import check as checker

    real, lps = checker._minima, []
    monkeypatch.setattr(
        checker, "_minima", lambda net, model, cols: lps.extend(cols) or real(net, model, cols)
    )
    vnnlib = MNIST / "vnnlib" / "prop_9_0.05.vnnlib"
    docs = [_proved(tmp_path, BAB_YAML, NET, vnnlib, f"bab{P}", P=P) for P in (1, 2)]
    for P, doc in zip((1, 2), docs, strict=True):
        bab = [leaf for o in doc["obligations"] if "relu" in _kinds(o["tree"]) for leaf in _leaves(o["tree"])]
        assert bab and all(ev["lambda"] and ev["alpha"] and ev["beta"] for ev in bab), bab[:1]
        assert len(doc["obligations"][0]["tree"]["bounds"]["1"]["alpha"]["neurons"]) > 40, P
        (tmp_path / "doc.json").write_text(json.dumps(doc))
        lps.clear()
        r = check_proof(str(vnnlib), {"net": str(NET)}, str(tmp_path / "doc.json"))
        assert r.status == "valid" and r.by_lp <= r.leaves - len(bab), (P, r)
        assert len(lps) < 10, (P, len(lps))
    assert docs[1]["producer"] == {
        "engine": "abcrown",
        "world_size": 2,
        "mode": "fsdp",
        "method": docs[0]["producer"]["method"],
    }
    assert "activation-bab" in docs[0]["producer"]["method"]
    assert [_shape(o["tree"]) for o in docs[0]["obligations"]] == [
        _shape(o["tree"]) for o in docs[1]["obligations"]
    ]
    assert any("relu" in _kinds(o["tree"]) for o in docs[0]["obligations"])
    bad = copy.deepcopy(docs[0])
    node = next(o["tree"] for o in bad["obligations"] if "relu" in _kinds(o["tree"]))
    while "relu" not in node:
        node = node["children"][0]
    node["children"].pop()
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = check_proof(str(vnnlib), {"net": str(NET)}, str(tmp_path / "bad.json"))
    assert r.status == "invalid", r


@needs_abcrown
def test_a_two_network_proof_names_the_relus_of_each_network(tmp_path):
    """A VNN-LIB 2.0 query on two networks (``two_network_query``) by β-CROWN BaB at P = 2: α,β-CROWN
    orders the joint model's ReLUs by depth (f's first, g's, f's second), not as the graph lists them;
    the proof lists the graph's, numbers them in α,β-CROWN's order and names each by its network and
    its output there, and is valid."""
    from support import two_network_query

    nets, vnnlib = two_network_query(tmp_path)
    doc = _proved(tmp_path, BAB_YAML, nets, vnnlib, "two", P=2)
    assert [(r["id"], r["network"], r["output"]) for r in doc["relu_layers"]] == [
        (0, "f", "h0"),
        (2, "f", "h1"),
        (1, "g", "R0"),
    ]  # in the graph's order, numbered in α,β-CROWN's
    assert "relu" in _kinds(doc["obligations"][0]["tree"])
    assert sorted(n["name"] for n in doc["query"]["networks"]) == ["f", "g"]


@needs_abcrown
def test_input_split_proofs_with_clipping(tmp_path):
    """A 4-96-96-3 MLP, robustness of label 0 (two clauses): α,β-CROWN's ACAS Xu settings (naive splits,
    reordered BaB, CROWN bounds, children clipped by their parent's bounds) prove it at P = 1 and at
    P = 2 (tp); the trees hold input splits and clips, and the checker says valid. With α-CROWN bounds
    (``INPUT_SPLIT_YAML``: smart branching, intermediate bounds optimised per box, slabs clipped by
    optimised slopes) and with forward-mode intermediate bounds (tllverifybench's config) the proof
    carries the same tree, and the checker's own bounds (its LP over LP bounds where they fall short:
    those dominate any slopes) decide it: valid too."""
    from complete_verifier_ext.testing import mlp_onnx, write_vnnlib

    onnx = Path(mlp_onnx(tmp_path / "m.onnx", [4, 96, 96, 3], seed=3))
    x0 = np.array([0.1, -0.2, 0.3, 0.05])
    vnnlib = Path(write_vnnlib(tmp_path / "p.vnnlib", x0 - 0.08, x0 + 0.08, 0, 3))
    for P, mode in ((1, "fsdp"), (2, "tp")):
        doc = _proved(tmp_path, REORDERED_YAML, onnx, vnnlib, f"reordered{P}", P=P, mode=mode)
        assert doc["producer"]["method"] == "input-split", doc["producer"]
        assert {"input", "clip", "leaf"} <= set().union(*(_kinds(o["tree"]) for o in doc["obligations"]))
    forward = REORDERED_YAML.replace("bound_prop_method: crown", "bound_prop_method: forward+backward")
    for name, yaml in (("alpha", INPUT_SPLIT_YAML), ("forward", forward)):
        doc = _proved(tmp_path, yaml, onnx, vnnlib, name)
        assert doc["producer"]["method"] == "input-split", doc["producer"]
        assert "input" in set().union(*(_kinds(o["tree"]) for o in doc["obligations"]))


def _sigmoid_onnx(path: Path, sizes=(4, 24, 24, 3), seed: int = 4) -> Path:
    """Gemm, Sigmoid, Gemm, Relu, Gemm (dist_shift's mix of activations), float32 weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "x"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        W, b = rng.normal(size=(n_out, n_in)) * 2 / np.sqrt(n_in), rng.normal(size=n_out) * 0.1
        inits += [numpy_helper.from_array(W.astype(np.float32), f"W{i}")]
        inits += [numpy_helper.from_array(b.astype(np.float32), f"b{i}")]
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"b{i}"], [f"z{i}"], transB=1))
        prev = f"z{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Sigmoid" if i == 0 else "Relu", [prev], [f"h{i}"]))
            prev = f"h{i}"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, sizes[0]])
    y = helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, sizes[-1]])
    model = helper.make_model(helper.make_graph(nodes, "sig", [x], [y], inits))
    path.write_bytes(model.SerializeToString())
    return path


@needs_abcrown
def test_a_sigmoid_networks_input_split_proof(tmp_path):
    """A network with a Sigmoid and a ReLU (as dist_shift's), α,β-CROWN's input split under α-CROWN
    bounds (dist_shift's settings): unsat, its proof valid; the checker reads the Sigmoid itself. The
    root's claims include the sigmoid's input bounds, and those of the ReLU after it carry α-CROWN's
    tangent points of the sigmoid."""
    from complete_verifier_ext.testing import write_vnnlib

    onnx = _sigmoid_onnx(tmp_path / "sig.onnx")
    x0 = np.array([0.2, -0.1, 0.4, 0.0])
    vnnlib = Path(write_vnnlib(tmp_path / "p.vnnlib", x0 - 0.25, x0 + 0.25, 0, 3))  # sampled margin >= 0.26
    doc = _proved(tmp_path, INPUT_SPLIT_YAML, onnx, vnnlib, "sig")
    assert doc["producer"]["method"] == "incomplete+input-split", doc["producer"]  # (a clause each way)
    # the root claims the sigmoid's input too, and the ReLU's claims carry the sigmoid's tangent points
    assert doc["sigmoid_layers"] == [{"id": 0, "output": "h0", "size": 24}], doc["sigmoid_layers"]
    tables = doc["bounds_tables"]
    assert any("s0" in t for t in tables), [list(t) for t in tables]
    points = [e for t in tables for c in t.values() for e in (c.get("alpha") or {}).get("lower", {}).values()]
    assert any(len(e.get("lower_line", [])) for e in points), points


def test_phase_tree_from_histories_in_any_order():
    """Leaves of a case split whose histories list the splits in any order: the same tree as in order;
    a leaf missing is no case split."""
    ordered = [
        ((0, 1, -1), (1, 4, -1)),
        ((0, 1, -1), (1, 4, 1)),
        ((0, 1, 1), (1, 2, -1)),
        ((0, 1, 1), (1, 2, 1)),
    ]
    tree = proofs.phase_tree(ordered)
    assert tree["relu"] == {"layer": 0, "neuron": 1}
    assert [c["relu"] for c in tree["children"]] == [{"layer": 1, "neuron": 4}, {"layer": 1, "neuron": 2}]
    shuffled = [h[::-1] for h in ordered[::-1]]
    unordered = proofs.phase_tree(shuffled)
    assert unordered["relu"] == {"layer": 0, "neuron": 1} and len(_leaves(unordered)) == 4
    with pytest.raises(ValueError):
        proofs.phase_tree(shuffled[1:])


def test_tiling_tree_cuts_a_box_into_its_parts():
    """A 2 x 2 grid of boxes and a strip beside it rebuilt as cuts; a gap between parts is no tiling."""
    parts = np.array(
        [[[0, 0], [1, 1]], [[1, 0], [2, 1]], [[0, 1], [1, 2]], [[1, 1], [2, 2]], [[2, 0], [3, 2]]], float
    )
    leaves = [proofs.leaf(bound={"const": k}) for k in range(5)]
    tree = proofs.tiling_tree(np.zeros(2), np.array([3.0, 2.0]), parts, leaves)
    assert tree["input"] == {"dim": 0, "at": [1.0]} and len(_leaves(tree)) == 5
    gap = parts.copy()
    gap[4, 0, 0] = 2.5
    with pytest.raises(ValueError):
        proofs.tiling_tree(np.zeros(2), np.array([3.0, 2.0]), gap, leaves)


def test_a_nan_or_minus_infinite_bound_records_no_proven_row():
    """What the recording hooks take as proved: a lower bound above its threshold, +inf included
    (α,β-CROWN's mark of a row α-CROWN verified and pruned: oval21's robustness rows, 8 of 9 proved at
    the root, had no proof without it); NaN and -inf prove nothing (a box or row recorded wrongly would
    only make the proof invalid, never the verdict)."""
    import torch

    from complete_verifier_ext.abcrown_plugin.proofs import _proven_rows, above, row_key

    lb = torch.tensor([[1.0, float("nan"), float("inf"), -float("inf"), -1.0]])
    assert above(lb, torch.zeros(1, 5)).tolist() == [[True, False, True, False, False]]
    c, rhs = torch.eye(5)[None], torch.zeros(1, 5)
    assert _proven_rows(lb, c, rhs, 1) == [{row_key(c[0, k].double().numpy(), 0.0) for k in (0, 2)}]


def test_a_split_across_a_fixed_input_records_one_copy_of_each_box():
    """α,β-CROWN's naive split also cuts a dimension of width 0 (ACAS Xu property 4 fixes two inputs):
    its parts come in identical pairs, and a box cut there into two copies of itself stays one box. The
    log then rebuilds the tree of the real cuts (three property-4 proofs were refused as no tiling)."""
    import torch

    from complete_verifier_ext.abcrown_plugin.proofs import _record_split, box_keys
    from complete_verifier_ext.abcrown_plugin.run import Proofs

    proof = Proofs(path="unused")
    cs, thr = torch.tensor([[[1.0, -1.0]]]), torch.zeros(1, 1)
    lo, hi = torch.tensor([[0.0, 0.5]]), torch.tensor([[1.0, 0.5]])  # input 1 fixed at 0.5
    # one box into four: input 0 at 0.5, input 1 "at 0.5" (j + N r for r = 0..3)
    kid_lo = torch.tensor([[0.0, 0.5], [0.5, 0.5], [0.0, 0.5], [0.5, 0.5]])
    kid_hi = torch.tensor([[0.5, 0.5], [1.0, 0.5], [0.5, 0.5], [1.0, 0.5]])
    _record_split(proof, lo, hi, cs, thr, (kid_lo, kid_hi, cs.expand(4, 1, 2), thr.expand(4, 1)))
    (root,) = box_keys(proof, lo, hi, cs, thr)
    kids = box_keys(proof, kid_lo[:2], kid_hi[:2], cs.expand(2, 1, 2), thr.expand(2, 1))
    assert proof.splits == {root: tuple(kids)}
    _record_split(proof, kid_lo[:1], kid_hi[:1], cs, thr, (kid_lo[:1], kid_hi[:1], cs, thr))  # a copy only
    assert proof.splits == {root: tuple(kids)} and proof.refused is None
    log = proofs.BoxLog(proof.splits, {}, frozenset(kids))
    assert proofs.logged_tree(root, log) == {
        "input": {"dim": 0, "at": [0.5]},
        "children": [proofs.leaf(), proofs.leaf()],
    }
    with pytest.raises(ValueError):  # a box recorded as split into itself is no proof, not a loop
        proofs.logged_tree(kids[0], proofs.BoxLog({kids[0]: (kids[0],)}, {}, frozenset()))
