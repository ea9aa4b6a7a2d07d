"""``abcrown --config FILE.yaml [--section.key VALUE ...] [--summary PATH] [--quiet]``.

Reads the config, lists the instances (one from ``model.onnx_path`` + ``specification.vnnlib_path``,
or many from ``general.root_path``/``general.csv_name``), runs them on ``parallel.world_size`` ranks,
and writes the VNN-COMP result file, an optional JSON summary and a readable summary on stdout.
A user mistake (bad config, model or spec) prints one line and exits 1; rank 0 alone writes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import clock, shell
from .config import Config, ConfigError
from .config_help import key_table
from .config_load import flag_value, load_config
from .errors import UserError, end_cleanly_on_signals
from .results import check_writable, write_atomic
from .spec.networks import label, map_paths

if TYPE_CHECKING:
    from .verify import InstanceResult

PROOF_DIR_ENV = "CVE_PROOF_DIR"

# torch, onnx and the engine are imported only once the command line is parsed: ``--help`` needs none


@dataclass(frozen=True)
class Instance:
    onnx: str
    vnnlib: str
    timeout: float


class Progress:
    """The progress of the whole run, on rank 0: instance k of N and what its current stage says
    (PGD, each bound method, α-CROWN steps, BaB rounds with domains left, worst bound and domains/s).
    On a terminal, one tqdm line rewritten in place (at most 5 times a second); with
    ``general.verbose``, every status on its own line of stderr, terminal or not; ``--quiet``: nothing."""

    def __init__(self, enabled: bool, verbose: bool, total: int):
        self.verbose, self.bar, self.last, self.name = verbose and enabled, None, 0.0, ""
        if enabled and not verbose and sys.stderr.isatty():
            from tqdm import tqdm

            fmt = "{n_fmt}/{total_fmt} instances {elapsed} {postfix}"
            self.bar = tqdm(total=total, file=sys.stderr, leave=False, bar_format=fmt, dynamic_ncols=True)

    def start(self, inst: Instance) -> None:
        self.name = _name(inst)
        self("start")

    def __call__(self, status: str) -> None:
        if self.verbose:
            print(f"{self.name}: {status}", file=sys.stderr, flush=True)
        elif self.bar is not None and time.monotonic() - self.last > 0.2:
            self.last = time.monotonic()
            self.bar.set_postfix_str(f"{self.name}: {status}")

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def list_instances(cfg: Config) -> list[Instance]:
    """The single instance of the config, or the rows of ``root_path/csv_name``."""
    g = cfg.general
    if cfg.model.onnx_path and cfg.specification.vnnlib_path:
        return [Instance(cfg.model.onnx_path, cfg.specification.vnnlib_path, cfg.bab.timeout)]
    if not g.csv_name:
        raise ConfigError(
            "no instance: set model.onnx_path and specification.vnnlib_path, or general.csv_name"
        )
    path = Path(g.root_path) / g.csv_name
    if not path.is_file():
        raise ConfigError(f"general.csv_name: {path} does not exist")
    out = []
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise ConfigError(f"{path}:{lineno}: expected 'onnx,vnnlib[,timeout]'")
            try:
                timeout = float(row[2]) if len(row) > 2 and row[2].strip() else cfg.bab.timeout
            except ValueError:
                raise ConfigError(f"{path}:{lineno}: timeout '{row[2]}' is not a number") from None
            root = Path(g.root_path)
            onnx = map_paths(
                row[0], lambda p, root=root: str(root / (cfg.model.onnx_path_prefix + p.strip()))
            )
            vnnlib = root / (cfg.specification.vnnlib_path_prefix + row[1].strip())
            out.append(Instance(onnx, str(vnnlib), timeout))
    return out


def instance_config(cfg: Config, source: tuple[str | None, list[str]], inst: Instance) -> Config:
    """The config of one instance: ``cfg`` itself, or with ``general.complete_verifier: auto`` the
    method :mod:`.methods` chooses for its model and query under the keys the YAML file and command
    line (``source``) set themselves, named in one stderr line (rank 0)."""
    if cfg.general.complete_verifier != "auto":
        return cfg
    from . import methods
    from .config_load import explicit_keys
    from .parallel import comm

    path, overrides = source
    method, why = methods.for_instance(inst.onnx, inst.vnnlib, cfg.parallel.mode == "tp")
    explicit = explicit_keys(path, overrides) - {"general.complete_verifier"}
    chosen = methods.settings(method, explicit)
    if comm.rank() == 0:
        print(f"method: {why} (general.complete_verifier auto)", file=sys.stderr, flush=True)
    out, _ = load_config(path, [*chosen, *overrides])
    return out


def run_instances(
    cfg: Config,
    instances: list[Instance],
    show_progress: bool,
    partial: str | None = None,
    started: float | None = None,
    quiet: bool = False,
    source: tuple[str | None, list[str]] = (None, []),
) -> list[InstanceResult]:
    """Runs on every rank, in lockstep.  A user error in one instance of a list is that instance's
    ``error`` verdict; a single instance re-raises it so that the CLI exits non-zero.  The clock of a
    single instance starts at ``started`` (the verifier's start, clock.py): its timeout is a wall-clock limit.
    For a list, rank 0 prints one line per finished instance and appends it to the results file at
    once, and to ``partial`` (JSON lines for the summary): a run that is killed keeps what it did.
    ``source`` (the YAML file and the command line) gives each instance its method where the config
    leaves it to ``auto`` (:func:`instance_config`)."""
    from .parallel import comm
    from .verify import InstanceResult, verify_instance

    results = []
    single = len(instances) == 1
    progress = Progress(show_progress and comm.rank() == 0, cfg.general.verbose, len(instances))
    for k, inst in enumerate(instances, 1):
        progress.start(inst)
        try:
            t0 = started if single else None
            mine = instance_config(cfg, source, inst)
            results.append(verify_instance(mine, inst.onnx, inst.vnnlib, inst.timeout, progress, started=t0))
        except shell.USER_ERRORS as e:
            if single:
                progress.close()
                raise
            results.append(InstanceResult("error", 0.0, message=str(e)))
        progress.done()
        if single or comm.rank() != 0:
            continue
        res = results[-1]
        with open(cfg.general.results_file, "a") as f:
            f.write(result_line(inst, res))
        if partial:
            with open(partial, "a") as f:
                f.write(
                    json.dumps(dict(res.to_json(), onnx=inst.onnx, vnnlib=inst.vnnlib), allow_nan=False)
                    + "\n"
                )
        if not quiet:
            worst = min((min(v) for v in res.bounds.values()), default=None)
            tail = f"  worst bound {worst:+.4g}" if worst is not None else ""
            print(
                f"[{k}/{len(instances)}] {res.verdict:8s} {res.time_s:7.2f}s  {_name(inst)}{tail}", flush=True
            )
    return results


def _name(inst: Instance) -> str:
    return f"{label(inst.onnx)} {Path(inst.vnnlib).name}"


def result_line(inst: Instance, res: InstanceResult) -> str:
    """One line of a csv run's results file (csv quoting: a network list holds commas)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([inst.onnx, inst.vnnlib, res.verdict, f"{res.time_s:.3f}"])
    return buf.getvalue()


def done_instances(results_file: str) -> dict[tuple[str, str], str]:
    """(onnx, vnnlib) -> line, of the instances a csv run's results file already holds (``--resume``)."""
    done = {}
    if os.path.isfile(results_file):
        for line in Path(results_file).read_text().splitlines():
            parts = next(csv.reader([line]), [])
            if len(parts) >= 4:
                done[(parts[0], parts[1])] = line + "\n"
    return done


def result_text(res: InstanceResult) -> str:
    """VNN-COMP result file content."""
    if res.verdict == "sat" and res.counterexample:
        return "sat\n" + res.counterexample + "\n"
    return res.verdict + "\n"


def write_outputs(
    cfg: Config,
    instances: list[Instance],
    results: list[InstanceResult],
    summary: str | None,
    quiet: bool,
    earlier: dict[tuple[str, str], str] | None = None,
    earlier_json: list[dict] | None = None,
) -> None:
    """The results file (atomically; for a list, the lines of the ``earlier`` instances of a resumed
    run first), the summary JSON and the readable summary on stdout."""
    results_file = cfg.general.results_file
    if len(instances) == 1 and not earlier:
        write_atomic(results_file, result_text(results[0]))
    else:
        write_atomic(
            results_file, "".join((earlier or {}).values()) + "".join(map(result_line, instances, results))
        )
    if summary:
        data = (earlier_json or []) + [
            dict(r.to_json(), onnx=i.onnx, vnnlib=i.vnnlib) for i, r in zip(instances, results, strict=True)
        ]
        text = json.dumps(data[0] if len(data) == 1 else {"instances": data}, indent=1, allow_nan=False)
        write_atomic(summary, text)
    if len(instances) == 1:
        res, inst = results[0], instances[0]
        print(f"{res.verdict:8s} {res.time_s:7.2f}s  {_name(inst)}")
        if not quiet:
            for method, vals in res.bounds.items():
                print(f"    {method:12s} worst clause bound {min(vals):+.6f}  ({len(vals)} clauses)")
            if res.peak_mb:
                note = (
                    ""
                    if res.peak_exact
                    else "  (an upper bound: parallel.exact_memory: true gives the exact peak)"
                )
                print("    peak MB per rank: " + " ".join(f"{p:.1f}" for p in res.peak_mb) + note)
        if res.message:  # why it stopped without an answer: said even when quiet (on stderr)
            print("    " + res.message, file=sys.stderr if quiet else sys.stdout)
    else:
        counts = {
            v: sum(r.verdict == v for r in results) for v in ("sat", "unsat", "unknown", "timeout", "error")
        }
        print("total: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _rank_main(cfg: Config, *args) -> list[InstanceResult]:
    """``run_instances(cfg, *args)`` on one rank, with its share of the threads."""
    from .parallel import comm, launch

    launch.set_threads(cfg.parallel.threads, comm.world_size())
    return run_instances(cfg, *args)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """usage: abcrown [--config FILE.yaml] [--summary PATH] [--quiet] [--resume] [--section.key VALUE ...]

    --config   the YAML config (alpha-beta-CROWN's layout)
    --summary  write a JSON summary (verdict, time, bounds per method, peak MB per rank)
    --quiet    no progress, only the verdict line
    --resume   csv runs: skip the instances the results file already holds (and keep their lines)"""
    p = argparse.ArgumentParser(
        prog="abcrown",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="α,β-CROWN-style YAML file")
    p.add_argument(
        "--summary", help="write a JSON summary (verdict, time, bounds per method, peak MB per rank)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress, only the verdict line")
    p.add_argument(
        "--resume",
        action="store_true",
        help="csv runs: skip the instances the results file already holds (and keep their lines)",
    )
    return p.parse_known_args(argv)


def keys_help() -> str:
    """Every config key with its default and its doc (from the config dataclasses)."""
    import textwrap

    out = ["config keys: set them in the YAML file (section: {key: value}) or as --section.key VALUE", ""]
    for key, default, doc in key_table():
        out.append(f"  {key} = {'null' if default is None else default}")
        text = doc.replace("``", "")
        out += textwrap.wrap(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


def _yaml_general(config: str | None, key: str) -> str | None:
    """``general.KEY`` of the YAML file ``config`` when it can be read and is a string, else None."""
    try:
        import yaml

        with open(config or "", encoding="utf-8") as f:
            value = ((yaml.safe_load(f) or {}).get("general") or {}).get(key)
        return value if isinstance(value, str) else None
    except Exception:
        return None  # our loader reports the unreadable file


def _with_proof_folder(config: str | None, overrides: list[str]) -> list[str]:
    """``$CVE_PROOF_DIR`` (a folder): where neither the command line nor the YAML names
    ``general.proof``, every ``unsat`` writes its proof there (``proofs.in_folder``), as if the command
    said ``--general.proof FOLDER``; for harnesses that cannot change the command (the test suite checks
    every proof its end-to-end runs write)."""
    folder = os.environ.get(PROOF_DIR_ENV)
    given = flag_value(overrides, "--general.proof", "--proof") or _yaml_general(config, "proof")
    if not folder or given:
        return overrides
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        print(f"warning: {PROOF_DIR_ENV}={folder} is not a folder ({why}): no proofs", file=sys.stderr)
        return overrides
    return [*overrides, "--general.proof", folder]


def results_file_hint(config: str | None, overrides: list[str]) -> str | None:
    """Where ``error`` goes when the config itself cannot be loaded: ``--general.results_file`` of the
    command line, else ``general.results_file`` of the YAML if it can be read, else None."""
    return flag_value(overrides, "--general.results_file") or _yaml_general(config, "results_file")


def engine_of(config: str | None, overrides: list[str], say: bool = False) -> str:
    """``general.engine`` from the command line (``--general.engine X``; α,β-CROWN's ``--engine X``),
    else from the YAML, else ``auto``: ``abcrown`` where an α,β-CROWN checkout is found
    (``$ABCROWN_PATH``, or an importable ``complete_verifier``), so that α,β-CROWN's users type their
    own command, else ``native``; ``say``: one stderr line names the engine ``auto`` chose and why.
    Read before the config is loaded: with ``abcrown`` the YAML is α,β-CROWN's, which our loader does
    not check."""
    given = flag_value(overrides, "--general.engine", "--engine") or _yaml_general(config, "engine")
    engine = given or "auto"
    if engine != "auto":
        return engine
    from .abcrown_plugin import available

    root, why = available()
    engine = "abcrown" if root else "native"
    if say:
        reason = f"alpha-beta-CROWN found at {root} ({why})" if root else f"no alpha-beta-CROWN: {why}"
        print(f"engine: {engine} (general.engine auto; {reason})", file=sys.stderr)
    return engine


def _abcrown_help() -> int:
    """``--help`` with ``general.engine abcrown``: the command's options, then the user's α,β-CROWN keys."""
    from . import abcrown_plugin

    usage = parse_args.__doc__ or ""
    try:
        keys = abcrown_plugin.keys_help()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{usage.strip()}\n\n{keys}")
    return 0


def _reexec_for_exact_memory(cfg: Config, argv: list[str] | None) -> None:
    """With ``parallel.exact_memory``, re-exec this process (run as a command: ``argv`` None) with
    glibc's mmap threshold set and MKL's buffer cache off unless they are already: both are read at
    start-up, and with them freed tensors and GEMM buffers return to the OS, so that the measured
    peak follows live tensors (see parallel/memory.py)."""
    from .parallel.memory import EXACT_MEMORY_ENV, exact_memory_env_ok

    if cfg.parallel.exact_memory and argv is None and not exact_memory_env_ok():
        env = {**os.environ, **EXACT_MEMORY_ENV, clock.ENV: repr(clock.started_wall())}  # same origin
        os.execve(sys.executable, [sys.executable, "-m", "complete_verifier_ext.cli", *sys.argv[1:]], env)


def _csv_start(
    instances: list[Instance], results_file: str, summary: str | None, resume: bool, writer: bool
) -> tuple[list[Instance], dict[tuple[str, str], str], list[dict], str | None]:
    """Where a csv run (more than one instance) starts: with ``resume``, the instances still to do, the
    verdicts of those done and their lines of the partial summary; else the results file and the
    partial summary emptied. Returns the instances to run, those verdicts, those lines and the partial
    summary's path (None without ``summary`` or for a single instance)."""
    earlier: dict[tuple[str, str], str] = {}
    earlier_json: list[dict] = []
    partial = None
    if len(instances) <= 1:
        return instances, earlier, earlier_json, partial
    if resume:
        earlier = done_instances(results_file)
        instances = [i for i in instances if (i.onnx, i.vnnlib) not in earlier]
    elif writer:
        Path(results_file).write_text("")
    if summary:
        partial = summary + ".partial.jsonl"
        if resume and os.path.isfile(partial):
            lines = Path(partial).read_text().splitlines()
            earlier_json = [
                d for d in map(json.loads, filter(None, lines)) if (d["onnx"], d["vnnlib"]) in earlier
            ]
        elif writer:
            Path(partial).unlink(missing_ok=True)
    return instances, earlier, earlier_json, partial


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The ``abcrown`` command (``argv``: its arguments, default ``sys.argv[1:]``). Returns the exit code.
    A single instance's timeout counts from ``started`` (``time.monotonic()``), else from the verifier's
    start when run as a command, from the call when called with ``argv``.

    A rank that torchrun started ends here, once its group is shut down and everything is written
    (``os._exit``, streams flushed): the interpreter's finalization would destroy torch's store and
    gloo threads after a peer has gone, which aborted rank 0 after its verdict (``terminate called
    without an active exception``, SIGABRT) in about 1 of 20 two-node runs here."""
    code = _main(argv, started)
    if argv is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None, started: float | None) -> int:
    if argv is None:  # Ctrl-C, SIGTERM and SIGHUP end the run cleanly (ranks stopped, scratch removed)
        end_cleanly_on_signals()
    raw = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(raw) and engine_of(flag_value(raw, "--config"), raw) == "abcrown":
        return _abcrown_help()
    args, overrides = parse_args(raw)
    overrides = _with_proof_folder(args.config, overrides)
    if engine_of(args.config, overrides, say=True) == "abcrown":
        from .abcrown_plugin import main as abcrown_main

        started_wall = clock.started_wall() if argv is None else None
        return abcrown_main(args.config, overrides, args.summary, args.quiet, started_wall)
    # the timeout of a single instance counts from the verifier's start (imports too; clock.py); a call
    # from Python (``main(argv)``) counts from the call
    if started is None:
        started = clock.started_monotonic() if argv is None else time.monotonic()
    return shell.run(lambda sh: _native(sh, args, overrides, argv, started))


def _native(sh: shell.Shell, args: argparse.Namespace, overrides: list[str], argv, started: float) -> int:
    """The command on the native engine, inside the shell's error ladder."""
    single = not args.resume  # a csv run keeps its results file: an error never overwrites its lines
    sh.results_file = results_file_hint(args.config, overrides) if single else None
    cfg, warnings = load_config(args.config, overrides)
    results_file = cfg.general.results_file
    sh.results_file = results_file if single else None
    check_writable(results_file, "general.results_file")
    if args.summary:
        check_writable(args.summary, "--summary")
    _reexec_for_exact_memory(cfg, argv)
    sh.warn(warnings)
    instances = list_instances(cfg)
    sh.results_file = results_file if single and len(instances) == 1 else None
    instances, earlier, earlier_json, partial = _csv_start(
        instances, results_file, args.summary, args.resume, sh.writer
    )
    if earlier or len(instances) > 1:
        sh.interrupted = f"interrupted; the finished instances are in {results_file}"
    t0 = time.monotonic()
    if not instances:
        print(f"nothing to do: the {len(earlier)} instances are all in {results_file}")
        return 0
    rank_args = (cfg, instances, not args.quiet, partial, started, args.quiet, (args.config, overrides))
    results = sh.launch(_rank_main, cfg.parallel, rank_args, cfg.general.device)
    if not sh.writer:  # torchrun: every rank got the result, rank 0 alone reports
        return 0
    write_outputs(cfg, instances, results, args.summary, args.quiet, earlier, earlier_json)
    if len(instances) > 1 and not args.quiet:
        print(f"wall time {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
