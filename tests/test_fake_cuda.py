"""The native engine with ``general.device: cuda`` keeps every tensor of a computation on one device.

No GPU here: :mod:`fake_cuda` marks what would be on the GPU and raises where CUDA would (a GPU run found
three such mixes, one stage after another; these tests find them on the CPU). Each case runs once on the
CPU and once on the fake GPU: same verdict, same bounds.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_cuda import DeviceMismatch, FakeCuda, on_cuda

from complete_verifier_ext import testing
from complete_verifier_ext.config_load import load_config
from complete_verifier_ext.verify import verify_instance

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "benchmarks"


@pytest.fixture
def fake_cuda(monkeypatch):
    """The stand-in, with ``torch.cuda``'s memory counters answering as an idle GPU would."""
    for name, value in (
        ("synchronize", lambda *a, **k: None),
        ("reset_peak_memory_stats", lambda *a, **k: None),
        ("memory_allocated", lambda *a, **k: 0),
        ("max_memory_allocated", lambda *a, **k: 0),
        ("mem_get_info", lambda *a, **k: (8 << 30, 8 << 30)),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    return FakeCuda


def test_the_stand_in_raises_where_cuda_would():
    host = torch.ones(3)
    with FakeCuda():
        dev = host.to("cuda")
        assert on_cuda(dev) and dev.device.type == "cuda" and not on_cuda(host)
        assert on_cuda(dev * 2 + torch.tensor(1.0))  # a 0-dim CPU tensor passes as a scalar
        assert on_cuda(dev[torch.tensor([0, 2])])  # CPU indices into a GPU tensor
        assert on_cuda(torch.zeros(2, device=dev.device)) and not on_cuda(dev.cpu())
        for bad in (
            lambda: dev + host,
            lambda: dev.numpy(),
            lambda: torch.cat([dev, host]),
            lambda: torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0)),
        ):
            with pytest.raises(DeviceMismatch):
                bad()
        with torch.device("cuda"):
            made = torch.zeros(3)
        assert on_cuda(made)
        with pytest.raises(DeviceMismatch):
            made + host


def _both(cfg_args: list[str], onnx: str, vnnlib: str) -> tuple:
    cpu_cfg, _ = load_config(None, [*cfg_args, "--general.device", "cpu"])
    gpu_cfg, _ = load_config(None, [*cfg_args, "--general.device", "cuda"])
    on_cpu = verify_instance(cpu_cfg, onnx, vnnlib, timeout=120)
    with FakeCuda():
        on_gpu = verify_instance(gpu_cfg, onnx, vnnlib, timeout=120)
    assert on_gpu.verdict == on_cpu.verdict, (on_gpu, on_cpu)
    for method, values in on_cpu.bounds.items():
        np.testing.assert_allclose(on_gpu.bounds[method], values, rtol=1e-5, atol=1e-5)
    return on_cpu, on_gpu


def test_relu_bab_and_attack_on_one_device(fake_cuda, tmp_path):
    """α-CROWN, ReLU BaB and the attack (both verdicts) on a generated MLP."""
    onnx = testing.mlp_onnx(tmp_path / "m.onnx", [4, 12, 12, 3], seed=3)
    bab = ["--general.complete_verifier", "bab", "--solver.alpha-crown.iteration", "5"]
    for eps, label in ((0.05, 0), (0.6, 0)):
        spec = testing.write_vnnlib(tmp_path / f"p{eps}.vnnlib", [-eps] * 4, [eps] * 4, label, 3)
        cpu, _ = _both([*bab, "--attack.pgd_order", "before"], onnx, spec)
        assert cpu.verdict in ("unsat", "sat")


def test_refinement_and_output_milp_on_one_device(fake_cuda, tmp_path):
    onnx = testing.mlp_onnx(tmp_path / "m.onnx", [4, 8, 8, 3], seed=3)
    spec = testing.write_vnnlib(tmp_path / "p.vnnlib", [-0.3] * 4, [0.3] * 4, 0, 3)
    args = ["--general.complete_verifier", "bab-refine", "--solver.alpha-crown.iteration", "2"]
    args += ["--solver.mip.refine_neuron_timeout", "5", "--attack.pgd_order", "skip"]
    args += ["--solver.mip.quick_bab_percentage", "0", "--solver.mip.refine_method", "split+milp"]
    _both(args, onnx, spec)


def test_the_bundled_example_on_one_device(fake_cuda):
    ex = REPO / "complete_verifier_ext" / "examples"
    args = ["--general.complete_verifier", "bab", "--attack.pgd_order", "before"]
    cpu, _ = _both(args, str(ex / "example.onnx"), str(ex / "example.vnnlib"))
    assert cpu.verdict == "unsat"


@pytest.mark.skipif(not (SHARED / "acasxu").is_dir(), reason="../shared/benchmarks/acasxu is absent")
@pytest.mark.parametrize(("net", "prop", "expected"), [("1_1", 5, "unsat"), ("1_5", 2, "sat")])
def test_input_split_on_one_device(fake_cuda, net, prop, expected):
    acas = SHARED / "acasxu"
    args = ["--bab.branching.input_split.enable", "true", "--solver.batch_size", "4096"]
    args += ["--solver.bound_prop_method", "crown", "--attack.pgd_order", "after"]
    onnx = str(acas / "onnx" / f"ACASXU_run2a_{net}_batch_2000.onnx")
    cpu, _ = _both(args, onnx, str(acas / "vnnlib" / f"prop_{prop}.vnnlib"))
    assert cpu.verdict == expected


def test_out_of_memory_in_a_pass_halves_its_rows(fake_cuda, tmp_path, monkeypatch, capsys):
    """A ``torch.OutOfMemoryError`` in a back-substitution pass (raised here for passes of more than 8
    neurons, as a GPU would for passes too big for it): the pass runs again in halves, one warning line
    each time, and the bounds are those of the run that never ran out; with not even one neuron fitting,
    the run gives up with the error."""
    from complete_verifier_ext.bounds import crown

    onnx = testing.mlp_onnx(tmp_path / "m.onnx", [4, 40, 40, 3], seed=3)
    spec = testing.write_vnnlib(tmp_path / "p.vnnlib", [-0.3] * 4, [0.3] * 4, 0, 3)
    args = ["--general.complete_verifier", "skip", "--attack.pgd_order", "skip"]
    args += ["--solver.alpha-crown.iteration", "3"]
    cpu_cfg, _ = load_config(None, [*args, "--general.device", "cpu"])
    gpu_cfg, _ = load_config(None, [*args, "--general.device", "cuda"])
    whole = verify_instance(cpu_cfg, onnx, spec, timeout=120)
    bound_rows, passes = crown._bound_unit_rows, []

    def small_passes_only(graph, k, part, *rest):
        passes.append(len(part))
        if len(part) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return bound_rows(graph, k, part, *rest)

    monkeypatch.setattr(crown, "_bound_unit_rows", small_passes_only)
    limit = 8
    with FakeCuda():
        halved = verify_instance(gpu_cfg, onnx, spec, timeout=120)
    err = capsys.readouterr().err
    assert max(passes) > limit and "retrying in passes of" in err, (passes, err)
    assert all(line.startswith("warning: out of memory in a pass of") for line in err.splitlines())
    assert halved.verdict == whole.verdict
    assert {"crown", "alpha_crown"} <= set(whole.bounds), whole.bounds
    for method, values in whole.bounds.items():
        np.testing.assert_allclose(halved.bounds[method], values, rtol=1e-5, atol=1e-5)
    limit = 0
    with FakeCuda(), pytest.raises(torch.OutOfMemoryError):
        verify_instance(gpu_cfg, onnx, spec, timeout=120)
    assert "pass of 1 row(s) of" in capsys.readouterr().err


def _native_out_of_memory(mode: str, late: bool) -> list:
    """On every rank, CROWN and 3 α-CROWN iterations of an MLP and a small CNN sharded ``mode``, first
    never running out, then with rank 1 running out of memory in every ReLU step of more than 6 A rows
    (midway through a pass: after the first layer's collectives), from CROWN on, or only under autograd
    (``late``: α-CROWN's iterations); 16 spec rows, so that the output node's pass runs out too.
    Returns every rank's bounds and collective calls, per net and run."""
    from complete_verifier_ext.bounds import crown, ops
    from complete_verifier_ext.bounds.alpha import AlphaOptions, alpha_crown
    from complete_verifier_ext.model.torch_loader import from_sequential
    from complete_verifier_ext.parallel import comm

    backward_relu, limit = ops.Relu.backward_relu, [0]

    def small_passes_only(self, A, *rest, **kw):
        rows = (A if isinstance(A, torch.Tensor) else A.values).shape[0]
        if comm.rank() == 1 and rows > limit[0] and (torch.is_grad_enabled() or not late):
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return backward_relu(self, A, *rest, **kw)

    ops.Relu.backward_relu = small_passes_only
    nets = [(testing.mlp([4, 24, 24, 24, 3], seed=3), (4,))]
    nets.append((testing.cnn(3, (1, 8, 8), channels=4, hidden=16), (1, 8, 8)))
    out = []
    for i, (net, shape) in enumerate(nets):
        if comm.rank() == 1:
            print(f"-- net {i}", file=sys.stderr, flush=True)
        graph = from_sequential(net, shape).shard(mode)
        x = torch.zeros(1, *shape)
        box, C = (x - 0.5, x + 0.5), torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        for limit[0] in (10**9, 6):
            comm.reset_stats()
            lb, state = crown.crown(graph, box, C)
            lb_a, _ = alpha_crown(graph, box, C, state, AlphaOptions(iteration=3, early_stop=False))
            out.append((lb, lb_a, {name: v["calls"] for name, v in comm.stats().items()}))
    return comm.all_gather_object(out)


@pytest.mark.parametrize("mode,late", [("fsdp", False), ("tp", False), ("tp", True)])
def test_out_of_memory_at_p2_halves_the_pass_on_every_rank(capfd, mode, late):
    """At P = 2 a rank that runs out of memory midway through a pass of a layer's rows (or of the spec
    rows, the output node's back-substitution) ends that pass with the other rank over no row, and both
    run it again in halves (:func:`.oom.passes_in_lockstep`): the bounds of CROWN and α-CROWN are
    those of the run that never ran out, both ranks make the same collective calls, one warning line
    per pass that ran out (once: α-CROWN's later iterations start from the size that fitted), no hang."""
    from complete_verifier_ext.parallel import launch

    ranks = launch.run(_native_out_of_memory, 2, (mode, late), backend="gloo")
    err = capfd.readouterr().err
    assert "giving up" not in err, err
    for net in err.split("-- net ")[1:]:  # CROWN and α-CROWN's first iteration run out, its later ones not
        lines = [line for line in net.splitlines() if line.startswith("warning: out of memory on rank 1")]
        assert lines and max(collections.Counter(lines).values()) == (1 if late else 2), net
    for net in range(2):
        (lb, lb_a, stats0), (lb1, lb1_a, stats1) = (rank[2 * net + 1] for rank in ranks)
        whole, whole_a, _ = ranks[0][2 * net]
        assert stats0 == stats1, (net, stats0, stats1)
        for got in (lb, lb1):
            np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)
        for got in (lb_a, lb1_a):
            np.testing.assert_allclose(got, whole_a, rtol=1e-5, atol=1e-5)
