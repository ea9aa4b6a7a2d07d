"""VNN-LIB 2.0 (``complete_verifier_ext.spec.v2``): the joint input/output layout, ties, every
comparison form, the 1.x forms of the same properties, and one-line errors naming the line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from complete_verifier_ext.spec import SpecError, load_vnnlib
from complete_verifier_ext.spec.v2 import is_vnnlib2

pytest.importorskip("vnnlib", reason="the reference VNN-LIB 2.0 parser (pip install vnnlib)")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "benchmarks"
HEAD = "(vnnlib-version <2.0>)\n"


def spec_of(tmp_path: Path, text: str, name: str = "q.vnnlib"):
    path = tmp_path / name
    path.write_text(text)
    return load_vnnlib(path, cache=False)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(SpecError) as e:
        spec_of(tmp_path, text)
    return str(e.value)


def test_detects_the_version():
    assert is_vnnlib2("; a comment (vnnlib-version <1.0>)\n(vnnlib-version <2.0>)\n")
    assert is_vnnlib2("(declare-network f\n (declare-input X real [1]))")
    assert not is_vnnlib2("(declare-const X_0 Real)\n; (declare-network f)\n(assert (<= X_0 1))")


@pytest.mark.parametrize("prop", ["prop_1", "prop_2"])
def test_acasxu_properties_equal_their_1x_forms(prop):
    folder = SHARED / "vnnlib2" / "acasxu" / "vnnlib"
    if not folder.is_dir():
        pytest.skip("../shared/benchmarks/vnnlib2 is absent")
    two, one = (
        load_vnnlib(folder / f"{prop}.vnnlib", cache=False),
        load_vnnlib(SHARED / "acasxu" / "vnnlib" / f"{prop}.vnnlib", cache=False),
    )
    assert (two.n_inputs, two.n_outputs) == (one.n_inputs, one.n_outputs) == (5, 5)
    assert len(two.regions) == len(one.regions) == 1
    a, b = two.regions[0], one.regions[0]
    assert np.array_equal(a.lower, b.lower) and np.array_equal(a.upper, b.upper)
    assert len(a.clauses) == len(b.clauses)
    for ca, cb in zip(a.clauses, b.clauses, strict=True):
        assert np.array_equal(ca.C, cb.C) and np.array_equal(ca.d, cb.d)
    assert two.layout is not None and two.layout.single and one.layout is None


def test_two_networks_tied_inputs_and_concatenated_outputs(tmp_path):
    """An isomorphic-networks query: g's inputs equal f's (one joint input), outputs f then g, the
    relational rows over both; a bound given on g's copy tightens the shared input."""
    s = spec_of(
        tmp_path,
        HEAD + "(declare-network f (declare-input Xf real [2]) (declare-output Yf real [2]))\n"
        "(declare-network g (isomorphic-to f) (declare-input Xg real [2]) (declare-output Yg real [2]))\n"
        "(assert (and (<= Xf[0] 1.0) (>= Xf[0] -1.0)))\n"
        "(assert (and (<= Xf[1] 2.0) (>= Xf[1] 0.0)))\n"
        "(assert (== Xf[0] Xg[0]))\n(assert (== Xg[1] Xf[1]))\n"
        "(assert (<= Xg[1] 1.5))\n"
        "(assert (>= Yg[0] (+ Yf[1] 0.25)))\n",
    )
    assert (s.n_inputs, s.n_outputs) == (2, 4)
    (r,) = s.regions
    assert r.lower.tolist() == [-1.0, 0.0] and r.upper.tolist() == [1.0, 1.5]
    (c,) = r.clauses
    assert c.C.tolist() == [[0.0, 1.0, -1.0, 0.0]] and c.d.tolist() == [-0.25]
    f, g = s.layout.networks
    assert f.inputs[0].index == g.inputs[0].index == (0, 1)
    assert f.outputs[0].index == (0, 1) and g.outputs[0].index == (2, 3)
    assert not s.layout.single


def test_untied_inputs_matrices_scalars_and_every_comparison(tmp_path):
    """Two inputs (a 2x2 matrix and a scalar ``[]``) side by side in the joint input, row-major; ``==``
    with a constant pins an input; ``<``/``>`` as ``<=``/``>=``; an ``or`` of output conjunctions; n-ary
    ``+``/``-`` and ``*`` by a constant; a constant comparison that is true drops out."""
    s = spec_of(
        tmp_path,
        HEAD + "(declare-network n (declare-input A real [2,2]) (declare-input b real [])"
        " (declare-output Y real [3]))\n"
        "(assert (and (>= A[0,0] 0.0) (<= A[0,0] 1.0) (>= A[0,1] 0.0) (<= A[0,1] 1.0)))\n"
        "(assert (and (> A[1,0] -1.0) (< A[1,0] 0.0) (== A[1,1] 0.5)))\n"
        "(assert (and (<= b 3.0) (>= (* 2.0 b) 2.0)))\n"
        "(assert (or (and (< (+ Y[0] Y[1] 1.0) (- Y[2] 0.5)) (<= 1.0 2.0)) (> Y[1] 2.0)))\n",
    )
    assert (s.n_inputs, s.n_outputs) == (5, 3)
    (r,) = s.regions
    assert r.lower.tolist() == [0.0, 0.0, -1.0, 0.5, 1.0]
    assert r.upper.tolist() == [1.0, 1.0, 0.0, 0.5, 3.0]
    c0, c1 = r.clauses
    assert c0.C.tolist() == [[1.0, 1.0, -1.0]] and c0.d.tolist() == [-1.5]
    assert c1.C.tolist() == [[0.0, -1.0, 0.0]] and c1.d.tolist() == [-2.0]
    (net,) = s.layout.networks
    assert [x.index for x in net.inputs] == [(0, 1, 2, 3), (4,)]
    assert not s.layout.single  # two inputs: the model gets a wrapper


def test_input_boxes_inside_or_make_regions(tmp_path):
    s = spec_of(
        tmp_path,
        HEAD + "(declare-network n (declare-input X real [1]) (declare-output Y real [1]))\n"
        "(assert (or (and (>= X[0] 0.0) (<= X[0] 1.0)) (and (>= X[0] 2.0) (<= X[0] 3.0))))\n"
        "(assert (<= Y[0] 0.0))\n",
    )
    assert [(r.lower.tolist(), r.upper.tolist()) for r in s.regions] == [([0.0], [1.0]), ([2.0], [3.0])]


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ("(assert (!= Y[0] 0.0))", 4, "'!='"),
        ("(assert (<= X[0] Y[0]))", 4, "relating inputs to outputs"),
        ("(assert (<= X[0] X[1]))", 4, "relating several inputs"),
        ("(assert (or (== X[0] X[1]) (<= Y[0] 1.0)))", 4, "relating several inputs"),
        ("(assert (X[0] < Y[0]))", 4, "syntax error"),
        ("(assert (<= Z[0] 1.0))", 4, "Undeclared variable: 'Z'"),
        ("(assert (<= Y[0] 1.0))\n(assert (<= X[1] 1.0))", 3, "X[0] has no lower bound"),
        (
            "(assert (and (<= X[0] 1.0) (>= X[0] 2.0) (>= X[1] 0.0) (<= X[1] 1.0)))\n(assert (<= Y[0] 1.0))",
            4,
            "X[0] has empty bounds",
        ),
        ("(assert (> 1.0 2.0))", 4, "can never hold"),
        ("(assert (>= (* Y[0] Y[0]) 0.0))", 4, "a product of variables"),  # POLY
        ("(assert (== X[0] (* X[1] X[1])))", 4, "a product of variables"),  # in a tie's place
    ],
)
def test_what_the_joint_model_cannot_express_is_one_line_naming_it(tmp_path, body, line, words):
    text = HEAD + "(declare-network n\n (declare-input X real [2]) (declare-output Y real [1]))\n"
    bounds = "(assert (and (>= X[0] 0.0) (<= X[0] 1.0) (>= X[1] 0.0) (<= X[1] 1.0)))\n"
    message = error_of(
        tmp_path, text + body + "\n" + ("" if "bound" in words or "empty" in words else bounds)
    )
    assert message.startswith(f"{tmp_path / 'q.vnnlib'}:{line}: "), message
    assert words in message, message
    assert "\n" not in message


def test_hidden_tensors_are_refused(tmp_path):
    hidden = error_of(
        tmp_path,
        HEAD + '(declare-network n (declare-input X real [1]) (declare-hidden H real [1] "h")'
        " (declare-output Y real [1]))\n"
        "(assert (<= X[0] 1.0))\n(assert (>= X[0] 0.0))\n(assert (<= Y[0] 0.0))\n",
    )
    assert "hidden" in hidden
