"""The native engine's proofs (``general.proof``, ``complete_verifier_ext/proofs.py``): the trees rebuilt from
a search's leaves, the ReLU layers named as the format says, and whole proofs the independent checker
(``complete_verifier_ext/check``) finds valid, at P = 1 and P = 2, and invalid once tampered with."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from complete_verifier_ext import cli, proofs
from complete_verifier_ext.check import check_proof, tree

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "complete_verifier_ext" / "examples"
MNIST = REPO.parent / "shared" / "benchmarks" / "mnist_fc"
needs_mnist = pytest.mark.skipif(not MNIST.is_dir(), reason=f"{MNIST} is absent")


def _box(lo, hi) -> np.ndarray:
    return np.array([lo, hi], dtype=np.float32)


def test_bisections_are_rebuilt_from_the_leaf_boxes_and_a_gap_is_no_tree():
    """Four leaves of [0, 1]²: cut at x = 0.5, then each half at y = 0.5 (the left) or not (the right)."""
    leaves = np.stack([_box([0, 0], [0.5, 0.5]), _box([0, 0.5], [0.5, 1]), _box([0.5, 0], [1, 1])])
    tree = proofs.input_tree(np.zeros(2), np.ones(2), leaves)
    assert tree["input"] == {"dim": 0, "at": [0.5]}
    assert tree["children"][0]["input"] == {"dim": 1, "at": [0.5]} and tree["children"][1] == proofs.leaf()
    with pytest.raises(ValueError, match="do not tile"):
        proofs.input_tree(np.zeros(2), np.ones(2), leaves[:2])


def _bisected(n_leaves: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A box of 4 inputs (one fixed) bisected at random at float32 midpoints into ``n_leaves`` boxes."""
    rng = np.random.default_rng(seed)
    lo = rng.normal(size=4).astype(np.float32)
    hi = (lo + rng.uniform(0.1, 2.0, 4)).astype(np.float32)
    hi[2] = lo[2]
    boxes = [(lo, hi)]
    while len(boxes) < n_leaves:
        l, h = boxes.pop(int(rng.integers(len(boxes))))
        d = int(rng.choice(np.flatnonzero(h > l)))
        h2, l2 = h.copy(), l.copy()
        h2[d] = l2[d] = (l[d] + h[d]) / np.float32(2)
        boxes += [(l, h2), (l2, h)]
    return lo, hi, np.stack([np.stack(b) for b in boxes])[rng.permutation(n_leaves)]


def _leaf_boxes(node: dict, lo: np.ndarray, hi: np.ndarray) -> list[tuple]:
    if "leaf" in node:
        return [(tuple(lo.tolist()), tuple(hi.tolist()))]
    d, at = node["input"]["dim"], node["input"]["at"][0]
    left_hi, right_lo = hi.copy(), lo.copy()
    left_hi[d] = right_lo[d] = at
    return _leaf_boxes(node["children"][0], lo, left_hi) + _leaf_boxes(node["children"][1], right_lo, hi)


@pytest.mark.parametrize("n_leaves", [1, 2, 9, 3000])
def test_random_bisections_are_rebuilt_with_every_leaf_once(n_leaves):
    """Random bisections (uneven depths, an input of width 0) rebuilt level by level: the tree's leaves
    are exactly the boxes given, each once; one box missing is no tree."""
    lo, hi, leaves = _bisected(n_leaves, seed=n_leaves)
    tree = proofs.input_tree(lo, hi, leaves)
    got = _leaf_boxes(tree, lo.astype(np.float64), hi.astype(np.float64))
    assert sorted(got) == sorted((tuple(a.tolist()), tuple(b.tolist())) for a, b in leaves.astype(np.float64))
    if n_leaves > 1:
        with pytest.raises(ValueError, match="do not tile"):
            proofs.input_tree(lo, hi, leaves[1:])


def test_phase_splits_are_rebuilt_from_the_histories_and_a_missing_side_is_no_tree():
    histories = [((0, 3, -1),), ((0, 3, 1), (1, 0, -1)), ((0, 3, 1), (1, 0, 1))]
    tree = proofs.phase_tree(histories)
    assert tree["relu"] == {"layer": 0, "neuron": 3}
    assert tree["children"][0] == proofs.leaf() and tree["children"][1]["relu"] == {"layer": 1, "neuron": 0}
    with pytest.raises(ValueError):
        proofs.phase_tree(histories[1:])
    bad = {
        "inside another": histories + [((0, 3, 1),)],
        "none": [],
        "twice": [((0, 3, -1), (0, 3, 1)), ((0, 3, 1),)],
        "both ways": [((0, 3, -1), (1, 0, 1)), ((0, 3, 1), (1, 1, -1))],
    }
    for why, hs in bad.items():
        with pytest.raises(ValueError, match=why):
            proofs.phase_tree(hs)


def test_relu_layers_are_named_by_their_output_tensor_and_must_match():
    """The bundled example's ReLU nodes are named ``relu_0`` and ``relu_1``; their outputs ``h0`` and ``h1``
    are what the format names. Sizes that are not the verifier's are no proof."""
    layers = proofs.relu_layers(str(EXAMPLE / "example.onnx"), [48, 48])
    assert [(r["id"], r["output"], r["size"]) for r in layers] == [(0, "h0", 48), (1, "h1", 48)]
    with pytest.raises(ValueError, match="not the verifier's ReLUs"):
        proofs.relu_layers(str(EXAMPLE / "example.onnx"), [48])


def _prove(tmp_path: Path, name: str, config: str, onnx: Path, spec: Path, *extra: str) -> dict:
    """One native run with ``general.proof`` (in this process at P = 1); the proof it wrote."""
    proof = tmp_path / f"{name}.json"
    argv = ["--config", config, "--general.csv_name", "null", "--model.onnx_path", str(onnx)]
    results = tmp_path / f"{name}.txt"
    argv += ["--specification.vnnlib_path", str(spec), "--general.results_file", str(results)]
    assert cli.main([*argv, "--general.proof", str(proof), "--quiet", *extra]) == 0
    assert results.read_text().strip() == "unsat"
    return _read(proof)


def _read(proof: Path) -> dict:
    """A proof document, its shared bounds tables in place."""
    doc = json.loads(proof.read_text())
    tree.share_tables(doc)
    return doc


def _shape(node: dict) -> dict:
    """A tree without its claimed numbers (which layers are claimed, and the rest) and without its
    leaves' evidence values (which rows, layers and neurons they name)."""
    out = {k: v for k, v in node.items() if k not in ("bounds", "children", "leaf")}
    if "bounds" in node:
        out["bounds"] = sorted(node["bounds"])
    if "leaf" in node:
        ev = node["leaf"]
        out["leaf"] = [
            ev.get("lambda"),
            *({w: {k: sorted(v) for k, v in ev.get(w, {}).items()}} for w in ("alpha", "beta")),
        ]
    return {**out, "children": [_shape(c) for c in node.get("children", [])]}


def _claims(doc: dict) -> list[np.ndarray]:
    """Every claimed number of a proof, node by node in depth-first order."""
    out, stack = [], [o["tree"] for o in doc["obligations"]]
    while stack:
        node = stack.pop()
        for _, table in sorted(node.get("bounds", {}).items()):
            out.append(np.array(table["lower"] + table["upper"]))
        stack.extend(reversed(node.get("children", [])))
    return out


def _check(tmp_path: Path, doc: dict, spec: Path, onnx: Path) -> str:
    path = tmp_path / "checked.json"
    path.write_text(json.dumps(doc))
    return check_proof(str(spec), {"N": str(onnx)}, str(path)).line()


def test_an_input_split_proof_is_valid_and_one_without_a_leaf_is_not(tmp_path):
    """The bundled example through the solver command line (``verify --proof``; its 16 inputs choose
    input splits): the checker finds the proof valid; with a subtree dropped (its box no longer
    covered) invalid."""
    from complete_verifier_ext import solver_cli

    spec, onnx, proof = EXAMPLE / "example.vnnlib", EXAMPLE / "example.onnx", tmp_path / "p.json"
    assert solver_cli.main(["verify", str(spec), "--network", f"N={onnx}", "--proof", str(proof)]) == 0
    doc = _read(proof)
    assert _check(tmp_path, doc, spec, onnx) == "valid"
    bad = copy.deepcopy(doc)
    node = next(o["tree"] for o in bad["obligations"] if "input" in o["tree"])
    node["children"] = node["children"][:1]
    assert _check(tmp_path, bad, spec, onnx).startswith("invalid")


def test_a_proof_folder_takes_a_new_file_per_unsat(tmp_path, monkeypatch):
    """``$CVE_PROOF_DIR`` (what the test suite sets for every test): each run's proof is a new file
    named after the network and the query, never one over another; ``general.proof`` on the command
    line goes before the folder."""
    folder = tmp_path / "proofs"
    folder.mkdir()
    monkeypatch.setenv("CVE_PROOF_DIR", str(folder))
    spec, onnx = EXAMPLE / "example.vnnlib", EXAMPLE / "example.onnx"
    argv = [
        "--config",
        str(REPO / "configs" / "example.yaml"),
        "--general.results_file",
        str(tmp_path / "o.txt"),
    ]
    argv += ["--model.onnx_path", str(onnx), "--specification.vnnlib_path", str(spec), "--quiet"]
    assert cli.main(argv) == 0 and cli.main(argv) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["example__example.1.json", "example__example.json"]
    for proof in folder.iterdir():
        doc = json.loads(proof.read_text())
        assert doc["query"]["vnnlib"]["path"] == str(spec)  # absolute: a checker finds it from anywhere
        assert check_proof(str(spec), {"N": str(onnx)}, str(proof)).line() == "valid"
    assert cli.main([*argv, "--general.proof", str(tmp_path / "mine.json")]) == 0
    assert (tmp_path / "mine.json").is_file() and len(list(folder.iterdir())) == 2


@needs_mnist
def test_relu_split_proofs_are_valid_and_the_same_at_p1_and_p2(tmp_path, monkeypatch):
    """mnist-net_256x2 prop_8_0.03 (β-CROWN BaB, 14 domains): the phase-split tree under α-CROWN's
    intermediate bounds is valid, and two ranks (fsdp, the domains split over them) write the same
    tree, its claims P = 1's to α-CROWN's float32 rounding across ranks. The claims carry the slopes
    that made them (every rank's rows): the checker verifies them with no LP."""
    from complete_verifier_ext import check as checker

    real, lps = checker._neuron_minimum, []
    monkeypatch.setattr(checker, "_neuron_minimum", lambda *a: lps.append(a[1:]) or real(*a))
    onnx, spec = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_8_0.03.vnnlib"
    config = str(REPO / "configs" / "mnist_fc.yaml")
    one = _prove(tmp_path, "p1", config, onnx, spec)
    two = _prove(tmp_path, "p2", config, onnx, spec, "--parallel.mode", "fsdp", "--parallel.world_size", "2")
    assert any("relu" in json.dumps(o["tree"]) for o in one["obligations"])
    assert [_shape(o["tree"]) for o in two["obligations"]] == [_shape(o["tree"]) for o in one["obligations"]]
    for a, b in zip(_claims(one), _claims(two), strict=True):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert two["producer"]["world_size"] == 2
    for doc in (one, two):
        tables = [t for o in doc["obligations"] for t in o["tree"].get("bounds", {}).values()]
        slopes = [t["alpha"] for t in tables if "alpha" in t]  # not the first layer's: exact by IBP
        assert slopes and all(a["lower"] and a["upper"] for a in slopes)
    assert _check(tmp_path, two, spec, onnx) == "valid" and not lps, len(lps)
    # every leaf carries its evidence (row, slopes, β of its splits): closed without the LP fallback
    bab = [o["tree"] for o in one["obligations"] if "relu" in json.dumps(o["tree"])]
    leaves = [node["leaf"] for tree in bab for node in _leaves(tree)]
    assert leaves and all(ev["lambda"] and ev["alpha"] and ev["beta"] for ev in leaves)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    result = check_proof(str(spec), {"N": str(onnx)}, str(path))
    assert result.status == "valid" and result.by_lp == 0, result


@needs_mnist
def test_a_clause_alpha_crown_proves_carries_its_row_and_output_slopes(tmp_path):
    """mnist-net_256x2 prop_4_0.03: CROWN proves 8 clauses, α-CROWN the last. Its leaf carries the
    clause's best row (``lambda``) and α-CROWN's output slopes of that row, at neurons the claims leave
    unstable, in [0, 1] (CROWN's leaves: none, its slopes are the checker's own); two ranks (every spec
    row's slopes on every rank) give the same rows and neurons; the checker closes every leaf by its
    bounds."""
    onnx, spec = MNIST / "onnx" / "mnist-net_256x2.onnx", MNIST / "vnnlib" / "prop_4_0.03.vnnlib"
    config = str(REPO / "configs" / "mnist_fc.yaml")
    one = _prove(tmp_path, "p1", config, onnx, spec)
    two = _prove(tmp_path, "p2", config, onnx, spec, "--parallel.mode", "fsdp", "--parallel.world_size", "2")
    evidence = []
    for doc in (one, two):
        evidence.append([])
        for o in doc["obligations"]:
            claims, leaf = o["tree"]["bounds"], o["tree"]["children"][0]["leaf"]
            if not leaf:
                continue
            assert sorted(leaf["lambda"]) == [0.0] * (len(o["rows"]["d"]) - 1) + [1.0], leaf
            for layer, slopes in leaf["alpha"].items():
                lo, hi = (np.array(claims[layer][k]) for k in ("lower", "upper"))
                neurons = np.array([int(j) for j in slopes])
                assert ((lo[neurons] < 0) & (hi[neurons] > 0)).all() and len(neurons) > 10
                assert all(0 <= v <= 1 for v in slopes.values())
            evidence[-1].append((leaf["lambda"], {k: sorted(v) for k, v in leaf["alpha"].items()}))
    assert evidence[0] == evidence[1] and len(evidence[0]) == 1
    path = tmp_path / "one.json"
    path.write_text(json.dumps(one))
    result = check_proof(str(spec), {"N": str(onnx)}, str(path))
    assert result.status == "valid" and result.by_bounds == 9, result


def _leaves(node: dict) -> list[dict]:
    return [node] if "leaf" in node else [x for c in node.get("children", []) for x in _leaves(c)]


ACAS = REPO.parent / "shared" / "benchmarks" / "acasxu"


@pytest.mark.skipif(not ACAS.is_dir(), reason=f"{ACAS} is absent")
def test_a_one_property_proof_in_aptp_syntax_is_valid(tmp_path, capsys):
    """A proof path ending in ``.aptp`` writes APTP: ACAS Xu 1_1 property 1 (one clause, input splits as
    NeuralSAT writes them) reads back through the checker's APTP reader as valid; the bundled example
    (four clauses: APTP holds one property) writes none and says why."""
    from complete_verifier_ext import solver_cli

    spec, onnx, proof = (
        ACAS / "vnnlib" / "prop_1.vnnlib",
        ACAS / "onnx" / "ACASXU_run2a_1_1_batch_2000.onnx",
        tmp_path / "p.aptp",
    )
    assert solver_cli.main(["verify", str(spec), "--network", f"N={onnx}", "--proof", str(proof)]) == 0
    text = proof.read_text()
    assert text.startswith(spec.read_text().rstrip()) and "(declare-pwl N_300 ReLU)" in text
    assert check_proof(str(spec), {"N": str(onnx)}, str(proof)).line() == "valid"
    spec, onnx, proof = EXAMPLE / "example.vnnlib", EXAMPLE / "example.onnx", tmp_path / "e.aptp"
    assert solver_cli.main(["verify", str(spec), "--network", f"N={onnx}", "--proof", str(proof)]) == 0
    assert not proof.exists() and "APTP holds one property" in capsys.readouterr().err


# ACAS Xu 1_3 property 1: a box of its input-split search (a leaf of its proof) whose CROWN bound
# depends on the other boxes of a batch bounded with it
LEAF_1_3 = (
    [0.5999999642372131, 0.0, 0.2500000298023224, 0.44999998807907104, -0.5000000596046448],
    [0.6798577904701233, 0.1250000149011612, 0.3750000596046448, 0.5000000596046448, -0.44999998807907104],
)


@pytest.mark.skipif(not ACAS.is_dir(), reason=f"{ACAS} is absent")
def test_a_proofs_leaf_is_bounded_as_if_alone_whatever_its_batch():
    """CROWN refines the neurons some box of the batch has unstable; beside a wider box, a box's neurons
    that IBP already fixes get CROWN's bounds too, which moves the box's own bound (here from -2.40 to
    -0.21: sound either way). ``per_box`` (what the checker's bound pass does) bounds each box as if
    alone: the same bound in any batch, to float32 rounding (a search that records a proof uses it on
    networks beyond ``proofs.BATCHED_LEAVES_MAX``)."""
    import torch

    from complete_verifier_ext.bounds.crown import crown
    from complete_verifier_ext.model.onnx_loader import load_model
    from complete_verifier_ext.spec import Clauses, load_vnnlib

    graph = load_model(ACAS / "onnx" / "ACASXU_run2a_1_3_batch_2000.onnx")
    problem = Clauses.of(load_vnnlib(ACAS / "vnnlib" / "prop_1.vnnlib").regions[0].clauses)
    lo, hi = (torch.tensor([x]) for x in LEAF_1_3)
    batch = (torch.cat([lo, torch.full_like(lo, -0.5)]), torch.cat([hi, torch.full_like(hi, 0.5)]))
    alone = crown(graph, (lo, hi), problem.C, per_box=True)[0][0, 0].item()
    beside = crown(graph, batch, problem.C, per_box=True)[0][0, 0].item()
    coupled = crown(graph, batch, problem.C)[0][0, 0].item()
    assert abs(beside - alone) <= 1e-4 * max(1.0, abs(alone))
    assert abs(coupled - alone) > 1.0  # without per_box the batch moves the bound


@pytest.mark.skipif(not ACAS.is_dir(), reason=f"{ACAS} is absent")
@pytest.mark.parametrize("net", ["1_3", "2_4"])
def test_acasxu_input_split_proofs_whose_leaves_batches_moved_are_valid(tmp_path, net):
    """ACAS Xu 1_3 and 2_4 property 1, whose proofs were invalid while a leaf's bound depended on its
    batch and the checker had only its own pass and the leaf's LP: valid. The search bounds its boxes in
    batches, as without a proof (the net is within ``proofs.BATCHED_LEAVES_MAX``); the leaves whose
    bounds a batch moved close by the checker's LP over LP bounds."""
    from complete_verifier_ext import solver_cli

    spec, onnx = ACAS / "vnnlib" / "prop_1.vnnlib", ACAS / "onnx" / f"ACASXU_run2a_{net}_batch_2000.onnx"
    proof = tmp_path / "p.json"
    assert solver_cli.main(["verify", str(spec), "--network", f"N={onnx}", "--proof", str(proof)]) == 0
    result = check_proof(str(spec), {"N": str(onnx)}, str(proof))
    assert result.line() == "valid" and result.by_lp < result.leaves / 10, result


def test_input_split_leaves_are_batched_only_where_the_checkers_lp_over_lp_bounds_reaches():
    """The engine's limit for batched leaves stays within the checker's (``check.LP_BOUNDS_MAX``), with
    room for an ONNX graph of more nodes than the engine's; an ACAS Xu net is within it, a conv net not."""
    import torch

    from complete_verifier_ext.bounds.graph import Graph
    from complete_verifier_ext.check import LP_BOUNDS_MAX
    from complete_verifier_ext.model.torch_loader import from_sequential
    from complete_verifier_ext.proofs import BATCHED_LEAVES_MAX, leaves_bounded_alone

    assert 2 * BATCHED_LEAVES_MAX <= LP_BOUNDS_MAX[1] and BATCHED_LEAVES_MAX // 2 <= LP_BOUNDS_MAX[0]
    acas = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(50, 50), torch.nn.ReLU())])
    acas[0] = torch.nn.Linear(5, 50)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten())
    graph = from_sequential(acas, (5,))
    assert isinstance(graph, Graph) and not leaves_bounded_alone(graph)
    assert leaves_bounded_alone(from_sequential(conv, (1, 28, 28)))


@pytest.mark.skipif(not ACAS.is_dir(), reason=f"{ACAS} is absent")
def test_an_alpha_crown_input_split_proof_is_valid(tmp_path):
    """ACAS Xu 1_3 property 1 by α-CROWN input split: with α-CROWN optimising every layer's slopes a
    leaf's bound rested on intermediate bounds no checker re-derives (the proof was invalid at a leaf
    whose LP over the checker's bounds reached -7e-12); with a proof asked for it optimises the output's
    slopes over the box's own CROWN bounds, which the checker's LP always reaches."""
    argv = ["--config", str(REPO / "configs" / "acasxu.yaml"), "--general.csv_name", "null"]
    argv += ["--model.onnx_path", str(ACAS / "onnx" / "ACASXU_run2a_1_3_batch_2000.onnx")]
    argv += ["--specification.vnnlib_path", str(ACAS / "vnnlib" / "prop_1.vnnlib")]
    argv += ["--general.results_file", str(tmp_path / "o.txt"), "--solver.bound_prop_method", "alpha-crown"]
    argv += ["--general.proof", str(tmp_path / "p.json"), "--attack.pgd_order", "skip", "--quiet"]
    assert cli.main(argv) == 0 and (tmp_path / "o.txt").read_text().strip() == "unsat"
    onnx, spec = argv[5], argv[7]
    assert check_proof(spec, {"N": onnx}, str(tmp_path / "p.json")).line() == "valid"


def test_a_two_network_proof_is_valid_and_checked_on_those_networks(tmp_path):
    """A VNN-LIB 2.0 query on two networks (``two_network_query``) by β-CROWN BaB through the solver
    command line: its phase splits reach both networks' ReLUs; the checker composes the networks as
    the query says (the ties, the outputs in order) and finds the proof valid; given the networks the
    other way round, a ReLU layer named in the other network, or one network only, it does not."""
    from support import two_network_query

    from complete_verifier_ext import solver_cli
    from complete_verifier_ext.check import UsageError

    nets, spec = two_network_query(tmp_path)
    config, proof = tmp_path / "bab.yaml", tmp_path / "p.json"
    config.write_text("general:\n  complete_verifier: bab\nbab:\n  branching:\n    method: kfsb\n")
    argv = ["verify", str(spec), *(f"--network={k}={v}" for k, v in nets.items()), "--config", str(config)]
    assert solver_cli.main([*argv, "--proof", str(proof)]) == 0
    doc = _read(proof)
    layers = {(r["network"], r["output"]) for r in doc["relu_layers"]}
    assert layers == {("f", "h0"), ("f", "h1"), ("g", "R0")}
    split = set()
    stack = [o["tree"] for o in doc["obligations"]]
    while stack:
        node = stack.pop()
        split |= {node["relu"]["layer"]} if "relu" in node else set()
        stack.extend(node.get("children", []))
    assert {doc["relu_layers"][i]["network"] for i in split} == {"f", "g"}
    paths = {k: str(v) for k, v in nets.items()}
    assert check_proof(str(spec), paths, str(proof)).line() == "valid"
    swapped = check_proof(str(spec), {"f": paths["g"], "g": paths["f"]}, str(proof))
    assert swapped.status == "invalid" and "another network f" in swapped.message
    bad = copy.deepcopy(doc)
    next(r for r in bad["relu_layers"] if r["network"] == "g")["network"] = "f"
    assert _check_with(tmp_path, bad, spec, paths).startswith("invalid: relu_layers")
    with pytest.raises(UsageError, match="declares the networks f, g"):
        check_proof(str(spec), {"f": paths["f"]}, str(proof))


def _check_with(tmp_path: Path, doc: dict, spec: Path, networks: dict[str, str]) -> str:
    path = tmp_path / "checked.json"
    path.write_text(json.dumps(doc))
    return check_proof(str(spec), networks, str(path)).line()


PAIRS = REPO.parent / "shared" / "benchmarks" / "vnnlib2" / "acasxu_isomorphic"


@pytest.mark.skipif(not PAIRS.is_dir(), reason=f"{PAIRS} is absent")
def test_leaves_a_batch_tightened_close_by_crown_on_every_neuron(tmp_path):
    """The shared isomorphic pair 1_1 / 1_1 pruned by 30%, its query's box with the first outputs at
    least 0.2 apart, by the native input split: the search bounds its boxes in batches, refining
    neurons a box alone has stable, which tightens its later layers. The checker's second pass over
    the leaves its first leaves open, CROWN on every neuron, closes all of them (before it, 12 of the
    113 went to the LP over LP bounds)."""
    from complete_verifier_ext import solver_cli

    text = (PAIRS / "vnnlib" / "instance_0.vnnlib").read_text().split("; Output Constraints")[0]
    spec, proof = tmp_path / "gap.vnnlib", tmp_path / "p.json"
    spec.write_text(text + "(assert (or (>= (- Y_g[0] Y_f[0]) 0.2) (<= (- Y_g[0] Y_f[0]) -0.2)))\n")
    nets = {"f": PAIRS / "onnx" / "nets" / "ACASXU_run2a_1_1_batch_2000.onnx",
            "g": PAIRS / "onnx" / "nets_pruned" / "ACASXU_run2a_1_1_batch_2000_pruned30.onnx"}  # fmt: skip
    argv = ["verify", str(spec), *(f"--network={k}={v}" for k, v in nets.items()), "--proof", str(proof)]
    assert solver_cli.main(argv) == 0
    result = check_proof(str(spec), {k: str(v) for k, v in nets.items()}, str(proof))
    assert (result.line(), result.by_lp) == ("valid", 0), result
