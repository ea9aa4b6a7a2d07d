"""``witness.py``'s re-check of α,β-CROWN's ``sat``: it stands only when onnxruntime confirms its
counterexample."""

from __future__ import annotations

from plugin_support import (
    config,
    instance,
    needs_abcrown,
    run,
)

pytestmark = needs_abcrown


def test_a_sat_that_does_not_check_becomes_unknown(tmp_path):
    """Rank 0 re-checks α,β-CROWN's counterexample with onnxruntime before a ``sat`` stands: the centre
    of prop_1_0.03's box is classified correctly, so a results file claiming it is turned into
    ``unknown``; a real counterexample nudged just outside the box (float32 rounding) is rounded
    back in and kept."""
    import numpy as np

    from complete_verifier_ext import witness
    from complete_verifier_ext.attack import format_counterexample
    from complete_verifier_ext.spec import load_vnnlib

    onnx, spec = instance("mnist-net_256x2", "prop_1_0.03.vnnlib")[1::2]
    region = load_vnnlib(spec).regions[0]
    results = tmp_path / "results.txt"
    centre = (region.lower + region.upper) / 2
    results.write_text(f"sat\n{format_counterexample(centre, np.zeros(10))}\n")
    assert "does not check" in witness.recheck_results_file(str(results), onnx, spec, "alpha-beta-CROWN")
    assert results.read_text() == "unknown\n"

    # the plugin's own sat on this instance (test_vnncomp_route_runs_abcrowns_config_sharded) is a real one
    proc, s, text = run(
        tmp_path,
        config(tmp_path, "general:\n  device: cpu\n  save_adv_example: true\n"),
        *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"),
    )
    assert proc.returncode == 0 and text.startswith("sat\n")
    x = witness.read_inputs(text)
    at_upper = np.isclose(x, region.upper, rtol=0, atol=1e-6)
    assert at_upper.any()
    outside = np.where(at_upper, region.upper + 1e-9, x)  # a bound rounded outward
    results.write_text(f"sat\n{format_counterexample(outside, np.zeros(10))}\n")
    assert witness.recheck_results_file(str(results), onnx, spec, "alpha-beta-CROWN") is None
    kept = witness.read_inputs(results.read_text())
    assert results.read_text().startswith("sat\n") and np.all(kept <= region.upper)
