"""``abcrown_plugin/table.py``: the patch table is every change the plugin makes, and undo restores all."""

from __future__ import annotations

import subprocess
import sys

from plugin_support import (
    VENDOR,
    needs_abcrown,
    plugin_env,
)

pytestmark = needs_abcrown


def test_the_patch_table_is_every_change_and_undo_restores_all(tmp_path):
    """Snapshot every attribute of every α,β-CROWN and auto_LiRPA module and of their classes (and the
    plugin's own modules) before installing, for one process, fsdp and tp: exactly the attributes of
    ``table.TABLE``'s rows that apply change (a patch left out of the table fails here), and after
    ``undo`` every attribute is the same object as before."""
    code = f"""
import sys, inspect
from pathlib import Path
from complete_verifier_ext.abcrown_plugin import locate, patches, runner, table
from complete_verifier_ext.config import ParallelConfig
checkout = locate.find({str(VENDOR)!r})
runner._import_abcrown(checkout)
import abcrown
roots = [str(checkout.root.resolve()), str(Path(patches.__file__).parent)]
def ours(mod):
    f = getattr(mod, "__file__", None) or ""
    return any(str(Path(f).resolve()).startswith(r) for r in roots)
def snapshot():
    out = {{}}
    for name, mod in list(sys.modules.items()):
        if mod is None or not ours(mod):
            continue
        for attr, value in list(vars(mod).items()):
            out[f"{{name}}.{{attr}}"] = value
            if inspect.isclass(value) and value.__module__ == name:
                for a, v in list(vars(value).items()):
                    out[f"{{name}}.{{attr}}.{{a}}"] = v
    return out
def canonical(target):  # the snapshot's key of a table target: the class by its defining module
    owner, name = patches.resolve(target)
    where = f"{{owner.__module__}}.{{owner.__qualname__}}" if inspect.isclass(owner) else owner.__name__
    return f"{{where}}.{{name}}"
before = snapshot()
counts = []
for mode, world in (("none", 1), ("fsdp", 2), ("tp", 2)):
    setup = table.Setup(ParallelConfig(mode=mode, world_size=world), world, patches.Probe(),
                        {str(tmp_path / "cache")!r}, 0.0)
    p = patches.Patcher()
    table.install(p, setup)
    during = snapshot()
    missing = object()  # a key on one side only: a method set on a class that inherited it
    changed = {{k for k in set(before) | set(during) if before.get(k, missing) is not during.get(k, missing)}}
    expected = {{canonical(t) for t in table.targets(setup)}}
    assert changed == expected, (sorted(changed - expected), sorted(expected - changed))
    p.undo()
    after = snapshot()
    left = [k for k in before if after.get(k) is not before[k]]
    assert not left and set(after) == set(before), left
    counts.append(len(changed))
print(*counts)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=plugin_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    always, fsdp, tp = map(int, out.stdout.split()[-3:])
    assert always < tp < fsdp  # fsdp also wraps MatMul
