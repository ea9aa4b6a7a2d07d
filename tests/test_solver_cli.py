"""``complete-verifier-ext`` (``solver_cli.py``), the VNN-LIB 2.0 standard's solver command line: the 13
questions answered as the VNNLIB-Solver-Database's collector checks them, its packaging files by the
database's rules, and ``verify`` keeping what ``supports`` claims: a query in each claimed theory is
answered (every ``sat`` assignment replayed on onnxruntime), one outside is one line on stderr."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from complete_verifier_ext import solver_cli, testing

pytest.importorskip("vnnlib", reason="the reference VNN-LIB 2.0 parser (pip install vnnlib)")

REPO = Path(__file__).resolve().parents[1]
PACKAGING = REPO / "packaging" / "vnnlib-solver-database" / "solvers" / "complete-verifier-ext"
ACAS2 = REPO.parent / "shared" / "benchmarks" / "vnnlib2" / "acasxu"
THEORIES = {  # the database's permitted answers (its scripts/schema.py)
    "--hidden-node-theories": {"NH", "H"},
    "--multiple-input-output-theories": {"SIO", "MIO"},
    "--multiple-network-theories": {"SNET", "MENET", "MINET", "MNET"},
    "--multiple-node-comparison-theories": {"SNC", "MNC"},
    "--arithmetic-complexity-theories": {"BND", "OUTC", "LIN", "POLY"},
}


def ask(capsys, *argv: str) -> tuple[int, str, str]:
    code = solver_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def supports(capsys, flag: str) -> list[str]:
    code, out, _ = ask(capsys, "supports", flag)
    assert code == 0
    return [ln for ln in out.splitlines() if ln.strip()]


def test_the_database_questions(capsys):
    """Every answer as the collector checks it: exit 0, non-empty; two int opsets min <= max; two
    VNN-LIB versions; permitted theory tokens; exactly ``true``/``false``; the installed script's
    ``--version`` equals the packaging folder's."""
    code, out, _ = ask(capsys, "--name")
    assert code == 0 and out.strip()
    lo, hi = map(int, supports(capsys, "--onnx-opset-versions"))
    assert lo <= hi
    assert supports(capsys, "--vnnlib-versions") == ["1.0", "2.0"]
    assert supports(capsys, "--onnx-element-types") == ["real"]
    ops = supports(capsys, "--onnx-operators")
    assert {"Conv", "Gemm", "MatMul", "Relu", "Add"} <= {ln.split()[0] for ln in ops}
    for flag, permitted in THEORIES.items():
        assert {ln.split()[0] for ln in supports(capsys, flag)} <= permitted, flag
    for flag in ("--optimised-disjunctive-reasoning", "--serialise-assignments"):
        code, out, _ = ask(capsys, "supports", flag)
        assert code == 0 and out.strip() in ("true", "false")
    assert [p.name for p in PACKAGING.iterdir()] == [solver_cli._version()]
    script = shutil.which("complete-verifier-ext")
    cmd = [script] if script else [sys.executable, "-m", "complete_verifier_ext.solver_cli"]
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and out.stdout.splitlines()[0].strip() == solver_cli._version()
    code, out, err = ask(capsys, "supports", "--unknown-flag")
    assert code == 2 and not out and len(err.splitlines()) == 1


def test_the_packaging_files_keep_the_databases_rules():
    """``install.sh``: the exact shebang, LF only, executable in git (100755), names its version;
    ``solver.toml`` has an http(s) ``repo``."""
    import tomllib

    folder = PACKAGING / solver_cli._version()
    raw = (folder / "install.sh").read_bytes()
    assert raw.split(b"\n", 1)[0] == b"#!/usr/bin/env bash" and b"\r" not in raw
    assert solver_cli._version().encode() in raw
    staged = subprocess.run(["git", "ls-files", "-s", str(folder / "install.sh")], cwd=REPO,
                            capture_output=True, text=True)  # fmt: skip
    if staged.returncode == 0 and staged.stdout:  # a git checkout
        assert staged.stdout.split()[0] == "100755"
    toml = tomllib.loads((folder / "solver.toml").read_text())
    assert re.match(r"https?://", toml["repo"])


def read_assignment(out: str) -> dict[str, np.ndarray]:
    """The command-line assignment format: ``NAME TYPE [dims]`` then one value per line."""
    lines, values = out.splitlines()[1:], {}
    while lines:
        name, _, dims = lines.pop(0).split(maxsplit=2)
        shape = [int(d) for d in dims.strip("[]").split(",") if d]
        n = math.prod(shape)
        values[name] = np.array([float(v) for v in lines[:n]]).reshape(shape)
        lines = lines[n:]
    return values


def two_input_net(path: Path) -> str:
    """A network with two inputs (a [1,3], b [1,2]) and two outputs (y1 [1,2], y2 [1,1]): MIO."""
    rng = np.random.default_rng(0)
    W = {"W1": (3, 6), "W2": (2, 6), "V": (6, 2), "U": (6, 1)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in W.items()]
    node = helper.make_node
    nodes = [node("MatMul", ["a", "W1"], ["p"]), node("MatMul", ["b", "W2"], ["q"]),
             node("Add", ["p", "q"], ["s"]), node("Relu", ["s"], ["h"]),
             node("MatMul", ["h", "V"], ["y1"]), node("MatMul", ["h", "U"], ["y2"])]  # fmt: skip
    io = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "mio", [io("a", TensorProto.FLOAT, [1, 3]), io("b", TensorProto.FLOAT, [1, 2])],
        [io("y1", TensorProto.FLOAT, [1, 2]), io("y2", TensorProto.FLOAT, [1, 1])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return str(path)


MIO = """(vnnlib-version <2.0>)
(declare-network n (declare-input A real [1,3]) (declare-input B real [1,2])
  (declare-output Y1 real [1,2]) (declare-output Y2 real [1,1]))
(assert (and (>= A[0,0] 0.0) (<= A[0,0] 1.0) (>= A[0,1] 0.0) (<= A[0,1] 1.0) (>= A[0,2] 0.0) (<= A[0,2] 1.0)))
(assert (and (>= B[0,0] -1.0) (<= B[0,0] 1.0) (>= B[0,1] -1.0) (<= B[0,1] 1.0)))
(assert (>= (- Y1[0,1] Y2[0,0]) {t}))
"""


def test_verify_mio_sat_replays_and_serialises(capsys, tmp_path):
    """Two inputs and two outputs (MIO, OUTC): ``unsat`` where the gap cannot be reached; ``sat`` with
    every variable in declaration order, the outputs those onnxruntime computes from the inputs, and
    the same values written as ONNX tensors (float64 for ``real``) by ``--serialise-assignments``.
    Asked for a proof, the ``unsat`` writes one and the ``sat`` none (its search verified no box: the
    gather of no leaves was an error once)."""
    net = two_input_net(tmp_path / "mio.onnx")
    for t, verdict in (("1000.0", "unsat"), ("-1000.0", "sat")):
        (tmp_path / "q.vnnlib").write_text(MIO.format(t=t))
        proof = tmp_path / f"{verdict}.json"
        code, out, err = ask(capsys, "verify", str(tmp_path / "q.vnnlib"), "--network", f"n={net}",
                             "--timeout", "60", "--serialise-assignments", str(tmp_path / "pb"),
                             "--proof", str(proof))  # fmt: skip
        assert code == 0 and out.splitlines()[0] == verdict, err[-2000:]
        assert "input-split branch and bound" in err  # the method named on stderr
        assert proof.exists() == (verdict == "unsat")
    got = read_assignment(out)
    assert list(got) == ["A", "B", "Y1", "Y2"] and got["A"].shape == (1, 3) and got["Y2"].shape == (1, 1)
    y1, y2 = ort.InferenceSession(net).run(None, {"a": got["A"].astype(np.float32),
                                                  "b": got["B"].astype(np.float32)})  # fmt: skip
    np.testing.assert_allclose(got["Y1"], y1, atol=1e-5)
    np.testing.assert_allclose(got["Y2"], y2, atol=1e-5)
    for name, value in got.items():
        tensor = onnx.load_tensor(str(tmp_path / "pb" / f"{name}.pb"))
        assert tensor.name == name and tensor.data_type == TensorProto.DOUBLE
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), value)


@pytest.mark.skipif(not ACAS2.is_dir(), reason="../shared/benchmarks/vnnlib2 is absent")
def test_verify_acasxu_2_0_and_its_1x_form(capsys):
    """ACAS Xu property 2 on net 2_1 (sat, known): the 2.0 query and the 1.x file give the same
    verdict; the 2.0 assignment replays on onnxruntime."""
    net = ACAS2 / "onnx" / "ACASXU_run2a_2_1_batch_2000.onnx"
    code, out, err = ask(
        capsys, "verify", str(ACAS2 / "vnnlib" / "prop_2.vnnlib"), "--network", f"prop_2={net}"
    )
    assert code == 0 and out.splitlines()[0] == "sat", err[-2000:]
    got = read_assignment(out)
    y = ort.InferenceSession(str(net)).run(None, {"input": got["X"].astype(np.float32).reshape(1, 1, 1, 5)})
    np.testing.assert_allclose(got["Y"], y[0].reshape(-1), atol=1e-5)
    one = REPO.parent / "shared" / "benchmarks" / "acasxu" / "vnnlib" / "prop_2.vnnlib"
    code, out, err = ask(capsys, "verify", str(one), "--network", f"any={net}", "--timeout", "60")
    assert code == 0 and out.splitlines()[0] == "sat", err[-2000:]


def pair_query(relation: str, gap: float) -> str:
    """``f`` and ``g`` (``relation`` to ``f``, or unrelated) on one tied input; ``Yg[1] − Yf[1] >= gap``."""
    rel = f" ({relation} f)" if relation else ""
    text = "(vnnlib-version <2.0>)\n"
    text += "(declare-network f (declare-input Xf real [3]) (declare-output Yf real [2]))\n"
    text += f"(declare-network g{rel} (declare-input Xg real [3]) (declare-output Yg real [2]))\n"
    for i in range(3):
        text += f"(assert (and (>= Xf[{i}] -1.0) (<= Xf[{i}] 1.0)))\n(assert (== Xg[{i}] Xf[{i}]))\n"
    return text + f"(assert (>= (- Yg[1] Yf[1]) {gap}))\n"


def test_verify_two_networks(capsys, tmp_path):
    """MENET (``equal-to``: one ``--network``), MINET (``isomorphic-to``: two) and MNET (unrelated: two),
    each ``unsat`` and ``sat`` by construction; a sat assignment lists both networks' variables."""
    f = testing.wx_onnx(tmp_path / "f.onnx", [3, 8, 2], 1)
    g = testing.wx_onnx(tmp_path / "g.onnx", [3, 8, 2], 2)
    for relation, nets in (("equal-to", [f"f={f}"]), ("isomorphic-to", [f"f={f}", f"g={g}"]),
                           ("", [f"f={f}", f"g={g}"])):  # fmt: skip
        for gap, verdict in ((100.0, "unsat"), (-100.0, "sat")):
            query = (
                tmp_path / f"q{relation}{gap}.vnnlib"
            )  # one file each: their proofs are checked at the end
            query.write_text(pair_query(relation, gap))
            argv = ["verify", str(query), "--timeout", "60"]
            code, out, err = ask(capsys, *argv, *[a for n in nets for a in ("--network", n)])
            assert code == 0 and out.splitlines()[0] == verdict, (relation, err[-2000:])
    assert list(read_assignment(out)) == ["Xf", "Yf", "Xg", "Yg"]


def one_error(capsys, *argv: str) -> str:
    code, out, err = ask(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1 and out == "" and len(lines) == 1, (code, out, err)
    return lines[0]


def test_network_files_missing_or_unnecessary(capsys, tmp_path):
    """The chapter's first error: a missing or an unnecessary ``--network`` (an ``equal-to`` network
    given a file, a name not declared), and a 1.x query given two."""
    f = testing.wx_onnx(tmp_path / "f.onnx", [3, 8, 2], 1)
    (tmp_path / "eq.vnnlib").write_text(pair_query("equal-to", 1.0))
    (tmp_path / "iso.vnnlib").write_text(pair_query("isomorphic-to", 1.0))
    eq, iso = str(tmp_path / "eq.vnnlib"), str(tmp_path / "iso.vnnlib")
    assert "no --network for the declared network 'g'" in one_error(
        capsys, "verify", iso, "--network", f"f={f}"
    )
    assert "marked equal-to" in one_error(capsys, "verify", eq, "--network", f"f={f}", "--network", f"g={f}")
    assert "not declared" in one_error(capsys, "verify", eq, "--network", f"f={f}", "--network", f"h={f}")
    assert "file not found" in one_error(capsys, "verify", eq, "--network", f"f={tmp_path / 'none.onnx'}")
    one = testing.write_vnnlib(tmp_path / "one.vnnlib", [0.0] * 3, [1.0] * 3, 0, 2)
    assert "takes one --network" in one_error(
        capsys, "verify", one, "--network", f"a={f}", "--network", f"b={f}"
    )


PLAIN = "(declare-input X real [2]) (declare-output Y real [1])"


@pytest.mark.parametrize(
    ("declarations", "assertion", "words"),
    [
        ("(declare-input X float32 [2]) (declare-output Y float32 [1])", "(<= Y[0] 0.0)", "declared float32"),
        ('(declare-input X real [2]) (declare-hidden H real [1] "h") (declare-output Y real [1])',
         "(<= Y[0] 0.0)", "hidden"),  # H
        (PLAIN, "(<= X[0] Y[0])", "inputs to outputs"),  # MNC
        (PLAIN, "(<= (+ X[0] X[1]) 0.5)", "several inputs"),  # LIN
        (PLAIN, "(<= (* Y[0] Y[0]) 0.5)", "product"),  # POLY
    ],
)  # fmt: skip
def test_what_supports_does_not_claim_is_one_line(capsys, tmp_path, declarations, assertion, words):
    """Outside the claimed theories (and a declared ONNX element type: only ``real`` is analysed) a
    query is refused in one line, nothing on stdout, exit 1."""
    net = testing.mlp_onnx(tmp_path / "n.onnx", [2, 4, 1], 0)
    (tmp_path / "q.vnnlib").write_text(
        f"(vnnlib-version <2.0>)\n(declare-network n {declarations})\n"
        "(assert (and (>= X[0] 0.0) (<= X[0] 1.0) (>= X[1] 0.0) (<= X[1] 1.0)))\n"
        f"(assert {assertion})\n"
    )
    assert words in one_error(capsys, "verify", str(tmp_path / "q.vnnlib"), "--network", f"n={net}")


def test_an_in_process_verify_counts_its_timeout_from_the_call(capsys, tmp_path, monkeypatch):
    """Called from Python long after this package was imported (here: 1000 s), ``verify --timeout``
    counts from the call: it neither times out at once nor ends its caller later (its hard end is
    cancelled once the answer is out)."""
    import time

    from complete_verifier_ext import clock

    monkeypatch.setattr(clock, "_IMPORTED_WALL", time.time() - 1000)
    monkeypatch.setattr(clock, "_IMPORTED_MONO", time.monotonic() - 1000)
    net = two_input_net(tmp_path / "mio.onnx")
    (tmp_path / "q.vnnlib").write_text(MIO.format(t="-1000.0"))
    code, out, err = ask(
        capsys, "verify", str(tmp_path / "q.vnnlib"), "--network", f"n={net}", "--timeout", "3"
    )
    assert code == 0 and out.splitlines()[0] == "sat", err[-2000:]
    time.sleep(3)  # past the hard end of that call: this process is still here


def test_a_bad_world_size_is_one_line():
    """``--world-size`` goes through the ``parallel`` section's own checks: 0 ranks is one line, exit 1."""
    ex = Path(__file__).resolve().parents[1] / "complete_verifier_ext" / "examples"
    cmd = [sys.executable, "-m", "complete_verifier_ext.solver_cli", "verify", str(ex / "example.vnnlib")]
    cmd += ["--network", f"N={ex / 'example.onnx'}", "--world-size", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "error: --world-size 0: expected a number of ranks, 1 or more"
    ], out.stderr
