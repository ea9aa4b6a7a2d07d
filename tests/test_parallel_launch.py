"""launch.run: in-process at world size 1, torchrun environment, spawned gloo ranks, failures.

Failures must end in RankFailure naming the rank within seconds, with no child process left.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from complete_verifier_ext.parallel import (
    EXACT_MEMORY_ENV,
    RankFailure,
    comm,
    exact_memory_env_ok,
    launch,
    run,
)

FAIL_WITHIN_S = 30.0


def _report(tag: str) -> dict[str, Any]:
    """Who and where this rank is."""
    return {
        "tag": tag,
        "rank": comm.rank(),
        "world": comm.world_size(),
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in EXACT_MEMORY_ENV},
        "exact_env_ok": exact_memory_env_ok(),
        "sum": comm.all_reduce(torch.ones(1)).item(),
    }


def _write_pid(pid_dir: str) -> None:
    Path(pid_dir, f"rank{comm.rank()}.pid").write_text(str(os.getpid()))


def _raise_on_rank_1(pid_dir: str) -> None:
    """Rank 1 raises while the others wait in a collective it never joins."""
    _write_pid(pid_dir)
    if comm.rank() == 1:
        raise ValueError("boom on purpose")
    comm.all_reduce(torch.ones(1))


def _sigkill_on_rank_1(pid_dir: str) -> None:
    """Rank 1 kills itself (SIGKILL) while the others wait in a collective."""
    _write_pid(pid_dir)
    if comm.rank() == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(1))


def _assert_no_children(pid_dir: Path, world_size: int) -> None:
    pids = [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]
    assert len(pids) == world_size
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_size_one_runs_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    res = run(_report, 1, ("single",))
    assert res["pid"] == os.getpid()
    assert (res["rank"], res["world"], res["sum"]) == (0, 1, 1.0)


def test_torchrun_environment_is_joined_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match="torchrun started 1 ranks"):
        res = run(_report, 2, ("torchrun",))
    assert res["pid"] == os.getpid() and res["world"] == 1


def test_spawned_ranks_return_rank_0_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """P = 3; MASTER_PORT from the environment is used (no port search); children get the exact-memory env."""
    monkeypatch.delenv("RANK", raising=False)
    for k in EXACT_MEMORY_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))

    def no_search(addr: str) -> int:
        raise AssertionError("MASTER_PORT was set: no port search expected")

    monkeypatch.setattr(launch, "_free_port", no_search)
    res = run(_report, 3, ("spawned",), timeout_s=30)
    assert res["tag"] == "spawned"
    assert (res["rank"], res["world"], res["sum"]) == (0, 3, 3.0)
    assert res["pid"] != os.getpid()
    assert res["env"] == EXACT_MEMORY_ENV and res["exact_env_ok"]
    assert not set(EXACT_MEMORY_ENV) & set(os.environ)  # the parent's environment is restored
    assert multiprocessing.active_children() == []


def test_spawned_ranks_without_exact_memory_keep_the_default_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    for k in EXACT_MEMORY_ENV:
        monkeypatch.delenv(k, raising=False)
    res = run(_report, 2, ("fast",), timeout_s=30, exact_memory=False)
    assert set(res["env"].values()) == {None} and not res["exact_env_ok"]


def test_rank_that_raises_is_named(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 1 failed: ValueError: boom on purpose") as info:
        run(_raise_on_rank_1, 2, (str(tmp_path),), timeout_s=60)
    assert time.monotonic() - start < FAIL_WITHIN_S
    assert info.value.rank == 1 and "Traceback" in info.value.details
    _assert_no_children(tmp_path, 2)


def test_rank_killed_by_signal_is_named(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=rf"^rank 1 died \(signal {int(signal.SIGKILL)}\)") as info:
        run(_sigkill_on_rank_1, 2, (str(tmp_path),), timeout_s=60)
    assert time.monotonic() - start < FAIL_WITHIN_S
    assert info.value.rank == 1
    _assert_no_children(tmp_path, 2)


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run(_report, 0, ("x",))


def test_gpu_ranks_without_a_gpu_each_are_said_to_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from complete_verifier_ext.parallel.launch import check_gpus

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (warning,) = check_gpus(2, "cuda", "auto")
    assert "1 GPU(s)" in warning and "CPU under gloo" in warning
    assert check_gpus(1, "cuda", "auto") == [] and check_gpus(2, "cpu", "auto") == []
    assert check_gpus(2, "cuda", "gloo") == []  # asked for by name
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_gpus(2, "cuda", "auto") == []
