"""The VNN-COMP route through the plugin: ``run_instance.sh`` with ``ABCROWN_PATH`` set (or
``CVE_ENGINE=abcrown``, or a category config saying ``engine: abcrown``) runs α,β-CROWN's own config
for the category, the way α,β-CROWN's ``vnncomp_main.py`` picks it, on ``engine: abcrown``.

    python -m complete_verifier_ext.abcrown_plugin.vnncomp CATEGORY ONNX VNNLIB RESULTS TIMEOUT \
        [--ours configs/CATEGORY.yaml] [extra abcrown flags...]

The sharding comes from the ``parallel`` section of our category config (``--ours``), if it has
``mode`` and ``world_size``; extra flags (``ABCROWN_EXTRA_ARGS``) come last and win. Without CUDA,
``--device cpu`` is added (α,β-CROWN's default device is ``cuda``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from .. import clock
from ..errors import end_cleanly_on_signals

USAGE = "vnncomp CATEGORY ONNX VNNLIB RESULTS TIMEOUT [--ours CONFIG] [abcrown flags...]"

# The fallback table: categories vnncomp_main.py does not name, live or commented out (the 2026 VNN-LIB
# 2.0 ACAS Xu categories) -> config under complete_verifier/exp_configs; a callable picks by the ONNX
# argument (a path or a network list).
CONFIGS = MappingProxyType(
    {
        "acas_xu_vnnlib2": "vnncomp21/acasxu.yaml",
        "isomorphic_acasxu": "vnncomp21/acasxu.yaml",
        "monotonic_acasxu": "vnncomp21/acasxu.yaml",
    }
)
ALIASES = MappingProxyType({"mnistfc": "mnist_fc", "collins-rul-cnn": "collins_rul_cnn"})

# vnncomp_main.py's choices, live or commented out (its record of earlier years'): a header naming the
# category (``== "X"``, ``in ["a", "b"]``, ``.startswith("x")``), then ``cmd += "exp_configs/REL"``, or a
# chain of ``if 'S' in args.ONNX_FILE [or ...]:`` / ``elif`` / ``else:`` each with its own ``cmd +=``
_HEADER = re.compile(r"^(?:el)?if\s+args\.CATEGORY\s*(==\s*\S|in\s*\[|\.startswith\()(.*?):\s*(#.*)?$")
_NAMES = re.compile(r"""["']([^"']+)["']""")
_BRANCH = re.compile(r"^(if|elif)\s+(.*?)\s*:\s*(#.*)?$")
_CMD = re.compile(r"""^cmd\s*\+=\s*["'][^"']*?exp_configs/([^"']+)["']""")


@dataclass
class _Choice:
    """One category's choice in vnncomp_main.py: its names (or a name prefix), whether it is commented
    out, and its configs: ``(substrings of the ONNX path or None for the default, config)``."""

    names: list[str]
    prefix: bool
    commented: bool
    branches: list[tuple[list[str] | None, str]] = field(default_factory=list)

    def config(self, onnx: str) -> str | None:
        for needles, rel in self.branches:
            if needles is None or any(n in onnx for n in needles):
                return rel
        return None


def _parse_main(text: str, exists) -> list[_Choice]:
    """Every category choice of vnncomp_main.py's ``text``, in file order, keeping only configs for
    which ``exists(rel)``."""
    out: list[_Choice] = []
    needles: list[str] | None = None
    for raw in text.splitlines():
        commented = raw.lstrip().startswith("#")
        line = raw.strip().lstrip("#").strip()
        header = _HEADER.match(line)
        if header:
            kind, rest = header.group(1), header.group(1)[-1] + header.group(2)
            out.append(_Choice(_NAMES.findall(rest), kind.startswith(".startswith"), commented))
            needles = None
            continue
        if not out or out[-1].commented != commented:
            continue
        branch = _BRANCH.match(line)
        if branch and "ONNX_FILE" in branch.group(2):
            needles = _NAMES.findall(branch.group(2))
        elif line.startswith("else:"):
            needles = None
        elif (cmd := _CMD.match(line)) and exists(cmd.group(1)):
            out[-1].branches.append((needles, cmd.group(1)))
    return [c for c in out if c.names and c.branches]


def _main_choices(complete_verifier: Path) -> list[_Choice]:
    main = complete_verifier / "vnncomp_main.py"
    if not main.is_file():
        return []
    return _parse_main(
        main.read_text(errors="replace"), lambda rel: (complete_verifier / "exp_configs" / rel).is_file()
    )


def checkout_choices(complete_verifier: Path, commented: bool = False) -> dict:
    """Category -> config (relative to exp_configs; a callable of the ONNX path where vnncomp_main.py
    picks by it) as the checkout's own ``vnncomp_main.py`` maps them, so that a newer α,β-CROWN brings
    its own categories; with ``commented``, the choices it keeps commented out (earlier years'; where a
    name repeats, the latest, which comes last), whose config the checkout still has. Empty when the
    file is not there."""
    out: dict = {}
    for c in _main_choices(complete_verifier):
        if c.commented == commented and not c.prefix:
            value = c.branches[0][1] if c.branches[0][0] is None else c.config
            out.update((name, value) for name in c.names)
    return out


def _prefix_choices(complete_verifier: Path) -> dict[str, str]:
    return {c.names[0]: c.branches[0][1] for c in _main_choices(complete_verifier) if c.prefix}


_YEAR = re.compile(r"_20\d\d$")
# vnncomp_main.py's own special cases: VNN-COMP's test instances, whatever the category
TEST_SPECS = frozenset(f"test_{size}.vnnlib" for size in ("nano", "tiny", "small"))


def _norm(name: str, year: bool = False) -> str:
    """A category or config name compared loosely: lower case, ``-`` as ``_``, no year suffix (unless
    ``year``)."""
    loose = name.lower().replace("-", "_")
    return loose if year else _YEAR.sub("", loose)


def _config_files(complete_verifier: Path, year: bool = False) -> dict[str, str]:
    """Every config under ``exp_configs/vnncomp2*/`` by its loose name (:func:`_norm` of the file's
    stem; the latest year's where several share one): ``lsnc`` -> ``vnncomp24/lsnc.yaml``."""
    found: dict[str, str] = {}
    root = complete_verifier / "exp_configs"
    for path in sorted(root.glob("vnncomp2*/*.yaml")):  # years in order: the latest wins
        found[_norm(path.stem, year)] = str(path.relative_to(root))
    return found


def _pick(table: dict, name: str, onnx: str) -> str | None:
    choice = table.get(name)
    return choice(onnx) if callable(choice) else choice


def config_choice(complete_verifier: Path, category: str, onnx: str, vnnlib: str) -> str | None:
    """The config (relative to exp_configs) for ``category``: VNN-COMP's test specs first, as
    vnncomp_main.py does; then the name exactly as the checkout's ``vnncomp_main.py`` maps it (live,
    then commented out), the fallback table (2021/2022 names, and picks by the ONNX file); then the
    config file of that name under ``exp_configs/vnncomp2*/``; then all of these with a year suffix
    (``_2023``) dropped or added as either side spells it, and the prefix choices (``safenlp*``)."""
    if Path(vnnlib).name in TEST_SPECS:
        return "vnncomp21/test.yaml"
    if "test_prop" in vnnlib:
        return "vnncomp21/acasxu.yaml"
    name = ALIASES.get(category, category)
    tables = (checkout_choices(complete_verifier), checkout_choices(complete_verifier, True), CONFIGS)
    for table in tables:
        found = _pick(table, name, onnx)
        if found:
            return found
    exact = _config_files(complete_verifier, year=True).get(_norm(name, year=True))
    if exact:
        return exact
    for table in tables:
        for key in table:
            if _norm(ALIASES.get(key, key)) == _norm(name):
                return _pick(table, key, onnx)
    for prefix, rel in _prefix_choices(complete_verifier).items():
        if name.startswith(prefix):
            return rel
    return _config_files(complete_verifier).get(_norm(name))


def known_categories(complete_verifier: Path) -> list[str]:
    """Every category name :func:`config_choice` knows by name."""
    names = {*checkout_choices(complete_verifier), *checkout_choices(complete_verifier, True), *CONFIGS}
    return sorted(names | set(_config_files(complete_verifier)))


def abcrown_config(checkout_root: Path, category: str, onnx: str, vnnlib: str = "") -> Path:
    import difflib

    from .locate import PluginError

    cv = checkout_root / "complete_verifier"
    rel = config_choice(cv, category, onnx, vnnlib)
    if rel is None:
        known = known_categories(cv)
        near = difflib.get_close_matches(category, known, n=4, cutoff=0.5) or known[:6]
        raise PluginError(
            f"no alpha-beta-CROWN config known for category {category!r} (nearest known: {', '.join(near)}; "
            f"{len(known)} known in {cv / 'vnncomp_main.py'} and {cv / 'exp_configs'})"
        )
    path = cv / "exp_configs" / rel
    if not path.is_file():
        raise PluginError(f"{path}: not found in the alpha-beta-CROWN checkout")
    return path


def _parallel_of(ours: str | None) -> list[str]:
    """Every key of the ``parallel`` section of our category config ``ours``, checked by the one schema
    (:func:`~complete_verifier_ext.config_load.load_parallel`), as ``--parallel.KEY VALUE``."""
    if not ours or not Path(ours).is_file():
        return []
    import yaml

    from ..config_load import load_parallel

    section = (yaml.safe_load(Path(ours).read_text()) or {}).get("parallel") or {}
    par = load_parallel([(section, ours)])
    return [item for key in section for item in (f"--parallel.{key}", str(getattr(par, key)).lower())]


def plain(path: str) -> str:
    """``path`` itself, or for a gzipped file (``.onnx.gz``, ``.vnnlib.gz``, as VNN-COMP's repositories
    hold them) its content decompressed once into the cache folder (named by content): α,β-CROWN's
    customized loaders (gtrsb's, cctsdb's) read plain files only, as the competition hands them."""
    import gzip
    import hashlib
    import os

    from ..spec import cache_root

    if not path.endswith(".gz") or not os.path.isfile(path):
        return path
    data = Path(path).read_bytes()
    try:
        data = gzip.decompress(data)
    except (OSError, EOFError):
        return path  # not gzip after all: α,β-CROWN's loaders say what is wrong with it
    name = Path(path).name.removesuffix(".gz")
    out = cache_root() / "plain" / hashlib.sha256(data).hexdigest()[:32] / name
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)
    return str(out)


def command(category: str, onnx: str, vnnlib: str, results: str, timeout: str, ours: str | None) -> list[str]:
    """The ``abcrown`` arguments for one instance (gzipped files decompressed: :func:`plain`)."""
    from . import locate

    args = [
        "--config",
        str(abcrown_config(locate.find().complete_verifier.parent, category, onnx, vnnlib)),
        "--general.engine",
        "abcrown",
        "--onnx_path",
        plain(onnx),
        "--vnnlib_path",
        plain(vnnlib),
        "--results_file",
        results,
        "--timeout",
        timeout,
    ]
    import torch

    if not torch.cuda.is_available():
        args += ["--device", "cpu"]
    return args + _parallel_of(ours)


def main(argv: list[str]) -> int:
    import argparse

    from ..errors import UserError
    from ..results import report_error
    from .parent import main as run

    ours = None
    if "--ours" in argv:
        i = argv.index("--ours")
        ours, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    if len(argv) < 5:
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    category, onnx, vnnlib, results, timeout, *extra = argv
    try:
        args = command(category, onnx, vnnlib, results, timeout, ours)
    except UserError as e:
        return report_error(results, True, str(e))
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--summary")
    p.add_argument("--quiet", action="store_true")
    opts, rest = p.parse_known_args(extra)
    return run(args[1], [*args[2:], *rest], opts.summary, True, clock.started_wall())


if __name__ == "__main__":
    end_cleanly_on_signals()
    sys.exit(main(sys.argv[1:]))
