"""``abcrown_plugin/search/customized.py``: a ``Customized`` verifier runs once, on rank 0 alone."""

from __future__ import annotations

import pytest
from plugin_support import config, instance, needs_abcrown, plugin_env, run

VERIFIER = """import os
import torch

def verify(model_ori, vnnlib, onnx_path):
    y = model_ori(torch.zeros(1, 1, 28, 28))  # the whole model, as one process
    with open(os.environ["MARK"], "a") as f:
        f.write(f"{tuple(y.shape)}\\n")
    return "safe"
"""

YAML = """general:
  device: cpu
  complete_verifier: Customized("verifier.py", "verify")
model:
  input_shape: [-1, 1, 28, 28]
"""


@needs_abcrown
def test_customized_verifier_runs_once_on_rank0(tmp_path):
    """α,β-CROWN hands the instance to the user's function (found beside the user's YAML, as
    α,β-CROWN looks for it, although the plugin runs a merged copy elsewhere). At P = 2 it runs once,
    on rank 0 with the whole model, one line says so, and its verdict is the run's."""
    (tmp_path / "verifier.py").write_text(VERIFIER)
    cfg = config(tmp_path, YAML)
    mark = tmp_path / "mark.txt"
    env = plugin_env(MARK=str(mark))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=2, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "unsat" and mark.read_text() == "(1, 10)\n"
    assert "is not split: it runs on rank 0 alone" in proc.stderr


# a verifier that finds a counterexample (PGD on the least violated disjunct of the spec: its rows C y
# <= rhs all hold) and writes it where α,β-CROWN's Logger reads it back (attack.cex_path), as
# cctsdb_yolo's verifier does
ATTACKER = """import arguments
import torch

def verify(model_ori, vnnlib, onnx_path):
    (box, specs), = vnnlib
    box = torch.tensor(box, dtype=torch.float32)
    lo, hi = box[:, 0].view(1, 1, 28, 28), box[:, 1].view(1, 1, 28, 28)
    x = ((lo + hi) / 2).requires_grad_(True)
    for _ in range(100):
        y = model_ori(x).view(-1, 1)
        worst = [((torch.tensor(C, dtype=torch.float32) @ y).view(-1) - torch.tensor(r)).max()
                 for C, r in specs]
        margin = torch.stack(worst).min()
        if margin <= 0:
            break
        margin.backward()
        x = (x - 0.01 * x.grad.sign()).clamp(lo, hi).detach().requires_grad_(True)
    else:
        return "unknown"
    y = model_ori(x).view(-1)
    lines = [f"(X_{i} {v})" for i, v in enumerate(x.view(-1).tolist())]
    lines += [f"(Y_{j} {v})" for j, v in enumerate(y.tolist())]
    with open(arguments.Config["attack"]["cex_path"], "w") as f:
        f.write("(" + "\\n".join(lines) + ")\\n")
    return "unsafe"
"""


@needs_abcrown
def test_a_counterexample_of_the_customized_verifier_reaches_every_rank(tmp_path):
    """At P = 2 the verifier runs on rank 0 and writes its counterexample there; α,β-CROWN's Logger on
    every rank reads one back for its ``sat``: the other ranks get rank 0's, and the results file holds
    it, confirmed by onnxruntime."""
    (tmp_path / "verifier.py").write_text(ATTACKER)
    cfg = config(tmp_path, YAML)
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_1_0.03.vnnlib"), P=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.startswith("sat\n") and "(X_783 " in results
    assert (
        sum("warning" in line for line in proc.stderr.splitlines()) == 1
    )  # "is not split", no re-check failure


@needs_abcrown
@pytest.mark.parametrize("P", [1, 2])
def test_a_missing_customized_file_is_one_line(tmp_path, P):
    """The user's verifier file is not beside the YAML: one line naming it, ``error``, exit 1."""
    cfg = config(tmp_path, YAML)
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=P)
    assert proc.returncode == 1 and results == "error\n"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith(f"Customized file {tmp_path / 'verifier.py'} not found")


@needs_abcrown
@pytest.mark.parametrize("P", [1, 2])
def test_a_failure_inside_the_run_still_writes_error(tmp_path, P):
    """Whatever fails inside a run (here the user's verifier raising, in this process at P = 1, in a
    rank at P = 2) keeps its traceback on stderr, and the harness still gets ``error`` and exit 1."""
    failing = "def verify(model_ori, vnnlib, onnx_path):\n    raise RuntimeError('boom')\n"
    (tmp_path / "verifier.py").write_text(failing)
    cfg = config(tmp_path, YAML)
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=P)
    assert proc.returncode == 1 and results == "error\n", proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr.splitlines()[-1]
