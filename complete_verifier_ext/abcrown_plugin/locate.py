"""Find the user's α,β-CROWN, make it importable in this process, and refuse versions we do not patch.

A checkout is a folder holding ``complete_verifier/abcrown.py`` (α,β-CROWN's layout); its auto_LiRPA is
``complete_verifier/auto_LiRPA`` (the upstream symlink), else ``auto_LiRPA/auto_LiRPA`` of the checkout
(a copy where the symlink became a file), else an installed ``auto_LiRPA``. The ONNX loader needs the
onnx2pytorch fork α,β-CROWN uses: an installed one, else ``$ONNX2PYTORCH_PATH``, else an
``onnx2pytorch`` folder beside the checkout.

α,β-CROWN imports ``torchvision`` when it loads (for its built-in datasets only). Where torchvision
cannot be imported, :func:`activate` puts a stand-in into ``sys.modules`` of *this process*, whose every
attribute raises a :class:`PluginError` saying so: ONNX + VNN-LIB runs never touch it. Nothing is
installed or written anywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

ABCROWN_VERSION = "0.7.0"  # complete_verifier/__init__.py of α,β-CROWN 8250d5f (Dec 2025 release)
AUTO_LIRPA_VERSION = "0.7.0"  # its pinned auto_LiRPA 9d100ec
ENV = "ABCROWN_PATH"


class PluginError(UserError):
    """α,β-CROWN cannot be found, imported or patched: one line, ``error``, exit 1."""


@dataclass(frozen=True)
class Checkout:
    root: Path  # the checkout (holds complete_verifier/)
    complete_verifier: Path
    auto_lirpa: Path | None  # the folder to put on sys.path so that ``import auto_LiRPA`` finds it
    onnx2pytorch: Path | None  # likewise, None when onnx2pytorch is installed


def find(path: str | None = None) -> Checkout:
    """The checkout named by ``path``, else ``$ABCROWN_PATH``, else an importable ``abcrown`` package."""
    path = path or os.environ.get(ENV)
    if not path:
        spec = importlib.util.find_spec("complete_verifier")
        if spec is None or spec.origin is None:
            raise PluginError(
                f"general.engine abcrown: set {ENV} to an alpha-beta-CROWN checkout "
                "(a folder holding complete_verifier/abcrown.py)"
            )
        path = str(Path(spec.origin).parent.parent)
    root = Path(path).expanduser().resolve()
    cv = root / "complete_verifier"
    if not (cv / "abcrown.py").is_file():
        if (root / "abcrown.py").is_file():  # ABCROWN_PATH names complete_verifier itself
            root, cv = root.parent, root
        else:
            raise PluginError(
                f"{ENV}={path}: no complete_verifier/abcrown.py there (not an alpha-beta-CROWN checkout)"
            )
    auto_lirpa = None
    if not (cv / "auto_LiRPA" / "__init__.py").is_file():
        if (root / "auto_LiRPA" / "auto_LiRPA" / "__init__.py").is_file():
            auto_lirpa = root / "auto_LiRPA"
        elif importlib.util.find_spec("auto_LiRPA") is None:
            raise PluginError(f"{ENV}={path}: no auto_LiRPA in the checkout and none installed")
    o2p = None
    if importlib.util.find_spec("onnx2pytorch") is None:
        for cand in (os.environ.get("ONNX2PYTORCH_PATH"), root.parent / "onnx2pytorch"):
            if cand and (Path(cand) / "onnx2pytorch" / "__init__.py").is_file():
                o2p = Path(cand).resolve()
                break
        else:
            raise PluginError(
                "general.engine abcrown: onnx2pytorch (the fork alpha-beta-CROWN uses) is not importable; "
                "install it or set ONNX2PYTORCH_PATH to its checkout"
            )
    return Checkout(root, cv, auto_lirpa, o2p)


def _version_of(init_py: Path) -> str | None:
    m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", init_py.read_text(), re.M)
    return m.group(1) if m else None


def _stand_in(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that ``import torchvision.datasets`` works

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise PluginError(
            f"{name}.{attr}: torchvision cannot be imported here, and alpha-beta-CROWN needs it for its "
            "built-in datasets; use an ONNX model with a VNN-LIB spec"
        )

    mod.__getattr__ = missing  # type: ignore[method-assign]
    return mod


def _torchvision_or_stand_in() -> bool:
    """True when the real torchvision imports; else the stand-in is installed in ``sys.modules``."""
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # ImportError, or a CUDA build's RuntimeError beside a CPU torch
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
    names = ("torchvision", "torchvision.datasets", "torchvision.transforms")
    mods = {n: _stand_in(n) for n in names}
    mods["torchvision"].datasets = mods["torchvision.datasets"]  # type: ignore[attr-defined]
    mods["torchvision"].transforms = mods["torchvision.transforms"]  # type: ignore[attr-defined]
    sys.modules.update(mods)
    return False


_ACTIVE: Checkout | None = None  # the checkout loaded in this process (process-wide: see __init__)


def activate(checkout: Checkout) -> None:
    """Make α,β-CROWN's modules importable here (they are top-level names: ``arguments``, ``bab``, …) and
    check the versions. Idempotent; one checkout per process."""
    global _ACTIVE
    if _ACTIVE is not None:  # the same checkout found again (its helpers may be importable by now)
        if _ACTIVE.complete_verifier.resolve() != checkout.complete_verifier.resolve():
            raise PluginError(f"another alpha-beta-CROWN ({_ACTIVE.root}) is already loaded in this process")
        return
    version = _version_of(checkout.complete_verifier / "__init__.py")
    if version != ABCROWN_VERSION:
        raise PluginError(
            f"{checkout.root}: alpha-beta-CROWN {version} is not supported "
            f"(this plugin patches {ABCROWN_VERSION}, the Dec 2025 release 8250d5f)"
        )
    for extra in (checkout.onnx2pytorch, checkout.auto_lirpa, checkout.complete_verifier):
        if extra is not None and str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
    _torchvision_or_stand_in()
    import auto_LiRPA

    if getattr(auto_LiRPA, "__version__", None) != AUTO_LIRPA_VERSION:
        raise PluginError(
            f"{auto_LiRPA.__file__}: auto_LiRPA {getattr(auto_LiRPA, '__version__', '?')} is not supported "
            f"(this plugin patches {AUTO_LIRPA_VERSION})"
        )
    _ACTIVE = checkout
