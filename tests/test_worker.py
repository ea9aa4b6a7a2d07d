"""The resident worker (``worker.py``) behind ``prepare_instance.sh`` / ``run_instance.sh``: instances
run warm give the verdicts of cold runs (both engines, P = 1 and 2, one after another in one worker);
a missing, killed or stopped worker falls back to a cold start with the same verdict; a worker ends
when idle; a client that goes takes its instance with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plugin_support import LIMIT_S, needs_abcrown, plugin_env

from complete_verifier_ext import testing, worker

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "vnncomp_scripts"


@pytest.fixture
def instances(tmp_path):
    """A net with a sat and an unsat property by construction (an output above −1000, above 1000)."""
    net = testing.mlp_onnx(tmp_path / "n.onnx", [3, 8, 2], 0)
    head = "".join(f"(declare-const X_{i} Real)\n" for i in range(3)) + "(declare-const Y_0 Real)\n"
    head += "(declare-const Y_1 Real)\n" + "".join(
        f"(assert (>= X_{i} 0.0))\n(assert (<= X_{i} 1.0))\n" for i in range(3)
    )
    (tmp_path / "sat.vnnlib").write_text(head + "(assert (>= Y_0 -1000.0))\n")
    (tmp_path / "unsat.vnnlib").write_text(head + "(assert (>= Y_0 1000.0))\n")
    return net, str(tmp_path / "sat.vnnlib"), str(tmp_path / "unsat.vnnlib")


def _env(tmp_path: Path, engine: str, world: int = 1, **extra: str) -> dict:
    env = plugin_env(CVE_ENGINE=engine, CVE_WORKER_DIR=str(tmp_path), PYTHON=sys.executable, **extra)
    env["ABCROWN_EXTRA_ARGS"] = (
        f"--parallel.mode fsdp --parallel.world_size {world} --summary {tmp_path / 's.json'}"
    )
    return env


def _run(tmp_path: Path, env: dict, net: str, spec: str) -> tuple[str, subprocess.CompletedProcess]:
    results = tmp_path / "r.txt"
    cmd = ["bash", str(SCRIPTS / "run_instance.sh"), "v1", "acasxu", net, spec, str(results), "60"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp_path)
    return (results.read_text().split("\n")[0] if results.exists() else ""), out


def _start(tmp_path: Path, env: dict, net: str, spec: str) -> int:
    prep = subprocess.run(["bash", str(SCRIPTS / "prepare_instance.sh"), "v1", "acasxu", net, spec],
                          env=env, capture_output=True, text=True, timeout=LIMIT_S)  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    reply = _ask(env, "ping")
    assert reply, "no worker answers after prepare_instance.sh"
    return reply["pid"]


def _socket(env: dict) -> Path:
    code = f"from complete_verifier_ext import worker; print(worker.socket_path({env['CVE_ENGINE']!r}))"
    return Path(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()
    )


def _ask(env: dict, op: str) -> dict | None:
    """The worker's answer to ``op`` (None: no worker answers within 2 s; a busy one does not)."""
    call = f"worker._ask({env['CVE_ENGINE']!r}, {op!r})"
    code = f"import json; from complete_verifier_ext import worker; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip() or "null")


@pytest.mark.parametrize("engine", ["native", pytest.param("abcrown", marks=needs_abcrown)])
def test_warm_instances_give_the_cold_verdicts(tmp_path, instances, engine):
    """One worker, instances one after another at P = 1 and 2 (each in its own forked process, whose
    summary says it began work after the script started); then the worker is killed: the next run
    starts cold with the same verdict."""
    net, sat, unsat = instances
    env = _env(tmp_path, engine)
    pid = _start(tmp_path, env, net, sat)
    for world in (1, 2):
        env = _env(tmp_path, engine, world)
        for spec, verdict in ((sat, "sat"), (unsat, "unsat"), (sat, "sat")):
            t0 = time.time()
            got, out = _run(tmp_path, env, net, spec)
            assert got == verdict and out.returncode == 0, out.stderr[-2000:]
            summary = json.loads((tmp_path / "s.json").read_text())
            assert (summary[0] if isinstance(summary, list) else summary)["started_at"] >= t0 - 0.01
    assert _ask(env, "ping")["pid"] == pid  # the same worker served them all
    os.kill(pid, signal.SIGKILL)
    got, out = _run(tmp_path, env, net, unsat)
    assert got == "unsat" and out.returncode == 0, out.stderr[-2000:]


def test_no_worker_or_a_stopped_one_starts_cold(tmp_path, instances):
    net, sat, _ = instances
    env = _env(tmp_path, "native")
    got, out = _run(tmp_path, env, net, sat)  # none was started
    assert got == "sat", out.stderr[-2000:]
    _start(tmp_path, env, net, sat)
    assert _ask(env, "stop") is not None
    deadline = time.monotonic() + 30
    while _ask(env, "ping") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ask(env, "ping")
    got, out = _run(tmp_path, env, net, sat)
    assert got == "sat", out.stderr[-2000:]
    assert not _socket(env).exists(), "a stopped worker removes its socket"


def test_an_idle_worker_ends_on_its_own(tmp_path, instances):
    net, sat, _ = instances
    env = _env(tmp_path, "native", CVE_WORKER_IDLE_S="1")
    _start(tmp_path, env, net, sat)
    deadline = time.monotonic() + 60
    while _ask(env, "ping") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ask(env, "ping") and not _socket(env).exists()


def test_a_client_that_goes_takes_its_instance(tmp_path, instances):
    """The harness kills run_instance.sh mid-instance: the instance's processes (rank included) end,
    and the worker serves the next instance."""
    net, sat, _ = instances
    env = _env(tmp_path, "native", 2)
    pid = _start(tmp_path, env, net, sat)
    long_run = (
        "--attack.pgd_order skip --bab.branching.input_split.enable false --solver.bound_prop_method "
        "alpha-crown --solver.alpha-crown.iteration 100000 --solver.alpha-crown.lr_alpha 0"
    )
    env_long = {**env, "ABCROWN_EXTRA_ARGS": env["ABCROWN_EXTRA_ARGS"] + " " + long_run}
    cmd = ["bash", str(SCRIPTS / "run_instance.sh"), "v1", "acasxu", net, sat, str(tmp_path / "r.txt"), "300"]
    proc = subprocess.Popen(
        cmd, env=env_long, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    forked: list[int] = []
    while len(forked) < 2 and time.monotonic() < deadline:  # the instance and its second rank
        forked = _descendants(pid)
        time.sleep(0.2)
    assert len(forked) >= 2, forked
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in forked) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in forked)
    got, out = _run(tmp_path, env, net, sat)
    assert got == "sat" and _ask(env, "ping")["pid"] == pid, out.stderr[-2000:]


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    children = [int(p) for p in out]
    return children + [d for c in children for d in _descendants(c)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_a_worker_is_found_only_by_its_own_code_and_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("CVE_WORKER_DIR", str(tmp_path))
    monkeypatch.setenv("ABCROWN_PATH", "/a")
    a = worker.socket_path("abcrown")
    monkeypatch.setenv("ABCROWN_PATH", "/b")
    assert worker.socket_path("abcrown") != a and worker.socket_path("native") != worker.socket_path(
        "abcrown"
    )
    monkeypatch.setenv("CVE_WORKER_DIR", str(tmp_path / ("x" * 120)))  # too long for a socket's name
    assert len(str(worker.socket_path("native"))) < 100
    monkeypatch.setenv("CVE_WORKER", "off")
    assert not worker.start("native") and not list(tmp_path.iterdir())
