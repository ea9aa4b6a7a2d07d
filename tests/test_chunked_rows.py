"""``solver.crown.batch_size``: intermediate neurons back-substituted in chunks give the bounds of one
pass (MLP, conv, residual; CROWN and α-CROWN; one process and two gloo ranks with uneven shares), and
the chunk the pipeline picks is recorded in the summary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from complete_verifier_ext import testing
from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
from complete_verifier_ext.bounds.crown import crown, pre_activation_nodes
from complete_verifier_ext.config_load import load_config
from complete_verifier_ext.model.onnx_loader import load_onnx
from complete_verifier_ext.model.torch_loader import from_sequential
from complete_verifier_ext.parallel import comm, launch
from complete_verifier_ext.verify import verify_instance

RTOL = 1e-6  # splitting rows can change the BLAS kernel (DESIGN.md); most rows are bitwise equal


def _problem(kind: str, tmp: str | None = None):
    if kind == "mlp":
        graph, shape = from_sequential(testing.mlp([6, 40, 40, 40, 4], seed=3), (6,)), (6,)
    elif kind == "conv":
        graph, shape = from_sequential(testing.cnn(seed=4), testing.CNN_INPUT_SHAPE), testing.CNN_INPUT_SHAPE
    else:  # written once, by the first (one-process) call: ranks only read it
        path = Path(tmp) / "res.onnx"
        if not path.exists():
            testing.residual_onnx(path, seed=5)
        graph, shape = load_onnx(path), testing.RESIDUAL_INPUT_SHAPE
    x0 = torch.rand(1, *shape, generator=torch.Generator().manual_seed(0))
    box = (x0 - 0.2, x0 + 0.2)
    n = graph.output_size
    C = torch.stack([torch.eye(n)[0] - torch.eye(n)[j] for j in range(1, n)])
    return graph, box, C


def _bounds(kind: str, chunk: int | None, tmp: str | None = None, mode: str = "fsdp") -> dict:
    graph, box, C = _problem(kind, tmp)
    if comm.world_size() > 1:
        graph.shard(mode)
    lb, state = crown(graph, box, C, chunk=chunk)
    alpha, _ = alpha_crown(graph, box, C, state, AlphaOptions(iteration=5, early_stop=False, chunk=chunk))
    inter = {k: state.bounds[k] for k in pre_activation_nodes(graph)}
    return {"crown": lb, "alpha": alpha, "inter": inter, "rows": {k: len(v) for k, v in state.rows.items()}}


def _close(a: dict, b: dict) -> None:
    torch.testing.assert_close(a["crown"], b["crown"], rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(a["alpha"], b["alpha"], rtol=1e-5, atol=1e-5)
    for k in a["inter"]:
        for x, y in zip(a["inter"][k], b["inter"][k], strict=True):
            torch.testing.assert_close(x, y, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "conv", "residual"])
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_equals_one_pass(tmp_path, kind, chunk):
    whole = _bounds(kind, None, str(tmp_path))
    assert max(whole["rows"].values()) > chunk  # the layers really are split into several passes
    _close(_bounds(kind, chunk, str(tmp_path)), whole)


def _pair(kind: str, chunk: int | None, tmp: str, mode: str) -> dict:
    out = _bounds(kind, chunk, tmp, mode)
    return {**out, "rank": comm.rank()}


@pytest.mark.parametrize(("kind", "mode"), [("mlp", "fsdp"), ("conv", "tp"), ("residual", "fsdp")])
def test_chunked_on_two_ranks_equals_one_process(tmp_path, kind, mode):
    """Uneven shares (odd row counts) with a chunk that does not divide them: the ranks still issue
    the same collectives (a hang would fail the launcher's timeout) and get one process's bounds."""
    whole = _bounds(kind, None, str(tmp_path))
    two = launch.run(_pair, 2, (kind, 3, str(tmp_path), mode), backend="gloo")
    _close(two, whole)


def test_the_summary_says_which_chunk_was_used(tmp_path):
    ex = testing.mlp_onnx(tmp_path / "m.onnx", [4, 30, 30, 3], seed=1)
    spec = testing.write_vnnlib(tmp_path / "p.vnnlib", [-0.1] * 4, [0.1] * 4, 0, 3)
    auto, _ = load_config(None, ["--attack.pgd_order", "skip", "--general.complete_verifier", "skip"])
    res = verify_instance(auto, ex, spec, timeout=60)
    assert res.crown_batch_size >= 30 and res.to_json()["crown_batch_size"] == res.crown_batch_size
    given, _ = load_config(None, ["--attack.pgd_order", "skip", "--general.complete_verifier", "skip",
                                  "--solver.crown.batch_size", "4"])  # fmt: skip
    res4 = verify_instance(given, ex, spec, timeout=60)
    assert res4.crown_batch_size == 4
    torch.testing.assert_close(
        torch.tensor(res4.bounds["crown"]), torch.tensor(res.bounds["crown"]), rtol=RTOL, atol=1e-6
    )
