"""Loading a :class:`~complete_verifier_ext.config.Config` from YAML files and command-line overrides.

The schema (sections, types, defaults, choices, the alpha-beta-CROWN keys we accept and ignore) lives in
:mod:`complete_verifier_ext.config`; this module is the generic loader that walks it.

Rules applied when loading:

* A key we do not know raises :class:`ConfigError` naming the file, the dotted key and the closest valid
  key. A key that alpha-beta-CROWN knows but we do not implement (``general.conv_mode``, ``solver.mip.*``,
  ``data.*``, ...) is accepted and reported in ONE warning string returned next to the config.
* Values are coerced to the field's type (``"20"`` -> 20, ``yes`` -> True, 1 -> 1.0, ``null`` -> None
  for optional fields) and enumerations are checked; a mismatch raises :class:`ConfigError`.
* alpha-beta-CROWN enum values that we do not implement (``attack.pgd_order: middle``,
  ``bab.branching.method: kfsb-intercept-only``, ...) are replaced by the closest value we implement;
  the replacement is reported in the same single warning.
* Relative paths (``general.root_path``, ``model.onnx_path``, ``model.path``,
  ``specification.vnnlib_path``) are made absolute: a path written in the YAML file is taken relative to
  the YAML file's directory if it exists there, else relative to the current working directory; a path
  given on the command line is taken relative to the current working directory (see :func:`resolve_path`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from types import MappingProxyType
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from .config import (
    ALIASES,
    DECLARED_NOT_IMPLEMENTED,
    IGNORED_KEYS,
    IGNORED_SECTIONS,
    PATH_KEYS,
    Config,
    ConfigError,
    ParallelConfig,
)
from .spec.networks import map_paths

__all__ = [
    "COMMAND_LINE",
    "config_from_dict",
    "flag_value",
    "load_config",
    "load_parallel",
    "parse_overrides",
    "resolve_path",
]

COMMAND_LINE = "command line"
"""The source name used in messages for values given as ``--section.key value`` overrides."""

_NULL_WORDS = frozenset({"null", "none", "~"})

KeyPath = tuple[str, ...]
Flat = dict[KeyPath, tuple[Any, str]]  # dotted path -> (raw value, source it came from)


# ----------------------------------------------------------------------------------------------------
# Schema introspection
# ----------------------------------------------------------------------------------------------------


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML name of a dataclass field."""
    return f.metadata.get("key") or f.name


@cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a config dataclass."""
    return get_type_hints(cls)


@cache
def _children(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """YAML name -> (field, resolved type) for the fields of ``cls``."""
    hints = _hints(cls)
    return {yaml_key(f): (f, hints[f.name]) for f in dataclasses.fields(cls)}


def _lookup(path: KeyPath) -> tuple[dataclasses.Field, Any] | None:
    """The field and type at a YAML path of :class:`Config` (section or leaf), or None."""
    cls: Any = Config
    found = None
    for key in path:
        if not (dataclasses.is_dataclass(cls) and key in _children(cls)):
            return None
        found = _children(cls)[key]
        cls = found[1]
    return found


@cache
def _valid_keys() -> tuple[str, ...]:
    """Every dotted key we accept (sections and leaves, implemented or ignored), for suggestions."""
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for key, (_, tp) in _children(cls).items():
            keys.append(prefix + key)
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + key + ".")

    walk(Config, "")
    return tuple(keys) + tuple(sorted(IGNORED_KEYS | IGNORED_SECTIONS)) + tuple(ALIASES)


def _is_ignored(dotted: str) -> bool:
    """True for a key alpha-beta-CROWN knows and we accept without implementing it."""
    if dotted in IGNORED_KEYS:
        return True
    return any(dotted == s or dotted.startswith(s + ".") for s in IGNORED_SECTIONS)


def _unknown_key(source: str, dotted: str) -> ConfigError:
    """ConfigError for an unknown key, with the closest valid key when one is close enough."""
    match = difflib.get_close_matches(dotted, _valid_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{match[0]}'?)" if match else ""
    return ConfigError(f"{source}: unknown key '{dotted}'{hint}")


# ----------------------------------------------------------------------------------------------------
# Flattening nested mappings into validated dotted paths
# ----------------------------------------------------------------------------------------------------


def _leaf_keys(value: Any, dotted: str) -> list[str]:
    """The dotted leaf keys of an ignored value (a mapping is listed key by key)."""
    if isinstance(value, Mapping) and value:
        return [k for sub, v in value.items() for k in _leaf_keys(v, f"{dotted}.{sub}")]
    return [dotted]


def _flatten(data: Any, source: str, prefix: KeyPath = ()) -> tuple[Flat, list[str]]:
    """Check the keys of a nested mapping and flatten it.

    Returns:
        ``{path: (value, source)}`` for the keys we implement (aliases already renamed), and the dotted
        keys that are known to alpha-beta-CROWN but ignored here.

    Raises:
        ConfigError: for an unknown key or a section that is not a mapping.
    """
    if data is None:
        return {}, []
    if not isinstance(data, Mapping):
        where = f"section '{'.'.join(prefix)}'" if prefix else "the top level"
        raise ConfigError(f"{source}: {where} must be a mapping of keys to values, got {data!r}")
    flat: Flat = {}
    ignored: list[str] = []
    for raw_key, value in data.items():
        path = (*prefix, str(raw_key))
        dotted = ".".join(path)
        if dotted in ALIASES:
            path = tuple(ALIASES[dotted].split("."))
        found = _lookup(path)
        if found is not None and dataclasses.is_dataclass(found[1]):
            sub_flat, sub_ignored = _flatten(value, source, path)
            flat.update(sub_flat)
            ignored.extend(sub_ignored)
        elif found is not None:
            flat[path] = (value, source)
        elif _is_ignored(dotted):
            ignored.extend(_leaf_keys(value, dotted))
        else:
            raise _unknown_key(source, dotted)
    return flat, ignored


# ----------------------------------------------------------------------------------------------------
# Value coercion
# ----------------------------------------------------------------------------------------------------

_TRUE_WORDS = frozenset({"true", "yes", "y", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "n", "off", "0"})


def _to_bool(value: Any) -> bool:
    """bool from a bool, 0/1 or a yes/no word."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise TypeError


def _to_int(value: Any) -> int:
    """int from an int, an integral float or a numeric string (``"20"``, ``"1e5"``)."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = _to_float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError


def _to_float(value: Any) -> float:
    """float from an int, a float or a numeric string (``"1e-3"``, ``"inf"``, ``".inf"``)."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            parsed = _yaml_scalar(text)
            if isinstance(parsed, float):
                return parsed
    raise TypeError


def _to_str(value: Any) -> str:
    """str from a str or an int (an unquoted number such as a file name ``2024``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise TypeError


def _yaml_scalar(text: str) -> Any:
    """``text`` parsed by YAML rules; the text itself if it is not valid YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


_SCALARS: Mapping[Any, Callable[[Any], Any]] = MappingProxyType(
    {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
)
_UNION_ORDER = (bool, int, float, list, str)  # try the most specific type first


def _union_members(tp: Any) -> tuple[Any, ...]:
    """Members of ``X | Y`` (or ``Union[X, Y]``); ``(tp,)`` for a plain type."""
    if get_origin(tp) in (Union, types.UnionType):
        return get_args(tp)
    return (tp,)


def _is_optional(tp: Any) -> bool:
    """True for ``X | None``."""
    return type(None) in _union_members(tp)


_TYPE_NAMES = MappingProxyType({bool: "a boolean", int: "an integer", float: "a number", str: "a string"})
_PLURAL_TYPE_NAMES = MappingProxyType({bool: "booleans", int: "integers", float: "numbers", str: "strings"})


def _describe(tp: Any) -> str:
    """Human-readable type name for error messages (``an integer``, ``a list of integers or null``)."""
    names = []
    for member in _union_members(tp):
        if member is type(None):
            names.append("null")
        elif get_origin(member) is list:
            names.append(f"a list of {_PLURAL_TYPE_NAMES[get_args(member)[0]]}")
        else:
            names.append(_TYPE_NAMES[member])
    return " or ".join(names)


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to type ``tp``; raises TypeError when it cannot be."""
    members = _union_members(tp)
    if type(None) in members and (value is None or (isinstance(value, str) and value.lower() in _NULL_WORDS)):
        return None
    order = sorted(
        (m for m in members if m is not type(None)), key=lambda m: _UNION_ORDER.index(get_origin(m) or m)
    )
    for member in order:
        try:
            return _coerce_one(value, member)
        except (TypeError, ValueError):
            continue
    raise TypeError


def _coerce_one(value: Any, tp: Any) -> Any:
    """``value`` converted to one non-union type (a scalar or ``list[X]``)."""
    if get_origin(tp) is list:
        if isinstance(value, str) and value.strip().startswith("["):
            value = _yaml_scalar(value)
        if not isinstance(value, list | tuple):
            raise TypeError
        (item_tp,) = get_args(tp)
        return [_coerce(item, item_tp) for item in value]
    return _SCALARS[tp](value)


def _check_leaf(f: dataclasses.Field, tp: Any, value: Any, source: str, dotted: str, notes: list[str]) -> Any:
    """Coerce and validate one leaf value.

    Args:
        f: the dataclass field (its metadata holds choices, legacy values, checks).
        tp: the field's resolved type.
        value: the raw value from YAML or the command line.
        source: where the value came from (file path or ``command line``), for messages.
        dotted: the dotted YAML key, for messages.
        notes: receives a note when an alpha-beta-CROWN value is replaced by one of ours.
    """
    where = f"{source}: key '{dotted}'"
    try:
        result = _coerce(value, tp)
    except TypeError:
        raise ConfigError(f"{where} expects {_describe(tp)}, got {value!r}") from None
    meta = f.metadata
    if isinstance(result, str) and result in meta["legacy"]:
        notes.append(f"{dotted} '{result}' -> '{meta['legacy'][result]}'")
        result = meta["legacy"][result]
    if meta["choices"] and result is not None and result not in meta["choices"]:
        raise ConfigError(f"{where} must be one of {'|'.join(meta['choices'])}, got {result!r}")
    if meta["check"] is not None and result is not None and not meta["check"](result):
        raise ConfigError(f"{where} must be {meta['expected']}, got {result!r}")
    if meta["minimum"] is not None and isinstance(result, int | float) and result < meta["minimum"]:
        raise ConfigError(f"{where} must be >= {meta['minimum']}, got {result!r}")
    return result


# ----------------------------------------------------------------------------------------------------
# Building, validating, resolving
# ----------------------------------------------------------------------------------------------------


def _build(cls: type, flat: Flat, notes: list[str], prefix: KeyPath = ()) -> Any:
    """An instance of the section ``cls`` at ``prefix`` with the values of ``flat`` (defaults elsewhere)."""
    kwargs = {}
    for key, (f, tp) in _children(cls).items():
        path = (*prefix, key)
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, flat, notes, path)
        elif path in flat:
            value, source = flat[path]
            kwargs[f.name] = _check_leaf(f, tp, value, source, ".".join(path), notes)
    return cls(**kwargs)


def _source_of(flat: Flat, *dotted: str) -> str:
    """The source that set the first of the given keys, for cross-key messages."""
    for key in dotted:
        path = tuple(key.split("."))
        if path in flat:
            return flat[path][1]
    return "config"


def load_parallel(sources: Sequence[tuple[Any, str]]) -> ParallelConfig:
    """The ``parallel`` section alone, checked as in a whole config: ``sources`` are ``(section
    mapping, where it came from)`` pairs, later ones winning (the α,β-CROWN plugin's YAML, then its
    command line). Both engines share this one schema."""
    flat: Flat = {}
    for data, source in sources:
        flat.update(_flatten({"parallel": data}, source)[0])
    par = _default_mode(_build(ParallelConfig, flat, [], ("parallel",)), flat)
    _validate_parallel(par, flat)
    return par


def parallel_flags(par: ParallelConfig) -> list[str]:
    """``par`` as the ``--parallel.KEY VALUE`` overrides that give it (the keys not at their default), for a
    front door that hands a command line on to either engine."""
    default, out = ParallelConfig(), []
    for f in dataclasses.fields(ParallelConfig):
        value = getattr(par, f.name)
        if value != getattr(default, f.name):
            out += [f"--parallel.{f.name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def _default_mode(par: ParallelConfig, flat: Flat) -> ParallelConfig:
    """``parallel.world_size`` above 1 with no ``parallel.mode`` given means ``fsdp`` (the bounds of one
    process, bit for bit in CROWN); an explicit ``none`` stays an error."""
    if ("parallel", "mode") not in flat and par.world_size > 1 and par.mode == "none":
        return dataclasses.replace(par, mode="fsdp")
    return par


def _validate_parallel(par: ParallelConfig, flat: Flat) -> None:
    """The checks of the ``parallel`` section that involve more than one of its keys."""
    if par.mode == "none" and par.world_size > 1:
        source = _source_of(flat, "parallel.world_size", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'parallel.world_size' is {par.world_size} but 'parallel.mode' is 'none'; "
            "set parallel.mode to 'fsdp' or 'tp' to shard over several processes, or world_size to 1"
        )
    if par.mode == "tp" and par.bab_weights == "replicated":
        source = _source_of(flat, "parallel.bab_weights", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'parallel.bab_weights' is 'replicated' but 'parallel.mode' is 'tp', which never "
            "holds a full layer; use parallel.mode 'fsdp' or bab_weights 'sharded'"
        )


def _validate(cfg: Config, flat: Flat) -> None:
    """Checks that involve more than one key."""
    par = cfg.parallel
    _validate_parallel(par, flat)
    if par.mode == "tp" and cfg.general.complete_verifier in ("bab-refine", "mip"):
        source = _source_of(flat, "general.complete_verifier", "parallel.mode")
        raise ConfigError(
            f"{source}: key 'general.complete_verifier' is '{cfg.general.complete_verifier}', whose "
            "refinement needs whole weight matrices, but 'parallel.mode' is 'tp', which never holds a "
            "full layer; use parallel.mode 'fsdp' or complete_verifier 'bab'"
        )
    if par.backend == "nccl" and cfg.general.device == "cpu":
        source = _source_of(flat, "parallel.backend", "general.device")
        raise ConfigError(f"{source}: key 'parallel.backend' is 'nccl', which needs general.device 'cuda'")


def resolve_path(cfg_dir: str | None, p: str) -> str:
    """The absolute form of a path written in a config.

    An absolute path (after ``~`` expansion) is returned normalised. A relative one is taken relative to
    ``cfg_dir`` (the directory of the YAML file) if it exists there, else relative to the current working
    directory, whether it exists or not. ``cfg_dir=None`` means the current working directory.
    """
    p = os.path.expanduser(p)
    if os.path.isabs(p):
        return os.path.normpath(p)
    if cfg_dir is not None:
        candidate = os.path.join(cfg_dir, p)
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    return os.path.abspath(p)


def _resolve_paths(cfg: Config, flat: Flat, cfg_dir: str | None, file_source: str | None) -> Config:
    """Make the input paths of ``cfg`` absolute (see :func:`resolve_path`)."""
    for dotted in PATH_KEYS:
        section_name, key = dotted.split(".")
        section = getattr(cfg, section_name)
        value = getattr(section, key)
        if not value:
            continue
        from_file = flat.get((section_name, key), (None, None))[1] == file_source
        base = cfg_dir if from_file else None
        resolved = map_paths(value, lambda p, base=base: resolve_path(base, p))  # a path or a network list
        cfg = dataclasses.replace(cfg, **{section_name: dataclasses.replace(section, **{key: resolved})})
    return cfg


def _warning(source: str, ignored: Sequence[str], notes: Sequence[str]) -> list[str]:
    """The single warning about ignored keys and replaced values (empty list if there is nothing)."""
    parts = []
    unique = list(dict.fromkeys(ignored))
    if unique:
        listed = ", ".join(unique)
        parts.append(f"ignoring {len(unique)} alpha-beta-CROWN option(s) not implemented here: {listed}")
    if notes:
        parts.append(f"replaced unsupported alpha-beta-CROWN value(s): {', '.join(dict.fromkeys(notes))}")
    return [f"{source}: {'; '.join(parts)}"] if parts else []


# ----------------------------------------------------------------------------------------------------
# Overrides and the public API
# ----------------------------------------------------------------------------------------------------


def _split_argv(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """``[(dotted_key, raw_text_or_None_for_a_bare_flag)]`` from ``--key value`` / ``--key=value`` items."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        if not item.startswith("--") or len(item) == 2:
            raise ConfigError(f"{COMMAND_LINE}: expected '--section.key value', got {item!r}")
        key, eq, text = item[2:].partition("=")
        if eq:
            pairs.append((key, text))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 2
        else:
            pairs.append((key, None))  # a bare flag means true, as alpha-beta-CROWN's store_true options
            i += 1
    return pairs


def _parse_text(key: str, text: str | None) -> Any:
    """The value of one override: raw text for string options, YAML-parsed text otherwise."""
    if text is None:
        return True
    found = _lookup(tuple(key.split(".")))
    if found is not None and not dataclasses.is_dataclass(found[1]):
        members = set(_union_members(found[1])) - {type(None)}
        if members == {str}:
            return None if _is_optional(found[1]) and text.lower() in _NULL_WORDS else text
    return _yaml_scalar(text)


def _overrides_tree(argv: Sequence[str]) -> dict[str, Any]:
    """Nested mapping (YAML names) of raw override values; later occurrences of a key win."""
    tree: dict[str, Any] = {}
    for key, text in _split_argv(argv):
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"{COMMAND_LINE}: malformed key '--{key}'")
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _parse_text(key, text)
    return tree


def _nest(flat: Mapping[KeyPath, Any]) -> dict[str, Any]:
    """Nested dict from ``{path: value}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def parse_overrides(argv: Sequence[str]) -> dict:
    """Parse ``--section.key value`` (or ``--section.key=value``) command-line overrides.

    Values are parsed by YAML rules (``20`` -> int, ``yes`` -> True, ``null`` -> None, ``[1, 2]`` -> list)
    except for string options, which keep the raw text (``null``/``none`` still mean None where None is
    allowed), then type-checked and coerced like YAML values. A bare ``--section.key`` means true. A whole
    section may be given as YAML (``--parallel "{mode: fsdp, world_size: 2}"``). The CLI's own flags
    (``--config``, ``--quiet``) must be removed before calling this.

    Returns:
        Nested dict keyed by YAML names, e.g. ``{"solver": {"alpha-crown": {"iteration": 20}}}``; keys
        alpha-beta-CROWN knows but we ignore are kept with their YAML-parsed value.

    Raises:
        ConfigError: malformed item, unknown key (with a suggestion) or bad value.
    """
    tree = _overrides_tree(argv)
    flat, _ = _flatten(tree, COMMAND_LINE)
    checked = {}
    for path, (value, source) in flat.items():
        f, tp = _lookup(path)  # type: ignore[misc]  # _flatten only keeps known leaves
        checked[path] = _check_leaf(f, tp, value, source, ".".join(path), [])
    result = _nest(checked)
    for path, value in _ignored_values(tree).items():
        node = result
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return result


def _ignored_values(tree: Mapping[str, Any], prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    """``{path: value}`` for the ignored alpha-beta-CROWN keys of an (already validated) tree."""
    out: dict[KeyPath, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if _is_ignored(".".join(path)):
            out[path] = value
        elif isinstance(value, Mapping):
            out.update(_ignored_values(value, path))
    return out


def _assemble(data: Any, source: str, overrides: Sequence[str]) -> tuple[Config, Flat, list[str]]:
    """Config from parsed YAML ``data`` plus ``overrides``; also the flat values and the warnings."""
    flat, ignored = _flatten(data, source)
    over_flat, over_ignored = _flatten(_overrides_tree(overrides), COMMAND_LINE)
    flat.update(over_flat)
    notes: list[str] = []
    cfg = _build(Config, flat, notes)
    cfg = dataclasses.replace(cfg, parallel=_default_mode(cfg.parallel, flat))
    _validate(cfg, flat)
    if cfg.bab.branching.input_split.enable:  # there the method names the input-split heuristic
        notes = [_input_split_note(n) if n.startswith("bab.branching.method ") else n for n in notes]
    unread = [k for k in DECLARED_NOT_IMPLEMENTED if _value(cfg, k) != _value(Config(), k)]
    return cfg, flat, _warning(source, ignored + over_ignored + unread, notes)


def _input_split_note(note: str) -> str:
    """The note of a replaced ``bab.branching.method`` under input split, where it chose the input
    dimension to bisect in alpha-beta-CROWN: say what ours does instead."""
    original = note.split("'")[1]
    return (
        f"bab.branching.method '{original}' (the input-split heuristic) -> ours: bisect the dimension "
        "of largest width x |coefficient of the worst row's CROWN bound|"
    )


def _value(cfg: Any, dotted: str) -> Any:
    """The value of the dotted YAML key ``dotted`` in ``cfg``."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part.replace("-", "_"))
    return cfg


def config_from_dict(
    data: Mapping[str, Any] | None, source: str = "config", overrides: Sequence[str] = ()
) -> tuple[Config, list[str]]:
    """Build a :class:`Config` from a nested mapping laid out like the YAML file.

    Paths are left as given (no resolution). ``overrides`` are command-line items as in
    :func:`parse_overrides` and win over ``data``; ``source`` names ``data`` in messages.

    Returns:
        The config and a list of warnings (at most one: ignored keys and replaced values).
    """
    cfg, _, warnings = _assemble(data, source, overrides)
    return cfg, warnings


def _read_yaml(path: str) -> Any:
    """The parsed content of a YAML file; ConfigError if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {what}") from None


def load_config(path: str | None, overrides: Sequence[str] = ()) -> tuple[Config, list[str]]:
    """Load a YAML config file (or only defaults when ``path`` is None) and apply overrides.

    Relative input paths (``general.root_path``, ``model.onnx_path``, ``model.path``,
    ``specification.vnnlib_path``) become absolute: those written in the file are taken relative to the
    file's directory if they exist there, else relative to the current working directory; those given
    as overrides are taken relative to the current working directory. ``general.results_file`` is an
    output and is left as given.

    Args:
        path: YAML file in alpha-beta-CROWN layout, or None.
        overrides: command-line items such as ``["--solver.alpha-crown.iteration", "20"]``.

    Returns:
        The config and a list of warnings (at most one string, listing every alpha-beta-CROWN key that is
        accepted but not implemented and every replaced value).

    Raises:
        ConfigError: unreadable file, unknown key, bad value, inconsistent keys.
    """
    data = _read_yaml(path) if path is not None else None
    cfg, flat, warnings = _assemble(data, path if path is not None else COMMAND_LINE, overrides)
    cfg_dir = os.path.dirname(os.path.abspath(path)) if path is not None else None
    return _resolve_paths(cfg, flat, cfg_dir, path), warnings


def explicit_keys(path: str | None, overrides: Sequence[str] = ()) -> set[str]:
    """The dotted keys (YAML names) that the YAML file ``path`` or the command line ``overrides`` set."""
    data = _read_yaml(path) if path is not None else None
    flat, _ = _flatten(data, path if path is not None else COMMAND_LINE)
    flat.update(_flatten(_overrides_tree(overrides), COMMAND_LINE)[0])
    return {".".join(key) for key in flat}


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last of the flags ``names`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``),
    as argparse would take it: the one scanner of a command line before it is parsed (both engines)."""
    value = None
    for i, item in enumerate(argv):
        for name in names:
            if item == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif item.startswith(name + "="):
                value = item.split("=", 1)[1]
    return value
