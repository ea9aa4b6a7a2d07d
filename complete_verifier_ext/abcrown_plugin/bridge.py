"""Our keys inside α,β-CROWN's config, and the command line each rank hands to ``ABCROWN(args)``.

The user's YAML goes to α,β-CROWN as it is, so every α,β-CROWN key is valid and α,β-CROWN validates it.
Our own keys are registered into its ``arguments.Config`` with its public ``add_argument(...,
hierarchy=[...])``, so its YAML check accepts them and ``dump_config`` lists them. Overrides in our
``--section.key VALUE`` form are merged into a copy of the YAML (α,β-CROWN's own check then rejects a
typo); its flat flags (``--device cpu``, ``--onnx_path X``) pass through unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from .locate import PluginError

# (flag, hierarchy, argparse keywords); the help texts follow α,β-CROWN's rules (capital, full stop)
OUR_KEYS: list[tuple[str, list[str], dict]] = [
    (
        "--engine",
        ["general", "engine"],
        dict(
            type=str,
            default="abcrown",
            choices=["native", "abcrown"],
            help="Which engine runs the verification: native (complete_verifier_ext) or abcrown (this one).",
        ),
    ),
    (
        "--parallel_mode",
        ["parallel", "mode"],
        dict(
            type=str,
            default="none",
            choices=["none", "fsdp", "tp"],
            help="How the bound propagation is sharded over the ranks (none, fsdp or tp).",
        ),
    ),
    (
        "--parallel_world_size",
        ["parallel", "world_size"],
        dict(type=int, default=1, help="Number of ranks (processes, one GPU each with CUDA)."),
    ),
    (
        "--parallel_backend",
        ["parallel", "backend"],
        dict(
            type=str,
            default="auto",
            choices=["auto", "gloo", "nccl"],
            help="Collective backend: auto picks gloo on CPU and NCCL with one GPU per rank.",
        ),
    ),
    (
        "--parallel_threads",
        ["parallel", "threads"],
        dict(
            type=int, default=0, help="Torch threads per rank; 0 divides the available cores among the ranks."
        ),
    ),
    (
        "--parallel_exact_memory",
        ["parallel", "exact_memory"],
        dict(
            type=lambda s: str(s).lower() in ("1", "true", "yes"),
            default=False,
            help="Measure the exact per-rank peak (glibc returns freed memory at once; slower).",
        ),
    ),
    (
        "--parallel_bab_weights",
        ["parallel", "bab_weights"],
        dict(
            type=str,
            default="auto",
            choices=["auto", "replicated", "sharded"],
            help="Whether BaB keeps every layer whole on every rank (replicated) or sharded, fetched per "
            "use (sharded); auto: replicated under fsdp, sharded under tp (which never builds a layer).",
        ),
    ),
]


@dataclass(frozen=True)
class Parallel:
    """What the parent needs before any rank starts (read from the merged YAML)."""

    mode: str = "none"
    world_size: int = 1
    backend: str = "auto"
    threads: int = 0
    exact_memory: bool = False
    bab_weights: str = "replicated"  # resolved: replicated or sharded


def register(config) -> None:
    """Add our keys to α,β-CROWN's ``arguments.Config`` (idempotent)."""
    for flag, hierarchy, kw in OUR_KEYS:
        if flag.lstrip("-") in config.config_file_hierarchies:
            continue
        config.add_argument(flag, hierarchy=hierarchy, **copy.deepcopy(kw))
    config.default_args = vars(config.defaults_parser.parse_args([]))


def _set(d: dict, keys: list[str], value) -> None:
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise PluginError(f"--{'.'.join(keys)}: '{k}' is not a section")
        d = nxt
    d[keys[-1]] = value


def split_overrides(overrides: list[str]) -> tuple[list[tuple[list[str], object]], list[str]]:
    """``--section.key VALUE`` pairs (values read as YAML) and the rest (α,β-CROWN's own flags)."""
    ours, flat = [], []
    i = 0
    while i < len(overrides):
        item = overrides[i]
        name = item[2:].split("=", 1)[0] if item.startswith("--") else ""
        if "." in name:
            if "=" in item:
                value = item.split("=", 1)[1]
            elif i + 1 < len(overrides):
                i += 1
                value = overrides[i]
            else:
                raise PluginError(f"{item}: no value")
            ours.append((name.split("."), yaml.safe_load(value)))
        else:
            flat.append(item)
        i += 1
    return ours, flat


def merged_yaml(config_path: str | None, overrides: list[str], out_dir: str) -> tuple[str, list[str], dict]:
    """Write the user's YAML with our ``--section.key`` overrides applied to ``out_dir`` and return its
    path, the flat flags, and the merged dict. α,β-CROWN resolves relative paths against the working
    directory (not the YAML's folder), so moving the YAML changes nothing."""
    data: dict = {}
    if config_path:
        try:
            with open(config_path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            raise PluginError(f"{config_path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(data, dict):
            raise PluginError(f"{config_path}: the top level must be a mapping of sections")
    ours, flat = split_overrides(overrides)
    for keys, value in ours:
        _set(data, keys, value)
    path = os.path.join(out_dir, "config.yaml")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return path, flat, data


def flag_value(flat: list[str], name: str) -> str | None:
    """The value of α,β-CROWN flag ``name`` on the command line (the last one wins, as in argparse)."""
    value = None
    for i, item in enumerate(flat):
        if item == name and i + 1 < len(flat):
            value = flat[i + 1]
        elif item.startswith(name + "="):
            value = item.split("=", 1)[1]
    return value


def parallel_of(data: dict, flat: list[str]) -> Parallel:
    """Our ``parallel`` section (α,β-CROWN's flat ``--parallel_*`` flags win, as in its parser)."""
    sec = dict(data.get("parallel") or {})
    for flag, hierarchy, _ in OUR_KEYS:
        value = flag_value(flat, flag)
        if hierarchy[0] == "parallel" and value is not None:
            sec[hierarchy[1]] = value
    try:
        p = Parallel(
            mode=str(sec.get("mode", "none")),
            world_size=int(sec.get("world_size", 1)),
            backend=str(sec.get("backend", "auto")),
            threads=int(sec.get("threads", 0)),
            exact_memory=str(sec.get("exact_memory", False)).lower() in ("1", "true", "yes"),
            bab_weights=str(sec.get("bab_weights", "auto")),
        )
    except (TypeError, ValueError) as e:
        raise PluginError(f"parallel: {e}") from None
    if p.mode not in ("none", "fsdp", "tp"):
        raise PluginError(f"parallel.mode: '{p.mode}' is not one of none, fsdp, tp")
    if p.world_size < 1:
        raise PluginError(f"parallel.world_size: {p.world_size} must be at least 1")
    if p.mode == "none" and p.world_size > 1:
        raise PluginError("parallel.world_size > 1 needs parallel.mode fsdp or tp")
    if p.bab_weights not in ("auto", "replicated", "sharded"):
        raise PluginError(f"parallel.bab_weights: '{p.bab_weights}' is not one of auto, replicated, sharded")
    if p.mode == "tp" and p.bab_weights == "replicated":
        raise PluginError(
            "parallel.bab_weights: 'replicated' but parallel.mode is 'tp', which never holds a whole "
            "layer: use parallel.mode fsdp or bab_weights sharded"
        )
    if p.bab_weights == "auto":
        p = dataclasses.replace(p, bab_weights="sharded" if p.mode == "tp" else "replicated")
    return p


def rank_args(config_yaml: str, flat: list[str], rank: int, scratch: str) -> list[str]:
    """The command line of ``ABCROWN(args)`` on ``rank``: ranks other than 0 write their results, pickles
    and counterexamples to ``scratch`` (rank 0 alone writes the user's files)."""
    args = ["--config", config_yaml, *flat]
    if rank != 0:
        d = os.path.join(scratch, f"rank{rank}")
        os.makedirs(d, exist_ok=True)
        args += [
            "--results_file",
            os.path.join(d, "out.txt"),
            "--output_file",
            os.path.join(d, "out.pkl"),
            "--cex_path",
            os.path.join(d, "cex.txt"),
        ]
    return args
