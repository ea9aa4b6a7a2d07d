"""Tests of the config schema and loader (YAML, overrides, validation) and of the VNN-COMP scripts."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from complete_verifier_ext.config import AlphaCrownConfig, Config, ConfigError
from complete_verifier_ext.config_help import config_to_dict
from complete_verifier_ext.config_load import (
    config_from_dict,
    load_config,
    parse_overrides,
    resolve_path,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SCRIPTS = REPO / "vnncomp_scripts"


def write_yaml(tmp_path: Path, text: str, name: str = "exp.yaml") -> str:
    """Write a dedented YAML file under tmp_path and return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# --------------------------------------------------------------------------------------------------
# Defaults and YAML loading
# --------------------------------------------------------------------------------------------------


def test_defaults():
    cfg = Config()
    assert cfg.general.device == "cpu"
    assert cfg.general.seed == 100
    assert cfg.general.csv_name is None
    assert cfg.general.results_file == "out.txt"
    assert cfg.general.enable_incomplete_verification is True
    assert cfg.general.complete_verifier == "bab"
    assert cfg.model.onnx_path is None and cfg.model.input_shape is None
    assert cfg.specification.vnnlib_path is None
    assert cfg.solver.batch_size == 64
    assert cfg.solver.bound_prop_method == "alpha-crown"
    assert cfg.solver.alpha_crown == AlphaCrownConfig(
        iteration=100, lr_alpha=0.1, lr_decay=0.98, early_stop_patience=10
    )
    assert (cfg.solver.beta_crown.iteration, cfg.solver.beta_crown.lr_beta) == (50, 0.05)
    assert (cfg.bab.timeout, cfg.bab.branching.method, cfg.bab.branching.reduceop) == (360, "kfsb", "min")
    assert cfg.bab.branching.input_split.enable is False
    assert (cfg.attack.pgd_order, cfg.attack.pgd_steps, cfg.attack.pgd_restarts) == ("before", 100, 30)
    assert cfg.attack.pgd_alpha == "auto"
    assert (cfg.parallel.mode, cfg.parallel.world_size, cfg.parallel.backend) == ("none", 1, "auto")


def test_load_without_file_gives_defaults():
    assert load_config(None) == (Config(), [])


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().solver.batch_size = 3  # type: ignore[misc]


def test_yaml_loading(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        general:
          device: cuda:1
          seed: 7
          results_file: res.txt
          enable_incomplete_verification: no
        model:
          input_shape: [-1, 1, 28, 28]
        solver:
          batch_size: "512"
          bound_prop_method: crown
          alpha-crown: {iteration: 20, lr_alpha: 1}
          beta-crown:
            lr_beta: 0.1
        bab:
          timeout: 30
          branching: {method: babsr, reduceop: max, input_split: {enable: true}}
        attack:
          pgd_order: skip
          pgd_alpha: 0.01
        parallel: {mode: tp, world_size: 4, backend: gloo}
    """,
    )
    cfg, warnings = load_config(path)
    assert len(warnings) == 1 and warnings[0].endswith(
        "not implemented here: model.input_shape"
    )  # parsed, unused
    assert (cfg.general.device, cfg.general.seed, cfg.general.results_file) == ("cuda:1", 7, "res.txt")
    assert cfg.general.enable_incomplete_verification is False
    assert cfg.model.input_shape == [-1, 1, 28, 28]
    assert cfg.solver.batch_size == 512
    assert cfg.solver.bound_prop_method == "crown"
    assert cfg.solver.alpha_crown.iteration == 20
    assert cfg.solver.alpha_crown.lr_alpha == 1.0 and isinstance(cfg.solver.alpha_crown.lr_alpha, float)
    assert cfg.solver.beta_crown.lr_beta == 0.1
    assert cfg.bab.timeout == 30.0 and isinstance(cfg.bab.timeout, float)
    assert cfg.bab.branching.method == "babsr" and cfg.bab.branching.input_split.enable is True
    assert cfg.attack.pgd_order == "skip" and cfg.attack.pgd_alpha == 0.01
    assert cfg.parallel == dataclasses.replace(cfg.parallel, mode="tp", world_size=4, backend="gloo")


def test_empty_yaml_file(tmp_path):
    assert load_config(write_yaml(tmp_path, "# nothing\n")) == (Config(), [])


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+:\d+: invalid YAML: expected"):
        load_config(write_yaml(tmp_path, "general: [unclosed\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write_yaml(tmp_path, "- a\n- b\n", "list.yaml"))
    with pytest.raises(ConfigError, match="section 'solver' must be a mapping"):
        load_config(write_yaml(tmp_path, "solver: 5\n", "sec.yaml"))


def test_early_stop_patience_alpha_beta_crown_spelling(tmp_path):
    cfg, warnings = load_config(write_yaml(tmp_path, "solver:\n  early_stop_patience: 3\n"))
    assert cfg.solver.alpha_crown.early_stop_patience == 3  # read under either spelling, and reported as
    assert len(warnings) == 1 and "solver.alpha-crown.early_stop_patience" in warnings[0]  # not acted on


def test_config_to_dict_round_trip():
    cfg, _ = config_from_dict({"solver": {"alpha-crown": {"iteration": 5}}, "model": {"input_shape": [1, 2]}})
    data = config_to_dict(cfg)
    assert data["solver"]["alpha-crown"]["iteration"] == 5
    assert "beta-crown" in data["solver"] and "alpha_crown" not in data["solver"]
    assert data["bab"]["branching"]["input_split"] == {"enable": False}
    again, warnings = config_from_dict(data)
    assert again == cfg and len(warnings) == 1 and "model.input_shape" in warnings[0]  # parsed, not used
    data["model"]["input_shape"].append(3)
    assert cfg.model.input_shape == [1, 2]  # the dict does not alias the config


# --------------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------------


def test_parse_overrides_values():
    tree = parse_overrides(
        [
            "--solver.alpha-crown.iteration",
            "20",
            "--parallel.mode=fsdp",
            "--general.deterministic",
            "yes",
            "--general.double_fp",  # bare flag
            "--solver.alpha-crown.lr_alpha",
            "1",
            "--general.csv_name",
            "null",
            "--model.input_shape",
            "[-1, 784]",
            "--general.results_file",
            "2024",
            "--attack.pgd_alpha",
            "auto",
        ]
    )
    assert tree == {
        "solver": {"alpha-crown": {"iteration": 20, "lr_alpha": 1.0}},
        "parallel": {"mode": "fsdp"},
        "general": {"deterministic": True, "double_fp": True, "csv_name": None, "results_file": "2024"},
        "model": {"input_shape": [-1, 784]},
        "attack": {"pgd_alpha": "auto"},
    }
    assert isinstance(tree["solver"]["alpha-crown"]["lr_alpha"], float)


def test_parse_overrides_later_wins_and_sections():
    assert parse_overrides(["--bab.timeout", "1", "--bab.timeout", "2"]) == {"bab": {"timeout": 2.0}}
    assert parse_overrides(["--parallel", "{mode: tp, world_size: 2}"]) == {
        "parallel": {"mode": "tp", "world_size": 2}
    }
    assert parse_overrides(["--data.start", "3"]) == {"data": {"start": 3}}  # known, ignored


def test_parse_overrides_malformed():
    with pytest.raises(ConfigError, match="expected '--section.key value'"):
        parse_overrides(["solver.batch_size", "3"])
    with pytest.raises(ConfigError, match="malformed key"):
        parse_overrides(["--solver..batch_size", "3"])


def test_overrides_win_over_file_and_csv_can_be_cleared(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        general: {csv_name: instances.csv, root_path: .}
        solver: {batch_size: 8}
    """,
    )
    cfg, _ = load_config(
        path, ["--solver.batch_size", "16", "--general.csv_name", "null", "--bab.timeout", "300.0"]
    )
    assert cfg.solver.batch_size == 16
    assert cfg.general.csv_name is None
    assert cfg.bab.timeout == 300.0


# --------------------------------------------------------------------------------------------------
# Errors: unknown keys, types, enums
# --------------------------------------------------------------------------------------------------


def test_unknown_key_in_file_names_file_key_and_suggestion(tmp_path):
    path = write_yaml(tmp_path, "solver:\n  alpha-crown:\n    lr_alfa: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(path)
    assert "unknown key 'solver.alpha-crown.lr_alfa'" in msg
    assert "(did you mean 'solver.alpha-crown.lr_alpha'?)" in msg


def test_unknown_section_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'genral' \(did you mean 'general'\?\)"):
        load_config(write_yaml(tmp_path, "genral:\n  seed: 1\n"))


def test_unknown_key_in_override():
    with pytest.raises(
        ConfigError,
        match=r"command line: unknown key 'solver.batchsize' "
        r"\(did you mean 'solver.batch_size'\?\)",
    ):
        parse_overrides(["--solver.batchsize", "3"])
    with pytest.raises(ConfigError, match=r"did you mean 'solver.alpha-crown'\?"):
        load_config(None, ["--solver.alpha_crown.iteration", "3"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("solver: {batch_size: abc}", "key 'solver.batch_size' expects an integer, got 'abc'"),
        ("solver: {batch_size: 2.5}", "key 'solver.batch_size' expects an integer"),
        ("general: {deterministic: maybe}", "key 'general.deterministic' expects a boolean"),
        ("bab: {timeout: soon}", "key 'bab.timeout' expects a number"),
        ("model: {input_shape: 5}", "key 'model.input_shape' expects a list of integers or null"),
        ("model: {input_shape: [1, x]}", "key 'model.input_shape' expects a list"),
        ("general: {device: [cpu]}", "key 'general.device' expects a string"),
        ("solver: {batch_size: {a: 1}}", "key 'solver.batch_size' expects an integer"),
        ("solver: {batch_size: 0}", "key 'solver.batch_size' must be >= 1"),
        ("parallel: {world_size: 0}", "key 'parallel.world_size' must be >= 1"),
        ("attack: {pgd_alpha: fast}", "key 'attack.pgd_alpha' must be 'auto' or a positive number"),
    ],
)
def test_type_errors(tmp_path, text, message):
    path = write_yaml(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(path + ": ")
    assert message in str(err.value)


def test_type_error_in_override():
    with pytest.raises(ConfigError, match="command line: key 'bab.branching.candidates' expects an integer"):
        parse_overrides(["--bab.branching.candidates", "many"])


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("solver.bound_prop_method", "deeppoly", "ibp|crown|alpha-crown"),
        ("attack.pgd_order", "during", "before|after|skip"),
        ("parallel.mode", "ddp", "none|fsdp|tp"),
        ("parallel.backend", "mpi", "auto|gloo|nccl"),
        ("bab.branching.method", "best", "babsr|fsb|kfsb"),
        ("bab.branching.reduceop", "sum", "min|max"),
        ("general.complete_verifier", "lp", "bab|bab-refine|mip|skip|auto"),
    ],
)
def test_enum_errors(key, value, allowed):
    with pytest.raises(ConfigError, match=f"key '{key}' must be one of {allowed.replace('|', '[|]')}"):
        load_config(None, [f"--{key}", value])


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU"])
def test_device_errors(device):
    with pytest.raises(ConfigError, match="key 'general.device' must be cpu, cuda or cuda:N"):
        load_config(None, ["--general.device", device])


def test_parallel_consistency(tmp_path):
    cfg, _ = load_config(write_yaml(tmp_path, "parallel: {world_size: 2}\n"))  # no mode given: fsdp
    assert (cfg.parallel.mode, cfg.parallel.world_size) == ("fsdp", 2)
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path, "parallel: {world_size: 2, mode: none}\n"))
    assert "'parallel.mode' is 'none'" in str(err.value) and "fsdp" in str(err.value)
    with pytest.raises(ConfigError, match="nccl"):
        load_config(None, ["--parallel.backend", "nccl"])
    cfg, _ = load_config(None, ["--parallel.mode", "fsdp", "--parallel.world_size", "2"])
    assert (cfg.parallel.mode, cfg.parallel.world_size) == ("fsdp", 2)
    cfg, _ = load_config(None, ["--parallel.mode", "tp"])  # one rank runs the same code path
    assert cfg.parallel.world_size == 1


# --------------------------------------------------------------------------------------------------
# alpha-beta-CROWN keys we know but do not implement
# --------------------------------------------------------------------------------------------------


def test_single_warning_lists_all_ignored_keys(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        general: {conv_mode: matrix, sparse_interm: false}
        model: {cache_onnx_conversion: true}
        specification: {norm: .inf, epsilon: 0.1, type: lp}
        solver:
          alpha-crown: {share_alphas: true}
          mip: {parallel_solvers: 8, solver_threads: 1}
        bab:
          cut: {enabled: true}
          attack: {enabled: false}
        attack: {attack_mode: PGD}
        data: {dataset: MNIST, start: 0}
        debug: {lp_test: null}
    """,
    )
    cfg, warnings = load_config(path, ["--solver.intermediate_refinement.enabled", "true"])
    assert cfg == Config()
    assert len(warnings) == 1
    warning = warnings[0]
    assert warning.startswith(path + ": ")
    for key in [
        "general.conv_mode",
        "general.sparse_interm",
        "model.cache_onnx_conversion",
        "specification.norm",
        "specification.epsilon",
        "specification.type",
        "solver.alpha-crown.share_alphas",
        "solver.mip.parallel_solvers",
        "solver.mip.solver_threads",
        "bab.cut.enabled",
        "bab.attack.enabled",
        "attack.attack_mode",
        "data.dataset",
        "data.start",
        "debug.lp_test",
        "solver.intermediate_refinement.enabled",
    ]:
        assert key in warning
    assert "16 alpha-beta-CROWN option(s)" in warning


def test_replaced_values_are_reported_in_the_same_warning(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        general: {conv_mode: matrix}
        solver: {bound_prop_method: forward+backward}
        bab: {branching: {method: kfsb-intercept-only}}
        attack: {pgd_order: middle}
    """,
    )
    cfg, warnings = load_config(path)
    assert cfg.solver.bound_prop_method == "crown"
    assert cfg.bab.branching.method == "kfsb"
    assert cfg.attack.pgd_order == "before"
    assert len(warnings) == 1
    assert "general.conv_mode" in warnings[0]
    assert "attack.pgd_order 'middle' -> 'before'" in warnings[0]
    assert "bab.branching.method 'kfsb-intercept-only' -> 'kfsb'" in warnings[0]


def test_bab_refine_reads_the_mip_section_and_refuses_tp(tmp_path):
    path = write_yaml(
        tmp_path,
        """
        general: {complete_verifier: bab-refine}
        solver: {mip: {parallel_solvers: 32, refine_neuron_timeout: 2, refine_neuron_time_percentage: 0.5}}
    """,
    )
    cfg, warnings = load_config(path)
    assert cfg.general.complete_verifier == "bab-refine"
    assert (cfg.solver.mip.refine_neuron_timeout, cfg.solver.mip.refine_neuron_time_percentage) == (2.0, 0.5)
    assert any("solver.mip.parallel_solvers" in w for w in warnings)
    with pytest.raises(ConfigError, match="'bab-refine'.*'tp'"):
        load_config(path, ["--parallel.mode", "tp", "--parallel.world_size", "2"])
    with pytest.raises(ConfigError, match="'mip'.*'tp'"):  # alpha-beta-CROWN's MILP mode: the same
        load_config(
            path,
            ["--general.complete_verifier", "mip", "--parallel.mode", "tp", "--parallel.world_size", "2"],
        )
    with pytest.raises(ConfigError, match="refine_neuron_time_percentage"):
        load_config(path, ["--solver.mip.refine_neuron_time_percentage", "1.5"])


# Key structure of alpha-beta-CROWN's VNN-COMP 2022 configs (mnist_fc, oval21 and sri_resnet_a benchmarks),
# rewritten here: the same sections and keys, with our own paths.
ABCROWN_VNNCOMP22_CONFIGS = {
    "mnistfc.yaml": """
        general:
          root_path: ../benchmarks/mnist_fc
          csv_name: instances.csv
          complete_verifier: bab-refine
        model:
          input_shape: [-1, 1, 28, 28]
        data: {dataset: MNIST, start: 30, end: 90}
        solver:
          batch_size: 4096
          beta-crown: {iteration: 20, lr_beta: 0.03, enable_opt_interm_bounds: True}
          mip: {parallel_solvers: 32, solver_threads: 1, refine_neuron_time_percentage: 0.8}
          start_save_best: -1
        bab:
          branching: {candidates: 5, reduceop: max}
        attack: {attack_mode: diversed_PGD, pgd_restarts: 100}
    """,
    "oval22.yaml": """
        general: {root_path: ../benchmarks/oval21, csv_name: instances.csv, conv_mode: matrix}
        data: {dataset: CIFAR}
        solver:
          batch_size: 2000
          beta-crown: {lr_beta: 0.01}
          start_save_best: -1
          prune_after_crown: False
        bab:
          branching: {reduceop: max, candidates: 10}
          cut: {enabled: True, cplex_cuts: True, bab_cut: True, lr_beta: 0.01}
        attack: {pgd_order: middle}
    """,
    "resnet_A.yaml": """
        general: {root_path: ../benchmarks/sri_resnet_a, csv_name: instances.csv}
        model:
          onnx_quirks: "{'Reshape': {'fix_batch_size': True}}"
        data: {dataset: CIFAR}
        solver:
          batch_size: 1024
          beta-crown: {lr_beta: 0.05, iteration: 10}
          prune_after_crown: True
        bab:
          initial_max_domains: 100
          branching: {method: kfsb-intercept-only, reduceop: max, candidates: 10}
          interm_transfer: False
        attack: {pgd_order: middle}
    """,
}


@pytest.mark.parametrize("name", sorted(ABCROWN_VNNCOMP22_CONFIGS))
def test_abcrown_vnncomp22_configs_load_with_one_warning(tmp_path, name):
    path = write_yaml(tmp_path, ABCROWN_VNNCOMP22_CONFIGS[name], name)
    cfg, warnings = load_config(path)
    assert len(warnings) == 1
    assert cfg.general.csv_name == "instances.csv"
    assert cfg.bab.branching.reduceop == "max"
    assert "data.dataset" in warnings[0]


def test_abcrown_mnistfc_values(tmp_path):
    path = write_yaml(tmp_path, ABCROWN_VNNCOMP22_CONFIGS["mnistfc.yaml"], "mnistfc.yaml")
    cfg, _ = load_config(path)
    assert cfg.model.input_shape == [-1, 1, 28, 28]
    assert cfg.solver.batch_size == 4096
    assert (cfg.solver.beta_crown.iteration, cfg.solver.beta_crown.lr_beta) == (20, 0.03)
    assert cfg.bab.branching.candidates == 5
    assert cfg.attack.pgd_restarts == 100


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------


def test_resolve_path(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    (cfg_dir / "net.onnx").write_text("")
    monkeypatch.chdir(tmp_path)
    assert resolve_path(str(cfg_dir), "net.onnx") == str(cfg_dir / "net.onnx")
    assert resolve_path(str(cfg_dir), "other.onnx") == str(tmp_path / "other.onnx")
    assert resolve_path(None, "net.onnx") == str(tmp_path / "net.onnx")
    assert resolve_path(str(cfg_dir), "/abs/../x.onnx") == "/x.onnx"


def test_load_config_resolves_paths(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "cfgs"
    (cfg_dir / "bench").mkdir(parents=True)
    (cfg_dir / "net.onnx").write_text("")
    path = write_yaml(
        cfg_dir,
        """
        general: {root_path: bench, results_file: res.txt}
        model: {onnx_path: net.onnx}
        specification: {vnnlib_path: prop.vnnlib}
    """,
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg, _ = load_config(path)
    assert cfg.general.root_path == str(cfg_dir / "bench")  # exists next to the YAML file
    assert cfg.model.onnx_path == str(cfg_dir / "net.onnx")
    assert cfg.specification.vnnlib_path == str(work / "prop.vnnlib")  # not there: the CWD
    assert cfg.general.results_file == "res.txt"  # outputs are left alone
    cfg, _ = load_config(path, ["--model.onnx_path", "net.onnx"])
    assert cfg.model.onnx_path == str(work / "net.onnx")  # command-line paths: the CWD


# --------------------------------------------------------------------------------------------------
# The repository's configs
# --------------------------------------------------------------------------------------------------


def test_configs_directory_is_populated():
    names = {p.name for p in CONFIGS}
    assert {
        "example.yaml",
        "default.yaml",
        "mnist_fc.yaml",
        "mnist_fc_fsdp.yaml",
        "oval21.yaml",
        "sri_resnet_a.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg, warnings = load_config(str(path))
    assert warnings == []
    if cfg.general.csv_name is not None:
        benchmark = path.stem.removesuffix("_fsdp")
        assert cfg.general.root_path.endswith(os.path.join("shared", "benchmarks", benchmark))
        if (REPO.parent / "shared").is_dir():  # resolved next to configs/, not against the CWD
            assert cfg.general.root_path == str(REPO.parent / "shared" / "benchmarks" / benchmark)


def test_fsdp_config_matches_single_process_config():
    single, _ = load_config(str(REPO / "configs" / "mnist_fc.yaml"))
    sharded, _ = load_config(str(REPO / "configs" / "mnist_fc_fsdp.yaml"))
    assert (sharded.parallel.mode, sharded.parallel.world_size) == ("fsdp", 2)
    assert dataclasses.replace(sharded, parallel=single.parallel) == single


def test_example_config_points_at_bundled_example():
    cfg, _ = load_config(str(REPO / "configs" / "example.yaml"))
    assert cfg.model.onnx_path.endswith(os.path.join("examples", "example.onnx"))
    assert cfg.specification.vnnlib_path.endswith(os.path.join("examples", "example.vnnlib"))


# --------------------------------------------------------------------------------------------------
# VNN-COMP scripts
# --------------------------------------------------------------------------------------------------


def run_script(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a vnncomp script with bash and capture its output."""
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("install_tool.sh", ()),
        ("install_tool.sh", ("v2",)),
        ("prepare_instance.sh", ()),
        ("prepare_instance.sh", ("v1", "mnist_fc", "net.onnx")),
        ("run_instance.sh", ()),
        ("run_instance.sh", ("v1", "mnist_fc", "net.onnx", "prop.vnnlib", "out.txt")),
        ("run_instance.sh", ("v2", "mnist_fc", "net.onnx", "prop.vnnlib", "out.txt", "60")),
        ("run_instance.sh", ("v1", "mnist_fc", "net.onnx", "prop.vnnlib", "out.txt", "soon")),
    ],
)
def test_scripts_print_usage_on_bad_arguments(name, args):
    result = run_script(name, *args)
    assert result.returncode != 0
    assert "usage:" in result.stderr


def test_prepare_instance_accepts_any_category_and_checks_files(tmp_path):
    onnx, vnnlib = tmp_path / "net.onnx", tmp_path / "prop.vnnlib"
    onnx.write_text("")
    vnnlib.write_text("")
    assert run_script("prepare_instance.sh", "v1", "mnist_fc", str(onnx), str(vnnlib)).returncode == 0
    assert run_script("prepare_instance.sh", "v1", "test", str(onnx), str(vnnlib)).returncode == 0
    other = run_script("prepare_instance.sh", "v1", "no_such_benchmark", str(onnx), str(vnnlib))
    assert other.returncode == 0 and "default.yaml" in other.stdout  # as run_instance.sh runs it
    missing = run_script("prepare_instance.sh", "v1", "mnist_fc", str(tmp_path / "x.onnx"), str(vnnlib))
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_run_instance_command_line(tmp_path):
    """run_instance.sh runs abcrown (through the resident worker's client, which starts it cold when no
    worker runs) with the category config and the instance overrides."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args_file = tmp_path / "args.txt"
    env = {**os.environ, "PYTHON": str(fake), "ARGS_FILE": str(args_file)}
    env["CVE_ENGINE"] = "native"  # the native route even where ABCROWN_PATH is set
    (tmp_path / "res.txt").write_text("stale")

    result = run_script(
        "run_instance.sh",
        "v1",
        "oval21",
        "net.onnx",
        "prop.vnnlib",
        str(tmp_path / "res.txt"),
        "720",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "res.txt").exists()  # a stale result is removed first
    args = args_file.read_text().splitlines()
    assert args[:5] == ["-m", "complete_verifier_ext.worker", "run", "native", "cli"]
    args = args[5:]
    assert args[:4] == ["--config", str(REPO / "configs" / "oval21.yaml"), "--general.engine", "native"]
    assert args[4:] == [
        "--model.onnx_path",
        "net.onnx",
        "--specification.vnnlib_path",
        "prop.vnnlib",
        "--general.results_file",
        str(tmp_path / "res.txt"),
        "--bab.timeout",
        "720",
        "--general.csv_name",
        "null",
        "--quiet",
    ]
    cfg, _ = load_config(args[1], [a for a in args[2:] if a != "--quiet"])
    assert cfg.general.csv_name is None and cfg.bab.timeout == 720.0

    result = run_script("run_instance.sh", "v1", "test", "net.onnx", "prop.vnnlib", "r.txt", "5", env=env)
    assert result.returncode == 0
    assert args_file.read_text().splitlines()[6] == str(REPO / "configs" / "default.yaml")


def test_tp_cannot_replicate_weights_in_bab(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel:\n  mode: tp\n  world_size: 2\n  bab_weights: replicated\n")
    with pytest.raises(ConfigError, match="bab_weights.*tp"):
        load_config(str(cfg))
    ok, _ = load_config(str(cfg), ["--parallel.mode", "fsdp"])
    assert ok.parallel.bab_weights == "replicated"
