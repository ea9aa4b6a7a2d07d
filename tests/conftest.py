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


# The long checks: sweeps over P, modes and engines of what a faster test checks at one setting,
# scenarios replayed with a stand-in fault (out of memory, signals, stopped ranks), and end-to-end runs
# beside a faster test of the same path. They keep the README's test
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
    "test_abcrown_plugin_proofs.py::test_a_resnet_proof_",  # sri_resnet_a by α-CROWN, checked
    # faults replayed: killed, stopped or skewed ranks, signals, dead peers, out of memory on one rank
    "test_abcrown_plugin_parent.py::test_a_rank_killed_mid_bab_",
    "test_abcrown_plugin_parent.py::test_a_killed_rank_",
    "test_abcrown_plugin_parent.py::test_clock_skew_",
    "test_abcrown_plugin_oom.py::test_a_layer_that_runs_out_",
    "test_abcrown_plugin_oom.py::test_not_even_one_row_",
    "test_bab_input_split.py::test_a_round_at_two_ranks_that_runs_out_",
    "test_bab_relu_split.py::test_at_p2_a_pass_that_runs_out_",
    "test_bab_relu_split.py::test_rank_killed_mid_bab_",
    "test_fake_cuda.py::test_out_of_memory_at_p2_",
    "test_real_runs.py::test_a_killed_csv_run_",
    "test_real_runs.py::test_torchrun_",
    "test_cli.py::test_killed_rank_",
    "test_cli.py::test_sighup_",
    "test_worker.py::test_no_worker_or_a_stopped_one_",
    "test_mip.py::test_a_stopped_solve_",
    "test_cli.py::test_killed_launcher_",
    "test_abcrown_plugin_search_mip.py::test_wait_patiently_",
    "test_abcrown_plugin_hostile.py::test_a_bad_model_or_spec_is_one_line_at_p1_and_p2[truncated onnx-True]",
    # P = 3, the second mode or the second engine of what a test at one setting checks
    "test_bab_relu_split.py::test_domain_parallel_three_ranks",
    "test_bab_input_split.py::test_domain_parallel_three_ranks_",
    "test_distributed_bounds.py::test_sharded_equals_single_on_every_rank[3-",
    "test_abcrown_plugin_search_activation.py::test_bab_with_domains_split_over_ranks[tp-3]",
    "test_abcrown_plugin_rows.py::test_conv_layers_below_the_pass_size_are_dealt[3-",
    "test_chunked_rows.py::test_chunked_on_two_ranks_equals_one_process[residual-fsdp]",
    "test_chunked_rows.py::test_chunked_on_two_ranks_equals_one_process[mlp-fsdp]",
    "test_fake_cuda.py::test_input_split_on_one_device[",
    "test_abcrown_plugin_rows.py::test_bounds_equal_unpatched_with_split_rows[3-",
    "test_parallel_sharded.py::test_gathered_is_bitwise_the_original[P3-",
    "test_cli.py::test_sat_has_checked_counterexample[2]",
    "test_mip.py::test_mip_mode_at_two_ranks_gives_the_verdict_of_one[-0.01]",
    "test_abcrown_plugin_hostile.py::test_a_bad_model_or_spec_is_one_line_at_p1_and_p2[vnnlib syntax-True]",
    "test_worker.py::test_warm_instances_give_the_cold_verdicts[abcrown]",
    "test_joint.py::test_two_networks_end_to_end_at_p1_and_p2[abcrown]",
    "test_joint.py::test_bad_2026_inputs_are_one_line_and_error_at_p2[abcrown]",
    "test_joint.py::test_a_gzipped_1x_instance_in_a_2026_category[abcrown]",
    # end-to-end runs on real data beside a faster test of the same path
    "test_abcrown_plugin_run.py::test_two_instances_in_one_rank_process_",
    "test_abcrown_plugin_proofs.py::test_activation_bab_proofs_",
    "test_abcrown_plugin_search_mip.py::test_auto_choosing_bab_refine_",
    "test_mip.py::test_two_ranks_share_the_output_milps_",
    "test_mip.py::test_bab_refine_pipeline[split",
    "test_joint.py::test_the_shared_isomorphic_instance_",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.nodeid.split("/")[-1].startswith(name) for name in LONG_CHECKS):
            item.add_marker(pytest.mark.slow)


# Tests whose runs write no proof to $CVE_PROOF_DIR: with a proof the native engine runs MILP steps as
# plain BaB, so these would no longer test what they test (tests of proofs name their own files).
NO_PROOF_FOLDER = (
    "test_mip.py::",
    "test_abcrown_plugin_search_mip.py::",
)


@pytest.fixture(autouse=True)
def _every_proof_checked(request, tmp_path_factory, monkeypatch):
    """Every ``unsat`` of a test's end-to-end runs writes its proof (``$CVE_PROOF_DIR``, read by the
    ``abcrown`` command of both engines, every P), and the independent checker decides each one when
    the test ends: an ``invalid`` proof fails the test. A proof whose files are gone by then (a
    temporary folder of the test's own) or that the checker cannot read (``unsupported``) is a warning."""
    if any(request.node.nodeid.split("/")[-1].startswith(name) for name in NO_PROOF_FOLDER):
        yield
        return
    folder = tmp_path_factory.mktemp("proofs")
    monkeypatch.setenv("CVE_PROOF_DIR", str(folder))
    yield
    import json
    import warnings

    from complete_verifier_ext.check import check_proof

    for proof in sorted(folder.glob("*.json")):
        if proof.stat().st_size == 0:
            continue  # reserved by a run that wrote no proof after all
        about = json.loads(proof.read_text())["query"]
        networks = {n["name"]: n["path"] for n in about["networks"]}
        try:
            result = check_proof(about["vnnlib"]["path"], networks, str(proof))
        except OSError as e:
            warnings.warn(f"{proof.name} not checked: {e}", stacklevel=1)
            continue
        if result.status == "unsupported":
            warnings.warn(f"{proof.name} not checked: {result.line()}", stacklevel=1)
        assert result.status != "invalid", f"the proof {proof} of an unsat: {result.line()}"


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
