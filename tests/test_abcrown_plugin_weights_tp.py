"""``abcrown_plugin/weights/tp.py``: no whole weight on any rank (column-parallel forward, IBP and PGD, ``A
@ W`` around a ring of shards), Linear and Conv layers."""

from __future__ import annotations

from plugin_support import (
    BENCH,
    BOUNDS_YAML,
    VENDOR,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    python,
    run,
)

pytestmark = needs_abcrown


def test_pgd_counterexample_with_tp_weights(tmp_path):
    """256x2 prop_1_0.03 is falsified by PGD: α,β-CROWN's attack runs on the sharded ``model_ori``,
    column-parallel under tp (under fsdp, gathered per call: ``test_vnncomp_route_runs_abcrowns_config…``)."""
    cfg = config(tmp_path, "general:\n  device: cpu\n  complete_verifier: skip\n")  # no BaB under tp
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"), P=2, mode="tp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert s["verdict"] == "sat" and results.startswith("sat\n((X_0 ")  # with its counterexample


def _close(ref: dict, got: dict) -> None:
    """CROWN and α-CROWN bounds equal within 1e-5 (relative above 1, absolute below)."""
    for method in ("crown", "alpha_crown"):
        a, b = ref["bounds"][method], got["bounds"][method]
        assert [x == "inf" for x in a] == [x == "inf" for x in b]
        pairs = [(x, y) for x, y in zip(a, b, strict=True) if x != "inf"]
        assert max(abs(x - y) / max(1.0, abs(x)) for x, y in pairs) < 1e-5, (method, pairs)


def test_tp_conv_layers(tmp_path):
    """oval21's cifar_base_kw under tp, its conv layers sharded by output channel: in matrix mode at
    P = 2, ``conv_transpose2d`` around the ring; in patches mode (α,β-CROWN's default) at P = 3, with
    uneven shards, auto_LiRPA's own patches step on each shard's channel block, summed (an identity start
    gets each shard's rows). CROWN and α-CROWN equal unpatched α,β-CROWN's within 1e-5, no whole weight
    on any rank, no layer left whole."""
    oval = BENCH / "oval21"
    args = ["--onnx_path", str(oval / "onnx" / "cifar_base_kw.onnx")]
    args += ["--vnnlib_path", str(oval / "vnnlib" / "cifar_base_kw-img8194-eps0.018300653594771243.vnnlib")]
    yaml = BOUNDS_YAML.format(chunk=64).replace("iteration: 10", "iteration: 3")
    p1, ref, _ = run(tmp_path, config(tmp_path, yaml), *args, name="p1")
    assert p1.returncode == 0, p1.stderr[-2000:]
    for conv_mode, P in (("matrix", 2), ("patches", 3)):
        cfg = config(
            tmp_path,
            yaml.replace("  complete_verifier: skip", f"  complete_verifier: skip\n  conv_mode: {conv_mode}"),
            name=f"{conv_mode}.yaml",
        )
        env = plugin_env(CVE_ABCROWN_AUDIT="1")
        p2, got, _ = run(tmp_path, cfg, *args, P=P, mode="tp", name=conv_mode, env=env)
        assert p2.returncode == 0, p2.stderr[-2000:]
        _close(ref, got)
        assert got["full_weights_live"] == [[[], []]] * P and "whole_layers" not in got


WHOLE = """
from complete_verifier_ext.abcrown_plugin import bridge, locate
from complete_verifier_ext.abcrown_plugin.weights import tp
bridge.import_abcrown(locate.find({vendor!r}))
from auto_LiRPA.operators import BoundConv, BoundLinear, BoundMatMul

conv = object.__new__(BoundConv)
conv.conv_dim, conv.groups = 2, 1
assert tp.whole_reason(conv) is None
conv.groups = 4
print(tp.whole_reason(conv))
gemm = object.__new__(BoundLinear)
gemm.transA, gemm.transB, gemm.alpha_linear, gemm.beta_linear = 0, 1, 1.0, 1.0
assert tp.whole_reason(gemm) is None
gemm.transB = 0
print(tp.whole_reason(gemm))
print(tp.whole_reason(object.__new__(BoundMatMul)))
"""


def test_layers_tp_cannot_shard_are_named_and_kept_whole():
    """A grouped conv, another Gemm form, a MatMul: tp keeps them whole on every rank and says why (the
    run goes on: their wrappers see no shard and run auto_LiRPA's own code)."""
    out = python(WHOLE.format(vendor=str(VENDOR)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-3:] == [
        "a 2-D convolution with 4 group(s)",
        "a Gemm with transA/transB/alpha/beta other than 0/1/1/1",
        "a BoundMatMul (tp shards Gemm and Conv layers)",
    ]
