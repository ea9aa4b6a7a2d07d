"""Every attribute of α,β-CROWN and auto_LiRPA that the plugin changes: one row each, in install order.

A row names the upstream attribute, when it is set (``always``; ``P>1``; ``fsdp`` / ``tp``: that mode
at P > 1; ``sharded``: either; ``proof``: with ``general.proof`` set), the function that makes its
replacement from the run and the original
(``make(run, original)``: one contract for every row; the plugin module that owns the replacement is
``make``'s), why, and the parameter names of the original that the replacement was written against
(``None`` for a module attribute that is not a callable). :func:`install` checks the parameters of
every row and of :data:`CALLED` before anything is set (an unknown upstream is refused with one line),
then walks the table in order; :meth:`.patcher.Patcher.undo` puts every original back in reverse
order. Where two rows name the same attribute, the later one wraps the earlier (``general_bab``: the
domain split inside, the probe outside, so that the BaB phase's peak includes the weights that
``bab_weights: replicated`` gathers for the search).

What the rows' code then changes at run time on objects that α,β-CROWN creates per instance is listed
in :data:`RUNTIME`, with its lifetime: those objects are dropped with the instance, not restored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import clocks, inputs, order, probe, proofs
from .patcher import Patcher, check_signature
from .rows import alpha, grads, passes, spec
from .run import Run
from .search import activation, customized, cuts, input_split, mip, oom, rounds
from .weights import fsdp, tp

Make = Callable[[Run, Any], Any]
"""``make(run, original) -> replacement``: every row's one contract."""


@dataclass(frozen=True)
class Patch:
    target: str  # "module.attr" or "module.Class.attr" (the module is imported to resolve it)
    when: str  # always | P>1 | fsdp | tp | sharded
    make: Make
    why: str
    params: tuple[str, ...] | None  # the original's parameter names (None: not a callable)

    @property
    def by(self) -> str:
        """The plugin module that owns the replacement (``make``'s)."""
        return self.make.__module__.removeprefix(f"{__package__}.")


def applies(patch: Patch, run: Run) -> bool:
    if patch.when == "always":
        return True
    if patch.when == "P>1":
        return run.world > 1
    if patch.when == "sharded":
        return run.sharded
    if patch.when in ("fsdp", "tp"):
        return run.world > 1 and run.par.mode == patch.when
    if patch.when == "proof":
        return run.proof is not None
    raise ValueError(f"unknown row condition {patch.when!r}")


_SPEC = "bad VNN-LIB input is one line naming the file and line; each rank reads its own cached copy"
_ONNX = "a bad ONNX file (unreadable, input size not the spec's) is one line naming it"
_CLOCK = "the maximum of the ranks' clocks, so that every time-limit decision is the same on every rank"
_GATHER = "the weight gathered for the call, freed after"
_RING = "column-parallel forward and IBP, A @ W around a ring of shards"
_LEN = "len(domains) between rounds counts every rank's"
_AV, _BM, _OPS = "auto_LiRPA.BoundedModule", "auto_LiRPA.optimized_bounds", "auto_LiRPA.operators"
_IBB = "input_split.batch_branch_and_bound"
_BUILD = "beta_CROWN_solver.LiRPANet"

# the parameter names of the originals, where several rows share one
_READ_VNNLIB = ("vnnlib_filename", "regression")
_LOAD_ONNX = ("path", "quirks", "x")
_GENERAL_BAB = ("net", "x", "c", "rhs", "reference_dict", "timeout", "max_iterations")
_INPUT_BAB = ("net", "x", "c", "rhs", "or_spec_size", "reference_dict", "timeout", "max_iterations", "vnnlib",
              "return_domains", "index")  # fmt: skip
_INPUT_ROUND = (
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
)
_SPLIT_DEPTH = ("current_domain_num", "split_partitions")
_LIRPANET_INIT = ("self", "model_ori", "in_size", "c", "device")
_LINEAR_FORWARD, _MATMUL_FORWARD, _CONV_FORWARD = ("self", "x", "w", "b"), ("self", "x", "y"), ("self", "x")
_LINEAR_BACKWARD = ("self", "last_lA", "last_uA", "x", "start_node", "reduce_bias", "kwargs")
_CONV_BACKWARD = ("self", "last_lA", "last_uA", "x", "kwargs")
_LINEAR_IBP, _IBP = ("self", "v", "C", "w"), ("self", "v", "C")
_LINEAR_FWD = ("self", "dim_in", "x", "w", "b", "C", "weight_has_batch")
_LINEAR_DYN = ("self", "x", "w", "b", "C", "max_dim", "offset")
_CONV_FWD, _CONV_DYN = ("self", "dim_in", "x"), ("self", "x", "max_dim", "offset")
_SOLVER = ("self", "v", "model", "C", "model_type", "solver_pkg")
_LIRPANET_BUILD = ("self", "x", "c", "rhs", "stop_criterion", "bounding_method", "vnnlib_handler",
                   "interm_bounds", "return_A", "or_spec_size", "full_alpha_info")  # fmt: skip
_ROUND = ("domains", "net", "batch", "iter_idx", "stats", "branching_heuristic")

# fmt: off
TABLE: tuple[Patch, ...] = (
    # the user's files (inputs.py)
    *(Patch(f"{m}.read_vnnlib", "always", inputs.read_vnnlib, _SPEC, _READ_VNNLIB)
      for m in ("read_vnnlib", "loading", "abcrown")),  # each module holds its own reference
    *(Patch(f"{m}.load_model_onnx", "always", inputs.load_model_onnx, _ONNX, _LOAD_ONNX)
      for m in ("load_model", "loading")),
    Patch("loading.default_onnx_and_vnnlib_loader", "always", inputs.default_onnx_and_vnnlib_loader,
          "a VNN-LIB 2.0 instance's networks (a list, VNN-COMP 2026) loaded as one joint model",
          ("file_root", "onnx_path", "vnnlib_path")),
    # the instance clock (clocks.py)
    Patch("utils.Logger.record_start_time", "always", clocks.record_start_time,
          "the first instance's clock starts at the verifier's start", ("self",)),
    Patch("utils.Logger.update_timeout", "always", clocks.update_timeout,
          "a single instance out of time before it starts ends timeout at once", ("self", "timeout")),
    *(Patch(f"{m}.time", "P>1", clocks.synced_time, _CLOCK, None) for m in clocks.CLOCK_MODULES),
    # loops over sets of nodes that bound each node, in lockstep (order.py)
    Patch("heuristics.nonlinear.utils.set", "P>1", order.insertion_ordered,
          "the nodes whose A-matrices nonlinear branching needs are bounded in the same order on every rank "
          "(a set of nodes iterates by their addresses)", None),
    # the rows of A-matrices and their α dealt over the ranks (rows/)
    Patch(f"{_AV}.batched_backward", "P>1", passes.batched_backward,
          "each rank back-substitutes its block of row passes; the bounds are all-gathered",
          ("self", "node", "C", "unstable_idx", "batch_size", "bound_lower", "bound_upper", "return_A")),
    Patch(f"{_AV}.get_sparse_C", "P>1", passes.get_sparse_C,
          "a patches-mode residual sum's unstable rows bounded in passes too (to be dealt)",
          ("self", "node", "ref_intermediate")),
    Patch(f"{_AV}.backward_general", "always", spec.backward_general,
          "the output node's spec rows dealt in α-CROWN's iterations (P > 1), with its α; in passes of "
          "fewer where one runs out of memory",
          ("self", "bound_node", "C", "start_backpropagation_at_node", "bound_lower", "bound_upper",
           "average_A", "need_A_only", "unstable_idx", "update_mask", "apply_output_constraints_to",
           "initial_As", "initial_lb", "initial_ub")),
    Patch(f"{_AV}._compute_bounds_main", "P>1", grads.compute_bounds_main,
          "the bounds' gradient counted once over the ranks",
          ("self", "C", "method", "IBP", "bound_lower", "bound_upper", "reuse_ibp", "reuse_alpha",
           "average_A", "alpha_idx", "need_A_only", "update_mask")),
    Patch(f"{_AV}.compute_intermediate_bounds", "always", passes.halving_on_oom,
          "out of memory bounding a layer: at P = 1 its rows again in passes of half as many",
          ("self", "node", "prior_checked")),
    Patch(f"{_OPS}.BoundRelu.init_opt_parameters", "P>1", alpha.init_opt_parameters,
          "each rank keeps the α of its own rows", ("self", "start_nodes")),
    Patch(f"{_OPS}.BoundRelu.select_alpha_by_idx", "P>1", alpha.select_alpha_by_idx,
          "a rank reads its local α rows", ("self", "last_lA", "last_uA", "unstable_idx", "start_node")),
    Patch("prune.PruneAfterCROWN.__init__", "P>1", alpha.prune_after_crown,
          "the output node's α whole while α,β-CROWN prunes its verified spec rows, then kept by row",
          ("self", "net", "x", "c", "rhs", "lb", "aux_reference_bounds", "stop_criterion", "or_spec_size")),
    Patch("prune.PruneAfterCROWN.recover", "P>1", alpha.prune_recover,
          "the output node's α whole where α,β-CROWN restores its pruned spec rows",
          ("self", "lb", "ub", "lA", "alphas", "mask", "input_split_idx", "full_alpha_info")),
    Patch(f"{_BUILD}.get_lA", "P>1", spec.get_lA,
          "the output node's A-matrices whole where α-CROWN's last iteration dealt its spec rows",
          ("self", "preserve_mask", "tot_cells", "transpose", "device")),
    Patch("auto_LiRPA.backward_bound.tqdm", "P>1", grads.tqdm,
          "no progress bar for each dealt pass (every layer is bounded in passes at P > 1)", None),
    Patch(f"{_BM}.optim", "P>1", grads.optim,
          "Adam and SGD sum every gradient over the ranks before their step", None),
    # out of memory in a BaB round: the round again with half its domains (search/oom.py)
    Patch("branching_domains.BatchedDomainList.pick_out", "always", oom.pick_out,
          "what a pick takes off the domain list is recorded, to be put back", ("self", "batch", "device")),
    Patch("bab.split_domain", "always", oom.split_domain,
          "out of memory in a BaB round: its domains back on the list, the round with half of them",
          ("net", "domains", "d", "batch", "stats", "set_init_alpha", "fix_interm_bounds",
           "branching_heuristic", "iter_idx")),
    Patch("bab.act_split_round", "always", oom.act_split_round,
          "after running out of memory a round picks at most the domains that fitted", _ROUND),
    # the BaB domain list split over the ranks (search/)
    Patch("bab.act_split_round", "P>1", activation.act_split_round,
          "each rank splits and bounds its share of the domains; one agreement a round", _ROUND),
    Patch("bab.get_split_depth", "P>1", activation.get_split_depth,
          "the split depth from the round's total batch", ("batch_size", "min_batch_size", "min_depth")),
    Patch("branching_domains.BatchedDomainList.__len__", "P>1", rounds.list_len, _LEN, ("self",)),
    Patch("complete_verifier_func.general_bab", "P>1", activation.general_bab,
          "BaB with the weights replicated (bab_weights: replicated) and the rows not dealt", _GENERAL_BAB),
    Patch("bab.multi_tree_bab", "P>1", cuts.multi_tree_bab,
          "BICCOS multi-tree branching on rank 0 alone; its cuts, domains and settings every rank's",
          ("net", "domains", "batch", "stop_criterion_func", "biccos_args", "stats", "start_time",
           "initial_bs_ratio")),
    Patch("abcrown.Customized", "P>1", customized.Customized,
          "a Customized verifier runs once, on rank 0 alone; its result every rank's",
          ("def_file", "callable_name", "args", "kwargs")),
    # out of memory in an input-split BaB round: its boxes back on the list, half as many bounded (oom.py)
    *(Patch(f"input_split.branching_domains.{cls}.pick_out_batch", "always", oom.pick_out_batch,
            "what a pick takes off the box list is recorded, to be put back",
            ("self", "batch_size", "device"))
      for cls in ("UnsortedInputDomainList", "UnsortedMultiSpecInputDomainList")),
    Patch(f"{_IBB}.batch_verification_input_split", "always", oom.batch_verification_input_split,
          "out of memory in an input-split BaB round: its boxes back on the list, the round bounding half as "
          "many", _INPUT_ROUND),
    # the input-split BaB box list split over the ranks (search/input_split.py)
    Patch(f"{_IBB}.batch_verification_input_split", "P>1", input_split.batch_verification_input_split,
          "each rank splits and bounds its share of the boxes; one agreement a round", _INPUT_ROUND),
    Patch("input_split.split.get_split_depth", "P>1", input_split.get_split_depth,
          "the split depth from the round's boxes on all ranks", _SPLIT_DEPTH),
    Patch("input_split.split.get_split_depth", "always", oom.get_split_depth,
          "after running out of memory a box is split no deeper than the boxes that fitted", _SPLIT_DEPTH),
    Patch(f"{_IBB}.pgd_attack_on_domains", "P>1", input_split.pgd_attack_on_domains,
          "the attack on each rank's own boxes; any rank's counterexample is every rank's",
          ("model_ori", "domains", "stage", "vnnlib")),
    *(Patch(f"input_split.branching_domains.{cls}.__len__", "P>1", rounds.list_len, _LEN, ("self",))
      for cls in ("UnsortedInputDomainList", "UnsortedMultiSpecInputDomainList")),
    Patch("complete_verifier_func.input_bab_parallel", "P>1", input_split.input_bab_parallel,
          "input BaB with the weights replicated (bab_weights: replicated), the rows not dealt, α whole",
          _INPUT_BAB),
    # MIP solves dealt over the ranks (search/mip.py)
    Patch("lp_mip_solver.utils.handle_gurobi_error", "P>1", mip.handle_gurobi_error,
          "Gurobi's refusal is one line at every P", ("message",)),
    *(Patch(f"{m}.multiprocessing", "P>1", mip.multiprocessing,
            "the pool solves this rank's share of the problems; the results gathered in order", None)
      for m in ("lp_mip_solver", "lp_mip_solver.refine_core")),
    Patch("lp_mip_solver.mip_solver_lb_ub_and", "P>1", mip.mip_solver_lb_ub_and,
          "an AND spec's one MIP solved on rank 0, the result broadcast", ("candidate", "save_adv", "rhs")),
    # sharded weights inside auto_LiRPA (weights/fsdp.py: gathered per call; weights/tp.py: never whole)
    Patch(f"{_OPS}.BoundLinear.forward", "fsdp", fsdp.positional, _GATHER, _LINEAR_FORWARD),
    Patch(f"{_OPS}.BoundLinear.bound_backward", "fsdp", fsdp.node_args, _GATHER, _LINEAR_BACKWARD),
    Patch(f"{_OPS}.BoundLinear.interval_propagate", "fsdp", fsdp.interval, _GATHER, _LINEAR_IBP),
    Patch(f"{_OPS}.BoundLinear.build_solver", "fsdp", fsdp.positional, _GATHER, _SOLVER),
    Patch(f"{_OPS}.BoundLinear.bound_forward", "fsdp", fsdp.forward_mode, _GATHER, _LINEAR_FWD),
    Patch(f"{_OPS}.BoundLinear.bound_dynamic_forward", "fsdp", fsdp.dynamic_forward, _GATHER, _LINEAR_DYN),
    Patch(f"{_OPS}.BoundMatMul.bound_forward", "fsdp", fsdp.forward_mode, _GATHER,
          ("self", "dim_in", "x", "y", "C")),
    Patch(f"{_OPS}.BoundMatMul.forward", "fsdp", fsdp.positional, _GATHER, _MATMUL_FORWARD),
    Patch(f"{_OPS}.BoundMatMul.bound_backward", "fsdp", fsdp.node_args, _GATHER,
          ("self", "last_lA", "last_uA", "x", "start_node", "kwargs")),
    Patch(f"{_OPS}.BoundMatMul.interval_propagate", "fsdp", fsdp.interval, _GATHER, _IBP),
    Patch(f"{_OPS}.BoundConv.forward", "fsdp", fsdp.positional, _GATHER, _CONV_FORWARD),
    Patch(f"{_OPS}.BoundConv.bound_backward", "fsdp", fsdp.node_args, _GATHER, _CONV_BACKWARD),
    Patch(f"{_OPS}.BoundConv.interval_propagate", "fsdp", fsdp.interval, _GATHER, _IBP),
    Patch(f"{_OPS}.BoundConv.build_solver", "fsdp", fsdp.positional, _GATHER, _SOLVER),
    Patch(f"{_OPS}.BoundConv.bound_forward", "fsdp", fsdp.forward_mode, _GATHER, _CONV_FWD),
    Patch(f"{_OPS}.BoundConv.bound_dynamic_forward", "fsdp", fsdp.dynamic_forward, _GATHER, _CONV_DYN),
    Patch(f"{_OPS}.BoundLinear.forward", "tp", tp.forward, _RING, _LINEAR_FORWARD),
    Patch(f"{_OPS}.BoundLinear.bound_backward", "tp", tp.bound_backward, _RING, _LINEAR_BACKWARD),
    Patch(f"{_OPS}.BoundLinear.interval_propagate", "tp", tp.interval_propagate, _RING, _LINEAR_IBP),
    Patch(f"{_OPS}.BoundLinear.build_solver", "tp", tp.build_solver, _RING, _SOLVER),
    Patch(f"{_OPS}.BoundLinear.bound_forward", "tp", tp.bound_forward, _RING, _LINEAR_FWD),
    Patch(f"{_OPS}.BoundLinear.bound_dynamic_forward", "tp", tp.bound_dynamic_forward, _RING, _LINEAR_DYN),
    Patch(f"{_OPS}.BoundConv.forward", "tp", tp.conv_forward, _RING, _CONV_FORWARD),
    Patch(f"{_OPS}.BoundConv.interval_propagate", "tp", tp.conv_interval_propagate, _RING, _IBP),
    Patch(f"{_OPS}.BoundConv.bound_backward", "tp", tp.conv_bound_backward, _RING, _CONV_BACKWARD),
    Patch(f"{_OPS}.BoundConv.build_solver", "tp", tp.build_solver, _RING, _SOLVER),
    Patch(f"{_OPS}.BoundConv.bound_forward", "tp", tp.conv_bound_forward, _RING, _CONV_FWD),
    Patch(f"{_OPS}.BoundConv.bound_dynamic_forward", "tp", tp.conv_bound_dynamic_forward, _RING, _CONV_DYN),
    Patch(f"{_BUILD}.__init__", "fsdp", fsdp.lirpanet_init,
          "built on the whole model, then its weights sharded (RUNTIME)", _LIRPANET_INIT),
    Patch(f"{_BUILD}.__init__", "tp", tp.lirpanet_init,
          "built on the whole model, then its weights sharded (RUNTIME)", _LIRPANET_INIT),
    # general.proof (proofs.py): how each clause was proved, recorded for its proof tree
    Patch(f"{_BUILD}.build", "proof", proofs.build,
          "the rows the incomplete bounds proved and the ReLUs' pre-activation bounds (the claims)",
          _LIRPANET_BUILD),
    Patch(f"{_BM}._update_optimizable_activations", "proof", proofs.update_best,
          "the slopes of each pre-activation bound's best iteration, inside a build (the claims' slopes)",
          ("optimizable_activations", "interm_bounds", "fix_interm_bounds", "best_intermediate_bounds",
           "reference_idx", "idx", "alpha", "best_alphas", "deterministic")),
    Patch("complete_verifier_func.general_bab", "proof", proofs.general_bab,
          "the clauses activation BaB searched and the ReLU each split node feeds", _GENERAL_BAB),
    Patch("branching_domains.BatchedDomainList.add", "proof", proofs.domain_add,
          "the split history of every domain dropped as verified",
          ("self", "bounds", "d", "check_infeasibility")),
    Patch("complete_verifier_func.input_bab_parallel", "proof", proofs.input_bab_parallel,
          "each clause's root box in input-split BaB", _INPUT_BAB),
    Patch(f"{_IBB}.input_split_and_repeat", "proof", proofs.input_split_and_repeat,
          "each box and the boxes it was split into",
          ("x_L", "x_U", "current_domain_num", "shape", "i_idx", "split_partitions", "split_hint", "cs",
           "thresholds", "dm_lb", "alphas", "spec_size", "lA", "lbias", "constraints")),
    Patch(f"{_IBB}.get_bounds", "proof", proofs.get_bounds, "the boxes bounded above their threshold",
          ("net", "dm_lb", "x_L", "x_U", "alphas", "cs", "thresholds", "constraints", "bounding_method",
           "branching_method", "stop_func", "stats")),
    Patch(f"{_IBB}.clip_domains", "proof", proofs.clip_domains, "each box and the box it was clipped to",
          ("x_L", "x_U", "thresholds", "lA", "lbias", "dm_lb", "is_lower", "num_iters", "calculate_volume")),
    # the probe, outermost (probe.py): what α,β-CROWN computed, for --summary
    Patch("utils.Logger.summarize_results", "always", probe.summarize_results, "records the verdict and time",
          ("self", "verified_status", "index")),
    Patch("complete_verifier_func.general_bab", "always", probe.general_bab,
          "the BaB phase's time, domains and peak; a 'safe' it did not prove is unknown", _GENERAL_BAB),
    Patch("complete_verifier_func.input_bab_parallel", "always", probe.input_bab_parallel,
          "the input BaB phase's time, domains and peak", _INPUT_BAB),
    Patch(f"{_AV}.init_alpha", "always", probe.init_alpha, "records the initial CROWN bounds",
          ("self", "x", "share_alphas", "method", "c", "bound_lower", "bound_upper", "final_node_name",
           "interm_bounds", "reference_alphas", "skip_bound_compute")),
    Patch(f"{_AV}._get_optimized_bounds", "always", probe.get_optimized_bounds,
          "notes that α-CROWN ran, and its α count",
          ("self", "x", "aux", "C", "IBP", "forward", "method", "bound_side", "reuse_ibp", "return_A",
           "average_A", "final_node_name", "interm_bounds", "reference_bounds", "aux_reference_bounds",
           "needed_A_dict", "cutter", "decision_thresh", "epsilon_over_decision_thresh")),
    Patch(f"{_BUILD}.build", "always", probe.build, "the incomplete phase's bounds and peak",
          _LIRPANET_BUILD),
)

# upstream callables the rows' code calls with their parameters by name without patching them
CALLED: tuple[tuple[str, tuple[str, ...]], ...] = (
    (f"{_AV}.check_optimized_variable_sparsity", ("self", "node")),
    (f"{_AV}.get_unstable_locations", ("self", "ref_intermediate_lb", "ref_intermediate_ub", "conv",
                                       "channel_only")),
    ("bab.split_domain", ("net", "domains", "d", "batch", "stats", "set_init_alpha", "fix_interm_bounds",
                          "branching_heuristic", "iter_idx")),
    ("bab.check_worst_domain", ("d",)),
    ("branching_domains.BatchedDomainList.pick_out", ("self", "batch", "device")),
    ("tensor_storage.get_tensor_storage", ("full_shape", "initial_size", "switching_size", "dtype", "device",
                                           "concat_dim")),
    ("input_split.branching_domains.UnsortedInputDomainList.pick_out_batch",
     ("self", "batch_size", "device")),
    ("input_split.branching_domains.UnsortedInputDomainList.add",
     ("self", "lb", "dm_l", "dm_u", "alpha", "cs", "threshold", "constraints", "split_idx", "remaining_index",
      "check_dm_lbs", "check_input_boxes", "kwargs")),
)

# changes that the rows' code makes at run time to objects α,β-CROWN creates for each instance:
# (what, made by, lifetime)
RUNTIME: tuple[tuple[str, str, str], ...] = (
    ("the model's Linear/MatMul/Conv weight tensors (and buffers copying them) hold 1/P row shards "
     "(tensor.data)", "weights.shards.shard_net, at each LiRPANet build (sharded)",
     "the model is α,β-CROWN's per-instance object, dropped when the instance ends; not regathered "
     "(that would cost a collective and the whole weights' memory)"),
    ("the BoundParams of every sharded weight hold the shard (param.data)", "weights.shards.shard_net",
     "the LiRPANet is per instance; dropped with it"),
    ("model_ori.forward runs with the weights gathered in place of the shards (shards.swapped)",
     "weights.fsdp.gather_on_forward (fsdp)",
     "an instance attribute of the per-instance model; dropped with it"),
    ("the model's nn.Linear / nn.Conv2d forward is column-parallel",
     "weights.tp.column_parallel_forward (tp)",
     "instance attributes of the per-instance model; dropped with it"),
    ("a domain or box list's global count between rounds (_global_len, _split)", "search.rounds",
     "attributes of the per-instance list; dropped with it"),
    ("BICCOS's agreed cut list (_cve_agreed)", "search.cuts",
     "an attribute of the per-instance BICCOS object"),
    ("replicated(): every shard's tensor holds the whole weight during BaB",
     "weights.shards.replicated (fsdp)", "put back when the search ends"),
)
# fmt: on


def install(p: Patcher, run: Run) -> None:
    """Set every row that applies, in order, after checking every signature (never half-patched)."""
    for patch in TABLE:
        if patch.params is not None:
            check_signature(patch.target, patch.params)
    for dotted, params in CALLED:
        check_signature(dotted, params)
    for patch in TABLE:
        if applies(patch, run):
            p.wrap(patch.target, lambda orig, patch=patch: patch.make(run, orig))


def targets(run: Run) -> list[str]:
    """The attributes that :func:`install` sets for ``run`` (each once)."""
    return list(dict.fromkeys(t.target for t in TABLE if applies(t, run)))
