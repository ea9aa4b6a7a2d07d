"""Setting α,β-CROWN's and auto_LiRPA's attributes, and putting them back.

* :class:`Patcher` sets attributes and remembers the originals; ``undo`` puts them back. Every patch
  sets a class or module attribute (never a subclass: upstream checks ``type(x) == BoundLinear``).
* :func:`check_signature`: the parameter names of an upstream callable are the ones its row in
  :mod:`.table` was written against; every row is checked before anything is set, so that an unknown
  upstream is refused with one line instead of being half-patched.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .locate import PluginError


def resolve(dotted: str) -> tuple[Any, str]:
    """``"mod.Class.attr"`` -> (owner object, attribute name); the module part is imported."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for p in parts[cut:-1]:
            owner = getattr(owner, p)
        return owner, parts[-1]
    raise PluginError(f"cannot import {dotted}")


def check_signature(dotted: str, params: tuple[str, ...]) -> None:
    """PluginError unless ``dotted`` exists and takes exactly the parameters ``params``."""
    owner, name = resolve(dotted)
    fn = inspect.getattr_static(owner, name, None)
    if fn is None:
        raise PluginError(f"{dotted} does not exist in this alpha-beta-CROWN: not the supported release")
    got = tuple(inspect.signature(fn).parameters)
    if got != params:
        raise PluginError(f"{dotted}{got} differs from the supported release's {params}: refusing to patch")


_INHERITED = object()  # Patcher: the owner did not hold the attribute itself


@dataclass
class Patcher:
    """Sets attributes and remembers the originals, so that :meth:`undo` restores them all: an
    attribute that the owner only inherited (a class whose base defines the method) is deleted again,
    not left behind as a copy."""

    saved: list[tuple[Any, str, Any]] = field(default_factory=list)

    def wrap(self, dotted: str, make: Callable[[Any], Any]) -> None:
        """Set ``dotted`` to ``make(its current value)``; a module-level name the module does not define
        (a builtin it uses, such as ``set``) is made from the builtin and deleted again on undo."""
        owner, name = resolve(dotted)
        if isinstance(owner, types.ModuleType) and name not in vars(owner) and hasattr(builtins, name):
            self.set(owner, name, make(getattr(builtins, name)))
            return
        self.set(owner, name, make(inspect.getattr_static(owner, name)))

    def set(self, owner: Any, name: str, value: Any) -> None:
        own = vars(owner).get(name, _INHERITED) if hasattr(owner, "__dict__") else getattr(owner, name)
        self.saved.append((owner, name, own))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self.saved:
            owner, name, value = self.saved.pop()
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
