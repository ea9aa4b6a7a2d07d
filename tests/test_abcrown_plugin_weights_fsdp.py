"""``abcrown_plugin/weights/fsdp.py`` and ``shards.py``: weights as 1/P row shards inside auto_LiRPA,
gathered per call; bitwise α,β-CROWN's bounds when only the weights are sharded."""

from __future__ import annotations

from plugin_support import (
    BOUNDS_YAML,
    config,
    instance,
    needs_abcrown,
    run,
)

pytestmark = needs_abcrown


def test_bounds_bitwise_when_rows_are_not_split(tmp_path):
    """CROWN verifies 256x2 prop_0_0.03; no layer has more unstable neurons than a pass holds, so FSDP
    alone is active and the bounds are bitwise α,β-CROWN's."""
    cfg = config(tmp_path, BOUNDS_YAML.format(chunk=512))
    args = instance("mnist-net_256x2", "prop_0_0.03.vnnlib")
    p1, s1, r1 = run(tmp_path, cfg, *args, name="p1")
    p2, s2, r2 = run(tmp_path, cfg, *args, P=2, name="p2")
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-2000:]
    assert s1["bounds"]["crown"] == s2["bounds"]["crown"]
    assert s1["verdict"] == s2["verdict"] == "unsat" and r1.strip() == r2.strip() == "unsat"
