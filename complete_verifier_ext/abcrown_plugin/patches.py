"""The machinery of patching α,β-CROWN and auto_LiRPA, and the patches that belong to no sharding
concern; *what* is patched, when and in which order is :mod:`.table`, one row per attribute.

* :class:`Patcher` sets attributes and remembers the originals; ``undo`` puts them back. Every patch
  sets a class or module attribute (never a subclass: upstream checks ``type(x) == BoundLinear``).
  ``SIGNATURES`` holds the parameter names of every upstream callable the plugin wraps or calls,
  checked before anything is set, so that an unknown upstream is refused with one line instead of
  being half-patched.
* the **probe**: records what α,β-CROWN computed (the initial CROWN bounds, the α-CROWN bounds, each
  instance's verdict, time and BaB domains) for our ``--summary``, and the phases' memory peaks;
* the **spec cache**: α,β-CROWN caches a parsed VNN-LIB file as ``<spec>.compiled`` beside the spec;
  each rank reads a copy in its own cache folder instead (inputs may be read-only, and P ranks would
  race on one file);
* the **clocks**: the first instance's clock starts at the verifier's start; at P > 1, ``time`` in the
  modules whose clock feeds a time limit is the all-reduced maximum of the ranks' clocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import shutil
import sys
import time as _time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .locate import PluginError

# the parameter names of every callable we wrap, as in α,β-CROWN 8250d5f / auto_LiRPA 0.7.0
SIGNATURES: dict[str, tuple[str, ...]] = {
    "utils.Logger.summarize_results": ("self", "verified_status", "index"),
    "utils.Logger.record_start_time": ("self",),
    "utils.Logger.update_timeout": ("self", "timeout"),
    "load_model.load_model_onnx": ("path", "quirks", "x"),
    "loading.default_onnx_and_vnnlib_loader": ("file_root", "onnx_path", "vnnlib_path"),
    "auto_LiRPA.BoundedModule.init_alpha": (
        "self",
        "x",
        "share_alphas",
        "method",
        "c",
        "bound_lower",
        "bound_upper",
        "final_node_name",
        "interm_bounds",
        "reference_alphas",
        "skip_bound_compute",
    ),
    "auto_LiRPA.BoundedModule._get_optimized_bounds": (
        "self",
        "x",
        "aux",
        "C",
        "IBP",
        "forward",
        "method",
        "bound_side",
        "reuse_ibp",
        "return_A",
        "average_A",
        "final_node_name",
        "interm_bounds",
        "reference_bounds",
        "aux_reference_bounds",
        "needed_A_dict",
        "cutter",
        "decision_thresh",
        "epsilon_over_decision_thresh",
    ),
    "beta_CROWN_solver.LiRPANet.__init__": ("self", "model_ori", "in_size", "c", "device"),
    "beta_CROWN_solver.LiRPANet.build": (
        "self",
        "x",
        "c",
        "rhs",
        "stop_criterion",
        "bounding_method",
        "vnnlib_handler",
        "interm_bounds",
        "return_A",
        "or_spec_size",
        "full_alpha_info",
    ),
    "read_vnnlib.read_vnnlib": ("vnnlib_filename", "regression"),
    "auto_LiRPA.BoundedModule.batched_backward": (
        "self",
        "node",
        "C",
        "unstable_idx",
        "batch_size",
        "bound_lower",
        "bound_upper",
        "return_A",
    ),
    "auto_LiRPA.BoundedModule.get_sparse_C": ("self", "node", "ref_intermediate"),
    "auto_LiRPA.BoundedModule.check_optimized_variable_sparsity": ("self", "node"),
    "auto_LiRPA.BoundedModule.get_unstable_locations": (
        "self",
        "ref_intermediate_lb",
        "ref_intermediate_ub",
        "conv",
        "channel_only",
    ),
    "auto_LiRPA.BoundedModule.backward_general": (
        "self",
        "bound_node",
        "C",
        "start_backpropagation_at_node",
        "bound_lower",
        "bound_upper",
        "average_A",
        "need_A_only",
        "unstable_idx",
        "update_mask",
        "apply_output_constraints_to",
        "initial_As",
        "initial_lb",
        "initial_ub",
    ),
    "auto_LiRPA.BoundedModule._compute_bounds_main": (
        "self",
        "C",
        "method",
        "IBP",
        "bound_lower",
        "bound_upper",
        "reuse_ibp",
        "reuse_alpha",
        "average_A",
        "alpha_idx",
        "need_A_only",
        "update_mask",
    ),
    "bab.split_domain": (
        "net",
        "domains",
        "d",
        "batch",
        "stats",
        "set_init_alpha",
        "fix_interm_bounds",
        "branching_heuristic",
        "iter_idx",
    ),
    "bab.get_split_depth": ("batch_size", "min_batch_size", "min_depth"),
    "lp_mip_solver.mip_solver_lb_ub_and": ("candidate", "save_adv", "rhs"),
    "lp_mip_solver.utils.handle_gurobi_error": ("message",),
    "abcrown.Customized": ("def_file", "callable_name", "args", "kwargs"),
    "bab.multi_tree_bab": (
        "net",
        "domains",
        "batch",
        "stop_criterion_func",
        "biccos_args",
        "stats",
        "start_time",
        "initial_bs_ratio",
    ),
    "input_split.split.get_split_depth": ("current_domain_num", "split_partitions"),
    "input_split.batch_branch_and_bound.batch_verification_input_split": (
        "d",
        "net",
        "batch",
        "num_iter",
        "decision_thresh",
        "shape",
        "bounding_method",
        "branching_method",
        "stop_criterion",
        "split_partitions",
        "use_reordered_bab",
        "stats",
    ),
    "input_split.batch_branch_and_bound.pgd_attack_on_domains": ("model_ori", "domains", "stage", "vnnlib"),
    "complete_verifier_func.input_bab_parallel": (
        "net",
        "x",
        "c",
        "rhs",
        "or_spec_size",
        "reference_dict",
        "timeout",
        "max_iterations",
        "vnnlib",
        "return_domains",
        "index",
    ),
    "input_split.branching_domains.UnsortedInputDomainList.__len__": ("self",),
    "input_split.branching_domains.UnsortedMultiSpecInputDomainList.__len__": ("self",),
    "input_split.branching_domains.UnsortedInputDomainList.pick_out_batch": ("self", "batch_size", "device"),
    "input_split.branching_domains.UnsortedInputDomainList.add": (
        "self",
        "lb",
        "dm_l",
        "dm_u",
        "alpha",
        "cs",
        "threshold",
        "constraints",
        "split_idx",
        "remaining_index",
        "check_dm_lbs",
        "check_input_boxes",
        "kwargs",
    ),
    "bab.act_split_round": ("domains", "net", "batch", "iter_idx", "stats", "branching_heuristic"),
    # called (not patched) by the plugin's BaB round: see CALLED
    "bab.check_worst_domain": ("d",),
    "branching_domains.BatchedDomainList.__len__": ("self",),
    "branching_domains.BatchedDomainList.pick_out": ("self", "batch", "device"),
    "tensor_storage.get_tensor_storage": (
        "full_shape",
        "initial_size",
        "switching_size",
        "dtype",
        "device",
        "concat_dim",
    ),
    "complete_verifier_func.general_bab": (
        "net",
        "x",
        "c",
        "rhs",
        "reference_dict",
        "timeout",
        "max_iterations",
    ),
    "auto_LiRPA.operators.BoundRelu.init_opt_parameters": ("self", "start_nodes"),
    "auto_LiRPA.operators.BoundRelu.select_alpha_by_idx": (
        "self",
        "last_lA",
        "last_uA",
        "unstable_idx",
        "start_node",
    ),
    "auto_LiRPA.operators.BoundLinear.forward": ("self", "x", "w", "b"),
    "auto_LiRPA.operators.BoundLinear.bound_backward": (
        "self",
        "last_lA",
        "last_uA",
        "x",
        "start_node",
        "reduce_bias",
        "kwargs",
    ),
    "auto_LiRPA.operators.BoundLinear.interval_propagate": ("self", "v", "C", "w"),
    "auto_LiRPA.operators.BoundLinear.build_solver": ("self", "v", "model", "C", "model_type", "solver_pkg"),
    "auto_LiRPA.operators.BoundMatMul.forward": ("self", "x", "y"),
    "auto_LiRPA.operators.BoundMatMul.bound_backward": (
        "self",
        "last_lA",
        "last_uA",
        "x",
        "start_node",
        "kwargs",
    ),
    "auto_LiRPA.operators.BoundMatMul.interval_propagate": ("self", "v", "C"),
    "auto_LiRPA.operators.BoundConv.forward": ("self", "x"),
    "auto_LiRPA.operators.BoundConv.bound_backward": ("self", "last_lA", "last_uA", "x", "kwargs"),
    "auto_LiRPA.operators.BoundConv.interval_propagate": ("self", "v", "C"),
    "auto_LiRPA.operators.BoundConv.build_solver": ("self", "v", "model", "C", "model_type", "solver_pkg"),
}


# the entries of SIGNATURES that the plugin calls with their parameters by name but does not patch
CALLED = (
    "auto_LiRPA.BoundedModule.check_optimized_variable_sparsity",
    "auto_LiRPA.BoundedModule.get_unstable_locations",
    "auto_LiRPA.BoundedModule.backward_general",
    "bab.split_domain",
    "bab.check_worst_domain",
    "branching_domains.BatchedDomainList.pick_out",
    "tensor_storage.get_tensor_storage",
    "input_split.branching_domains.UnsortedInputDomainList.pick_out_batch",
    "input_split.branching_domains.UnsortedInputDomainList.add",
)


def resolve(dotted: str) -> tuple[Any, str]:
    """``"mod.Class.attr"`` -> (owner object, attribute name); the module part is imported."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for p in parts[cut:-1]:
            owner = getattr(owner, p)
        return owner, parts[-1]
    raise PluginError(f"cannot import {dotted}")


def check_signature(dotted: str) -> None:
    owner, name = resolve(dotted)
    fn = inspect.getattr_static(owner, name, None)
    if fn is None:
        raise PluginError(f"{dotted} does not exist in this alpha-beta-CROWN: not the supported release")
    got = tuple(inspect.signature(fn).parameters)
    if got != SIGNATURES[dotted]:
        raise PluginError(
            f"{dotted}{got} differs from the supported release's {SIGNATURES[dotted]}: refusing to patch"
        )


@dataclass
class Patcher:
    """Sets attributes and remembers the originals, so that :meth:`undo` restores them all: an
    attribute that the owner only inherited (a class whose base defines the method) is deleted again,
    not left behind as a copy."""

    saved: list[tuple[Any, str, Any]] = field(default_factory=list)

    def original(self, dotted: str) -> Callable:
        owner, name = resolve(dotted)
        return inspect.getattr_static(owner, name)

    def wrap(self, dotted: str, make: Callable[[Callable], Callable]) -> None:
        owner, name = resolve(dotted)
        orig = inspect.getattr_static(owner, name)
        self.set(owner, name, make(orig))

    def set(self, owner: Any, name: str, value: Any) -> None:
        own = vars(owner).get(name, _INHERITED) if hasattr(owner, "__dict__") else getattr(owner, name)
        self.saved.append((owner, name, own))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self.saved:
            owner, name, value = self.saved.pop()
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


_INHERITED = object()  # Patcher: the owner did not hold the attribute itself


@dataclass
class Record:
    """What α,β-CROWN computed for one instance, as it computed it."""

    verdict: str = "unknown"
    time_s: float = 0.0
    crown: list[float] = field(default_factory=list)
    alpha_crown: list[float] = field(default_factory=list)
    bab_domains: int = 0  # domains visited by BaB
    bab_s: float = 0.0


@dataclass
class Probe:
    records: list[Record] = field(default_factory=list)
    current: Record = field(default_factory=Record)
    optimized: bool = False  # α-CROWN ran since the last init_alpha
    alpha_elements: int = 0  # the most α elements this rank optimised in one α-CROWN run
    # called with ("bounds", True/False) at the start and end of LiRPANet.build, ("bab", ...) of BaB
    on_phase: Callable[[str, bool], None] | None = None

    def next_instance(self, verdict: str, time_s: float) -> None:
        self.current.verdict, self.current.time_s = verdict, time_s
        self.records.append(self.current)
        self.current = Record()


def _bounds(t) -> list[float]:
    return [float(v) for v in t.detach().flatten().tolist()]


def bab_proved(global_lb) -> bool:
    """Whether BaB's final worst margin (lower bound minus threshold) proves the property: at least 0
    (+inf when no domain is left). NaN proves nothing."""
    v = float(global_lb)
    return v >= 0.0


def _vnncomp_verdict(verified_status: Any) -> str:
    """α,β-CROWN's own mapping of its statuses to VNN-COMP words (single-instance mode)."""
    s = str(verified_status)
    if "unknown" in s or "timeout" in s or "timed out" in s:
        return "timeout"
    if "unsafe" in s:
        return "sat"
    if "safe" in s:
        return "unsat"
    return s


def _phase(probe: Probe, name: str, started: bool) -> None:
    """Tell ``probe.on_phase`` (if any) that phase ``name`` starts or ends."""
    if probe.on_phase:
        probe.on_phase(name, started)


Wrapper = Callable[[Callable], Callable]
"""What :meth:`Patcher.wrap` takes: the original callable -> its replacement."""


def probe_summarize(probe: Probe) -> Wrapper:
    """``Logger.summarize_results``: closes the probe's record of the instance with its verdict."""

    def summarize(orig):
        def summarize_results(self, verified_status, index):
            probe.next_instance(_vnncomp_verdict(verified_status), _time.time() - self.start_time)
            return orig(self, verified_status, index)

        return summarize_results

    return summarize


def probe_init_alpha(probe: Probe) -> Wrapper:
    """``BoundedModule.init_alpha``: records the initial CROWN bounds it returns."""

    def init_alpha(orig):
        def wrapper(self, x, *args, **kwargs):
            ret = orig(self, x, *args, **kwargs)
            probe.optimized = False
            if isinstance(ret, tuple) and ret and ret[0] is not None:
                probe.current.crown += _bounds(ret[0])
            return ret

        return wrapper

    return init_alpha


def probe_optimized(probe: Probe) -> Wrapper:
    """``BoundedModule._get_optimized_bounds``: notes that α-CROWN ran and how many α it holds."""

    def optimized(orig):
        def wrapper(self, *args, **kwargs):
            probe.optimized = True
            alphas = (getattr(node, "alpha", None) or {} for node in self.nodes())
            held = sum(a.numel() for per_start in alphas for a in per_start.values())
            probe.alpha_elements = max(probe.alpha_elements, held)
            return orig(self, *args, **kwargs)

        return wrapper

    return optimized


def probe_build(probe: Probe) -> Wrapper:
    """``LiRPANet.build``: the ``bounds`` phase; records its CROWN or α-CROWN bounds of the output."""

    def build(orig):
        def wrapper(self, *args, **kwargs):
            probe.optimized = False
            _phase(probe, "bounds", True)
            global_lb, result = orig(self, *args, **kwargs)
            _phase(probe, "bounds", False)
            import arguments

            method = kwargs.get("bounding_method") or arguments.Config["solver"]["bound_prop_method"]
            lower = (result or {}).get("lower_bounds") or {}
            if self.final_name in lower:
                if method == "crown" and not probe.current.crown:
                    probe.current.crown += _bounds(lower[self.final_name])
                elif method == "alpha-crown" and probe.optimized:
                    probe.current.alpha_crown += _bounds(lower[self.final_name])
            return global_lb, result

        return wrapper

    return build


def probe_general_bab(probe: Probe, input_split: bool = False) -> Wrapper:
    """``general_bab`` (``input_bab_parallel`` with ``input_split``): the ``bab`` phase, its time and
    domains; a "safe" that activation BaB did not prove is unknown (input BaB says "safe" only with no
    box left, and returns other values than a margin)."""

    def general_bab(orig):
        def wrapper(*args, **kwargs):
            _phase(probe, "bab", True)
            t0 = _time.monotonic()
            ret = orig(*args, **kwargs)
            if (
                not input_split
                and isinstance(ret, tuple)
                and len(ret) > 2
                and ret[2] == "safe"
                and not bab_proved(ret[0])
            ):
                # α,β-CROWN's BaB says "safe" when bab.max_iterations stops it with domains left (their
                # worst lower bound still below the threshold): that is no proof
                print("warning: BaB stopped by bab.max_iterations, domains open: unknown", file=sys.stderr)
                ret = (ret[0], ret[1], "unknown", *ret[3:])
            probe.current.bab_s += _time.monotonic() - t0
            probe.current.bab_domains += int(ret[1]) if isinstance(ret, tuple) and len(ret) > 1 else 0
            _phase(probe, "bab", False)
            return ret

        return wrapper

    return general_bab


def cached_read_vnnlib(orig: Callable, cache_dir: str) -> Callable:
    """α,β-CROWN's ``read_vnnlib`` (``orig``) reading a copy of the spec in ``cache_dir`` (named by its
    content), where its ``.compiled`` cache then lives too."""

    def read_vnnlib(vnnlib_filename, regression=False):
        data = Path(vnnlib_filename).read_bytes()
        os.makedirs(cache_dir, exist_ok=True)
        copy = os.path.join(cache_dir, hashlib.sha256(data).hexdigest()[:32] + ".vnnlib")
        if not os.path.exists(copy):
            tmp = f"{copy}.{os.getpid()}.tmp"
            shutil.copyfile(vnnlib_filename, tmp)
            os.replace(tmp, copy)
        return orig(copy, regression)

    return read_vnnlib


class OutOfTime(Exception):
    """A single instance's time ran out before its verification started (start-up took it all)."""


class FirstInstanceClock:
    """The first instance's clock (``Logger.start_time``, from which α,β-CROWN measures its timeout)
    starts at ``started_wall``, the verifier's start, so that start-up (imports, starting the ranks)
    counts against the timeout as in a VNN-COMP harness; later instances start when they start. A
    single instance whose time is gone once its timeout is known (``Logger.update_timeout``, after
    loading) is reported ``timeout`` at once (:class:`OutOfTime` ends ``ABCROWN.main``), not after
    the incomplete phase and a BaB round that α,β-CROWN would still run."""

    def __init__(self, started_wall: float) -> None:
        self.started_wall = started_wall
        self.first = True
        self.check = False

    def wrap_start(self, orig: Callable) -> Callable:
        def record_start_time(logger):
            orig(logger)  # the same calls (and clock collectives) on every rank
            if self.first:
                self.first, self.check = False, True
                logger.start_time = min(logger.start_time, self.started_wall)

        return record_start_time

    def wrap_timeout(self, orig: Callable) -> Callable:
        import importlib

        utils = importlib.import_module("utils")

        def update_timeout(logger, timeout):
            orig(logger, timeout)
            if self.check and logger.run_mode == "single_vnnlib":
                self.check = False
                if utils.time.time() - logger.start_time >= float(timeout):  # the synced clock at P > 1
                    logger.summarize_results("unknown (the time ran out before verification started)", 0)
                    raise OutOfTime

        return update_timeout


class SyncedTime(types.ModuleType):
    """A stand-in for the ``time`` module whose ``time()`` is the maximum over the ranks (one all-reduce
    per call: α,β-CROWN calls it at the same points on every rank, since all else is replicated), except
    inside :func:`local_clock` (rank-local work, such as a rank's share of a BaB round)."""

    local = False

    def __init__(self) -> None:
        super().__init__("time")
        self._rank_pid = os.getpid()  # a process forked from the rank (a MIP solver) reads its own clock

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    def time(self) -> float:
        import torch

        from ..parallel import comm

        if SyncedTime.local or os.getpid() != self._rank_pid:
            return _time.time()

        t = torch.tensor([_time.time()], dtype=torch.float64, device=comm.device())
        return float(comm.all_reduce(t, "max").item())


@contextlib.contextmanager
def local_clock():
    """The rank's own clock inside (no collective per call)."""
    saved, SyncedTime.local = SyncedTime.local, True
    try:
        yield
    finally:
        SyncedTime.local = saved


# every module whose clock feeds a time-limit decision (the BaB and α/β optimisation limits, the time
# left for BaB after the incomplete phase, the per-instance start)
CLOCK_MODULES = (
    "abcrown",
    "utils",
    "complete_verifier_func",
    "bab",
    "input_split.batch_branch_and_bound",
    "lp_mip_solver",
    "lp_mip_solver.refine_core",
    "auto_LiRPA.optimized_bounds",
)


def synced_time(orig: Any) -> SyncedTime:
    """The replacement of a module's ``time`` (``orig``: it must be the time module itself)."""
    if orig is not _time:
        raise PluginError(f"{orig!r} is not the time module: not the supported release")
    return SyncedTime()
