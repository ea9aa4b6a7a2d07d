"""An instance's ONNX argument: one path (VNN-COMP 2021-2025) or, since VNN-COMP 2026, a list naming
each network of a VNN-LIB 2.0 query, ``"[('f', 'a.onnx'), ('g', 'b.onnx')]"`` (what ``instances.csv``
holds and ``run_instance.sh`` receives). Light: read by the config loader before torch is imported."""

from __future__ import annotations

import ast
from collections.abc import Callable

from ..errors import UserError

__all__ = ["is_network_list", "label", "map_paths", "parse_networks"]


def is_network_list(arg: str) -> bool:
    return str(arg).strip().startswith("[")


def parse_networks(arg: str) -> list[tuple[str | None, str]]:
    """``[(name, path), ...]`` of a network list, or ``[(None, arg)]`` for one path."""
    text = str(arg).strip()
    if not is_network_list(text):
        return [(None, text)]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(v, tuple) and len(v) == 2 and all(isinstance(s, str) for s in v) for v in value)
    )
    if not ok:
        raise UserError(f"network list {text!r}: expected [('name', 'file.onnx'), ...]")
    return list(value)


def map_paths(arg: str, fn: Callable[[str], str]) -> str:
    """``arg`` with ``fn`` applied to its path, or to every path of its list."""
    entries = parse_networks(arg)
    if entries[0][0] is None:
        return fn(entries[0][1])
    return repr([(name, fn(path)) for name, path in entries])


def label(arg: str) -> str:
    """A short name for messages: the file name, or the networks' file names joined by ``+``."""
    return "+".join(path.replace("\\", "/").rsplit("/", 1)[-1] for _, path in parse_networks(arg))
