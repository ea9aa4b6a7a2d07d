"""Typed configuration loaded from alpha-beta-CROWN-style YAML files and command-line overrides.

The YAML layout and key names are those of alpha-beta-CROWN (``general``, ``model``, ``specification``,
``solver``, ``bab``, ``attack``; ``solver.alpha-crown`` and ``solver.beta-crown`` keep their dashes),
plus our own ``parallel`` section. Each section is a frozen dataclass; the whole tree is a
:class:`Config`, built once by :func:`load_config` and passed down explicitly (there is no global config).

Rules applied when loading:

* A key we do not know raises :class:`ConfigError` naming the file, the dotted key and the closest valid
  key. A key that alpha-beta-CROWN knows but we do not implement (``general.conv_mode``, ``solver.mip.*``,
  ``data.*``, ...) is accepted and reported in ONE warning string returned next to the config.
* Values are coerced to the field's type (``"20"`` -> 20, ``yes`` -> True, 1 -> 1.0, ``null`` -> None
  for optional fields) and enumerations are checked; a mismatch raises :class:`ConfigError`.
* alpha-beta-CROWN enum values that we do not implement (``attack.pgd_order: middle``,
  ``bab.branching.method: kfsb-intercept-only``, ...) are replaced by the closest value we implement;
  the replacement is reported in the same single warning.
* Relative paths (``general.root_path``, ``model.onnx_path``, ``model.path``,
  ``specification.vnnlib_path``) are made absolute: a path written in the YAML file is taken relative to
  the YAML file's directory if it exists there, else relative to the current working directory; a path
  given on the command line is taken relative to the current working directory (see :func:`resolve_path`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from .errors import UserError

__all__ = [
    "AlphaCrownConfig",
    "AttackConfig",
    "BabConfig",
    "BetaCrownConfig",
    "BranchingConfig",
    "Config",
    "CrownConfig",
    "ConfigError",
    "GeneralConfig",
    "InputSplitConfig",
    "ModelConfig",
    "ParallelConfig",
    "SolverConfig",
    "SpecificationConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_overrides",
    "resolve_path",
]

COMMAND_LINE = "command line"
"""The source name used in messages for values given as ``--section.key value`` overrides."""


class ConfigError(UserError):
    """A user error in a config file or override; the message names the source and the dotted key."""


# ----------------------------------------------------------------------------------------------------
# Field helpers
# ----------------------------------------------------------------------------------------------------


def _opt(
    default: Any,
    *,
    key: str | None = None,
    choices: Sequence[str] = (),
    legacy: Mapping[str, str] | None = None,
    check: Callable[[Any], bool] | None = None,
    expected: str = "",
    minimum: float | None = None,
) -> Any:
    """A dataclass field with the schema metadata used by the loader.

    Args:
        default: default value (immutable).
        key: YAML name when it differs from the Python field name (``alpha-crown``).
        choices: the allowed string values.
        legacy: alpha-beta-CROWN values we accept but replace (old -> ours), reported as a warning.
        check: extra predicate on the coerced value; ``expected`` describes it for error messages.
        minimum: smallest allowed number.
    """
    meta = {
        "key": key,
        "choices": tuple(choices),
        "legacy": dict(legacy or {}),
        "check": check,
        "expected": expected,
        "minimum": minimum,
    }
    return field(default=default, metadata=meta)


def _section(cls: type, key: str | None = None) -> Any:
    """A dataclass field holding a nested section, created with its defaults."""
    return field(default_factory=cls, metadata={"key": key})


def _is_device(value: Any) -> bool:
    """True for ``cpu``, ``cuda`` and ``cuda:N``."""
    return isinstance(value, str) and re.fullmatch(r"cpu|cuda(:\d+)?", value) is not None


_FRACTION = "a fraction between 0 and 1"


def _is_fraction(value: Any) -> bool:
    return isinstance(value, float) and 0 <= value <= 1


def _is_pgd_alpha(value: Any) -> bool:
    """True for ``auto`` or a positive step size."""
    return value == "auto" or (isinstance(value, float) and value > 0)


# ----------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneralConfig:
    """``general``: where instances come from, where results go, and global switches.

    Attributes:
        device: ``cpu``, ``cuda`` or ``cuda:N`` (with ``parallel.world_size > 1`` each rank uses its own GPU).
        seed: random seed (PGD restarts, tie-breaking).
        root_path: folder holding ``csv_name`` and the paths listed in it (absolute after loading).
        csv_name: VNN-COMP ``instances.csv`` (``onnx,vnnlib,timeout`` per line) in ``root_path``; None to
            verify the single instance ``model.onnx_path`` x ``specification.vnnlib_path``.
        results_file: where the VNN-COMP result (``sat``/``unsat``/``unknown``/``timeout``/``error``) goes.
        enable_incomplete_verification: run IBP/CROWN/alpha-CROWN on the whole box before BaB
            (``false``: straight to BaB, which starts from CROWN's bounds).
        complete_verifier: ``bab`` (branch and bound), ``bab-refine`` (first tighten the intermediate
            bounds, ``solver.mip``, then branch and bound), ``mip`` (the same refinement, then a MILP
            of the whole network per open clause for all the time left, as alpha-beta-CROWN's ``mip``)
            or ``skip`` (stop after incomplete verification).
        deterministic: use deterministic torch kernels (``torch.use_deterministic_algorithms``).
        double_fp: compute in float64 (not implemented: a value other than false is warned and ignored).
        verbose: print what every stage does on its own line of stderr (PGD, each bound method, every
            alpha-CROWN step with its worst clause bound, every BaB round with domains left, worst bound
            and domains/s, the refinement's layers); without it, a terminal shows one progress line.
        sparse_alpha: keep alpha-CROWN's slopes only for the neurons unstable when it starts (as
            alpha-beta-CROWN's ``sparse_alpha``); ``false``: one slope per neuron (the same bounds,
            more memory).
        engine: ``native`` (this package's engine) or ``abcrown`` (a real alpha-beta-CROWN checkout named
            by ``$ABCROWN_PATH``, sharded at runtime; the YAML then goes to alpha-beta-CROWN as it is, see
            docs/abcrown_plugin.md).
    """

    device: str = _opt("cpu", check=_is_device, expected="cpu, cuda or cuda:N")
    seed: int = _opt(100)
    root_path: str = _opt("")
    csv_name: str | None = _opt(None)
    results_file: str = _opt("out.txt")
    enable_incomplete_verification: bool = _opt(True)
    complete_verifier: str = _opt("bab", choices=("bab", "bab-refine", "mip", "skip"), legacy={"auto": "bab"})
    deterministic: bool = _opt(False)
    double_fp: bool = _opt(False)
    verbose: bool = _opt(False)
    sparse_alpha: bool = _opt(True)
    engine: str = _opt("native", choices=("native", "abcrown"))


@dataclass(frozen=True)
class ModelConfig:
    """``model``: the network to verify.

    Attributes:
        onnx_path: ONNX model of a single instance (absolute after loading), or None.
        onnx_path_prefix: prefix added to the ONNX paths of ``general.csv_name`` entries.
        input_shape: shape of the model input, e.g. ``[-1, 1, 28, 28]`` (not implemented: the shape
            comes from the ONNX model; a value is warned and ignored).
        name: alpha-beta-CROWN's torch model zoo name (not implemented: ONNX models only; warned).
        path: checkpoint of the torch model ``name`` (not implemented; warned).
    """

    onnx_path: str | None = _opt(None)
    onnx_path_prefix: str = _opt("")
    input_shape: list[int] | None = _opt(None)
    name: str | None = _opt(None)
    path: str | None = _opt(None)


@dataclass(frozen=True)
class SpecificationConfig:
    """``specification``: the property to verify.

    Attributes:
        vnnlib_path: VNN-LIB file of a single instance (absolute after loading), or None.
        vnnlib_path_prefix: prefix added to the VNN-LIB paths of ``general.csv_name`` entries.
    """

    vnnlib_path: str | None = _opt(None)
    vnnlib_path_prefix: str = _opt("")


@dataclass(frozen=True)
class AlphaCrownConfig:
    """``solver.alpha-crown``: optimisation of the ReLU lower slopes alpha on the whole input box.

    Attributes:
        iteration: optimisation steps.
        lr_alpha: Adam learning rate of alpha.
        lr_decay: per-step multiplicative learning-rate decay.
        early_stop_patience: alpha-beta-CROWN's patience (also spelled ``solver.early_stop_patience``);
            not implemented: alpha-CROWN stops early only once every row is proven, and a value other
            than 10 is warned.
        alpha_dtype: how the alpha and beta of every branch-and-bound domain are stored between rounds:
            ``float16`` (alpha-beta-CROWN's default: half the memory; any alpha in [0, 1] and beta >= 0
            is sound, and bounds are always recomputed from the stored values) or ``auto`` (float32).
    """

    iteration: int = _opt(100, minimum=0)
    lr_alpha: float = _opt(0.1, minimum=0)
    lr_decay: float = _opt(0.98, minimum=0)
    early_stop_patience: int = _opt(10, minimum=0)
    alpha_dtype: str = _opt("float16", choices=("float16", "auto"))


@dataclass(frozen=True)
class BetaCrownConfig:
    """``solver.beta-crown``: joint optimisation of alpha and the split multipliers beta during BaB.

    Attributes:
        iteration: optimisation steps per BaB round.
        lr_alpha: Adam learning rate of alpha.
        lr_beta: Adam learning rate of beta.
        lr_decay: per-step multiplicative learning-rate decay.
    """

    iteration: int = _opt(50, minimum=0)
    lr_alpha: float = _opt(0.01, minimum=0)
    lr_beta: float = _opt(0.05, minimum=0)
    lr_decay: float = _opt(0.98, minimum=0)


@dataclass(frozen=True)
class MipConfig:
    """``solver.mip``: refinement of intermediate bounds for ``general.complete_verifier: bab-refine``
    or ``mip``
    (other alpha-beta-CROWN keys of this section, e.g. ``parallel_solvers``, are ignored: the work is
    split over the ranks instead).

    Attributes:
        refine_method: ours: ``split`` (every unstable neuron is bounded by batched beta-CROWN over the
            sign patterns of the earlier neurons that matter most to it; any network) or ``milp``
            (alpha-beta-CROWN's: a MILP per neuron, HiGHS through highspy; chains of Linear and ReLU
            layers only) or ``split+milp`` (split, then MILP from its bounds for the rest of the time).
        refine_split_depth: ours, ``split``: neurons split per target (2^depth patterns each).
        refine_split_passes: ours, ``split``: at most this many passes over the layers, each further
            one at depth + 2 from the bounds of the one before, started only if it is expected to end
            within the refinement's time (4 times the time of the pass before).
        refine_neuron_timeout: ``milp``: time limit of one solve (the minimum or maximum of one
            neuron), seconds. A solve stopped by it still yields a sound bound (its dual bound).
        refine_neuron_time_percentage: the share (0 to 1) of the time left after alpha-CROWN that the
            refinement may take; the rest is left to branch and bound.
        refine_layers: refine this many layers after the first (which is exact already); 0: all.
        quick_bab_percentage: ours: the share of the time left after alpha-CROWN that a plain branch and
            bound gets before the refinement starts (instances it solves skip the refinement); 0:
            refine first, as alpha-beta-CROWN does.
        output_milp_percentage: ours: the share of the time left after the refinement given to a MILP
            of the whole network for each clause the refined bounds leave open (worst first, ``threads``
            solves at a time on each rank, as many as the rank's torch threads; chains of Linear and
            ReLU layers only). Clauses it does not prove go to branch and bound with the rest of the
            time. 0: none. ``general.complete_verifier: mip`` gives it all the time left (1).
    """

    refine_method: str = _opt("split", choices=("split", "milp", "split+milp"))
    refine_split_depth: int = _opt(6, check=lambda v: 0 <= v <= 16, expected="an integer from 0 to 16")
    refine_split_passes: int = _opt(1, check=lambda v: 1 <= v <= 8, expected="an integer from 1 to 8")
    refine_neuron_timeout: float = _opt(15.0, minimum=0)
    refine_neuron_time_percentage: float = _opt(0.8, check=_is_fraction, expected=_FRACTION)
    refine_layers: int = _opt(0, minimum=0)
    quick_bab_percentage: float = _opt(0.1, check=_is_fraction, expected=_FRACTION)
    output_milp_percentage: float = _opt(0.0, check=_is_fraction, expected=_FRACTION)


_BOUND_PROP_LEGACY = {
    "init-crown": "crown",
    "crown-ibp": "crown",
    "forward": "crown",
    "forward+crown": "crown",
    "forward+backward": "crown",
    "dynamic-forward": "crown",
    "dynamic-forward+crown": "crown",
    "dynamic-forward+backward": "crown",
    "alpha-forward": "alpha-crown",
}


@dataclass(frozen=True)
class CrownConfig:
    """``solver.crown``: CROWN's intermediate bounds.

    Attributes:
        batch_size: neurons of a layer back-substituted together (alpha-beta-CROWN's key); the
            A-matrices in flight are at most ``(2 batch_size, B, n)`` whatever the layer's width.  0
            (the default) picks the largest that keeps them within an eighth of the memory available;
            the summary's ``crown_batch_size`` says what was used.
    """

    batch_size: int = _opt(0, minimum=0)


@dataclass(frozen=True)
class SolverConfig:
    """``solver``: the bound propagation used on the whole box and on BaB domains.

    Attributes:
        batch_size: BaB domains bounded together in one round (per rank when domains are sharded).
        bound_prop_method: ``ibp``, ``crown`` or ``alpha-crown`` for incomplete verification.
        alpha_crown: ``solver.alpha-crown`` settings.
        beta_crown: ``solver.beta-crown`` settings.
        mip: ``solver.mip`` settings (``bab-refine``).
        crown: ``solver.crown`` settings.
        intersect_ibp: keep a neuron's IBP bound where it is tighter than CROWN's (sound; much tighter
            on deep networks).  ``false`` reproduces auto_LiRPA's CROWN bounds exactly.
    """

    batch_size: int = _opt(64, minimum=1)
    bound_prop_method: str = _opt(
        "alpha-crown", choices=("ibp", "crown", "alpha-crown"), legacy=_BOUND_PROP_LEGACY
    )
    intersect_ibp: bool = _opt(True)
    alpha_crown: AlphaCrownConfig = _section(AlphaCrownConfig, key="alpha-crown")
    beta_crown: BetaCrownConfig = _section(BetaCrownConfig, key="beta-crown")
    mip: MipConfig = _section(MipConfig)
    crown: CrownConfig = _section(CrownConfig)


@dataclass(frozen=True)
class InputSplitConfig:
    """``bab.branching.input_split``: branch on input dimensions instead of ReLUs.

    Attributes:
        enable: use input splitting.
    """

    enable: bool = _opt(False)


@dataclass(frozen=True)
class BranchingConfig:
    """``bab.branching``: how a BaB domain is split.

    Attributes:
        method: ReLU branching heuristic: ``babsr`` or ``fsb``/``kfsb`` (one method here: the
            ``candidates`` best neurons by BaBSR's score, per domain, bounded exactly; alpha-beta-CROWN's
            ``sb``, ``naive`` and ``random`` run ``babsr``, with a warning).
        candidates: candidates scored exactly by ``fsb``/``kfsb``.
        reduceop: how the scores of the two children are combined: ``min`` or ``max``.
        input_split: ``bab.branching.input_split`` settings.
    """

    method: str = _opt(
        "kfsb",
        choices=("babsr", "fsb", "kfsb"),
        legacy={
            "kfsb-intercept-only": "kfsb",
            "intercept": "babsr",
            "sb": "babsr",
            "naive": "babsr",
            "random": "babsr",
            "brute-force": "fsb",
            "nonlinear": "kfsb",
        },
    )
    candidates: int = _opt(3, minimum=1)
    reduceop: str = _opt("min", choices=("min", "max"), legacy={"mean": "min", "auto": "min"})
    input_split: InputSplitConfig = _section(InputSplitConfig)


@dataclass(frozen=True)
class BabConfig:
    """``bab``: branch and bound.

    Attributes:
        timeout: seconds for one instance (the whole pipeline: attack, incomplete, BaB).
        max_domains: most domains alive at once (all ranks together); more -> ``unknown``.
        branching: ``bab.branching`` settings.
    """

    timeout: float = _opt(360.0, minimum=0)
    max_domains: int = _opt(200_000, minimum=1)
    branching: BranchingConfig = _section(BranchingConfig)


@dataclass(frozen=True)
class AttackConfig:
    """``attack``: PGD search for a counterexample.

    Attributes:
        pgd_order: ``before`` or ``after`` incomplete verification, or ``skip``.
        pgd_steps: gradient steps per restart.
        pgd_restarts: random restarts.
        pgd_alpha: step size, or ``auto`` (a fraction of the box width).
        pgd_early_stop: stop as soon as a counterexample is found.
        pgd_lr_decay: per-step step-size decay.
        pgd_odi_steps: output-diversified initialisation (ours): every random start first takes this
            many sign steps of half the box width up a random direction of the outputs, which spreads
            the starts out in output space; 0 turns it off.
    """

    pgd_order: str = _opt(
        "before", choices=("before", "after", "skip"), legacy={"middle": "before", "input_bab": "before"}
    )
    pgd_steps: int = _opt(100, minimum=0)
    pgd_restarts: int = _opt(30, minimum=0)
    pgd_alpha: str | float = _opt("auto", check=_is_pgd_alpha, expected="'auto' or a positive number")
    pgd_early_stop: bool = _opt(True)
    pgd_lr_decay: float = _opt(0.99, minimum=0)
    pgd_odi_steps: int = _opt(10, minimum=0)


@dataclass(frozen=True)
class ParallelConfig:
    """``parallel`` (ours, not alpha-beta-CROWN's): sharding over several processes.

    Attributes:
        mode: ``none`` (one process), ``fsdp`` (weights gathered per layer) or ``tp`` (weights streamed).
        world_size: number of ranks; > 1 requires ``mode`` fsdp or tp.
        backend: ``auto`` (gloo on CPU, NCCL on CUDA), ``gloo`` or ``nccl``.
        exact_memory: run every rank with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back
            to the OS at once and the reported CPU peak follows live tensors (see
            ``parallel/memory.py``).  It costs time (every large tensor is fresh pages: BaB on
            mnist-net_256x4 runs about 1.4x slower), so it is off unless memory is being measured; off,
            ``peak_mb`` also counts memory the allocator keeps for reuse.
        bab_weights: during ReLU-split BaB in ``fsdp`` mode, ``sharded`` (the default) gathers each
            layer whenever it is used, as everywhere else: two all-gathers per layer per β step;
            ``replicated`` gathers every layer once when the search starts and holds it whole until it
            ends, so that a round costs no collective but its agreement.  The domains stay split either
            way; replicating adds one copy of the weights per rank (on mnist-net_256x6, 1.5 MB against
            ~14 KB per queued domain).  ``tp`` never holds a full layer, so it only allows ``sharded``.
        threads: torch threads per rank; 0 (the default) divides the cores available to the process
            (its CPU affinity) less one among the ranks on the host, at least 1 each (2 threads on 2
            cores are no faster alone and several times slower beside another busy process).
    """

    mode: str = _opt("none", choices=("none", "fsdp", "tp"))
    world_size: int = _opt(1, minimum=1)
    backend: str = _opt("auto", choices=("auto", "gloo", "nccl"))
    exact_memory: bool = _opt(False)
    bab_weights: str = _opt("sharded", choices=("sharded", "replicated"))
    threads: int = _opt(0, minimum=0)


@dataclass(frozen=True)
class Config:
    """The whole configuration; field names are the YAML section names."""

    general: GeneralConfig = _section(GeneralConfig)
    model: ModelConfig = _section(ModelConfig)
    specification: SpecificationConfig = _section(SpecificationConfig)
    solver: SolverConfig = _section(SolverConfig)
    bab: BabConfig = _section(BabConfig)
    attack: AttackConfig = _section(AttackConfig)
    parallel: ParallelConfig = _section(ParallelConfig)


# ----------------------------------------------------------------------------------------------------
# alpha-beta-CROWN keys that we accept without implementing them
# ----------------------------------------------------------------------------------------------------

_IGNORED_SECTIONS = frozenset(
    {
        "data",
        "debug",
        "find_feasible_solution",
        "solver.forward",
        "solver.intermediate_refinement",
        "solver.invprop",
        "solver.mip",
        "solver.multi_class",
        "bab.attack",
        "bab.cut",
        "bab.clip_n_verify",
        "bab.branching.nonlinear_split",
        "bab.branching.new_input_split",
        "attack.input_split",
        "attack.input_split_enhanced",
        "attack.input_split_check_adv",
    }
)
"""Whole alpha-beta-CROWN sections we ignore: any key below them is accepted (and reported)."""

_IGNORED_KEYS_BY_SECTION = {
    "general": """adhoc_tuning buffer_has_batchdim conv_mode deterministic_opt eval_adv_example
        graph_optimizer loss_reduction_func no_batchdim_buffers onnx_adv_example output_file precompile_jit
        prepare_only record_bounds reset_seed_after_precompile return_optimized_model save_adv_example
        save_output show_adv_example sparse_interm store_all_specs_on_cpu
        verify_onnxruntime_output""",
    "model": """bound_opts cache_onnx_conversion check_optimized check_optmized debug_onnx
        flatten_final_output onnx_loader onnx_optimization_flags onnx_quirks
        onnx_vnnlib_joint_optimization_flags optimize_graph with_jacobian""",
    "specification": "epsilon epsilon_min norm rhs_offset robustness_type shrink_eps type",
    "solver": """auto_enlarge_batch_size batched_crown_auto_enlarge_max_vram_ratio build_batch_size
        forward_before_compute_bounds init_bound_prop_method min_batch_size_ratio
        optimize_disjuncts_separately prune_after_crown skip_with_refined_bound start_save_best
        use_float64_in_last_iteration""",
    "solver.alpha-crown": """alpha apply_output_constraints_to disable_optimization
        full_conv_alpha input_split_alpha_iteration input_split_lr_alpha matmul_share_alphas max_coeff_mul
        max_time no_joint_opt share_alphas share_slopes""",
    "solver.crown": "max_crown_size activation_bound_option compare_crown_with_ibp",
    "solver.beta-crown": "all_node_split_LP beta beta_warmup enable_opt_interm_bounds optimizer",
    "bab": """backing_up_max_domain batched_domain_list decision_thresh dfs_percent get_upper_bound
        hugetensor_allocator initial_max_domains interm_transfer max_iterations optimized_interm
        optimized_intermediate_layers override_timeout pruning_in_iteration pruning_in_iteration_ratio
        recompute_interm sort_domain_interval sort_targets timeout_scale tree_traversal vanilla_crown""",
    "bab.branching": """branching_input_and_activation branching_input_and_activation_order
        branching_input_iterations branching_relu_iterations enable_intermediate_bound_opt sb_coeff_thresh""",
    "bab.branching.input_split": """adv_check attack_patience bf_backup_thresh bf_batch_size bf_iters
        bf_rhs_offset bf_zero_crossing_score catch_assertion compare_with_old_bounds enable_clip_domains
        enhanced_bound_patience enhanced_bound_prop_method enhanced_branching_method ibp_enhancement
        input_dim_threshold presplit_domains reorder_bab sb_coeff_thresh sb_margin_weight sb_primary_spec
        sb_primary_spec_iter sb_sum show_progress skip_getting_worst_domain sort_descending
        sort_domain_interval sort_index split_hint split_partitions touch_zero_score
        update_rhs_with_attack""",
    "attack": """adv_example_finalizer adv_saver adv_verifier attack_func attack_mode attack_tolerance
        cex_path check_clean early_stop_condition enable_mip_attack gama_decay gama_lambda general_attack
        pgd_alpha_scale pgd_batch_size pgd_loss pgd_loss_mode pgd_restart_when_stuck""",
}

_IGNORED_KEYS = frozenset(
    f"{section}.{name}" for section, names in _IGNORED_KEYS_BY_SECTION.items() for name in names.split()
)
"""Single alpha-beta-CROWN keys (dotted) we accept and ignore."""

_ALIASES = {
    "solver.early_stop_patience": "solver.alpha-crown.early_stop_patience",
    "solver.beta-crown.batch_size": "solver.batch_size",  # alpha-beta-CROWN before 2022
}
"""alpha-beta-CROWN spellings (dotted) of keys that live elsewhere in our tree."""

_PATH_KEYS = ("general.root_path", "model.onnx_path", "model.path", "specification.vnnlib_path")
"""Keys holding input paths, made absolute by :func:`load_config`."""

_NULL_WORDS = frozenset({"null", "none", "~"})

KeyPath = tuple[str, ...]
Flat = dict[KeyPath, tuple[Any, str]]  # dotted path -> (raw value, source it came from)


# ----------------------------------------------------------------------------------------------------
# Schema introspection
# ----------------------------------------------------------------------------------------------------


def _yaml_key(f: dataclasses.Field) -> str:
    """The YAML name of a dataclass field."""
    return f.metadata.get("key") or f.name


@cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a config dataclass."""
    return get_type_hints(cls)


@cache
def _children(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """YAML name -> (field, resolved type) for the fields of ``cls``."""
    hints = _hints(cls)
    return {_yaml_key(f): (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _lookup(path: KeyPath) -> tuple[dataclasses.Field, Any] | None:
    """The field and type at a YAML path of :class:`Config` (section or leaf), or None."""
    cls: Any = Config
    found = None
    for key in path:
        if not (dataclasses.is_dataclass(cls) and key in _children(cls)):
            return None
        found = _children(cls)[key]
        cls = found[1]
    return found


@cache
def _valid_keys() -> tuple[str, ...]:
    """Every dotted key we accept (sections and leaves, implemented or ignored), for suggestions."""
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for key, (_, tp) in _children(cls).items():
            keys.append(prefix + key)
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + key + ".")

    walk(Config, "")
    return tuple(keys) + tuple(sorted(_IGNORED_KEYS | _IGNORED_SECTIONS)) + tuple(_ALIASES)


def _is_ignored(dotted: str) -> bool:
    """True for a key alpha-beta-CROWN knows and we accept without implementing it."""
    if dotted in _IGNORED_KEYS:
        return True
    return any(dotted == s or dotted.startswith(s + ".") for s in _IGNORED_SECTIONS)


def _unknown_key(source: str, dotted: str) -> ConfigError:
    """ConfigError for an unknown key, with the closest valid key when one is close enough."""
    match = difflib.get_close_matches(dotted, _valid_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{match[0]}'?)" if match else ""
    return ConfigError(f"{source}: unknown key '{dotted}'{hint}")


# ----------------------------------------------------------------------------------------------------
# Flattening nested mappings into validated dotted paths
# ----------------------------------------------------------------------------------------------------


def _leaf_keys(value: Any, dotted: str) -> list[str]:
    """The dotted leaf keys of an ignored value (a mapping is listed key by key)."""
    if isinstance(value, Mapping) and value:
        return [k for sub, v in value.items() for k in _leaf_keys(v, f"{dotted}.{sub}")]
    return [dotted]


def _flatten(data: Any, source: str, prefix: KeyPath = ()) -> tuple[Flat, list[str]]:
    """Check the keys of a nested mapping and flatten it.

    Returns:
        ``{path: (value, source)}`` for the keys we implement (aliases already renamed), and the dotted
        keys that are known to alpha-beta-CROWN but ignored here.

    Raises:
        ConfigError: for an unknown key or a section that is not a mapping.
    """
    if data is None:
        return {}, []
    if not isinstance(data, Mapping):
        where = f"section '{'.'.join(prefix)}'" if prefix else "the top level"
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {data!r}")
    flat: Flat = {}
    ignored: list[str] = []
    for raw_key, value in data.items():
        path = (*prefix, str(raw_key))
        dotted = ".".join(path)
        if dotted in _ALIASES:
            path = tuple(_ALIASES[dotted].split("."))
        found = _lookup(path)
        if found is not None and dataclasses.is_dataclass(found[1]):
            sub_flat, sub_ignored = _flatten(value, source, path)
            flat.update(sub_flat)
            ignored.extend(sub_ignored)
        elif found is not None:
            flat[path] = (value, source)
        elif _is_ignored(dotted):
            ignored.extend(_leaf_keys(value, dotted))
        else:
            raise _unknown_key(source, dotted)
    return flat, ignored


# ----------------------------------------------------------------------------------------------------
# Value coercion
# ----------------------------------------------------------------------------------------------------

_TRUE_WORDS = frozenset({"true", "yes", "y", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "n", "off", "0"})


def _to_bool(value: Any) -> bool:
    """bool from a bool, 0/1 or a yes/no word."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise TypeError


def _to_int(value: Any) -> int:
    """int from an int, an integral float or a numeric string (``"20"``, ``"1e5"``)."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = _to_float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError


def _to_float(value: Any) -> float:
    """float from an int, a float or a numeric string (``"1e-3"``, ``"inf"``, ``".inf"``)."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            parsed = _yaml_scalar(text)
            if isinstance(parsed, float):
                return parsed
    raise TypeError


def _to_str(value: Any) -> str:
    """str from a str or an int (an unquoted number such as a file name ``2024``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise TypeError


def _yaml_scalar(text: str) -> Any:
    """``text`` parsed by YAML rules; the text itself if it is not valid YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


_SCALARS: dict[Any, Callable[[Any], Any]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
_UNION_ORDER = (bool, int, float, list, str)  # try the most specific type first


def _union_members(tp: Any) -> tuple[Any, ...]:
    """Members of ``X | Y`` (or ``Union[X, Y]``); ``(tp,)`` for a plain type."""
    if get_origin(tp) in (Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _is_optional(tp: Any) -> bool:
    """True for ``X | None``."""
    return type(None) in _union_members(tp)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
_PLURAL_TYPE_NAMES = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _describe(tp: Any) -> str:
    """Human-readable type name for error messages (``an integer``, ``a list of integers or null``)."""
    names = []
    for member in _union_members(tp):
        if member is type(None):
            names.append("null")
        elif get_origin(member) is list:
            names.append(f"a list of {_PLURAL_TYPE_NAMES[get_args(member)[0]]}")
        else:
            names.append(_TYPE_NAMES[member])
    return " or ".join(names)


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to type ``tp``; raises TypeError when it cannot be."""
    members = _union_members(tp)
    if type(None) in members and (value is None or (isinstance(value, str) and value.lower() in _NULL_WORDS)):
        return None
    order = sorted(
        (m for m in members if m is not type(None)), key=lambda m: _UNION_ORDER.index(get_origin(m) or m)
    )
    for member in order:
        try:
            return _coerce_one(value, member)
        except (TypeError, ValueError):
            continue
    raise TypeError


def _coerce_one(value: Any, tp: Any) -> Any:
    """``value`` converted to one non-union type (a scalar or ``list[X]``)."""
    if get_origin(tp) is list:
        if isinstance(value, str) and value.strip().startswith("["):
            value = _yaml_scalar(value)
        if not isinstance(value, list | tuple):
            raise TypeError
        (item_tp,) = get_args(tp)
        return [_coerce(item, item_tp) for item in value]
    return _SCALARS[tp](value)


def _check_leaf(f: dataclasses.Field, tp: Any, value: Any, source: str, dotted: str, notes: list[str]) -> Any:
    """Coerce and validate one leaf value.

    Args:
        f: the dataclass field (its metadata holds choices, legacy values, checks).
        tp: the field's resolved type.
        value: the raw value from YAML or the command line.
        source: where the value came from (file path or ``command line``), for messages.
        dotted: the dotted YAML key, for messages.
        notes: receives a note when an alpha-beta-CROWN value is replaced by one of ours.
    """
    where = f"{source}: key '{dotted}'"
    try:
        result = _coerce(value, tp)
    except TypeError:
        raise ConfigError(f"{where} expects {_describe(tp)}, got {value!r}") from None
    meta = f.metadata
    if isinstance(result, str) and result in meta["legacy"]:
        notes.append(f"{dotted} '{result}' -> '{meta['legacy'][result]}'")
        result = meta["legacy"][result]
    if meta["choices"] and result is not None and result not in meta["choices"]:
        raise ConfigError(f"{where} must be one of {'|'.join(meta['choices'])}, got {result!r}")
    if meta["check"] is not None and result is not None and not meta["check"](result):
        raise ConfigError(f"{where} must be {meta['expected']}, got {result!r}")
    if meta["minimum"] is not None and isinstance(result, int | float) and result < meta["minimum"]:
        raise ConfigError(f"{where} must be >= {meta['minimum']}, got {result!r}")
    return result


# ----------------------------------------------------------------------------------------------------
# Building, validating, resolving
# ----------------------------------------------------------------------------------------------------


def _build(cls: type, flat: Flat, notes: list[str], prefix: KeyPath = ()) -> Any:
    """An instance of the section ``cls`` at ``prefix`` with the values of ``flat`` (defaults elsewhere)."""
    kwargs = {}
    for key, (f, tp) in _children(cls).items():
        path = (*prefix, key)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, flat, notes, path)
        elif path in flat:
            value, source = flat[path]
            kwargs[f.name] = _check_leaf(f, tp, value, source, ".".join(path), notes)
    return cls(**kwargs)


def _source_of(flat: Flat, *dotted: str) -> str:
    """The source that set the first of the given keys, for cross-key messages."""
    for key in dotted:
        path = tuple(key.split("."))
        if path in flat:
            return flat[path][1]
    return "config"


def _validate(cfg: Config, flat: Flat) -> None:
    """Checks that involve more than one key."""
    par = cfg.parallel
    if par.mode == "none" and par.world_size > 1:
        source = _source_of(flat, "parallel.world_size", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'parallel.world_size' is {par.world_size} but 'parallel.mode' is 'none'; "
            "set parallel.mode to 'fsdp' or 'tp' to shard over several processes, or world_size to 1"
        )
    if par.mode == "tp" and par.bab_weights == "replicated":
        source = _source_of(flat, "parallel.bab_weights", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'parallel.bab_weights' is 'replicated' but 'parallel.mode' is 'tp', which never "
            "holds a full layer; use parallel.mode 'fsdp' or bab_weights 'sharded'"
        )
    if par.mode == "tp" and cfg.general.complete_verifier in ("bab-refine", "mip"):
        source = _source_of(flat, "general.complete_verifier", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'general.complete_verifier' is '{cfg.general.complete_verifier}', whose "
            "refinement needs whole weight matrices, but 'parallel.mode' is 'tp', which never holds a "
            "full layer; use parallel.mode 'fsdp' or complete_verifier 'bab'"
        )
    if par.backend == "nccl" and cfg.general.device == "cpu":
        source = _source_of(flat, "parallel.backend", "general.device")
        raise ConfigError(f"{source}: key 'parallel.backend' is 'nccl', which needs general.device 'cuda'")


def resolve_path(cfg_dir: str | None, p: str) -> str:
    """The absolute form of a path written in a config.

    An absolute path (after ``~`` expansion) is returned normalised. A relative one is taken relative to
    ``cfg_dir`` (the directory of the YAML file) if it exists there, else relative to the current working
    directory, whether it exists or not. ``cfg_dir=None`` means the current working directory.
    """
    p = os.path.expanduser(p)
    if os.path.isabs(p):
        return os.path.normpath(p)
    if cfg_dir is not None:
        candidate = os.path.join(cfg_dir, p)
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    return os.path.abspath(p)


def _resolve_paths(cfg: Config, flat: Flat, cfg_dir: str | None, file_source: str | None) -> Config:
    """Make the input paths of ``cfg`` absolute (see :func:`resolve_path`)."""
    for dotted in _PATH_KEYS:
        section_name, key = dotted.split(".")
        section = getattr(cfg, section_name)
        value = getattr(section, key)
        if not value:
            continue
        from_file = flat.get((section_name, key), (None, None))[1] == file_source
        resolved = resolve_path(cfg_dir if from_file else None, value)
        cfg = dataclasses.replace(cfg, **{section_name: dataclasses.replace(section, **{key: resolved})})
    return cfg


def _warning(source: str, ignored: Sequence[str], notes: Sequence[str]) -> list[str]:
    """The single warning about ignored keys and replaced values (empty list if there is nothing)."""
    parts = []
    unique = list(dict.fromkeys(ignored))
    if unique:
        listed = ", ".join(unique)
        parts.append(f"ignoring {len(unique)} alpha-beta-CROWN option(s) not implemented here: {listed}")
    if notes:
        parts.append(f"replaced unsupported alpha-beta-CROWN value(s): {', '.join(dict.fromkeys(notes))}")
    return [f"{source}: {'; '.join(parts)}"] if parts else []


# ----------------------------------------------------------------------------------------------------
# Overrides and the public API
# ----------------------------------------------------------------------------------------------------


def _split_argv(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """``[(dotted_key, raw_text_or_None_for_a_bare_flag)]`` from ``--key value`` / ``--key=value`` items."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        if not item.startswith("--") or len(item) == 2:
            raise ConfigError(f"{COMMAND_LINE}: expected '--section.key value', got {item!r}")
        key, eq, text = item[2:].partition("=")
        if eq:
            pairs.append((key, text))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 2
        else:
            pairs.append((key, None))  # a bare flag means true, as alpha-beta-CROWN's store_true options
            i += 1
    return pairs


def _parse_text(key: str, text: str | None) -> Any:
    """The value of one override: raw text for string options, YAML-parsed text otherwise."""
    if text is None:
        return True
    found = _lookup(tuple(key.split(".")))
    if found is not None and not dataclasses.is_dataclass(found[1]):
        members = set(_union_members(found[1])) - {type(None)}
        if members == {str}:
            return None if _is_optional(found[1]) and text.lower() in _NULL_WORDS else text
    return _yaml_scalar(text)


def _overrides_tree(argv: Sequence[str]) -> dict[str, Any]:
    """Nested mapping (YAML names) of raw override values; later occurrences of a key win."""
    tree: dict[str, Any] = {}
    for key, text in _split_argv(argv):
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"{COMMAND_LINE}: malformed key '--{key}'")
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _parse_text(key, text)
    return tree


def _nest(flat: Mapping[KeyPath, Any]) -> dict[str, Any]:
    """Nested dict from ``{path: value}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def parse_overrides(argv: Sequence[str]) -> dict:
    """Parse ``--section.key value`` (or ``--section.key=value``) command-line overrides.

    Values are parsed by YAML rules (``20`` -> int, ``yes`` -> True, ``null`` -> None, ``[1, 2]`` -> list)
    except for string options, which keep the raw text (``null``/``none`` still mean None where None is
    allowed), then type-checked and coerced like YAML values. A bare ``--section.key`` means true. A whole
    section may be given as YAML (``--parallel "{mode: fsdp, world_size: 2}"``). The CLI's own flags
    (``--config``, ``--quiet``) must be removed before calling this.

    Returns:
        Nested dict keyed by YAML names, e.g. ``{"solver": {"alpha-crown": {"iteration": 20}}}``; keys
        alpha-beta-CROWN knows but we ignore are kept with their YAML-parsed value.

    Raises:
        ConfigError: malformed item, unknown key (with a suggestion) or bad value.
    """
    tree = _overrides_tree(argv)
    flat, _ = _flatten(tree, COMMAND_LINE)
    checked = {}
    for path, (value, source) in flat.items():
        f, tp = _lookup(path)  # type: ignore[misc]  # _flatten only keeps known leaves
        checked[path] = _check_leaf(f, tp, value, source, ".".join(path), [])
    result = _nest(checked)
    for path, value in _ignored_values(tree).items():
        node = result
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return result


def _ignored_values(tree: Mapping[str, Any], prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    """``{path: value}`` for the ignored alpha-beta-CROWN keys of an (already validated) tree."""
    out: dict[KeyPath, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if _is_ignored(".".join(path)):
            out[path] = value
        elif isinstance(value, Mapping):
            out.update(_ignored_values(value, path))
    return out


def _assemble(data: Any, source: str, overrides: Sequence[str]) -> tuple[Config, Flat, list[str]]:
    """Config from parsed YAML ``data`` plus ``overrides``; also the flat values and the warnings."""
    flat, ignored = _flatten(data, source)
    over_flat, over_ignored = _flatten(_overrides_tree(overrides), COMMAND_LINE)
    flat.update(over_flat)
    notes: list[str] = []
    cfg = _build(Config, flat, notes)
    _validate(cfg, flat)
    unread = [k for k in _DECLARED_NOT_IMPLEMENTED if _value(cfg, k) != _value(Config(), k)]
    return cfg, flat, _warning(source, ignored + over_ignored + unread, notes)


_DECLARED_NOT_IMPLEMENTED = (
    "general.double_fp",  # computation is float32
    "solver.alpha-crown.early_stop_patience",  # α-CROWN stops early only when every row is proven
    "model.input_shape",  # the shape comes from the ONNX model
    "model.name",  # α,β-CROWN's torch model zoo: ONNX models only here
    "model.path",
)
"""Keys of α,β-CROWN's schema that we parse (and type-check) but do not act on: a value other than the
default is reported with the ignored keys, in the one warning."""


def _value(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part.replace("-", "_"))
    return cfg


def config_from_dict(
    data: Mapping[str, Any] | None, source: str = "config", overrides: Sequence[str] = ()
) -> tuple[Config, list[str]]:
    """Build a :class:`Config` from a nested mapping laid out like the YAML file.

    Paths are left as given (no resolution). ``overrides`` are command-line items as in
    :func:`parse_overrides` and win over ``data``; ``source`` names ``data`` in messages.

    Returns:
        The config and a list of warnings (at most one: ignored keys and replaced values).
    """
    cfg, _, warnings = _assemble(data, source, overrides)
    return cfg, warnings


def _read_yaml(path: str) -> Any:
    """The parsed content of a YAML file; ConfigError if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {what}") from None


def load_config(path: str | None, overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """Load a YAML config file (or only defaults when ``path`` is None) and apply overrides.

    Relative input paths (``general.root_path``, ``model.onnx_path``, ``model.path``,
    ``specification.vnnlib_path``) become absolute: those written in the file are taken relative to the
    file's directory if they exist there, else relative to the current working directory; those given
    as overrides are taken relative to the current working directory. ``general.results_file`` is an
    output and is left as given.

    Args:
        path: YAML file in alpha-beta-CROWN layout, or None.
        overrides: command-line items such as ``["--solver.alpha-crown.iteration", "20"]``.

    Returns:
        The config and a list of warnings (at most one string, listing every alpha-beta-CROWN key that is
        accepted but not implemented and every replaced value).

    Raises:
        ConfigError: unreadable file, unknown key, bad value, inconsistent keys.
    """
    data = _read_yaml(path) if path is not None else None
    cfg, flat, warnings = _assemble(data, path if path is not None else COMMAND_LINE, overrides)
    cfg_dir = os.path.dirname(os.path.abspath(path)) if path is not None else None
    return _resolve_paths(cfg, flat, cfg_dir, path), warnings


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict (YAML names, e.g. ``solver.alpha-crown``) of a config or of one of its sections.

    ``config_from_dict(config_to_dict(cfg))[0] == cfg`` holds for any config.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = config_to_dict(value)
        elif isinstance(value, list):
            value = list(value)
        out[_yaml_key(f)] = value
    return out


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a dataclass's docstring (continuation lines
    joined), the one place each key is documented."""
    docs: dict[str, str] = {}
    lines = (
        (cls.__doc__ or "").split("Attributes:", 1)[-1].splitlines()
        if "Attributes:" in (cls.__doc__ or "")
        else []
    )
    name = None
    for line in lines:
        m = re.match(r"^ {8}([A-Za-z_][\w-]*): (.*)$", line)
        if m:
            name = m.group(1)
            docs[name] = m.group(2).strip()
        elif name and line.startswith(" " * 12):
            docs[name] += " " + line.strip()
        elif line.strip():
            name = None
    return docs


def key_table(cfg: Any = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(dotted key, default, doc)`` for every key of the config, in schema order: what ``--help``
    prints and what the README's key table is generated from."""
    cfg = Config() if cfg is None else cfg
    docs = _attribute_docs(type(cfg))
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + _yaml_key(f)
        if dataclasses.is_dataclass(value):
            rows += key_table(value, key + ".")
        else:
            rows.append((key, value, docs.get(f.name, docs.get(_yaml_key(f), ""))))
    return rows
