"""Our keys inside α,β-CROWN's config, and the command line each rank hands to ``ABCROWN(args)``.

The user's YAML goes to α,β-CROWN as it is, so every α,β-CROWN key is valid and α,β-CROWN validates it.
Our own keys are registered into its ``arguments.Config`` with its public ``add_argument(...,
hierarchy=[...])``, so its YAML check accepts them and ``dump_config`` lists them. Overrides in our
``--section.key VALUE`` form are merged into a copy of the YAML (α,β-CROWN's own check then rejects a
typo); its flat flags (``--device cpu``, ``--onnx_path X``) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config import ParallelConfig
from ..config_load import flag_value
from . import locate
from .locate import PluginError

ENGINE_KEY = (
    "--engine",
    ["general", "engine"],
    dict(
        type=str,
        default="abcrown",
        choices=["auto", "native", "abcrown"],
        help="Which engine runs the verification: auto, native (ours) or abcrown (this one).",
    ),
)


PROOF_KEY = (
    "--proof",
    ["general", "proof"],
    dict(
        type=str,
        default=None,
        help="Where an unsat writes its proof (cve-proof-1, docs/proofs.md; .gz: gzipped), checked by "
        "complete-verifier-ext check; null: none.",
    ),
)


def _to_bool(text) -> bool:
    return str(text).strip().lower() in ("1", "true", "yes", "on", "y")


def _parallel_keys() -> list[tuple[str, list[str], dict]]:
    """``(flag, hierarchy, argparse keywords)`` of every ``parallel`` key, from the one schema that
    both engines share (``config.ParallelConfig``: types, defaults, choices, docs)."""
    from ..config_help import key_table

    docs = {key: doc for key, _, doc in key_table()}
    keys = []
    for f in dataclasses.fields(ParallelConfig):
        doc = " ".join(docs[f"parallel.{f.name}"].replace("``", "").split())
        doc = f"{f.name.replace('_', ' ').capitalize()}: {doc.rstrip('.')}."  # α,β-CROWN's help rule
        kw: dict = {"default": f.default, "help": doc}
        kw["type"] = _to_bool if isinstance(f.default, bool) else type(f.default)
        if f.metadata.get("choices"):
            kw["choices"] = list(f.metadata["choices"])
        keys.append((f"--parallel_{f.name}", ["parallel", f.name], kw))
    return keys


# (flag, hierarchy, argparse keywords) of our keys inside α,β-CROWN's config
OUR_KEYS: tuple[tuple[str, list[str], dict], ...] = (ENGINE_KEY, PROOF_KEY, *_parallel_keys())


def register(config) -> None:
    """Add our keys to α,β-CROWN's ``arguments.Config`` (idempotent)."""
    for flag, hierarchy, kw in OUR_KEYS:
        if flag.lstrip("-") in config.config_file_hierarchies:
            continue
        config.add_argument(flag, hierarchy=hierarchy, **copy.deepcopy(kw))
    config.default_args = vars(config.defaults_parser.parse_args([]))


def import_abcrown(checkout: locate.Checkout):
    """Activate the checkout and import its ``arguments`` with our keys registered (α,β-CROWN prints a
    line on import; it goes to stderr here). Returns the ``arguments`` module."""
    locate.activate(checkout)
    with contextlib.redirect_stdout(sys.stderr):
        import arguments
    register(arguments.Config)
    return arguments


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
    directory (not the YAML's folder), so moving the YAML changes nothing, except for the one it
    resolves against the YAML's folder: a ``Customized("file.py", ...)`` file, made absolute here."""
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
    general = data.get("general") if isinstance(data.get("general"), dict) else {}
    if config_path and not general.get("root_path"):
        data = _customized_files_absolute(data, os.path.dirname(os.path.abspath(config_path)))
    path = os.path.join(out_dir, "config.yaml")
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return path, flat, data


_CUSTOMIZED_FILE = re.compile(r"""(Customized\(\s*)(["'])([^"']+\.py)\2""")


def _customized_files_absolute(node: Any, folder: str) -> Any:
    """Every ``Customized("rel/file.py", ...)`` string under ``node`` with the file made absolute
    against ``folder`` (α,β-CROWN's ``Customized`` joins it to the YAML's folder)."""
    if isinstance(node, dict):
        return {k: _customized_files_absolute(v, folder) for k, v in node.items()}
    if isinstance(node, list):
        return [_customized_files_absolute(v, folder) for v in node]
    if isinstance(node, str):
        return _CUSTOMIZED_FILE.sub(lambda m: m[1] + m[2] + os.path.join(folder, m[3]) + m[2], node)
    return node


def check_customized_files(data: dict, config_path: str | None) -> None:
    """A ``Customized("file.py", ...)`` whose file is not there: one line naming it."""
    for found in _CUSTOMIZED_FILE.finditer(yaml.safe_dump(data)):
        if not os.path.isfile(found[3]):
            raise PluginError(f"{config_path or 'config'}: Customized file {found[3]} not found")


def parallel_of(data: dict, flat: list[str], config_path: str | None) -> ParallelConfig:
    """Our ``parallel`` section, checked by the schema both engines share; α,β-CROWN's flat
    ``--parallel_*`` flags win over the YAML, as in its parser. Every mistake names where it is."""
    from ..config import ConfigError
    from ..config_load import COMMAND_LINE, load_parallel

    from_flags = {}
    for flag, hierarchy, _ in OUR_KEYS:
        value = flag_value(flat, flag)
        if hierarchy[0] == "parallel" and value is not None:
            from_flags[hierarchy[1]] = value
    try:
        return load_parallel([(data.get("parallel"), config_path or "config"), (from_flags, COMMAND_LINE)])
    except ConfigError as e:
        raise PluginError(str(e)) from None


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
