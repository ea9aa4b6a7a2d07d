"""Out of memory while auto_LiRPA bounds a layer (``rows/passes.halving_on_oom``): the layer again with its
rows in passes of half as many, down to one row, and the bounds are those of a run that never ran out.

No GPU here: the stand-in raises ``torch.OutOfMemoryError`` (what CUDA raises) from every
back-substitution pass of an intermediate layer with more rows than a limit, in a real auto_LiRPA
(α,β-CROWN's, from ``../shared/vendor``) bounding a small conv net with CROWN and α-CROWN.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from plugin_support import VENDOR, needs_abcrown, python

pytestmark = needs_abcrown


def _net_script(classes: int) -> str:
    """The start of a probe script: a real auto_LiRPA (α,β-CROWN's, ``{vendor}`` formatted in later) and
    a small conv net of ``classes`` outputs."""
    return f"""
import json, math, sys
import torch
from complete_verifier_ext.abcrown_plugin import bridge, locate
from complete_verifier_ext.abcrown_plugin.run import Rows
from complete_verifier_ext.abcrown_plugin.rows import passes, spec
bridge.import_abcrown(locate.find({{vendor!r}}))
from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, stride=2, padding=1),
    torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 20), torch.nn.ReLU(),
    torch.nn.Linear(20, {classes}))
"""


PROBE = (
    _net_script(3)
    + """x = torch.rand(1, 1, 8, 8)
armed = [False]

def bounds(late):
    m = BoundedModule(net, x, bound_opts={{"optimize_bound_args": {{"iteration": 3}}}}, device="cpu")
    xb = BoundedTensor(x, PerturbationLpNorm(x_L=x - 0.1, x_U=x + 0.1))
    armed[0] = not late  # late: out of memory only once α-CROWN runs
    crown = m.compute_bounds(x=(xb,), method="CROWN")[0]
    armed[0] = True
    alpha = m.compute_bounds(x=(xb,), method="CROWN-Optimized")[0]
    return [crown.detach().flatten().tolist(), alpha.detach().flatten().tolist()]

ref = bounds(False)
limit, late = {limit}, {late}
backward_general = BoundedModule.backward_general

def stand_in(self, node, C, *args, unstable_idx=None, **kwargs):
    if armed[0] and node.name != self.final_name and type(C).__name__ != "BatchedCrownC":  # a real pass
        if unstable_idx is None:
            n = math.prod(node.output_shape[1:])
        else:
            n = (unstable_idx[0] if isinstance(unstable_idx, tuple) else unstable_idx).numel()
        if n > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    return backward_general(self, node, C, *args, unstable_idx=unstable_idx, **kwargs)

class Run:
    rows = Rows(active=False)

BoundedModule.backward_general = stand_in
bounds_of_layer = BoundedModule.compute_intermediate_bounds
BoundedModule.compute_intermediate_bounds = passes.halving_on_oom(Run, bounds_of_layer)
print(json.dumps({{"ref": ref, "got": bounds(late), "fits": Run.rows.fits}}))
"""
)


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: out of memory")]


def test_a_layer_that_runs_out_of_memory_is_bounded_in_halved_passes():
    """Passes of more than 8 rows fail (from the first CROWN, or only once α-CROWN runs): each layer is
    bounded again in passes of half as many rows until they fit (one warning line each time), keeps that
    size for its later bounds, and CROWN and α-CROWN equal the bounds of the run that never ran out."""
    for late in (False, True):
        proc = python(PROBE.format(vendor=str(VENDOR), limit=8, late=late), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["fits"] == {"/input-8": 8, "/input-12": 5}, out
        for ref, got in zip(out["ref"], out["got"], strict=True):
            assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-6, (late, out)
        assert _warnings(proc.stderr) == [
            "warning: out of memory in a pass of 64 rows of /input-8; retrying in passes of 32",
            "warning: out of memory in a pass of 32 rows of /input-8; retrying in passes of 16",
            "warning: out of memory in a pass of 16 rows of /input-8; retrying in passes of 8",
            "warning: out of memory in a pass of 20 rows of /input-12; retrying in passes of 10",
            "warning: out of memory in a pass of 10 rows of /input-12; retrying in passes of 5",
        ], proc.stderr[-3000:]


def test_not_even_one_row_fitting_gives_up_with_the_error():
    proc = python(PROBE.format(vendor=str(VENDOR), limit=0, late=False), timeout=120)
    assert proc.returncode != 0 and "torch.OutOfMemoryError" in proc.stderr
    assert _warnings(proc.stderr)[-1] == (
        "warning: out of memory in a pass of 1 row(s) of /input-8 (one row per pass): giving up"
    )


FINAL = (
    _net_script(10)
    + """
x, C = torch.rand(1, 1, 8, 8), torch.randn(1, 9, 10)  # 9 spec rows, as α,β-CROWN passes them
armed = [False]

def bounds(late):
    m = BoundedModule(net, x, bound_opts={{"optimize_bound_args": {{"iteration": 3}}}}, device="cpu")
    xb = BoundedTensor(x, PerturbationLpNorm(x_L=x - 0.1, x_U=x + 0.1))
    armed[0] = not late  # late: out of memory only once α-CROWN runs
    crown = m.compute_bounds(x=(xb,), C=C, method="CROWN")
    lA = [r.lA.flatten().tolist() for r in m.relus]  # what α,β-CROWN's get_lA reads for BaB
    armed[0] = True
    alpha = m.compute_bounds(x=(xb,), C=C, method="CROWN-Optimized")
    return [crown[0].detach().flatten().tolist(), crown[1].detach().flatten().tolist(),
            alpha[0].detach().flatten().tolist(), alpha[1].detach().flatten().tolist(), *lA]

ref = bounds(False)
limit, late = {limit}, {late}
backward_general = BoundedModule.backward_general

def stand_in(self, node, C, *args, **kwargs):
    if armed[0] and node.name == self.final_name and C.shape[1] > limit:
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    return backward_general(self, node, C, *args, **kwargs)

class Run:
    rows = Rows(active=False)

BoundedModule.backward_general = spec.backward_general(Run, stand_in)
print(json.dumps({{"ref": ref, "got": bounds(late), "fits": Run.rows.fits}}))
"""
)


def test_the_output_node_that_runs_out_of_memory_is_bounded_in_halved_passes_of_spec_rows():
    """P = 1: the output node's back-substitution over more than 2 of its 9 spec rows fails (from the
    first CROWN, or only once α-CROWN runs): it runs again in passes of 4 (then 2) spec rows, each
    auto_LiRPA's with its rows' α, one warning line each time, and keeps that size; CROWN's and
    α-CROWN's bounds (both sides) and the A-matrices it leaves on every ReLU (BaB's branching reads
    them) equal those of the run that never ran out."""
    for late in (False, True):
        proc = python(FINAL.format(vendor=str(VENDOR), limit=2, late=late), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["fits"] == {"/16": 2}, out["fits"]
        for ref, got in zip(out["ref"], out["got"], strict=True):
            assert len(ref) == len(got) and max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-6
        assert _warnings(proc.stderr) == [
            "warning: out of memory in a pass of 9 rows of /16; retrying in passes of 4",
            "warning: out of memory in a pass of 4 rows of /16; retrying in passes of 2",
        ], proc.stderr[-3000:]


LOCKSTEP = """
import json, sys, tempfile, time
sys.path.insert(0, {tests!r})
import plugin_support
from complete_verifier_ext import shell
from complete_verifier_ext.abcrown_plugin import parent
from complete_verifier_ext.parallel import launch

def job(name):
    overrides = ["--onnx_path", {onnx!r}, "--vnnlib_path", {spec!r}, "--results_file", f"{tmp}/{{name}}.txt",
                 "--parallel.mode", "tp", "--parallel.world_size", "2"]
    scratch = tempfile.mkdtemp(dir={tmp!r})
    return parent.prepare(shell.Shell(), {cfg!r}, overrides, None, True, time.time(), scratch)

a, b, c = job("ref"), job("oom"), job("oom_late")
calls = (("run_jobs", (a.job,)), ("run_jobs_out_of_memory", ({limit}, False, None, b.job)),
         ("run_jobs_out_of_memory", ({limit}, True, 2, c.job)))
runs = launch.run(plugin_support.run_calls, 2, calls, backend="gloo")  # the three runs in turn
print(json.dumps([parent.summary_json(r, a.par) for r in runs]))
"""

CNN7_YAML = """general:
  device: cpu
  complete_verifier: skip
  double_fp: true
solver:
  alpha-crown:
    iteration: 3
    full_conv_alpha: false
attack:
  pgd_order: skip
"""


def test_at_p2_a_pass_that_runs_out_on_one_rank_runs_again_in_halves_on_every_rank(tmp_path):
    """tp, P = 2, a CNN7 of 4 channels on 8x8 inputs in float64, CROWN and α-CROWN: on rank 1 alone every
    back-substitution step of an intermediate layer whose A-matrix has more than 8000 elements runs out
    of memory, midway through a pass, from the first CROWN pass on (or only in α-CROWN's iterations,
    under autograd). That rank ends the pass's collectives over a dummy row, and every rank runs the
    pass, and the passes after it, again in halves (dense conv passes by whole channels, the fc layer's
    rows), one line each time, until rank 1's fit; later bounds of the layer start from that size. In
    the second run the output node's passes of more than 2 spec rows fail on rank 1 too (CROWN's, whole
    on every rank, and α-CROWN's, dealt by spec rows). The bounds are those of the run that never ran
    out (to 1e-9), every rank bounds the same rows, and both ranks issue the same collectives."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from complete_verifier_ext.examples.cnn7 import build
    from complete_verifier_ext.testing import write_vnnlib

    onnx = tmp_path / "cnn7.onnx"
    build(onnx, width=4, shape=(3, 8, 8))
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(3)).numpy()
    label = int(ort.InferenceSession(str(onnx)).run(None, {"x": x})[0].argmax())
    spec = write_vnnlib(tmp_path / "s.vnnlib", np.clip(x - 0.01, 0, 1), np.clip(x + 0.01, 0, 1), label, 10)
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(CNN7_YAML)
    tests = str(Path(__file__).parent)
    code = LOCKSTEP.format(
        tests=tests, onnx=str(onnx), spec=str(spec), cfg=str(cfg), tmp=str(tmp_path), limit=8000
    )
    proc = python(code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, *runs = json.loads(proc.stdout.strip().splitlines()[-1])
    for got in runs:
        for method in ("crown", "alpha_crown"):
            a, b = ref["bounds"][method], got["bounds"][method]
            assert max(abs(u - v) / abs(u) for u, v in zip(a, b, strict=True)) < 1e-9, method
        assert got["rows_dealt"] == ref["rows_dealt"]
        assert len(set(got["collectives"])) == 1 and got["collectives"][0] > ref["collectives"][0]

    every = [ln for log in tmp_path.rglob("rank1.log") for ln in _warnings(log.read_text())]
    assert any("in a pass of 4 channels of" in ln for ln in every), every  # a conv layer's dense pass
    assert any("in a pass of 256 rows of" in ln for ln in every), every  # the fc layer's rows
    assert all(ln.endswith("; every rank runs that pass again in two halves") for ln in every), every
    assert not [ln for log in tmp_path.rglob("rank0.log") for ln in _warnings(log.read_text())]
    # the output node (/42, 9 spec rows): CROWN's whole pass on every rank, 9 -> 5 + 4 -> 3 + 2 + 2 + 2 rows;
    # then passes of 1 (α-CROWN's dealt shares of 5 and 4: 5 passes on each rank, one a dummy on rank 1)
    final = [ln for ln in every if " rows of /42;" in ln]
    assert [ln.split(" in a pass of ")[1].split()[0] for ln in final] == ["9", "5", "3"], final


BAB = """
import json, sys, tempfile, time
sys.path.insert(0, {tests!r})
import plugin_support
from complete_verifier_ext import shell
from complete_verifier_ext.abcrown_plugin import parent
from complete_verifier_ext.parallel import launch

def job(name, P):
    overrides = ["--results_file", f"{tmp}/{{name}}.txt", "--parallel.world_size", str(P),
                 "--parallel.mode", "fsdp" if P > 1 else "none", *{args!r}]
    scratch = tempfile.mkdtemp(dir={tmp!r})
    return parent.prepare(shell.Shell(), {cfg!r}, overrides, None, True, time.time(), scratch)

for P, limit in {cases!r}:
    a = job(f"{{P}}_{{limit}}", P)
    args = (limit, (0,), {where!r}, a.job)
    out = [parent.summary_json(r, a.par)
           for r in launch.run(plugin_support.run_jobs_bab_out_of_memory, P, args, backend="gloo")]
    print(json.dumps(out), flush=True)
"""


def _bab(
    tmp_path, cases, cfg: str | None = None, args: list[str] | None = None, where: str = "bound"
) -> subprocess.CompletedProcess:
    """The cases (P, limit) in one process, each a line of JSON (the ranks' summaries); by default on
    256x2 prop_9_0.05 with ``BAB_YAML``; ``where`` the stand-in runs out (``run_jobs_bab_out_of_memory``)."""
    from plugin_support import BAB_YAML, config, instance

    cfg = cfg or config(tmp_path, BAB_YAML)
    args = args or instance("mnist-net_256x2", "prop_9_0.05.vnnlib")
    code = BAB.format(
        tests=str(Path(__file__).parent), cfg=cfg, tmp=str(tmp_path), args=args, cases=cases, where=where
    )
    return python(code, timeout=600)


def _summaries(proc: subprocess.CompletedProcess) -> list[list[dict]]:
    """The ranks' summaries of each case :func:`_bab` ran (its JSON lines among the runs' output)."""
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('[{"')]


def _retried(proc: subprocess.CompletedProcess, domains: int, fits: tuple[list, list]) -> list[list[int]]:
    """What both kinds of BaB check of :func:`_bab`'s cases (P = 1, P = 2, then one that gives up): the
    last case ended with the error; the first two are unsat after ``domains`` domains (or boxes), with
    ``bab_fits`` ``fits`` (P = 1's, P = 2's). Returns P = 2's per-rank collectives of every round."""
    assert proc.returncode != 0 and "torch.OutOfMemoryError" in proc.stderr  # the last case gave up
    (p1,), p2 = _summaries(proc)
    for got in (p1, *p2):
        assert (got["verdict"], got["bab"]["domains"]) == ("unsat", domains), got
    assert p1["bab_fits"] == fits[0] and p2[0]["bab_fits"] == fits[1]
    return p2[0]["bab_collectives"]


def test_a_bab_round_that_runs_out_of_memory_runs_again_with_fewer_domains(tmp_path):
    """256x2 prop_9_0.05 needs BaB (kFSB, 8 domains a round; unpatched α,β-CROWN: unsat after 16 domains
    in 4 rounds, ``BAB_P1`` of test_abcrown_plugin_search_activation): on rank 0, every
    ``update_bounds`` of more than 6 domains runs out of memory (kFSB scores 3 candidates, 2 children
    each, of every domain: 2 domains are 12). The round's domains go back on the list and the round
    runs again with half as many, one warning line, and the later rounds pick at most that many: at
    P = 1 the first round (2 domains) and 7 rounds of 1 after it; at P = 2 the third round on rank 0
    alone, while rank 1 goes on with its share (rank-local work: the round's collectives are the same
    on both ranks). Both are unsat after the 16 domains of the run that never ran out. Where one domain
    split once does not fit (more than 1 child), the run gives up with the error after one line."""
    proc = _bab(tmp_path, [(1, 6), (2, 6), (1, 1)])
    rounds = _retried(proc, 16, ([1], [1, None]))
    assert len(rounds[0]) == 4 and rounds[0] == rounds[1], rounds
    line = "warning: out of memory in a BaB round of 2 domain(s); retrying with 1 a round"
    assert _warnings(proc.stderr) == [
        line,
        line,
        line,
        "warning: out of memory in a BaB round of 1 domain(s) (one domain a round): giving up",
    ], proc.stderr[-3000:]


def test_an_input_split_round_that_runs_out_of_memory_runs_again_bounding_half_as_many_boxes(tmp_path):
    """Input-split BaB (``INPUT_SPLIT_YAML``: α-CROWN bounds, clip-and-verify, sb) on a 4-96-96-3 MLP,
    unsat after 218 boxes in rounds of up to 20 picks (each split in two; at P = 2 each rank's share).
    The stand-in runs out of memory on rank 0 when a round bounds more than 24 boxes (P = 1) or 12
    (P = 2): the round's boxes go back on the box list, the round runs again bounding at most half as
    many (15 then 7: 7 picks split once), one warning line, and so do the later rounds. Both are unsat
    after the 218 boxes of the run that never ran out, and at P = 2 the ranks issue the same collectives
    in every round (rank 0 retries alone). Where one box split once does not fit, the run gives up with
    the error after one line."""
    from plugin_support import INPUT_SPLIT_YAML, config

    from complete_verifier_ext.testing import mlp_onnx, write_vnnlib

    onnx = mlp_onnx(tmp_path / "m.onnx", [4, 96, 96, 3], seed=3)
    x0 = [0.1, -0.2, 0.3, 0.05]
    spec = write_vnnlib(tmp_path / "p.vnnlib", [v - 0.08 for v in x0], [v + 0.08 for v in x0], 0, 3)
    args = ["--onnx_path", str(onnx), "--vnnlib_path", str(spec)]
    proc = _bab(tmp_path, [(1, 24), (2, 12), (1, 1)], config(tmp_path, INPUT_SPLIT_YAML), args)
    rounds = _retried(proc, 218, ([15], [7, None]))
    assert len(rounds[0]) > 5 and rounds[0] == rounds[1], rounds
    line = (
        "warning: out of memory in an input-split BaB round bounding {} box(es); retrying with at most {} "
        "bounded a round"
    )
    assert _warnings(proc.stderr) == [
        line.format(30, 15),  # P = 1: 15 picks
        line.format(14, 7),  # P = 2: rank 0's 7 picks
        line.format(4, 2),  # the last case: 2 picks, then 1 split once
        "warning: out of memory in an input-split BaB round bounding 2 box(es) (one box split once): "
        "giving up",
    ], proc.stderr[-3000:]


def test_a_pick_that_runs_out_of_memory_picks_half_as_many(tmp_path):
    """256x2 prop_9_0.05 as above, but copying a round's domains off the list runs out of memory (on
    rank 0, midway through ``pick_out``: the A-matrices, α, specs and thresholds popped, the
    intermediate bounds not yet) where a pick takes more than 1 domain. The popped domains go back on
    the list, half as many are picked, one warning line, and the later rounds pick at most that many:
    unsat after the same 16 domains at P = 1 and P = 2 (rank 0 alone, the ranks' collectives equal).
    Where one domain does not fit, the run gives up with the error after one line."""
    proc = _bab(tmp_path, [(1, 1), (2, 1), (1, 0)], where="pick")
    rounds = _retried(proc, 16, ([1], [1, None]))
    assert rounds[0] == rounds[1], rounds
    line = "warning: out of memory picking 2 domain(s) off the list; retrying with 1 a round"
    assert _warnings(proc.stderr) == [
        line,  # P = 1
        line,  # P = 2, rank 0
        line,  # the last case: the first pick (the root domain's two children; the root is split unpicked)
        "warning: out of memory picking 1 domain off the list: giving up",
    ], proc.stderr[-3000:]


def test_an_input_split_pick_that_runs_out_of_memory_picks_half_as_many(tmp_path):
    """Input-split BaB as above, but copying a round's boxes off the list runs out of memory (on rank 0,
    midway through ``pick_out_batch``: every storage popped, the list's volume not yet) where a round
    picks more than 8 boxes (P = 1) or 4 (P = 2). The boxes go back on the list and the round picks
    half as many (15 then 7 at P = 1; rank 0's 7 then 3 at P = 2), one warning line, and so do the
    later rounds: unsat after the same 218 boxes, the ranks' collectives equal in every round. Where
    one box does not fit, the run gives up with the error after one line."""
    from plugin_support import INPUT_SPLIT_YAML, config

    from complete_verifier_ext.testing import mlp_onnx, write_vnnlib

    onnx = mlp_onnx(tmp_path / "m.onnx", [4, 96, 96, 3], seed=3)
    x0 = [0.1, -0.2, 0.3, 0.05]
    spec = write_vnnlib(tmp_path / "p.vnnlib", [v - 0.08 for v in x0], [v + 0.08 for v in x0], 0, 3)
    args = ["--onnx_path", str(onnx), "--vnnlib_path", str(spec)]
    proc = _bab(tmp_path, [(1, 8), (2, 4), (1, 0)], config(tmp_path, INPUT_SPLIT_YAML), args, where="pick")
    rounds = _retried(proc, 218, ([15], [7, None]))  # fits: the boxes bounded, each pick split once
    assert len(rounds[0]) > 5 and rounds[0] == rounds[1], rounds
    line = "warning: out of memory in an input-split BaB round picking {} box(es) off the list{}"
    assert _warnings(proc.stderr) == [
        line.format(15, "; retrying with at most 7 picked a round"),  # P = 1
        line.format(7, "; retrying with at most 3 picked a round"),  # P = 2, rank 0
        line.format(2, "; retrying with at most 1 picked a round"),  # the last case
        line.format(1, " (one box): giving up"),
    ], proc.stderr[-3000:]
