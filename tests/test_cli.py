"""End-to-end runs of ``abcrown``: verdicts, result files, summaries, user errors, a killed rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support import alive, rank_processes

from complete_verifier_ext import testing
from complete_verifier_ext.cli import main
from complete_verifier_ext.model.onnx_loader import load_onnx

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs" / "example.yaml"


def _run(tmp_path: Path, *args: str) -> tuple[int, dict | None, str]:
    out = tmp_path / "out.txt"
    summary = tmp_path / "summary.json"
    code = main(
        [
            "--config",
            str(EXAMPLE),
            "--general.results_file",
            str(out),
            "--summary",
            str(summary),
            "--quiet",
            *args,
        ]
    )
    data = json.loads(summary.read_text()) if summary.exists() else None
    return code, data, out.read_text() if out.exists() else ""


def test_example_needs_alpha_crown(tmp_path):
    code, data, result = _run(tmp_path)
    assert code == 0 and result == "unsat\n"
    assert data["verdict"] == "unsat"
    assert min(data["bounds"]["crown"]) < 0 < min(data["bounds"]["alpha_crown"])
    assert len(data["bounds"]["ibp"]) == 4 and len(data["peak_mb"]) == 1
    assert "bab" not in data  # no search was needed


def test_crown_only_is_unknown_without_bab(tmp_path):
    code, data, result = _run(
        tmp_path, "--solver.bound_prop_method", "crown", "--general.complete_verifier", "skip"
    )
    assert code == 0 and result == "unknown\n" and "alpha_crown" not in data["bounds"]


def test_bab_completes_what_crown_cannot(tmp_path):
    code, data, result = _run(tmp_path, "--solver.bound_prop_method", "crown")
    assert code == 0 and result == "unsat\n" and min(data["bounds"]["crown"]) < 0
    bab = data["bab"]  # what the search did, for the benchmark tables
    assert bab["domains"] >= 2 and bab["rounds"] >= 1 and len(bab["max_queue"]) == 1


@pytest.mark.parametrize("world", [1, 2])
def test_sat_has_checked_counterexample(tmp_path, world):
    """The label wins at the box centre (where PGD starts), so PGD must take gradient steps; sharded,
    it needs the full input gradient on every rank to stay in lockstep."""
    onnx_path = testing.mlp_onnx(tmp_path / "net.onnx", [4, 16, 3], seed=3)
    graph = load_onnx(onnx_path)
    label = int(graph(torch.full((1, 4), 0.5)).argmax())
    testing.write_vnnlib(tmp_path / "p.vnnlib", np.zeros(4), np.ones(4), label, 3)
    code, data, result = _run(
        tmp_path,
        "--model.onnx_path",
        onnx_path,
        "--specification.vnnlib_path",
        str(tmp_path / "p.vnnlib"),
        "--attack.pgd_restarts",
        "1",
        "--parallel.mode",
        "fsdp" if world > 1 else "none",
        "--parallel.world_size",
        str(world),
        "--general.complete_verifier",
        "skip",
    )
    assert code == 0 and result.startswith("sat\n")
    xs = [float(v) for v in re.findall(r"\(X_\d+ ([^)]+)\)", result)]
    ys = [float(v) for v in re.findall(r"\(Y_\d+ ([^)]+)\)", result)]
    assert len(xs) == 4 and len(ys) == 3
    assert all(0.0 <= v <= 1.0 for v in xs)
    y = graph(torch.tensor([xs], dtype=torch.float32))[0]
    assert any(y[j] >= y[label] for j in range(3) if j != label)
    torch.testing.assert_close(y, torch.tensor(ys, dtype=torch.float32))


def test_instance_list_from_csv(tmp_path):
    ex = REPO / "complete_verifier_ext" / "examples"
    (tmp_path / "instances.csv").write_text(
        f"{ex / 'example.onnx'},{ex / 'example.vnnlib'},30\n{ex / 'example.onnx'},missing.vnnlib,30\n"
    )
    code, data, result = _run(
        tmp_path,
        "--model.onnx_path",
        "null",
        "--specification.vnnlib_path",
        "null",
        "--general.root_path",
        str(tmp_path),
        "--general.csv_name",
        "instances.csv",
    )
    assert code == 0
    verdicts = [i["verdict"] for i in data["instances"]]
    assert verdicts == ["unsat", "error"]
    assert "missing.vnnlib" in data["instances"][1]["message"]
    assert result.splitlines()[0].split(",")[2] == "unsat"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--solver.alpha-crown.lr_alfa", "0.1"], "lr_alpha"),
        (["--model.onnx_path", "/nonexistent/net.onnx"], "/nonexistent/net.onnx"),
        (
            ["--general.results_file", "/nonexistent_dir/out.txt"],
            "the folder /nonexistent_dir does not exist",
        ),
        (["--summary", "/nonexistent_dir/s.json"], "--summary: /nonexistent_dir/s.json"),
        (["--parallel.world_size", "2.5"], "'parallel.world_size' expects an integer, got 2.5"),
    ],
)
def test_user_errors_are_one_line(tmp_path, capsys, args, needle):
    code, _, result = _run(tmp_path, *args)
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert needle in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_bad_vnnlib_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.vnnlib"
    bad.write_text("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 oops))\n")
    code, _, result = _run(tmp_path, "--specification.vnnlib_path", str(bad))
    err = capsys.readouterr().err
    assert code == 1 and f"{bad}:3" in err and result == "error\n"


def test_two_ranks_same_verdict_and_bounds(tmp_path):
    _, single, _ = _run(tmp_path)
    code, sharded, result = _run(tmp_path, "--parallel.mode", "fsdp", "--parallel.world_size", "2")
    assert code == 0 and result == "unsat\n" and len(sharded["peak_mb"]) == 2
    # Rows split over two ranks go through products of other shapes (another BLAS blocking): float32
    # rounding of terms of magnitude ~1, seen up to 3.6e-7 on the bound -0.0337.
    np.testing.assert_allclose(sharded["bounds"]["crown"], single["bounds"]["crown"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sharded["bounds"]["alpha_crown"], single["bounds"]["alpha_crown"], atol=1e-4)


def _start_long_two_rank_run(out: Path, stderr) -> tuple[subprocess.Popen, list[int]]:
    """``abcrown`` on 2 ranks that cannot finish soon (lr 0: α-CROWN never proves the example);
    returns the launcher and its two rank processes once both run."""
    cmd = [sys.executable, "-m", "complete_verifier_ext.cli", "--config", str(EXAMPLE), "--quiet",
           "--general.results_file", str(out), "--parallel.mode", "fsdp", "--parallel.world_size", "2",
           "--attack.pgd_order", "skip", "--solver.alpha-crown.iteration", "100000",
           "--solver.alpha-crown.lr_alpha", "0", "--bab.timeout", "300"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=stderr, text=True)
    ranks: list[int] = []
    deadline = time.monotonic() + 60
    while len(ranks) < 2 and time.monotonic() < deadline:  # spawn also starts a resource tracker
        ranks = rank_processes(proc.pid)
        time.sleep(0.5)
    assert len(ranks) == 2, "ranks did not start"
    return proc, ranks


def test_killed_rank_ends_run_with_error(tmp_path):
    out = tmp_path / "out.txt"
    proc, ranks = _start_long_two_rank_run(out, subprocess.PIPE)
    time.sleep(4)  # let them get into alpha-CROWN
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert proc.returncode == 1
    assert "rank" in err and out.read_text() == "error\n"
    assert not [p for p in ranks if alive(p)]


def test_sighup_ends_the_run_like_ctrl_c(tmp_path):
    """SIGHUP (a closed terminal) and SIGTERM end a run as Ctrl-C does: ranks stopped, one line, exit
    128 + the signal, no traceback (the α,β-CROWN path: ``test_abcrown_plugin_hostile.py``)."""
    proc, ranks = _start_long_two_rank_run(tmp_path / "out.txt", subprocess.PIPE)
    time.sleep(2)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGHUP and "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted"]
    time.sleep(0.5)
    assert not [r for r in ranks if alive(r)]


def test_killed_launcher_takes_its_ranks_along(tmp_path):
    """SIGKILL of the launching process (no cleanup runs there) must not leave ranks running."""
    proc, ranks = _start_long_two_rank_run(tmp_path / "out.txt", subprocess.DEVNULL)
    time.sleep(2)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    left = ranks
    while left and time.monotonic() < deadline:
        left = [p for p in ranks if alive(p)]
        time.sleep(0.2)
    assert not left, f"ranks {left} outlived their launcher"


def test_an_internal_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    """Only user mistakes (UserError) are one line: a ValueError from inside the engine is a bug and
    keeps its traceback on stderr, and the harness still gets ``error`` and exit 1."""
    import complete_verifier_ext.verify as verify

    def broken(*args, **kwargs):
        raise ValueError("an internal inconsistency")

    monkeypatch.setattr(verify, "verify_instance", broken)
    code, _, _ = _run(tmp_path)
    err = capsys.readouterr().err
    assert code == 1 and (tmp_path / "out.txt").read_text() == "error\n"
    assert "Traceback" in err
    assert err.strip().splitlines()[-1] == "error: ValueError: an internal inconsistency"
