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


# The long checks: sweeps over P and modes of what a faster test checks at one setting, and scenarios
# replayed with a stand-in fault (out of memory, signals, stopped ranks). They keep the README's test
# command short; `python -m pytest -q -n 2 -m slow tests` runs them, and CI runs both.
LONG_CHECKS = (
    "test_abcrown_plugin_zoo.py::",  # every zoo model at P = 1, 2, 3 in both modes (one setting: conformance)
    "test_abcrown_plugin_oom.py::test_at_p2_",  # out of memory on one rank, replayed in lockstep
    "test_abcrown_plugin_oom.py::test_a_bab_round_",
    "test_abcrown_plugin_oom.py::test_an_input_split_",
    "test_abcrown_plugin_oom.py::test_a_pick_",
    "test_abcrown_plugin_oom.py::test_the_output_node_",
    "test_abcrown_plugin_hostile.py::test_sigterm_",  # signals and stopped ranks mid-BaB
    "test_abcrown_plugin_hostile.py::test_a_stopped_rank_",
    "test_abcrown_plugin_hostile.py::test_the_first_instance_counts_",
    "test_joint.py::test_two_network_queries_on_the_plugin_route",  # two-network queries at P = 1 to 3
    "test_abcrown_plugin_rows.py::test_residual_sums_in_patches_mode_are_dealt",
    "test_abcrown_plugin_search_cuts.py::test_biccos_multi_tree_",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.nodeid.split("/")[-1].startswith(name) for name in LONG_CHECKS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _end_the_resident_worker():
    """The plugin tests' resident worker (``plugin_support.warm_prefix``) ends with the session."""
    yield
    from plugin_support import stop_worker

    stop_worker()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ``shared`` folder next to the repository checkout; skips the test when absent."""
    path = Path(__file__).resolve().parents[1].parent / "shared"
    if not path.is_dir():
        pytest.skip(f"shared data folder {path} not found (benchmark files unavailable)")
    return path


@pytest.fixture(scope="session")
def unpatched(tmp_path_factory):
    """α,β-CROWN alone (P = 1, through the plugin) on mnist 256x2 prop_0_0.05 (CROWN and α-CROWN do not
    verify it), with ``CHUNK`` rows per CROWN pass so that the ranks split the rows: the reference of
    the plugin's bound tests, run once for all pytest workers. Returns (folder, config path, summary)."""
    import json

    from filelock import FileLock
    from plugin_support import BOUNDS_YAML, CHUNK, config, instance, run

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this session
    tmp = root / "abcrown_p1"
    with FileLock(str(root / "abcrown_p1.lock")):
        done = tmp / "reference.json"
        if not done.is_file():
            tmp.mkdir(exist_ok=True)
            cfg = config(tmp, BOUNDS_YAML.format(chunk=CHUNK))
            proc, summary, _ = run(tmp, cfg, *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"))
            assert proc.returncode == 0, proc.stderr[-2000:]
            done.write_text(json.dumps({"cfg": cfg, "summary": summary}))
        saved = json.loads(done.read_text())
    return tmp, saved["cfg"], saved["summary"]
