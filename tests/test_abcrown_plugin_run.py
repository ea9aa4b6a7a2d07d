"""``abcrown_plugin/run.py``: a rank's run is one object, so two instances run one after the other in one
rank process each get their own verdict, bounds and summary, with nothing of the first in the second."""

from __future__ import annotations

import json
from pathlib import Path

from plugin_support import BAB_YAML, MNIST, needs_abcrown, python

pytestmark = needs_abcrown

TWO = """
import json, sys, tempfile, time
sys.path.insert(0, {tests!r})
import plugin_support
from complete_verifier_ext import shell
from complete_verifier_ext.abcrown_plugin import parent
from complete_verifier_ext.parallel import launch

def job(name, net, prop):
    overrides = ["--onnx_path", f"{mnist}/onnx/{{net}}.onnx", "--vnnlib_path", f"{mnist}/vnnlib/{{prop}}",
                 "--results_file", f"{tmp}/{{name}}.txt"]
    overrides += ["--parallel.mode", "fsdp", "--parallel.world_size", "2", "--solver.crown.batch_size", "32"]
    scratch = tempfile.mkdtemp(dir={tmp!r})
    return parent.prepare(shell.Shell(), {cfg!r}, overrides, None, True, time.time(), scratch)

a = job("a", "mnist-net_256x2", "prop_9_0.05.vnnlib")  # BaB: 16 domains
b = job("b", "mnist-net_256x4", "prop_2_0.03.vnnlib")  # another net: other layers, other rows
together = launch.run(plugin_support.run_jobs, 2, (a.job, b.job), backend="gloo")
alone = launch.run(plugin_support.run_jobs, 2, (b.job,), backend="gloo")
print(json.dumps([parent.summary_json(r, a.par) for r in [*together, *alone]]))
"""

# what depends on the run, not on the process it ran in
KEYS = ("verdict", "bounds", "bab", "alpha_elements", "rows_dealt", "bab_collectives", "crown_batch_size")


def _same(s: dict) -> dict:
    out = {k: s.get(k) for k in KEYS}
    out["bab"] = {k: v for k, v in (s.get("bab") or {}).items() if k != "time_s"}
    return out


def test_two_instances_in_one_rank_process_keep_nothing_of_each_other(tmp_path):
    """fsdp, P = 2: instance A (BaB on 256x2) then instance B (256x4) in the same two rank processes;
    B's summary equals B's run alone in fresh processes (verdict, bounds bit for bit, BaB domains, α
    elements, rows dealt per rank, the collectives of each BaB round), and A's is its own."""
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(BAB_YAML)
    tests = str(Path(__file__).parent)
    code = TWO.format(tests=tests, mnist=str(MNIST), tmp=str(tmp_path), cfg=str(cfg))
    out = python(code, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b, b_alone = json.loads(out.stdout.strip().splitlines()[-1])
    assert a["verdict"] == "unsat" and a["bab"]["domains"] == 16 and a["bab_collectives"][0]
    assert _same(b) == _same(b_alone)
    assert a["rows_dealt"][0] and b["rows_dealt"][0] and b["rows_dealt"] != a["rows_dealt"]
    assert (tmp_path / "a.txt").read_text().startswith("unsat")


def test_a_limit_learned_on_one_instance_of_a_csv_does_not_cap_the_next():
    """A csv's instances share one ``main()`` call and so one ``Run``: where α,β-CROWN closes an instance
    (``Logger.summarize_results``), the out-of-memory caps it learned (rows per pass of a layer, domains
    per BaB round) are recorded with it and forgotten, and the next instance starts with none."""
    from complete_verifier_ext.abcrown_plugin.probe import summarize_results
    from complete_verifier_ext.abcrown_plugin.run import Run
    from complete_verifier_ext.config import ParallelConfig

    run = Run(ParallelConfig(mode="fsdp", world_size=2), 2, "", 0.0)
    closed = []
    hook = summarize_results(run, lambda logger, status, index: closed.append((status, index)))
    logger = type("Logger", (), {"start_time": 0.0})()
    run.rows.fits["/input-8"], run.rounds.fits = 8, 5  # the first instance ran out of memory twice
    hook(logger, "safe", 0)
    assert (run.rows.fits, run.rounds.fits) == ({}, None)  # the second starts with no cap
    hook(logger, "unsafe-pgd", 1)
    assert [(r.verdict, r.bab_fits) for r in run.probe.records] == [("unsat", 5), ("sat", None)]
    assert closed == [("safe", 0), ("unsafe-pgd", 1)]
