"""The field's layer shapes through α,β-CROWN's own ONNX path at P = 2 and 3, both modes: every model of
``onnx_zoo`` (Gemm in all its forms, MatMul, layers with fewer output rows than ranks, Slice / Split /
Concat / Reshape, Sigmoid / Tanh, a residual sum, ConvTranspose, BatchNorm after Gemm, onnx2pytorch's
dotted module names, an output that is not a linear layer) gives one process's CROWN bounds (within
1e-6) and verdict, on every rank, under the settings that crashed inside a rank on VNN-COMP's own
models:

* forward-mode bounds through sharded weights (``bound_prop_method: forward+backward``, nn4sys's and
  tllverifybench's configs);
* the attack through the bounded model itself, with gradients (gtrsb's ``use_LiRPANet`` attacker),
  and PGD through ``model_ori`` (whose module names hold dots);
* IBP's merge of the spec into an output that is not a linear layer (``interval_propagate(None, ...)``:
  input-split BaB bounds its boxes so).

Every configuration of ranks runs all the instances in one start of the ranks (one α,β-CROWN process
per rank, as a csv does)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx_zoo
from plugin_support import needs_abcrown, python

pytestmark = needs_abcrown

FORWARD_YAML = """general:
  device: cpu
  complete_verifier: skip
solver:
  bound_prop_method: forward+backward
  crown:
    batch_size: 4
  alpha-crown:
    iteration: 3
attack:
  pgd_order: before
  pgd_restarts: 1
  pgd_steps: 2
"""

# PGD through a LiRPANet built on the (sharded) model (α,β-CROWN's attack when the model has a Jacobian;
# gtrsb's attacker does the same), with gradients through its sharded layers
LIRPANET_ATTACK_YAML = """general:
  device: cpu
  complete_verifier: skip
model:
  with_jacobian: true
solver:
  alpha-crown:
    iteration: 2
attack:
  pgd_order: before
  pgd_restarts: 2
  pgd_steps: 5
"""

INPUT_SPLIT_YAML = """general:
  device: cpu
solver:
  batch_size: 64
  bound_prop_method: crown
bab:
  timeout: 300
  branching:
    method: sb
    input_split:
      enable: True
attack:
  pgd_order: after
  pgd_restarts: 2
"""

RUNS = (("none", 1), ("fsdp", 2), ("tp", 2), ("fsdp", 3), ("tp", 3))

SCRIPT = """
import json, sys, tempfile, time
sys.path.insert(0, {tests!r})
import plugin_support
from complete_verifier_ext import shell
from complete_verifier_ext.abcrown_plugin import parent
from complete_verifier_ext.parallel import launch

def job(name, cfg, onnx, spec, P, mode):
    overrides = ["--onnx_path", onnx, "--vnnlib_path", spec]
    overrides += ["--results_file", f"{tmp}/{{name}}-{{mode}}{{P}}.txt", "--cex_path", f"{tmp}/{{name}}.cex"]
    if P > 1:
        overrides += ["--parallel.mode", mode, "--parallel.world_size", str(P)]
    scratch = tempfile.mkdtemp(dir={tmp!r})
    return parent.prepare(shell.Shell(), cfg, overrides, None, True, time.time(), scratch)

out = {{}}
for mode, P in {runs!r}:
    jobs = [job(n, c, o, s, P, mode) for n, c, o, s in {instances!r}]
    res = launch.run(plugin_support.run_jobs, P, tuple(j.job for j in jobs), backend="gloo")
    out[f"{{mode}}{{P}}"] = [parent.summary_json(r, j.par) for r, j in zip(res, jobs)]
print(json.dumps(out))
"""


def _runs(
    tmp: Path, instances: list[tuple[str, str, str, str]], timeout: float, runs=RUNS
) -> dict[str, list[dict]]:
    code = SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp), runs=runs, instances=instances)
    out = python(code, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same_as_one_process(got: dict[str, list[dict]], names: list[str]) -> None:
    one = got["none1"]
    for key, runs in got.items():
        for name, ref, mine in zip(names, one, runs, strict=True):
            where = f"{name} at {key}"
            assert ref["verdict"] in ("sat", "unsat"), f"{name}: one process answered {ref['verdict']}"
            assert mine["verdict"] == ref["verdict"], where
            assert mine["rank_spread"] <= 1e-6, where  # every rank's bounds are rank 0's
            crown, ref_crown = mine["bounds"].get("crown"), ref["bounds"].get("crown")
            if ref_crown is not None:
                assert crown is not None and len(crown) == len(ref_crown), where
                for a, b in zip(crown, ref_crown, strict=True):
                    assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (where, a, b)


def test_every_layer_shape_gives_one_processs_bounds_and_verdict_at_p2_and_p3(tmp_path):
    """Forward-mode bounds and PGD through ``model_ori`` over every zoo model (a spec no bound can
    cross: unsat), at P = 1, fsdp / tp at P = 2 and 3."""
    made = onnx_zoo.write(tmp_path / "zoo")
    cfg = tmp_path / "forward.yaml"
    cfg.write_text(FORWARD_YAML)
    instances = [(name, str(cfg), str(o), str(s)) for name, o, s in made]
    got = _runs(tmp_path, instances, timeout=600)
    _same_as_one_process(got, [name for name, _, _, _ in instances])
    assert all(r["verdict"] == "unsat" for runs in got.values() for r in runs)


def test_the_attack_through_the_bounded_model_with_gradients(tmp_path):
    """The attack builds a LiRPANet on the sharded model and runs PGD through it (tp: its
    column-parallel layers under autograd; gtrsb's attacker, traffic_signs_recognition): the
    counterexample of one process at P = 2 and 3."""
    made = onnx_zoo.write(tmp_path / "zoo", (onnx_zoo.gemm_forms, onnx_zoo.dotted_names), kinds=("sat",))
    cfg = tmp_path / "attack.yaml"
    cfg.write_text(LIRPANET_ATTACK_YAML)
    instances = [(name, str(cfg), str(o), str(s)) for name, o, s in made]
    got = _runs(tmp_path, instances, timeout=300, runs=(("none", 1), ("tp", 2), ("fsdp", 3)))
    _same_as_one_process(got, [name for name, _, _, _ in instances])
    assert all(r["verdict"] == "sat" for runs in got.values() for r in runs)


def test_input_split_search_over_outputs_that_are_not_linear(tmp_path):
    """Input-split BaB (IBP merges the spec into the output node: the residual sum, the smooth
    activations' nets, a narrow last layer) to a verdict, the same at every P."""
    builders = (onnx_zoo.residual, onnx_zoo.narrow_rows(1), onnx_zoo.nonlinear_output)
    made = onnx_zoo.write(tmp_path / "zoo", builders, kinds=("hard", "sat"))
    cfg = tmp_path / "split.yaml"
    cfg.write_text(INPUT_SPLIT_YAML)
    instances = [(name, str(cfg), str(o), str(s)) for name, o, s in made]
    got = _runs(tmp_path, instances, timeout=600)
    _same_as_one_process(got, [name for name, _, _, _ in instances])
    one = zip(got["none1"], instances, strict=True)
    sat = [r["verdict"] for r, (name, *_) in one if name.endswith("-sat")]
    assert sat == ["sat"] * len(builders)
