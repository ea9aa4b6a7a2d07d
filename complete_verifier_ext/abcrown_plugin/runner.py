"""``abcrown --general.engine abcrown``: α,β-CROWN's own ``ABCROWN(args).main()`` on every rank, with
our patches installed; rank 0 alone prints and writes.

The parent checks the config with α,β-CROWN's own parser first (a typo key is α,β-CROWN's error, one
line), then starts the ranks with the native engine's launcher (``parallel/launch.py``: spawned
gloo/NCCL ranks or torchrun; a rank that dies ends the run with ``error``). Ranks other than 0 write
α,β-CROWN's files into a scratch folder and their stdout to a log there.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import IO, Any

from .. import shell
from ..config import ParallelConfig
from ..results import bab_record, check_writable, write_atomic
from . import bridge, locate
from .locate import PluginError

DEFAULT_CROWN_BATCH = 1_000_000_000  # α,β-CROWN's default solver.crown.batch_size (rows never chunked)
SHARDED_CROWN_BATCH = (
    512  # rows of one process's pass that P > 1 ranks share when the config leaves the default
)
AUDIT_ENV = "CVE_ABCROWN_AUDIT"  # "1": count live full-size weights at the start and end of each build


@contextlib.contextmanager
def warnings_to_stdout() -> Iterator[None]:
    """Python warnings (α,β-CROWN's, onnx2pytorch's, torch's at their import) go with α,β-CROWN's log
    on stdout, the rank's log file where that is redirected; stderr keeps our own lines alone."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        shown(message, category, filename, lineno, sys.stdout, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _import_abcrown(checkout: locate.Checkout):
    """Activate the checkout and import its ``arguments`` with our keys registered (α,β-CROWN prints a
    line on import; it goes to stderr here)."""
    locate.activate(checkout)
    with contextlib.redirect_stdout(sys.stderr):
        import arguments
    bridge.register(arguments.Config)
    return arguments


def _fork_ready(checkout: locate.Checkout) -> None:
    """Import all of α,β-CROWN here, before the ranks are forked from this process (``launch.run``'s
    ``fork``): seconds saved per rank. What it prints on import is dropped (each rank's log gets its
    own run's output)."""
    with contextlib.redirect_stdout(io.StringIO()):
        _import_abcrown(checkout)
        import abcrown  # noqa: F401


def _log_to_stdout() -> None:
    """auto_LiRPA's log handler writes to the ``sys.stdout`` of its import; point it at this rank's."""
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:
            handler.setStream(sys.stdout)


def check_config(checkout: locate.Checkout, args: list[str], config_path: str | None) -> dict:
    """Parse the config with α,β-CROWN's own parser; its complaints become one-line errors."""
    arguments = _import_abcrown(checkout)
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
        arguments = _import_abcrown(checkout)
    config = arguments.Config
    actions = {a.dest: a for a in config.defaults_parser._actions}
    out = [
        f"config keys of alpha-beta-CROWN ({checkout.root}), ours (general.engine, parallel.*) included:",
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


def _crown_batch_args(all_args: dict, world_size: int) -> list[str]:
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


class Phases:
    """Per-rank peak memory of named, possibly nested phases (the run, the incomplete phase ``bounds``,
    BaB ``bab``) with one high-water mark: every boundary folds the mark into each open phase before
    it is reset, so a phase nested in another costs the outer one nothing. Code pages and torch's
    lazily loaded libraries are left out as ``PeakMemory.peak_mb`` does (``memory.not_bound_mb``;
    on CUDA the allocator never sees them)."""

    def __init__(self, meter) -> None:
        self.meter = meter
        self.open: dict[str, list[float]] = {}  # name -> [baseline, highest mark], MiB less not_bound
        self.peaks: dict[str, float] = {}

    def _fold(self) -> None:
        if self.open:
            mark = self.meter.peak_total_mb() - self.meter.not_bound_mb()
            for span in self.open.values():
                span[1] = max(span[1], mark)

    def start(self, name: str) -> None:
        self._fold()
        self.meter.start()
        base = self.meter.baseline_mb - self.meter.not_bound_mb()
        self.open[name] = [base, base]

    def end(self, name: str) -> None:
        self._fold()
        base, high = self.open.pop(name)
        self.peaks[name] = max(self.peaks.get(name, 0.0), high - base)


def _open_log(scratch: str, rank: int, quiet: bool) -> IO[str] | None:
    """The rank's log in ``scratch``: every rank but 0 has one, and rank 0 too when ``quiet``."""
    return open(os.path.join(scratch, f"rank{rank}.log"), "w") if rank != 0 or quiet else None


def _redirect_to_log(stack: contextlib.ExitStack, log: IO[str] | None, rank: int) -> None:
    """Send stdout (and, except on rank 0, stderr) to ``log`` for as long as ``stack`` is open."""
    if log:
        stack.enter_context(contextlib.redirect_stdout(log))
        if rank != 0:
            stack.enter_context(contextlib.redirect_stderr(log))


def _phase_hook(phases: Phases, full_live: list[list[str]] | None) -> Callable[[str, bool], None]:
    """``Probe.on_phase``: starts or ends the phase's peak; with ``full_live`` (the audit of sharded
    weights), first appends the full-size weights alive at each boundary of ``bounds``."""
    from ..parallel import memory
    from . import fsdp

    def on_phase(name: str, start: bool) -> None:
        if name == "bounds" and full_live is not None:
            full_live.append(fsdp.live_full_weights())
        if name == "bounds" and start:  # α-CROWN's first optimizer is near: its libraries are no bound memory
            memory.load_optimizer_libraries()
        (phases.start if start else phases.end)(name)

    return on_phase


def _gathered_result(phases: Phases, probe: Any, full_live: list[list[str]] | None, arguments: Any) -> dict:
    """Every rank's peaks and α elements (one all-gather), the probe's records and, with the audit
    (``full_live`` not None), every rank's live full-size weights."""
    import torch

    from ..parallel import comm, serve
    from . import rows, shards
    from .bab_split import round_collectives

    peaks = phases.peaks
    fetched = serve.stats()
    row = [peaks.get("run", 0.0), peaks.get("bounds", 0.0), peaks.get("bab", 0.0), probe.alpha_elements]
    row += [fetched["full"], fetched["shard"]]
    mine = torch.tensor([row], dtype=torch.float64, device=comm.device())
    every = comm.all_gather_cat(mine, 0).cpu()
    return {
        **({"full_weights_live": comm.all_gather_object(full_live)} if full_live is not None else {}),
        "records": [vars(r) for r in probe.records],
        "peak_mb": [float(v) for v in every[:, 0].tolist()],
        "peak_mb_bounds": [float(v) for v in every[:, 1].tolist()],
        "peak_mb_bab": [float(v) for v in every[:, 2].tolist()],
        "alpha_elements": [int(v) for v in every[:, 3].tolist()],
        # weights fetched on request in BaB rounds with the weights sharded (whole ones, single shards)
        "bab_weight_fetches": [[int(a), int(b)] for a, b in every[:, 4:6].tolist()],
        "bab_collectives": comm.all_gather_object(list(round_collectives)),
        "rows_dealt": comm.all_gather_object(dict(sorted(rows.dealt.items()))),
        "peak_mb_exact": phases.meter.exact,
        "crown_batch_size": int(arguments.Config["solver"]["crown"]["batch_size"]),
        "whole_layers": dict(shards.whole_layers),
    }


def _rank_main(
    checkout: locate.Checkout,
    args: list[str],
    par: ParallelConfig,
    scratch: str,
    quiet: bool,
    started_wall: float,
) -> dict:
    """One rank: α,β-CROWN's ``ABCROWN(args).main()`` with our patches (undone after), then what
    :func:`_gathered_result` collects; the launcher returns rank 0's."""
    import torch

    from ..parallel import comm, launch
    from ..parallel.memory import PeakMemory
    from ..spec import cache_root
    from . import patches, table

    rank, world = comm.rank(), comm.world_size()
    launch.set_threads(par.threads, world)
    if torch.cuda.is_available() and comm.backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    p = patches.Patcher()
    probe = patches.Probe()
    log = _open_log(scratch, rank, quiet)
    try:
        with contextlib.ExitStack() as quiet_ctx:
            _redirect_to_log(quiet_ctx, log, rank)
            quiet_ctx.enter_context(warnings_to_stdout())
            arguments = _import_abcrown(checkout)
            _log_to_stdout()
            import abcrown

            cache = str(cache_root() / "abcrown_specs" / f"rank{rank}")
            table.install(p, table.Setup(par, world, probe, cache, started_wall))  # every patch: table.py
            phases = Phases(PeakMemory(comm.device()))
            audit = os.environ.get(AUDIT_ENV) == "1"
            full_live: list[list[str]] = []
            sharded = par.mode in ("fsdp", "tp") and world > 1
            probe.on_phase = _phase_hook(phases, full_live if audit and sharded else None)
            phases.start("run")
            with contextlib.suppress(patches.OutOfTime):  # reported "timeout" already
                abcrown.ABCROWN(args=bridge.rank_args(args[0], args[1:], rank, scratch)).main()
            phases.end("run")
    finally:
        p.undo()
        if log:
            log.close()
    return _gathered_result(phases, probe, full_live if audit else None, arguments)


def _recheck_sat(all_args: dict, results_file: str | None, result: dict) -> str | None:
    """A single instance's ``sat`` stands only with a counterexample that onnxruntime confirms."""
    from . import witness

    onnx, vnnlib = all_args["model"]["onnx_path"], all_args["specification"]["vnnlib_path"]
    if not (results_file and onnx and vnnlib and os.path.isfile(results_file)):
        return None
    onnx = os.path.join(all_args["model"]["onnx_path_prefix"] or "", onnx)
    vnnlib = os.path.join(all_args["specification"]["vnnlib_path_prefix"] or "", vnnlib)
    warning = witness.recheck(results_file, onnx, vnnlib)
    if warning:
        for rec in result["records"]:
            if rec["verdict"] == "sat":
                rec["verdict"] = "unknown"
    return warning


def summary_json(result: dict, par: ParallelConfig) -> dict:
    """Our summary schema (as the native engine's) plus ``engine``; bounds as α,β-CROWN computed them."""
    from ..verify import json_number

    out = []
    for rec in result["records"]:
        bounds = {k: [json_number(v) for v in rec[k]] for k in ("crown", "alpha_crown") if rec[k]}
        out.append(
            {
                "engine": "abcrown",
                "verdict": rec["verdict"],
                "time_s": round(rec["time_s"], 4),
                "bounds": bounds,
                "peak_mb": [round(v, 2) for v in result["peak_mb"]],
                "peak_mb_bounds": [round(v, 2) for v in result["peak_mb_bounds"]],
                "peak_mb_bab": [round(v, 2) for v in result["peak_mb_bab"]],
                "bab": bab_record(rec["bab_domains"], time_s=rec["bab_s"]),
                "peak_mb_exact": result["peak_mb_exact"],
                "alpha_elements": result["alpha_elements"],
                "crown_batch_size": result["crown_batch_size"],
                "parallel": {
                    "mode": par.mode,
                    "world_size": par.world_size,
                    "bab_weights": par.bab_weights_resolved,
                },
                "bab_weight_fetches": result["bab_weight_fetches"],
                "bab_collectives": result["bab_collectives"],
                "rows_dealt": result["rows_dealt"],
                **({"whole_layers": result["whole_layers"]} if result.get("whole_layers") else {}),
                **(
                    {"full_weights_live": result["full_weights_live"]}
                    if "full_weights_live" in result
                    else {}
                ),
                "message": "",
            }
        )
    return out[0] if len(out) == 1 else {"instances": out}


def _refuse_unsupported(all_args: dict, par: ParallelConfig, config: str | None, checkout) -> None:
    """PluginError when the config asks for what α,β-CROWN itself refuses (at every P, before any rank
    starts, with the same line), or for a BaB feature that is not split over ranks yet (P > 1)."""
    from .bab_split import refused_upstream, unsupported

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
    extra = _crown_batch_args(all_args, world_size)
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


def _run(sh: shell.Shell, config, overrides, summary, quiet, started_wall: float, scratch: str) -> int:
    """The command on the plugin, inside the shell's error ladder."""
    yaml_path, flat, data = bridge.merged_yaml(config, overrides, scratch)
    general = data.get("general") if isinstance(data.get("general"), dict) else {}
    sh.results_file = bridge.flag_value(flat, "--results_file") or general.get("results_file")
    bridge.check_customized_files(data, config)
    checkout = locate.find()
    par = bridge.parallel_of(data, flat, config)
    all_args = check_config(checkout, ["--config", yaml_path, *flat], config)
    sh.results_file = results_file = all_args["general"]["results_file"]
    check_writable(results_file, "general.results_file")
    if summary:
        check_writable(summary, "--summary")
    _refuse_unsupported(all_args, par, config, checkout)
    extra = _extra_args(all_args, par.world_size)
    device = all_args["general"]["device"]
    # forked ranks (no α,β-CROWN import per rank) on the CPU with gloo only: a forked rank must not
    # inherit CUDA state, and exact memory needs fresh interpreters
    cpu_gloo = device == "cpu" and shell.backend(par, device) == "gloo"
    fork = par.world_size > 1 and cpu_gloo and not par.exact_memory
    if fork:
        _fork_ready(checkout)
    rank_args = (checkout, [yaml_path, *flat, *extra], par, scratch, quiet, started_wall)
    result = sh.launch(_rank_main, par, rank_args, device, fork=fork)
    if sh.writer:
        _report(result, all_args, results_file, summary, par, quiet)
    return 0
