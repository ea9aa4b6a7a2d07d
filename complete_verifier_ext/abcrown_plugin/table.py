"""Every attribute of α,β-CROWN and auto_LiRPA that the plugin changes: one row each, in install order.

A row names the upstream attribute, when it is set (``always``; ``P>1``; ``fsdp`` / ``tp``: that mode
at P > 1; ``sharded``: either), the plugin module whose code replaces it, and how its replacement is
made from the original (``make(setup, original)``). :func:`install` walks the table in order, after
checking every signature it relies on (``patches.SIGNATURES``: an unknown upstream is refused before
anything is set); :meth:`patches.Patcher.undo` puts every original back in reverse order. Where two rows
name the same attribute, the later one wraps the earlier (``general_bab``: the domain split inside, the
probe outside, so that the BaB phase's peak includes the weights that ``bab_weights: replicated``
gathers for the search).

What the rows' code then changes at run time on objects that α,β-CROWN creates per instance is listed
in :data:`RUNTIME`, with its lifetime: those objects are dropped with the instance, not restored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ParallelConfig
from . import bab_split, customized, cuts_split, fsdp, input_bab, inputs, mip_split, patches, rows, tp


@dataclass
class Setup:
    """What one rank's replacements are made from."""

    par: ParallelConfig
    world: int
    probe: patches.Probe
    spec_cache: str  # this rank's folder for VNN-LIB copies and their α,β-CROWN cache
    started_wall: float  # the verifier's start (time.time()): the first instance's clock
    first_clock: patches.FirstInstanceClock = field(init=False)

    def __post_init__(self) -> None:
        self.first_clock = patches.FirstInstanceClock(self.started_wall)

    @property
    def weights_sharded(self) -> bool:
        return self.par.bab_weights_resolved == "sharded"


Make = Callable[[Setup, Any], Any]


@dataclass(frozen=True)
class Patch:
    target: str  # "module.attr" or "module.Class.attr" (the module is imported to resolve it)
    when: str  # always | P>1 | fsdp | tp | sharded
    by: str  # the plugin module whose code is the replacement
    make: Make  # (setup, original) -> replacement
    why: str


WHEN: dict[str, Callable[[Setup], bool]] = {
    "always": lambda s: True,
    "P>1": lambda s: s.world > 1,
    "fsdp": lambda s: s.world > 1 and s.par.mode == "fsdp",
    "tp": lambda s: s.world > 1 and s.par.mode == "tp",
    "sharded": lambda s: s.world > 1 and s.par.mode in ("fsdp", "tp"),
}


def _wrap(factory: Callable[[Any], Any]) -> Make:
    return lambda setup, orig: factory(orig)


def _read_vnnlib(setup: Setup, orig: Any) -> Any:
    return inputs.checked_read_vnnlib(patches.cached_read_vnnlib(orig, setup.spec_cache))


def _act_split_round(setup: Setup, orig: Any) -> Any:
    import bab

    return bab_split.wrap_act_split_round(bab.split_domain, bab.check_worst_domain, setup.weights_sharded)


def _synced_time(setup: Setup, orig: Any) -> Any:
    return patches.synced_time(orig)


def _synced_optim(setup: Setup, orig: Any) -> Any:
    return rows.synced_optim(orig)


def _rows_active(setup: Setup, orig: Any) -> bool:
    return True


def _first_start(setup: Setup, orig: Any) -> Any:
    return setup.first_clock.wrap_start(orig)


def _first_timeout(setup: Setup, orig: Any) -> Any:
    return setup.first_clock.wrap_timeout(orig)


def _bab_weights(setup: Setup, orig: Any) -> Any:
    return bab_split.wrap_general_bab(orig, setup.weights_sharded)


def _multi_tree(setup: Setup, orig: Any) -> Any:
    return cuts_split.wrap_multi_tree_bab(orig, setup.weights_sharded)


def _input_round(setup: Setup, orig: Any) -> Any:
    return input_bab.wrap_input_split_round(orig, setup.weights_sharded)


def _input_attack(setup: Setup, orig: Any) -> Any:
    return input_bab.wrap_pgd_attack_on_domains(orig, setup.weights_sharded)


def _input_bab(setup: Setup, orig: Any) -> Any:
    return input_bab.wrap_input_bab_parallel(orig, setup.weights_sharded)


def _shard_on_build(setup: Setup, orig: Any) -> Any:
    return fsdp.wrap_lirpanet_init(setup.par.mode == "tp")(orig)


def _input_probe(probe: patches.Probe) -> Callable[[Any], Any]:
    return patches.probe_general_bab(probe, input_split=True)


def _probe(factory: Callable[[patches.Probe], Callable[[Any], Any]]) -> Make:
    return lambda setup, orig: factory(setup.probe)(orig)


_SPEC = "bad VNN-LIB input is one line naming the file and line; each rank reads its own cached copy"
_ONNX = "a bad ONNX file (unreadable, input size not the spec's) is one line naming it"
_CLOCK = "the maximum of the ranks' clocks, so that every time-limit decision is the same on every rank"
_GATHER = "the weight gathered for the call, freed after"
_RING = "column-parallel forward and IBP, A @ W around a ring of shards"
_AV, _BM, _RELU = "auto_LiRPA.BoundedModule", "auto_LiRPA.optimized_bounds", "auto_LiRPA.operators.BoundRelu"
_IBB = "input_split.batch_branch_and_bound"
_FIRST = "the first instance's clock starts at the verifier's start"
_OUT_OF_TIME = "a single instance out of time before it starts ends timeout at once"

# fmt: off
TABLE: tuple[Patch, ...] = (
    # the user's files (inputs.py, patches.py)
    *(Patch(f"{m}.read_vnnlib", "always", "inputs", _read_vnnlib, _SPEC)
      for m in ("read_vnnlib", "loading", "abcrown")),  # each module holds its own reference
    *(Patch(f"{m}.load_model_onnx", "always", "inputs", _wrap(inputs.checked_load_model_onnx), _ONNX)
      for m in ("load_model", "loading")),
    Patch("loading.default_onnx_and_vnnlib_loader", "always", "inputs", _wrap(inputs.joint_loader),
          "a VNN-LIB 2.0 instance's networks (a list, VNN-COMP 2026) loaded as one joint model"),
    # the instance clock (patches.py)
    Patch("utils.Logger.record_start_time", "always", "patches", _first_start, _FIRST),
    Patch("utils.Logger.update_timeout", "always", "patches", _first_timeout, _OUT_OF_TIME),
    *(Patch(f"{m}.time", "P>1", "patches", _synced_time, _CLOCK) for m in patches.CLOCK_MODULES),
    # the rows of A-matrices and their α dealt over the ranks (rows.py)
    Patch(f"{_AV}.batched_backward", "P>1", "rows", _wrap(rows.wrap_batched_backward),
          "each rank back-substitutes its block of row passes; the bounds are all-gathered"),
    Patch(f"{_AV}.get_sparse_C", "P>1", "rows", _wrap(rows.wrap_get_sparse_C),
          "a patches-mode residual sum's unstable rows bounded in passes too (to be dealt)"),
    Patch(f"{_AV}._compute_bounds_main", "P>1", "rows", _wrap(rows.wrap_compute_bounds_main),
          "the bounds' gradient counted once over the ranks"),
    Patch(f"{_RELU}.init_opt_parameters", "P>1", "rows", _wrap(rows.wrap_init_opt_parameters),
          "each rank keeps the α of its own rows"),
    Patch(f"{_RELU}.select_alpha_by_idx", "P>1", "rows", _wrap(rows.wrap_select_alpha_by_idx),
          "a rank reads its local α rows"),
    Patch(f"{_BM}.optim", "P>1", "rows", _synced_optim,
          "Adam and SGD sum every gradient over the ranks before their step"),
    Patch("complete_verifier_ext.abcrown_plugin.rows._active", "P>1", "rows", _rows_active,
          "the row dealing is on (ours: read by the wrappers above)"),
    # the BaB domain list split over the ranks (bab_split.py)
    Patch("bab.act_split_round", "P>1", "bab_split", _act_split_round,
          "each rank splits and bounds its share of the domains; one agreement a round"),
    Patch("bab.get_split_depth", "P>1", "bab_split", _wrap(bab_split.wrap_get_split_depth),
          "the split depth from the round's total batch"),
    Patch("branching_domains.BatchedDomainList.__len__", "P>1", "bab_split", _wrap(bab_split.wrap_len),
          "len(domains) between rounds counts every rank's"),
    Patch("complete_verifier_func.general_bab", "P>1", "bab_split", _bab_weights,
          "BaB with the weights replicated (bab_weights: replicated) and the rows not dealt"),
    Patch("bab.multi_tree_bab", "P>1", "cuts_split", _multi_tree,
          "BICCOS multi-tree branching on rank 0 alone; its cuts, domains and settings every rank's"),
    Patch("abcrown.Customized", "P>1", "customized", _wrap(customized.wrap_customized),
          "a Customized verifier runs once, on rank 0 alone; its result every rank's"),
    # the input-split BaB box list split over the ranks (input_bab.py)
    Patch(f"{_IBB}.batch_verification_input_split", "P>1", "input_bab", _input_round,
          "each rank splits and bounds its share of the boxes; one agreement a round"),
    Patch("input_split.split.get_split_depth", "P>1", "input_bab", _wrap(input_bab.wrap_get_split_depth),
          "the split depth from the round's boxes on all ranks"),
    Patch(f"{_IBB}.pgd_attack_on_domains", "P>1", "input_bab", _input_attack,
          "the attack on each rank's own boxes; any rank's counterexample is every rank's"),
    *(Patch(f"input_split.branching_domains.{cls}.__len__", "P>1", "input_bab", _wrap(bab_split.wrap_len),
            "len(domains) between rounds counts every rank's")
      for cls in ("UnsortedInputDomainList", "UnsortedMultiSpecInputDomainList")),
    Patch("complete_verifier_func.input_bab_parallel", "P>1", "input_bab", _input_bab,
          "input BaB with the weights replicated (bab_weights: replicated), the rows not dealt, α whole"),
    # MIP solves dealt over the ranks (mip_split.py)
    Patch("lp_mip_solver.utils.handle_gurobi_error", "P>1", "mip_split",
          _wrap(mip_split.gurobi_error_as_one_line), "Gurobi's refusal is one line at every P"),
    *(Patch(f"{m}.multiprocessing", "P>1", "mip_split", _wrap(mip_split.dealt_multiprocessing),
            "the pool solves this rank's share of the problems; the results gathered in order")
      for m in ("lp_mip_solver", "lp_mip_solver.refine_core")),
    Patch("lp_mip_solver.mip_solver_lb_ub_and", "P>1", "mip_split", _wrap(mip_split.on_rank0),
          "an AND spec's one MIP solved on rank 0, the result broadcast"),
    # sharded weights inside auto_LiRPA (fsdp.py: gathered per call; tp.py: never whole)
    *(Patch(d, "fsdp", "fsdp", _wrap(f), _GATHER) for d, f in fsdp.WRAPPED.items()),
    *(Patch(d, "tp", "tp", _wrap(f), _RING) for d, f in tp.WRAPPED.items()),
    Patch("beta_CROWN_solver.LiRPANet.__init__", "sharded", "fsdp", _shard_on_build,
          "built on the whole model, then its weights sharded (RUNTIME)"),
    # the probe, outermost (patches.py): what α,β-CROWN computed, for --summary
    Patch("utils.Logger.summarize_results", "always", "patches", _probe(patches.probe_summarize),
          "records the verdict and time"),
    Patch("complete_verifier_func.general_bab", "always", "patches", _probe(patches.probe_general_bab),
          "the BaB phase's time, domains and peak; a 'safe' it did not prove is unknown"),
    Patch("complete_verifier_func.input_bab_parallel", "always", "patches", _probe(_input_probe),
          "the input BaB phase's time, domains and peak"),
    Patch(f"{_AV}.init_alpha", "always", "patches", _probe(patches.probe_init_alpha),
          "records the initial CROWN bounds"),
    Patch(f"{_AV}._get_optimized_bounds", "always", "patches", _probe(patches.probe_optimized),
          "notes that α-CROWN ran, and its α count"),
    Patch("beta_CROWN_solver.LiRPANet.build", "always", "patches", _probe(patches.probe_build),
          "the incomplete phase's bounds and peak"),
)

# changes that the rows' code makes at run time to objects α,β-CROWN creates for each instance:
# (what, made by, lifetime)
RUNTIME: tuple[tuple[str, str, str], ...] = (
    ("the model's Linear/MatMul/Conv weight tensors (and buffers copying them) hold 1/P row shards "
     "(tensor.data)", "fsdp.shard_net, at each LiRPANet build (sharded)",
     "the model is α,β-CROWN's per-instance object, dropped when the instance ends; not regathered "
     "(that would cost a collective and the whole weights' memory)"),
    ("the BoundParams of every sharded weight hold the shard (param.data)", "fsdp.shard_net (sharded)",
     "the LiRPANet is per instance; dropped with it"),
    ("model_ori.forward runs with the weights gathered (torch.func.functional_call)",
     "fsdp._gather_on_forward (fsdp)", "an instance attribute of the per-instance model; dropped with it"),
    ("the model's nn.Linear / nn.Conv2d forward is column-parallel", "tp.column_parallel_forward (tp)",
     "instance attributes of the per-instance model; dropped with it"),
    ("replicated(): every shard's tensor holds the whole weight during BaB", "shards.replicated (fsdp)",
     "put back when the search ends"),
)
# fmt: on


def applies(patch: Patch, setup: Setup) -> bool:
    return WHEN[patch.when](setup)


def install(p: patches.Patcher, setup: Setup) -> None:
    """Set every row that applies, in order, after checking every signature (never half-patched)."""
    for dotted in patches.SIGNATURES:
        patches.check_signature(dotted)
    for patch in TABLE:
        if applies(patch, setup):
            p.wrap(patch.target, lambda orig, patch=patch: patch.make(setup, orig))


def targets(setup: Setup) -> list[str]:
    """The attributes that :func:`install` sets for ``setup`` (each once)."""
    return list(dict.fromkeys(t.target for t in TABLE if applies(t, setup)))
