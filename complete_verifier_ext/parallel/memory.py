"""Per-rank peak memory of the bound computation (one mode per process, measured per rank).

Usage::

    pm = PeakMemory(device)
    pm.start()            # after the model (this rank's shards) is loaded
    ...                   # bound computation
    pm.peak_mb()          # peak above the start, in MiB

CUDA: ``torch.cuda.reset_peak_memory_stats`` at ``start()``; ``peak_mb() = max_memory_allocated - baseline``.

CPU: ``start()`` resets the kernel's resident-set high-water mark (writes ``5`` to
``/proc/self/clear_refs``, Linux) and records the current RSS as the baseline; ``peak_mb()`` is
``VmHWM`` (``/proc/self/status``, or ``ru_maxrss``) minus the baseline. If the reset is impossible,
``reset_ok`` is False and the value is an upper bound (it includes any peak before ``start()``).

RSS follows the live tensors only if the allocators below torch give freed memory back to the OS:
glibc does for blocks above ``MALLOC_MMAP_THRESHOLD_`` (e.g. 65536), and MKL's GEMM keeps its
packing buffers for reuse (3-5 MB per process at these sizes, the same at every P, so it would not
divide by P) unless ``MKL_DISABLE_FAST_MM=1``. Both read their variable once, when the process starts,
so they must be in the environment *before* it starts (``EXACT_MEMORY_ENV``): ``launch.run`` sets
them for the ranks it spawns; a single-process run (the CLI) must re-exec itself with them, e.g.::

    if not exact_memory_env_ok():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **EXACT_MEMORY_ENV})

``exact_memory_env_ok()`` says whether this process started with them.

Code is not the bound computation's memory. RSS counts file-backed pages too, and torch pages in its
own machine code (``libtorch_cpu.so``) the first time each operator runs: 4-7 MB in a process's first
CROWN / α-CROWN pass, the same at every model size and every P, and shared between the ranks' processes
by the kernel. ``peak_mb`` leaves out the file-backed pages that came in since ``start()``
(``RssFile``, ``code_mb``): exact when none comes in after the peak (a warm-up pass before ``start()``
makes it so), else low by at most those that did. Likewise torch's first optimizer construction and step
import about 800 modules (``torch._dynamo``, the profiler): 70-80 MB of RSS and about a second, once
per process, the same at every model size and every P (a GPU allocator never sees it). α- and β-CROWN
call :func:`load_optimizer_libraries` before their first optimizer; the RSS it added is recorded and
``peak_mb`` leaves out what was loaded after ``start()`` (the modules stay resident to the end, so
the high-water mark holds them exactly once).

Out of memory in a bound pass: at P = 1 (:func:`halving_on_oom`) the pass runs again with half its rows
per sub-pass, down to one row, as GPU verifiers do; at P > 1 (:func:`passes_in_lockstep`) the rank that
ran out ends the pass with the others over a dummy row, the ranks vote, and every rank runs that pass and
the ones after it in halves (:func:`lockstep_on_oom`), so their collectives never part. A pass of one row
that still runs out stops every rank at the same point (:class:`LockstepOutOfMemoryError`), where a
caller that can shrink its own work on every rank retries it (``halving_on_oom(..., lockstep=True)``).
"""

from __future__ import annotations

import gc
import os
import resource
from pathlib import Path
from types import MappingProxyType

import torch

__all__ = [
    "EXACT_MEMORY_ENV",
    "PeakMemory",
    "available_mb",
    "file_mb",
    "hwm_mb",
    "load_optimizer_libraries",
    "exact_memory_env_ok",
    "not_bound_mb",
    "rss_mb",
]

# glibc: freed blocks above 64 KiB go back to the OS; MKL: no GEMM buffers kept for reuse
EXACT_MEMORY_ENV = MappingProxyType({"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"})

_MIB = 1024 * 1024
# this process's lazily loaded torch libraries: their RSS, and the file-backed part of it
_library = {"loaded": False, "mb": 0.0, "file_mb": 0.0}


def load_optimizer_libraries() -> None:
    """Construct and step an Adam once on a throwaway tensor (first call in a process only), recording
    the RSS this adds as library memory (see the module docstring)."""
    if _library["loaded"]:
        return
    _library["loaded"] = True
    gc.collect()  # garbage freed during the load would read as a smaller library
    gc.disable()
    try:
        before, file_before = rss_mb(), file_mb()
        p = torch.zeros(1, requires_grad=True)
        opt = torch.optim.Adam([p], lr=0.0)
        p.sum().backward()
        opt.step()
        _library["mb"] = max(0.0, rss_mb() - before)
        _library["file_mb"] = max(0.0, file_mb() - file_before)
    finally:
        gc.enable()


def not_bound_mb() -> float:
    """What this process holds that is no bound computation's memory, MiB: its file-backed pages (code)
    outside the lazily loaded libraries, plus those libraries' whole RSS. Only grows; a measurement
    leaves out its growth (see the module docstring)."""
    return file_mb() - _library["file_mb"] + _library["mb"]


def exact_memory_env_ok() -> bool:
    """True if this process started with ``EXACT_MEMORY_ENV`` (an integer mmap threshold, MKL's buffer
    cache off).

    Reads the start-up environment (``/proc/self/environ``) where available: setting ``os.environ``
    later does not affect glibc or MKL.
    """
    try:
        entries = Path("/proc/self/environ").read_bytes().split(b"\0")
        start_env = dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)
    except OSError:
        start_env = dict(os.environ)
    threshold = start_env.get("MALLOC_MMAP_THRESHOLD_", "").strip().isdigit()
    return threshold and start_env.get("MKL_DISABLE_FAST_MM", "").strip() not in ("", "0")


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmRSS``, ``VmHWM``), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb() -> float:
    """Current resident set size of this process, MiB (``ru_maxrss`` if /proc is unavailable)."""
    kb = _status_kb("VmRSS")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def file_mb() -> float:
    """File-backed resident pages of this process (``RssFile``: code and mapped files), MiB; 0 where
    unknown."""
    kb = _status_kb("RssFile")
    return (kb or 0) / 1024


def hwm_mb() -> float:
    """Resident-set high-water mark of this process, MiB."""
    kb = _status_kb("VmHWM")
    return (kb if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def available_mb(device: torch.device | str = "cpu") -> float:
    """Memory a computation may still take on ``device``, MiB: free GPU memory on CUDA, else the
    kernel's ``MemAvailable`` (inf where neither is known)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / _MIB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("inf")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


class PeakMemory:
    """Peak memory of this rank above the level at ``start()``, in MiB (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.baseline_mb = 0.0
        self.reset_ok = False
        self.library_at_start_mb = 0.0
        self.not_bound_at_start_mb = 0.0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def exact(self) -> bool:
        """Whether ``peak_mb`` is the peak of live memory (CUDA; CPU with the high-water mark reset
        and ``EXACT_MEMORY_ENV`` set at start-up) rather than an upper bound of it (freed blocks that
        glibc or MKL keeps for reuse count too)."""
        return self.is_cuda or (self.reset_ok and exact_memory_env_ok())

    def start(self) -> None:
        """Reset the high-water mark and record the current level as the baseline."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_mb = torch.cuda.memory_allocated(self.device) / _MIB
            self.reset_ok = True
        else:
            self.reset_ok = _reset_hwm()
            self.baseline_mb = rss_mb()
            self.library_at_start_mb = _library["mb"]
            self.not_bound_at_start_mb = not_bound_mb()

    def peak_total_mb(self) -> float:
        """The absolute high-water mark since ``start()`` (allocated bytes on CUDA, RSS on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / _MIB
        return hwm_mb()

    def library_mb(self) -> float:
        """RSS of the libraries torch loaded since ``start()`` (CPU; 0 on CUDA), left out of ``peak_mb``."""
        return 0.0 if self.is_cuda else _library["mb"] - self.library_at_start_mb

    def not_bound_mb(self) -> float:
        """:func:`not_bound_mb` now (CPU; 0 on CUDA, whose allocator never sees code or libraries)."""
        return 0.0 if self.is_cuda else not_bound_mb()

    def code_mb(self) -> float:
        """File-backed pages (torch's machine code) paged in since ``start()`` outside
        :func:`load_optimizer_libraries` (CPU; 0 on CUDA), left out of ``peak_mb``."""
        return max(0.0, self.not_bound_mb() - self.not_bound_at_start_mb - self.library_mb())

    def peak_mb(self) -> float:
        """Peak above the baseline recorded at ``start()``, less library code loaded and code pages paged
        in since, MiB (never negative)."""
        return max(0.0, self.peak_total_mb() - self.baseline_mb - self.library_mb() - self.code_mb())
