"""Shared pytest fixtures.

The test models are tiny, and distributed tests run several ranks on the same cores: one thread per
process (set before torch starts, so spawned ranks inherit it) avoids OpenMP oversubscription, which
made the suite an order of magnitude slower on a busy 2-core machine.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ``shared`` folder next to the repository checkout; skips the test when absent."""
    path = Path(__file__).resolve().parents[1].parent / "shared"
    if not path.is_dir():
        pytest.skip(f"shared data folder {path} not found (benchmark files unavailable)")
    return path
