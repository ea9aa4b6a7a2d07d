"""``abcrown --config FILE.yaml [--section.key VALUE ...] [--summary PATH] [--quiet]``.

Reads the config, lists the instances (one from ``model.onnx_path`` + ``specification.vnnlib_path``,
or many from ``general.root_path``/``general.csv_name``), runs them on ``parallel.world_size`` ranks,
and writes the VNN-COMP result file, an optional JSON summary and a readable summary on stdout.
A user mistake (bad config, model or spec) prints one line and exits 1; rank 0 alone writes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import Config, ConfigError, load_config
from .model.onnx_loader import ModelError
from .parallel import comm, launch
from .parallel.memory import MMAP_THRESHOLD_ENV, mmap_threshold_env_ok
from .spec import SpecError
from .verify import InstanceResult, verify_instance

USER_ERRORS = (ConfigError, ModelError, SpecError, FileNotFoundError, ValueError)


@dataclass(frozen=True)
class Instance:
    onnx: str
    vnnlib: str
    timeout: float


class Progress:
    """α-CROWN progress bar (tqdm), shown on a terminal only, on rank 0, after 2 s."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="alpha-CROWN", leave=False, delay=2.0, file=sys.stderr)

    def __call__(self, it: int, best) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(worst=f"{float(best.min()):.4g}")

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
            onnx = root / (cfg.model.onnx_path_prefix + row[0].strip())
            vnnlib = root / (cfg.specification.vnnlib_path_prefix + row[1].strip())
            out.append(Instance(str(onnx), str(vnnlib), timeout))
    return out


def run_instances(
    cfg: Config, instances: list[Instance], show_progress: bool, partial: str | None = None
) -> list[InstanceResult]:
    """Runs on every rank, in lockstep.  A user error in one instance of a list is that instance's
    ``error`` verdict; a single instance re-raises it so that the CLI exits non-zero.  With
    ``partial``, rank 0 appends one JSON line per finished instance there (long runs survive a kill)."""
    results = []
    for inst in instances:
        bar = Progress(show_progress and comm.rank() == 0, cfg.solver.alpha_crown.iteration)
        try:
            results.append(verify_instance(cfg, inst.onnx, inst.vnnlib, inst.timeout, on_step=bar))
        except USER_ERRORS as e:
            if len(instances) == 1:
                raise
            results.append(InstanceResult("error", 0.0, message=str(e)))
        finally:
            bar.close()
        if partial and comm.rank() == 0:
            with open(partial, "a") as f:
                f.write(
                    json.dumps(
                        dict(results[-1].to_json(), onnx=inst.onnx, vnnlib=inst.vnnlib), allow_nan=False
                    )
                    + "\n"
                )
    return results


def result_text(res: InstanceResult) -> str:
    """VNN-COMP result file content."""
    if res.verdict == "sat" and res.counterexample:
        return "sat\n" + res.counterexample + "\n"
    return res.verdict + "\n"


def write_outputs(
    cfg: Config, instances: list[Instance], results: list[InstanceResult], summary: str | None, quiet: bool
) -> None:
    results_file = cfg.general.results_file
    if len(instances) == 1:
        Path(results_file).write_text(result_text(results[0]))
    else:
        with open(results_file, "w") as f:
            for inst, res in zip(instances, results):
                f.write(f"{inst.onnx},{inst.vnnlib},{res.verdict},{res.time_s:.3f}\n")
    if summary:
        data = [dict(r.to_json(), onnx=i.onnx, vnnlib=i.vnnlib) for i, r in zip(instances, results)]
        Path(summary).write_text(
            json.dumps(data[0] if len(data) == 1 else {"instances": data}, indent=1, allow_nan=False)
        )
    for inst, res in zip(instances, results):
        line = f"{res.verdict:8s} {res.time_s:7.2f}s  {Path(inst.onnx).name} {Path(inst.vnnlib).name}"
        if not quiet or len(instances) == 1:
            print(line)
        if not quiet:
            for method, vals in res.bounds.items():
                print(f"    {method:12s} worst clause bound {min(vals):+.6f}  ({len(vals)} clauses)")
            if res.peak_mb:
                print("    peak MB per rank: " + " ".join(f"{p:.1f}" for p in res.peak_mb))
            if res.message:
                print("    " + res.message)
    if len(instances) > 1:
        counts = {
            v: sum(r.verdict == v for r in results) for v in ("sat", "unsat", "unknown", "timeout", "error")
        }
        print("total: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _backend(cfg: Config) -> str:
    """``auto`` means NCCL only when the config asks for CUDA; a CPU run uses gloo even on a GPU host."""
    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend
    return "gloo" if cfg.general.device == "cpu" else "auto"


def _rank_main(
    cfg: Config, instances: list[Instance], show_progress: bool, partial: str | None = None
) -> list[InstanceResult]:
    if comm.world_size() > 1:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.world_size()))
    return run_instances(cfg, instances, show_progress, partial)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="abcrown", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--config", help="α,β-CROWN-style YAML file")
    p.add_argument(
        "--summary", help="write a JSON summary (verdict, time, bounds per method, peak MB per rank)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars, only the verdict line")
    return p.parse_known_args(argv)


def _error(cfg: Config | None, msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    if cfg is not None and cfg.model.onnx_path and cfg.specification.vnnlib_path and comm.rank() == 0:
        try:
            Path(cfg.general.results_file).write_text("error\n")
        except OSError:
            pass
    return 1


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = None
    try:
        cfg, warnings = load_config(args.config, overrides)
        if cfg.parallel.exact_memory and argv is None and not mmap_threshold_env_ok():
            # glibc reads the threshold at start-up: re-exec so that freed tensors return to the OS and
            # the measured peak follows live tensors (see parallel/memory.py).
            env = {**os.environ, **MMAP_THRESHOLD_ENV}
            os.execve(sys.executable, [sys.executable, "-m", "complete_verifier_ext.cli", *sys.argv[1:]], env)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        instances = list_instances(cfg)
        show = not args.quiet and sys.stderr.isatty()
        partial = None
        if args.summary and len(instances) > 1:
            partial = args.summary + ".partial.jsonl"
            Path(partial).unlink(missing_ok=True)
        t0 = time.monotonic()
        results = launch.run(
            _rank_main,
            cfg.parallel.world_size,
            (cfg, instances, show, partial),
            backend=_backend(cfg),
            exact_memory=cfg.parallel.exact_memory,
        )
        if comm.rank() != 0:  # torchrun: every rank got the result, rank 0 alone reports
            return 0
        write_outputs(cfg, instances, results, args.summary, args.quiet)
        if len(instances) > 1 and not args.quiet:
            print(f"wall time {time.monotonic() - t0:.1f}s")
        return 0
    except USER_ERRORS as e:
        return _error(cfg, str(e))
    except launch.RankFailure as e:
        return _error(cfg, str(e).splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
