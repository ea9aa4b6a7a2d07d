"""PeakMemory on the CPU (each measurement in a fresh process) and the start-up environment check."""

from __future__ import annotations

import os
import subprocess
import sys

from complete_verifier_ext.parallel import EXACT_MEMORY_ENV, exact_memory_env_ok


def _fresh(script: str, *args: str) -> list[str]:
    """Run ``script`` in a fresh Python process started with ``EXACT_MEMORY_ENV``; its printed words.

    RSS follows the live tensors only in such a process: in a long-lived test worker, glibc may serve a
    64 MiB block from free heap memory that earlier tests left resident, and RSS does not move (CI once
    read a peak of 0 three times in a row)."""
    env = {**os.environ, **EXACT_MEMORY_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


TRANSIENT = """
import torch
from complete_verifier_ext.parallel.memory import PeakMemory, hwm_mb, rss_mb
pm = PeakMemory("cpu")
torch.ones(1024).sum()  # torch's first operator: its code in
pm.start()
t = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, written
del t
first = pm.peak_mb()
assert rss_mb() <= hwm_mb()
pm.start()
print(first, pm.peak_mb(), pm.reset_ok)
"""


def test_cpu_peak_counts_a_transient_allocation_and_restart_forgets_it() -> None:
    """A 64 MiB transient shows as a 56..112 MiB peak; a new ``start()`` forgets it."""
    first, after_restart, reset_ok = _fresh(TRANSIENT)
    if reset_ok == "True":
        assert 56 <= float(first) <= 64 + 48, first
        assert float(after_restart) < 32, after_restart
    else:  # the high-water mark could not be reset: only an upper bound
        assert float(first) >= 56, first


def test_exact_memory_env_check_returns_bool() -> None:
    assert isinstance(exact_memory_env_ok(), bool)


GEMM = """
import torch
from complete_verifier_ext.parallel.memory import exact_memory_env_ok, rss_mb
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
(a[:64, :64] @ b[:64, :64]).sum()  # threads and code in
before = rss_mb()
c = a @ b
del c
print(exact_memory_env_ok(), rss_mb() - before)
"""


def test_gemm_buffers_go_back_under_the_exact_memory_env() -> None:
    """MKL keeps a GEMM's packing buffers for reuse (about 2.6 MB after a 1024 x 1024 product): a
    per-process constant that would not divide by P. Under ``EXACT_MEMORY_ENV`` nothing stays."""
    ok, kept = _fresh(GEMM)
    assert ok == "True" and float(kept) < 0.5, (ok, kept)


LIBRARY = """
import torch
from complete_verifier_ext.parallel.memory import PeakMemory, load_optimizer_libraries
pm = PeakMemory("cpu")
pm.start()
load_optimizer_libraries()  # torch's first optimizer: ~800 modules
load_optimizer_libraries()  # once per process
t = torch.ones(64 * 1024 * 1024 // 4)
del t
print(pm.library_mb(), pm.peak_mb(), pm.reset_ok)
"""


def test_library_code_loaded_during_a_measurement_is_left_out() -> None:
    """In a fresh process, torch's first optimizer adds tens of MB of RSS (module code, the same at any
    model size or P): ``peak_mb`` leaves it out and still sees a 64 MiB transient."""
    library, peak, reset_ok = _fresh(LIBRARY)
    assert float(library) > 20.0
    if reset_ok == "True":
        assert 56 <= float(peak) <= 64 + 48, (library, peak)


FILE_PAGES = """
import mmap, sys
import torch
from complete_verifier_ext.parallel.memory import PeakMemory
path = sys.argv[1]
with open(path, "wb") as f:
    f.truncate(32 * 1024 * 1024)
pm = PeakMemory("cpu")
pm.start()
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    total = sum(m[i] for i in range(0, len(m), 4096))  # every page resident, file-backed
    t = torch.ones(64 * 1024 * 1024 // 4)
    del t
    print(pm.code_mb(), pm.peak_mb(), pm.reset_ok)
    m.close()
"""


def test_file_backed_pages_paged_in_during_a_measurement_are_left_out(tmp_path) -> None:
    """Pages of a mapped file (as torch's own code is paged in the first time an operator runs) are
    not the computation's memory: ``peak_mb`` leaves them out and still sees a 64 MiB transient."""
    code, peak, reset_ok = _fresh(FILE_PAGES, str(tmp_path / "pages.bin"))
    assert 30.0 <= float(code) <= 34.0, code
    if reset_ok == "True":
        assert 60 <= float(peak) <= 72, (code, peak)


def _toy_passes(limit: int) -> list:
    """Two gloo ranks, each with one pass of its own rows (6 on rank 0, 8 on rank 1), every pass
    issuing the same collectives (a weight gather, a decision that the rest hangs on, a ring pass, a
    shard pass, a sized all-gather) whatever its rows (0: a dummy pass); rank 1 runs out of memory after
    the first two in any pass of more than ``limit`` rows. Returns every rank's (passes run,
    collectives issued, collective counts)."""
    import torch

    from complete_verifier_ext.parallel import comm, memory

    w = torch.arange(4.0) + comm.rank()

    def one_pass(n: int) -> float:
        out = torch.empty(4 * comm.world_size())
        comm.all_gather_into(out, w)
        if not comm.all_reduce_flag(comm.rank() == 0):  # True: a replay must be told so, not guess
            return 0.0
        if comm.rank() == 1 and n > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        got = comm.ring_pass_start(w, recv_shape=(4,)).wait()
        comm.shard_pass(w, torch.empty(4), 1)
        both = comm.all_gather_cat(w[None], 0, sizes=[1, 1])
        return float(out.sum() + got.sum() + both.sum()) + n

    queue, done = [6 if comm.rank() == 0 else 8], []
    while queue:
        n = queue.pop(0)
        out, failed = memory.lockstep_on_oom(lambda n=n: one_pass(n), lambda: one_pass(0), n, "toy")
        if out is None:  # every rank: this pass again as two of half its rows
            assert failed > limit
            queue[:0] = [n - n // 2, n // 2]
            continue
        done.append((n, out))
    stats = {k: v["calls"] for k, v in comm.stats().items()}
    return comm.all_gather_object((done, comm.issued(), stats))


def test_a_pass_that_runs_out_on_one_rank_runs_again_in_halves_on_every_rank(capfd) -> None:
    """Rank 1 runs out of memory midway through its pass (after the weight gather and a decision): it
    issues the rest of the pass's collectives over one dummy row without issuing those two again (the
    decision as it was), the ranks vote, and every rank runs its pass again as two of half its rows,
    until rank 1's fit. No hang; both ranks issue the same collectives; every row is bounded once; one
    line per pass that ran out."""
    from complete_verifier_ext.parallel import launch

    ranks = launch.run(_toy_passes, 2, (2,), backend="gloo")
    (done0, issued0, stats0), (done1, issued1, stats1) = ranks
    assert issued0 == issued1 and stats0 == stats1
    assert sum(n for n, _ in done0) == 6 and sum(n for n, _ in done1) == 8
    assert len(done0) == len(done1) and max(n for n, _ in done1) <= 2
    w0, w1 = sum(range(4)), sum(range(4)) + 4  # every pass saw both ranks' real weights
    assert all(out == 2 * (w0 + w1) + w1 + n for n, out in done0)
    assert all(out == 2 * (w0 + w1) + w0 + n for n, out in done1)
    err = capfd.readouterr().err
    assert "warning: out of memory on rank 1 in a pass of 8 rows of toy; every rank runs that" in err
    assert err.count("warning: out of memory on rank 1") == 3  # 8, then 4 and 4


def test_a_rank_out_of_memory_on_one_row_ends_every_rank_with_the_error(capfd) -> None:
    """Where a rank runs out on a pass of one row, every rank raises (no hang), after one line."""
    import pytest

    from complete_verifier_ext.parallel import launch

    with pytest.raises(launch.RankFailure, match="OutOfMemoryError"):
        launch.run(_toy_passes, 2, (0,), backend="gloo")
    err = capfd.readouterr().err
    assert "out of memory on rank 1 in a pass of 1 of toy's rows (the smallest pass): every rank stops" in err
