"""``abcrown_plugin/tp.py``: no whole weight on any rank (column-parallel forward, IBP and PGD, ``A @ W``
around a ring of shards), Linear and Conv layers."""

from __future__ import annotations

from plugin_support import (
    BENCH,
    BOUNDS_YAML,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    run,
)
from support import relative_error as rel

pytestmark = needs_abcrown


def test_pgd_counterexample_with_tp_weights(tmp_path):
    """256x2 prop_1_0.03 is falsified by PGD: α,β-CROWN's attack runs on the sharded ``model_ori``,
    column-parallel under tp (under fsdp, gathered per call: ``test_vnncomp_route_runs_abcrowns_config…``)."""
    cfg = config(tmp_path, "general:\n  device: cpu\n  complete_verifier: skip\n")  # no BaB under tp
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"), P=2, mode="tp")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert s["verdict"] == "sat" and results.startswith("sat\n((X_0 ")  # with its counterexample


def test_tp_conv_layers_in_matrix_mode(tmp_path):
    """oval21's cifar_base_kw under tp (conv layers column-parallel, ``conv_transpose2d`` around the
    ring): CROWN and α-CROWN equal unpatched α,β-CROWN's within 1e-5, no whole weight on any rank. In
    patches mode (α,β-CROWN's default) tp says which node it cannot shard."""
    oval = BENCH / "oval21"
    args = ["--onnx_path", str(oval / "onnx" / "cifar_base_kw.onnx")]
    args += ["--vnnlib_path", str(oval / "vnnlib" / "cifar_base_kw-img8194-eps0.018300653594771243.vnnlib")]
    matrix = BOUNDS_YAML.format(chunk=256).replace("iteration: 10", "iteration: 3")
    cfg = config(
        tmp_path,
        matrix.replace("  complete_verifier: skip", "  complete_verifier: skip\n  conv_mode: matrix"),
    )
    p1, ref, _ = run(tmp_path, cfg, *args, name="p1")
    p2, got, _ = run(tmp_path, cfg, *args, P=2, mode="tp", name="tp", env=plugin_env(CVE_ABCROWN_AUDIT="1"))
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-2000:]
    for method in ("crown", "alpha_crown"):
        a, b = ref["bounds"][method], got["bounds"][method]
        assert [x == "inf" for x in a] == [x == "inf" for x in b]
        assert rel([x for x in a if x != "inf"], [x for x in b if x != "inf"]) < 1e-5
    assert got["full_weights_live"] == [[[], []]] * 2
    cfg = config(tmp_path, BOUNDS_YAML.format(chunk=64))
    proc, s, results = run(tmp_path, cfg, *args, P=2, mode="tp", name="patches")
    assert proc.returncode == 1 and results == "error\n"
    assert "parallel.mode: tp: Conv node" in proc.stderr and "general.conv_mode: matrix" in proc.stderr
    assert "Traceback" not in proc.stderr
