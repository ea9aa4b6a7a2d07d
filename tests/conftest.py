"""Shared pytest fixtures."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ``shared`` folder next to the repository checkout; skips the test when absent."""
    path = Path(__file__).resolve().parents[1].parent / "shared"
    if not path.is_dir():
        pytest.skip(f"shared data folder {path} not found (benchmark files unavailable)")
    return path
