"""PeakMemory on the CPU (in-process) and the start-up environment check."""

from __future__ import annotations

import torch

from complete_verifier_ext.parallel import PeakMemory, mmap_threshold_env_ok
from complete_verifier_ext.parallel.memory import hwm_mb, rss_mb


def _touch_and_free(mb: int) -> None:
    """Allocate and write ``mb`` MiB, then free it (large blocks are mmapped, so RSS goes back)."""
    t = torch.ones(mb * 1024 * 1024 // 4)
    del t


def test_cpu_peak_counts_a_transient_allocation() -> None:
    pm = PeakMemory("cpu")
    pm.start()
    _touch_and_free(64)
    peak = pm.peak_mb()
    assert rss_mb() <= hwm_mb()
    if pm.reset_ok:
        assert 56 <= peak <= 64 + 48, peak
    else:  # the high-water mark could not be reset: only an upper bound
        assert peak >= 56


def test_restart_forgets_the_previous_peak() -> None:
    pm = PeakMemory("cpu")
    pm.start()
    _touch_and_free(64)
    pm.start()
    if pm.reset_ok:
        assert pm.peak_mb() < 32


def test_mmap_threshold_check_returns_bool() -> None:
    assert isinstance(mmap_threshold_env_ok(), bool)
