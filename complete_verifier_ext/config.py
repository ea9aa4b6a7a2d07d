"""Typed configuration: the schema of alpha-beta-CROWN-style YAML files and command-line overrides.

The YAML layout and key names are those of alpha-beta-CROWN (``general``, ``model``, ``specification``,
``solver``, ``bab``, ``attack``; ``solver.alpha-crown`` and ``solver.beta-crown`` keep their dashes),
plus our own ``parallel`` section. Each section is a frozen dataclass; the whole tree is a
:class:`Config`, built once by :func:`complete_verifier_ext.config_load.load_config` and passed down
explicitly (there is no global config).

This module holds the schema only: the sections, each field's type, default, allowed values and
checks (in its metadata, see :func:`_opt`), the alpha-beta-CROWN keys that are accepted but not
implemented, and their aliases. Reading YAML, coercing values, validating and applying overrides is the
generic loader's work, in :mod:`complete_verifier_ext.config_load`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import UserError

__all__ = [
    "ALIASES",
    "AlphaCrownConfig",
    "AttackConfig",
    "BabConfig",
    "BetaCrownConfig",
    "BranchingConfig",
    "Config",
    "CrownConfig",
    "ConfigError",
    "DECLARED_NOT_IMPLEMENTED",
    "GeneralConfig",
    "IGNORED_KEYS",
    "IGNORED_SECTIONS",
    "InputSplitConfig",
    "MipConfig",
    "ModelConfig",
    "PATH_KEYS",
    "ParallelConfig",
    "SolverConfig",
    "SpecificationConfig",
]


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
            of the whole network per open clause for all the time left, as alpha-beta-CROWN's ``mip``),
            ``skip`` (stop after incomplete verification) or ``auto`` (the method chosen for each
            instance from its model and query, ``methods.py``: input split for few input dimensions,
            else ``bab-refine`` on fully connected nets and ``bab`` on convolutional ones; keys the
            config sets itself win).
        deterministic: use deterministic torch kernels (``torch.use_deterministic_algorithms``).
        double_fp: compute in float64 (not implemented: a value other than false is warned and ignored).
        verbose: print what every stage does on its own line of stderr (PGD, each bound method, every
            alpha-CROWN step with its worst clause bound, every BaB round with domains left, worst bound
            and domains/s, the refinement's layers); without it, a terminal shows one progress line.
        sparse_alpha: keep alpha-CROWN's slopes only for the neurons unstable when it starts (as
            alpha-beta-CROWN's ``sparse_alpha``); ``false``: one slope per neuron (the same bounds,
            more memory).
        engine: ``auto`` (``abcrown`` where an alpha-beta-CROWN checkout is found: ``$ABCROWN_PATH``
            or an importable ``complete_verifier``; else ``native``; one stderr line says which),
            ``native`` (this package's engine) or ``abcrown`` (the user's alpha-beta-CROWN, sharded at
            runtime; the YAML then goes to alpha-beta-CROWN as it is, see docs/abcrown_plugin.md).
        proof: where an ``unsat`` writes its proof (``docs/proofs.md``; ``.gz``: gzipped), checked by
            ``complete-verifier-ext check``; null: none. With a proof the native engine leaves out the
            steps a checker cannot re-derive (the MILP refinement and the output MILP: ``bab-refine``
            and ``mip`` run as ``bab``).
    """

    device: str = _opt("cpu", check=_is_device, expected="cpu, cuda or cuda:N")
    seed: int = _opt(100)
    root_path: str = _opt("")
    csv_name: str | None = _opt(None)
    results_file: str = _opt("out.txt")
    enable_incomplete_verification: bool = _opt(True)
    complete_verifier: str = _opt("bab", choices=("bab", "bab-refine", "mip", "skip", "auto"))
    deterministic: bool = _opt(False)
    double_fp: bool = _opt(False)
    verbose: bool = _opt(False)
    sparse_alpha: bool = _opt(True)
    engine: str = _opt("auto", choices=("auto", "native", "abcrown"))
    proof: str | None = _opt(None)


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


_BOUND_PROP_LEGACY = MappingProxyType(
    {
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
)


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
        method: ReLU branching heuristic: ``babsr`` or ``fsb``/``kfsb`` (one method here, alpha-beta-CROWN's
            kfsb: the ``candidates`` best neurons by BaBSR's score and the ``candidates`` best by its
            intercept term, per domain, each tried with a cheap bound of both children;
            alpha-beta-CROWN's ``sb``, ``naive`` and ``random`` run ``babsr``, with a warning).
        candidates: candidates per list scored by a bound in ``fsb``/``kfsb``.
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
            Left out with ``world_size`` above 1: ``fsdp``.
        world_size: number of ranks; > 1 requires ``mode`` fsdp or tp (``fsdp`` when mode is not given).
        backend: ``auto`` (gloo on CPU, NCCL on CUDA), ``gloo`` or ``nccl``.
        exact_memory: run every rank with ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MKL_DISABLE_FAST_MM=1``
            so that freed tensors and GEMM buffers go back to the OS at once and the reported CPU peak
            follows live tensors (see ``parallel/memory.py``).  It costs time (every large tensor is
            fresh pages: BaB on mnist-net_256x4 runs about 1.4x slower), so it is off unless memory is
            being measured; off, ``peak_mb`` also counts memory the allocator keeps for reuse.
        bab_weights: how ReLU-split BaB holds the weights (both engines): ``replicated`` gathers
            every layer once when the search starts and holds it whole until it ends, so that a round
            costs no collective but its agreement; ``sharded`` keeps the shards and gathers (or, in
            the α,β-CROWN plugin, fetches) a layer whenever it is used, as everywhere else.  The
            domains stay split either way; replicating adds one copy of the weights per rank (on
            mnist-net_256x6, 1.5 MB against ~14 KB per queued domain) and is several times faster
            per round.  ``tp`` never holds a full layer, so it only allows ``sharded``.  ``auto``
            (the default): ``replicated`` under ``fsdp``, ``sharded`` under ``tp``.
        threads: torch threads per rank; 0 (the default) divides the cores available to the process
            (its CPU affinity) less one among the ranks on the host, at least 1 each (2 threads on 2
            cores are no faster alone and several times slower beside another busy process).
        collective_timeout: seconds a collective waits for a rank before the run ends with one line
            naming the rank that stopped responding (stopped, swapped out, deadlocked).  A rank that
            dies is noticed within a second whatever this says.  Raise it where one rank may
            legitimately run far ahead of the others (a very slow shared machine).
    """

    mode: str = _opt("none", choices=("none", "fsdp", "tp"))
    world_size: int = _opt(1, minimum=1)
    backend: str = _opt("auto", choices=("auto", "gloo", "nccl"))
    exact_memory: bool = _opt(False)
    bab_weights: str = _opt("auto", choices=("auto", "replicated", "sharded"))
    threads: int = _opt(0, minimum=0)
    collective_timeout: float = _opt(30.0, minimum=1)

    @property
    def bab_weights_resolved(self) -> str:
        """``bab_weights`` with ``auto`` settled: ``sharded`` under ``tp``, else ``replicated``."""
        if self.bab_weights != "auto":
            return self.bab_weights
        return "sharded" if self.mode == "tp" else "replicated"


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

IGNORED_SECTIONS = frozenset(
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

_IGNORED_KEYS_BY_SECTION = MappingProxyType(
    {
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
)

IGNORED_KEYS = frozenset(
    f"{section}.{name}" for section, names in _IGNORED_KEYS_BY_SECTION.items() for name in names.split()
)
"""Single alpha-beta-CROWN keys (dotted) we accept and ignore."""

ALIASES = MappingProxyType(
    {
        "solver.early_stop_patience": "solver.alpha-crown.early_stop_patience",
        "solver.beta-crown.batch_size": "solver.batch_size",  # alpha-beta-CROWN before 2022
    }
)
"""alpha-beta-CROWN spellings (dotted) of keys that live elsewhere in our tree."""

PATH_KEYS = ("general.root_path", "model.onnx_path", "model.path", "specification.vnnlib_path")
"""Keys holding input paths, made absolute by :func:`~complete_verifier_ext.config_load.load_config`."""

DECLARED_NOT_IMPLEMENTED = (
    "general.double_fp",  # computation is float32
    "solver.alpha-crown.early_stop_patience",  # α-CROWN stops early only when every row is proven
    "model.input_shape",  # the shape comes from the ONNX model
    "model.name",  # α,β-CROWN's torch model zoo: ONNX models only here
    "model.path",
)
"""Keys of α,β-CROWN's schema that we parse (and type-check) but do not act on: a value other than the
default is reported with the ignored keys, in the one warning."""
