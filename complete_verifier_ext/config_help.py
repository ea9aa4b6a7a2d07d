"""What the config schema says about itself: every key with its default and its doc (``abcrown
--help``, the plugin's help, the README's key table) and a config as a plain nested dict."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .config import Config
from .config_load import yaml_key


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict (YAML names, e.g. ``solver.alpha-crown``) of a config or of one of its sections.

    ``config_from_dict(config_to_dict(cfg))[0] == cfg`` holds for any config.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = config_to_dict(value)
        elif isinstance(value, list):
            value = list(value)
        out[yaml_key(f)] = value
    return out


def attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a dataclass's docstring (continuation lines
    joined), the one place each key is documented."""
    docs: dict[str, str] = {}
    lines = (
        (cls.__doc__ or "").split("Attributes:", 1)[-1].splitlines()
        if "Attributes:" in (cls.__doc__ or "")
        else []
    )
    name = None
    for line in lines:
        m = re.match(r"^ {8}([A-Za-z_][\w-]*): (.*)$", line)
        if m:
            name = m.group(1)
            docs[name] = m.group(2).strip()
        elif name and line.startswith(" " * 12):
            docs[name] += " " + line.strip()
        elif line.strip():
            name = None
    return docs


def key_table(cfg: Any = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(dotted key, default, doc)`` for every key of the config, in schema order: what ``--help``
    prints and what the README's key table is generated from."""
    cfg = Config() if cfg is None else cfg
    docs = attribute_docs(type(cfg))
    rows: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + yaml_key(f)
        if dataclasses.is_dataclass(value):
            rows += key_table(value, key + ".")
        else:
            rows.append((key, value, docs.get(f.name, docs.get(yaml_key(f), ""))))
    return rows
