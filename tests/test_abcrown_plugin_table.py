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
from complete_verifier_ext.abcrown_plugin import bridge, locate, patcher, table
from complete_verifier_ext.abcrown_plugin.run import Run
from complete_verifier_ext.config import ParallelConfig
checkout = locate.find({str(VENDOR)!r})
bridge.import_abcrown(checkout)
import abcrown
roots = [str(checkout.root.resolve()), str(Path(table.__file__).parent)]
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
    owner, name = patcher.resolve(target)
    where = f"{{owner.__module__}}.{{owner.__qualname__}}" if inspect.isclass(owner) else owner.__name__
    return f"{{where}}.{{name}}"
before = snapshot()
counts = []
for mode, world in (("none", 1), ("fsdp", 2), ("tp", 2)):
    run = Run(ParallelConfig(mode=mode, world_size=world), world, {str(tmp_path / "cache")!r}, 0.0)
    p = patcher.Patcher()
    table.install(p, run)
    during = snapshot()
    missing = object()  # a key on one side only: a method set on a class that inherited it
    changed = {{k for k in set(before) | set(during) if before.get(k, missing) is not during.get(k, missing)}}
    expected = {{canonical(t) for t in table.targets(run)}}
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


def test_every_row_is_made_by_its_owner_with_one_contract():
    """No adapters in ``table.py``: every row's ``make`` is a function of the module that owns the
    replacement, taking ``(run, orig)``; rows that name one attribute agree on its parameters."""
    import inspect

    from complete_verifier_ext.abcrown_plugin import table

    plugin = "complete_verifier_ext.abcrown_plugin."
    params: dict[str, tuple] = {}
    for row in table.TABLE:
        assert inspect.isfunction(row.make), row
        assert row.by != "table" and row.make.__module__.startswith(plugin), row
        assert list(inspect.signature(row.make).parameters) == ["run", "orig"], row
        assert params.setdefault(row.target, row.params) == row.params, row.target
    owners = {row.by for row in table.TABLE}
    assert {"inputs", "clocks", "probe", "rows.passes", "rows.spec", "rows.alpha", "rows.grads"} <= owners
    assert {"weights.fsdp", "weights.tp"} <= owners
    assert {"search.activation", "search.input_split", "search.mip", "search.cuts"} <= owners
