"""``abcrown --general.engine abcrown``, the parent process: checks the config with α,β-CROWN's own
parser first (a typo key is α,β-CROWN's error, one line), refuses what cannot run, then starts the
ranks (:func:`.rank.rank_main`) with the native engine's launcher (``parallel/launch.py``: spawned
gloo/NCCL ranks or torchrun; a rank that dies ends the run with ``error``) and reports rank 0's
result: the results file's ``sat`` re-checked, the summary, the peaks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import shell
from ..config import ParallelConfig
from ..results import bab_record, check_writable, summary_record, write_atomic
from . import bridge, locate
from .locate import PluginError
from .rank import RankJob, rank_main, warnings_to_stdout
from .search.refusals import refused_upstream, unsupported

DEFAULT_CROWN_BATCH = 1_000_000_000  # α,β-CROWN's default solver.crown.batch_size (rows never chunked)
SHARDED_CROWN_BATCH = (
    512  # rows of one process's pass that P > 1 ranks share when the config leaves the default
)


def _fork_ready(checkout: locate.Checkout) -> None:
    """Import all of α,β-CROWN here, before the ranks are forked from this process (``launch.run``'s
    ``fork``): seconds saved per rank. What it prints on import is dropped (each rank's log gets its
    own run's output)."""
    with contextlib.redirect_stdout(io.StringIO()):
        bridge.import_abcrown(checkout)
        import abcrown  # noqa: F401


def check_config(checkout: locate.Checkout, args: list[str], config_path: str | None) -> dict:
    """Parse the config with α,β-CROWN's own parser; its complaints become one-line errors."""
    arguments = bridge.import_abcrown(checkout)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            arguments.Config.parse_config(list(args), verbose=False)
    except SystemExit:  # argparse: an unknown flag or a bad value
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise PluginError(f"alpha-beta-CROWN: {lines[-1] if lines else 'bad command line'}") from None
    except ValueError as e:  # "Config key [...] not found!"
        raise PluginError(f"{config_path or 'config'}: alpha-beta-CROWN: {e}") from None
    return arguments.Config.all_args


def keys_help(checkout: locate.Checkout) -> str:
    """``abcrown --help`` on this engine: every key of the user's α,β-CROWN (section.key, its flat
    flag, default and help, read from the checkout's own parser), ours among them with the defaults
    this engine uses."""
    import textwrap

    with contextlib.redirect_stdout(io.StringIO()), warnings_to_stdout():
        arguments = bridge.import_abcrown(checkout)
    config = arguments.Config
    actions = {a.dest: a for a in config.defaults_parser._actions}
    out = [
        f"config keys of alpha-beta-CROWN ({checkout.root}), ours (general.engine, general.proof, "
        "parallel.*) included:",
        "set them in the YAML file (section: {key: value}), as --section.key VALUE, or as the flat flag",
        "",
    ]
    for dest, hierarchy in config.config_file_hierarchies.items():
        action = actions.get(dest)
        if action is None or hierarchy is None:  # a command-line-only option (--config)
            continue
        default = "null" if action.default is None else action.default
        out.append(f"  {'.'.join(hierarchy)} = {default}    (--{dest})")
        text = " ".join(str(action.help or "").replace("%%", "%").split())
        if action.choices:
            text += f" Choices: {', '.join(map(str, action.choices))}."
        out += textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


def crown_batch_args(all_args: dict, world_size: int) -> list[str]:
    """Under P > 1, α,β-CROWN's default (one pass per layer) becomes passes to deal out: ⌈512 / P⌉ rows
    when the incomplete phase is CROWN (``solver.bound_prop_method: crown``), whose bounds do not
    depend on how the rows are grouped, else 512. (α-CROWN with passes of ⌈512 / P⌉ rows splits more
    layers and drifts from one process's result, up to 1.8e-4 at P = 3, where rows are dealt by α's
    owner after the unstable sets shrink: docs/abcrown_plugin.md.)"""
    if world_size > 1 and int(all_args["solver"]["crown"]["batch_size"]) == DEFAULT_CROWN_BATCH:
        rows = SHARDED_CROWN_BATCH
        if all_args["solver"]["bound_prop_method"] == "crown":
            rows = -(-rows // world_size)
        return ["--crown_batch_size", str(rows)]
    return []


def _recheck_sat(all_args: dict, results_file: str | None, result: dict) -> str | None:
    """A single instance's ``sat`` stands only with a counterexample that onnxruntime confirms."""
    from ..witness import recheck_results_file

    onnx, vnnlib = all_args["model"]["onnx_path"], all_args["specification"]["vnnlib_path"]
    if not (results_file and onnx and vnnlib and os.path.isfile(results_file)):
        return None
    onnx = os.path.join(all_args["model"]["onnx_path_prefix"] or "", onnx)
    vnnlib = os.path.join(all_args["specification"]["vnnlib_path_prefix"] or "", vnnlib)
    warning = recheck_results_file(results_file, onnx, vnnlib, "alpha-beta-CROWN")
    if warning:
        for rec in result["records"]:
            if rec["verdict"] == "sat":
                rec["verdict"] = "unknown"
    return warning


def summary_json(result: dict, par: ParallelConfig) -> dict:
    """Our summary (:func:`~complete_verifier_ext.results.summary_record`, as the native engine's) with
    the plugin's own fields; bounds as α,β-CROWN computed them."""
    out = []
    for rec in result["records"]:
        out.append(
            summary_record(
                engine="abcrown",
                verdict=rec["verdict"],
                time_s=rec["time_s"],
                bounds={k: rec[k] for k in ("crown", "alpha_crown") if rec[k]},
                peak_mb=result["peak_mb"],
                peak_mb_exact=result["peak_mb_exact"],
                crown_batch_size=result["crown_batch_size"],
                bab=bab_record(rec["bab_domains"], time_s=rec["bab_s"]),
                started_at=rec["started_at"],
                peak_mb_bounds=[round(v, 2) for v in result["peak_mb_bounds"]],
                peak_mb_bab=[round(v, 2) for v in result["peak_mb_bab"]],
                alpha_elements=result["alpha_elements"],
                parallel={
                    "mode": par.mode,
                    "world_size": par.world_size,
                    "bab_weights": par.bab_weights_resolved,
                },
                bab_weight_fetches=result["bab_weight_fetches"],
                bab_collectives=result["bab_collectives"],
                **({"bab_fits": result["bab_fits"]} if any(f for f in result["bab_fits"]) else {}),
                rows_dealt=result["rows_dealt"],
                rank_spread=result["rank_spread"],
                collectives=result["collectives"],
                unstable_per_layer=rec["unstable"],
                **({"whole_layers": result["whole_layers"]} if result.get("whole_layers") else {}),
                **(
                    {"full_weights_live": result["full_weights_live"]}
                    if "full_weights_live" in result
                    else {}
                ),
            )
        )
    return out[0] if len(out) == 1 else {"instances": out}


def _refuse_unsupported(all_args: dict, par: ParallelConfig, config: str | None, checkout) -> None:
    """PluginError when the config asks for what α,β-CROWN itself refuses (at every P, before any rank
    starts, with the same line), or for a BaB feature that is not split over ranks yet (P > 1)."""
    upstream = refused_upstream(all_args, checkout.complete_verifier)
    if upstream:  # one line, not α,β-CROWN's assertion traceback
        raise PluginError(f"{config or 'config'}: {upstream}")
    if par.world_size <= 1:
        return
    bad = unsupported(all_args)
    if bad:
        raise PluginError(
            f"{config or 'config'}: not supported with parallel.world_size > 1 yet: {'; '.join(bad)} "
            "(run it at world_size 1, or with general.complete_verifier: skip)"
        )


def _extra_args(all_args: dict, world_size: int) -> list[str]:
    """Flags added to the ranks' α,β-CROWN command line: the CROWN passes, and ``--save_adv_example``."""
    extra = crown_batch_args(all_args, world_size)
    if not all_args["general"]["save_adv_example"]:
        extra.append("--save_adv_example")  # a sat carries its counterexample, which rank 0 re-checks
    return extra


def _report(
    result: dict,
    all_args: dict,
    results_file: str | None,
    summary: str | None,
    par: ParallelConfig,
    quiet: bool,
) -> None:
    """Rank 0, after the run: re-check a sat, write the summary, print the peaks."""
    warning = _recheck_sat(all_args, results_file, result)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if summary:
        write_atomic(summary, json.dumps(summary_json(result, par), indent=1, allow_nan=False))
    if not quiet:
        print("peak MB per rank: " + " ".join(f"{v:.1f}" for v in result["peak_mb"]), file=sys.stderr)


def main(
    config: str | None,
    overrides: list[str],
    summary: str | None,
    quiet: bool,
    started_wall: float | None = None,
) -> int:
    """The ``abcrown`` command with ``general.engine: abcrown``. Returns the exit code. The first
    instance's timeout counts from ``started_wall`` (``time.time()`` of the verifier's start), else
    from now."""
    started_wall = time.time() if started_wall is None else started_wall
    scratch = tempfile.mkdtemp(prefix="cve_abcrown_")
    try:
        with warnings_to_stdout():
            return shell.run(lambda sh: _run(sh, config, overrides, summary, quiet, started_wall, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True)
class Prepared:
    """A checked run, ready to start: what every rank is handed, and what the parent reports with."""

    job: RankJob
    all_args: dict  # α,β-CROWN's parsed config
    par: ParallelConfig
    device: str
    fork: bool  # the ranks are forked from this process (α,β-CROWN imported here first)


def prepare(
    sh: shell.Shell, config, overrides, summary: str | None, quiet: bool, started_wall: float, scratch: str
) -> Prepared:
    """Everything before the ranks start: the config merged and checked by α,β-CROWN's own parser, the
    results file (``sh.results_file``, as soon as it is known) and summary checked writable, what
    cannot run refused, the ranks' command line."""
    yaml_path, flat, data = bridge.merged_yaml(config, overrides, scratch)
    general = data.get("general") if isinstance(data.get("general"), dict) else {}
    sh.results_file = bridge.flag_value(flat, "--results_file") or general.get("results_file")
    bridge.check_customized_files(data, config)
    checkout = locate.find()
    par = bridge.parallel_of(data, flat, config)
    all_args = check_config(checkout, ["--config", yaml_path, *flat], config)
    sh.results_file = all_args["general"]["results_file"]
    check_writable(sh.results_file, "general.results_file")
    if summary:
        check_writable(summary, "--summary")
    proof = all_args["general"].get("proof")
    if proof and not Path(proof).is_dir():  # a folder takes a file per unsat (proofs.in_folder)
        check_writable(proof, "general.proof")
    _refuse_unsupported(all_args, par, config, checkout)
    extra = _extra_args(all_args, par.world_size)
    device = all_args["general"]["device"]
    # forked ranks (no α,β-CROWN import per rank) on the CPU with gloo only: a forked rank must not
    # inherit CUDA state, and exact memory needs fresh interpreters
    cpu_gloo = device == "cpu" and shell.backend(par, device) == "gloo"
    fork = par.world_size > 1 and cpu_gloo and not par.exact_memory
    one_pass = bool(crown_batch_args(all_args, par.world_size))  # P = 1 bounds each layer in one pass
    job = RankJob(checkout, [yaml_path, *flat, *extra], par, scratch, quiet, started_wall, one_pass, proof)
    return Prepared(job, all_args, par, device, fork)


def _run(sh: shell.Shell, config, overrides, summary, quiet, started_wall: float, scratch: str) -> int:
    """The command on the plugin, inside the shell's error ladder."""
    ready = prepare(sh, config, overrides, summary, quiet, started_wall, scratch)
    if ready.fork:
        _fork_ready(ready.job.checkout)
    result = sh.launch(rank_main, ready.par, (ready.job,), ready.device, fork=ready.fork)
    if sh.writer:
        _report(result, ready.all_args, sh.results_file, summary, ready.par, quiet)
    return 0
