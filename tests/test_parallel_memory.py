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
