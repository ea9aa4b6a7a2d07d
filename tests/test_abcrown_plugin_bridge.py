"""``abcrown_plugin/bridge.py`` and ``locate.py``: our keys inside α,β-CROWN's config, its own errors for
its keys, the checkout found or one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from plugin_support import (
    VENDOR,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    run,
)


@needs_abcrown
def test_config_keys_registered_and_dumped(tmp_path):
    code = f"""
import sys
from complete_verifier_ext.abcrown_plugin import bridge, locate
arguments = bridge.import_abcrown(locate.find({str(VENDOR)!r}))
open({str(tmp_path / "c.yaml")!r}, "w").write("parallel:\\n  mode: fsdp\\n  world_size: 4\\n")
args = ["--config", {str(tmp_path / "c.yaml")!r}, "--parallel_world_size", "3"]
arguments.Config.parse_config(args, verbose=False)
print(arguments.Config.dump_config(arguments.Config.all_args))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=plugin_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    dumped = out.stdout[out.stdout.index("parallel:") :]
    assert "mode: fsdp" in dumped and "world_size: 3" in dumped  # the command line beats the YAML
    assert "engine: abcrown" in out.stdout


@needs_abcrown
def test_typo_key_is_abcrowns_own_error(tmp_path):
    cfg = config(tmp_path, "general:\n  device: cpu\nsolver:\n  bogus_key: 1\n")
    proc, _, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_0_0.03.vnnlib"))
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "bogus_key" in lines[0] and "not found" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert results.strip() == "error"


@needs_abcrown
def test_missing_checkout_is_one_line(tmp_path):
    cfg = config(tmp_path, "general:\n  device: cpu\n")
    env = plugin_env(ABCROWN_PATH=str(tmp_path / "nowhere"))
    proc, _, results = run(tmp_path, cfg, env=env)
    assert proc.returncode == 1 and "not an alpha-beta-CROWN checkout" in proc.stderr
    assert "Traceback" not in proc.stderr and results.strip() == "error"


def test_bab_weights_follow_the_mode():
    """``parallel.bab_weights: auto`` (the default) is replicated under fsdp and sharded under tp; tp
    with replicated weights is refused (tp never holds a whole layer)."""
    from complete_verifier_ext.abcrown_plugin import bridge
    from complete_verifier_ext.abcrown_plugin.locate import PluginError

    def of(**sec):
        return bridge.parallel_of({"parallel": {"world_size": 2, **sec}}, [], "x.yaml").bab_weights_resolved

    assert of(mode="fsdp") == "replicated" and of(mode="tp") == "sharded"
    assert of(mode="fsdp", bab_weights="sharded") == "sharded"
    assert bridge.parallel_of({}, ["--parallel_mode", "tp"], None).bab_weights_resolved == "sharded"
    with pytest.raises(PluginError, match="never holds a full layer"):
        of(mode="tp", bab_weights="replicated")
    with pytest.raises(PluginError, match="x.yaml: key 'parallel.bab_weights' must be one of"):
        of(mode="fsdp", bab_weights="some")
