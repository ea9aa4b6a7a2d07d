"""``abcrown_plugin/rows/``: the rows of each bounded layer (and their α) dealt over the ranks,
under ``fsdp`` and ``tp``: the bounds are unpatched α,β-CROWN's."""

from __future__ import annotations

import json

import pytest
import torch
from plugin_support import (
    BOUNDS_YAML,
    CHUNK,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    python,
    run,
)
from support import relative_error as rel


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_rows_dealt_evenly_in_as_many_passes_on_every_rank(P):
    """A start node's rows go to the ranks in contiguous blocks of ⌊U / P⌋ or ⌈U / P⌉ (or whole
    channels, about U / P rows each, where α is per channel), and every rank runs the same number of
    passes of at most ``crown.batch_size`` rows, near-equal in size (an empty one: a one-row dummy)."""
    from complete_verifier_ext.abcrown_plugin.rows.deal import (
        channel_blocks,
        even_blocks,
        passes_per_rank,
        split_passes,
    )

    for U in [*range(1, 40), 255, 1000, 3001]:
        owners = even_blocks(U, P)
        counts = torch.bincount(owners, minlength=P)
        assert bool((owners[1:] >= owners[:-1]).all()) and int(counts.max() - counts.min()) <= 1
        for batch in (1, 7, 64, 512, 10**9):
            k = passes_per_rank(counts.tolist(), batch)
            for q in range(P):
                parts = split_passes((owners == q).nonzero().squeeze(1), k)
                sizes = [int((p >= 0).sum()) for p in parts]
                assert len(parts) == k and sum(sizes) == int(counts[q]) and max(sizes) <= batch
                assert max(sizes) - min(sizes) <= 1 and all(p.numel() >= 1 for p in parts)
    gen = torch.Generator().manual_seed(P)
    channels = torch.randint(0, 64, (5000,), generator=gen).sort().values  # rows sorted by channel
    of_channel = channel_blocks(channels, 64, P)
    assert bool((of_channel[1:] >= of_channel[:-1]).all())  # contiguous blocks of channels
    rows = torch.bincount(of_channel[channels], minlength=P)
    assert int(rows.max()) <= 5000 / P + int(torch.bincount(channels).max())


class _Relu:  # what whole_alpha_dict reads of a BoundRelu: its name (a weak key of ``Rows.alpha``)
    name = "relu"


def _alpha_round_trip() -> dict:
    """On each rank: an α (float64, float32, float16) of 7 start rows split by row as ``init_opt_parameters``
    keeps it, then made whole by ``whole_alpha_dict`` as α,β-CROWN's BaB and ``recover`` read it."""
    from complete_verifier_ext.abcrown_plugin.rows.alpha import AlphaLayout, whole_alpha_dict
    from complete_verifier_ext.abcrown_plugin.rows.deal import even_blocks
    from complete_verifier_ext.abcrown_plugin.run import Rows

    out = {}
    for dtype in (torch.float64, torch.float32, torch.float16):
        alpha = torch.rand(2, 7, 1, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        alpha = alpha.to(dtype)
        layout = AlphaLayout(even_blocks(7), torch.arange(7), False, 7, (7,))
        state, relu = Rows(active=True), _Relu()
        state.alpha[relu] = {"start": layout}
        saved = {"relu": {"start": layout.split(alpha)}}
        whole_alpha_dict(state, saved)
        got = saved["relu"]["start"]
        out[str(dtype)] = (got.dtype == dtype, torch.equal(got, alpha))
    return out


def test_alpha_kept_by_row_is_made_whole_bit_for_bit_in_its_dtype():
    """The α kept by row, made whole again for BaB, is the α in its own dtype bit for bit: float64
    (``double_fp``, ``alpha_dtype: auto``) not rounded through float32 on the way."""
    from complete_verifier_ext.parallel import launch

    got = launch.run(_alpha_round_trip, 2, timeout_s=60)
    assert got == {str(d): (True, True) for d in (torch.float64, torch.float32, torch.float16)}


@needs_abcrown
@pytest.mark.parametrize(("P", "mode"), [(3, "fsdp"), (3, "tp")])  # P = 2: test_tp_conv…, test_bab…
def test_bounds_equal_unpatched_with_split_rows(unpatched, P, mode):
    """FSDP (weights gathered per call) and TP (never a whole weight: column-parallel forward and IBP,
    ``A @ W`` around a ring of shards), rows and α split: the bounds are unpatched α,β-CROWN's."""
    tmp, cfg, ref = unpatched
    proc, got, results = run(
        tmp,
        cfg,
        *instance("mnist-net_256x2", "prop_0_0.05.vnnlib"),
        P=P,
        name=f"p{P}{mode}",
        env=plugin_env(CVE_ABCROWN_AUDIT="1"),
        mode=mode,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert got["engine"] == "abcrown" and got["verdict"] == ref["verdict"]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-6
    # the passes are dealt whole and the gradients summed only where split: α-CROWN is one process's
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-6
    assert len(got["peak_mb"]) == P and got["crown_batch_size"] == CHUNK
    assert results.strip() == "timeout"
    # rank 0 alone prints: α,β-CROWN's "Result:" line appears once
    assert proc.stdout.count("Result: ") == 1
    # α is kept by row: 256x2 has 6972 α elements, 4200 of them one start node's 140 rows; each rank
    # holds its block of passes of those (+1 default slot) and the replicated rest
    assert ref["alpha_elements"] == [6972]
    assert max(got["alpha_elements"]) <= 2772 + 30 * (140 // P + CHUNK + 1)  # + one pass, slot 0
    # no rank holds a whole weight (nor a copy, nor a transposed copy) at the start and end of the build
    assert got["full_weights_live"] == [[[], []]] * P


@needs_abcrown
def test_a_layer_with_fewer_rows_than_passes_on_every_rank(tmp_path):
    """171 rows a pass at P = 3 on 256x6: a layer bounded for all its 256 neurons is three passes of 86
    (with two passes of 171, rank 2 owned none of its rows, kept α's default slot alone and ran dummy
    passes); the bounds are one process's."""
    cfg = config(tmp_path, BOUNDS_YAML.format(chunk=171).replace("iteration: 10", "iteration: 3"))
    args = instance("mnist-net_256x6", "prop_0_0.05.vnnlib")
    p1, ref, _ = run(tmp_path, cfg, *args, name="p1")
    p3, got, _ = run(tmp_path, cfg, *args, P=3, name="p3")
    assert p1.returncode == 0 and p3.returncode == 0, p3.stderr[-2000:]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-6
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-5


OWNERS = """
import json
import torch
from auto_LiRPA import BoundedModule, BoundedTensor
from auto_LiRPA.perturbations import PerturbationLpNorm
from complete_verifier_ext.abcrown_plugin.rows.deal import start_owners
from complete_verifier_ext.abcrown_plugin.run import Rows
torch.manual_seed(0)
L = torch.nn.Linear
relu, sigmoid = torch.nn.ReLU(), torch.nn.Sigmoid()
net = torch.nn.Sequential(L(4, 8), relu, L(8, 6), sigmoid, L(6, 5), torch.nn.ReLU(), L(5, 2))
x = torch.zeros(1, 4)
m = BoundedModule(net, x)
m.compute_bounds(x=(BoundedTensor(x, PerturbationLpNorm(x_L=x - 0.05, x_U=x + 0.05)),), method="CROWN")
for act in m.nodes():
    if type(act).__name__ in ("BoundRelu", "BoundSigmoid"):
        z = act.inputs[0]
        crossing = ((z.lower < 0) & (z.upper > 0)).flatten().tolist()
        print(json.dumps([type(act).__name__, start_owners(Rows(active=True), m, z).tolist(), crossing]))
"""


@needs_abcrown
def test_a_sigmoids_input_is_dealt_whole():
    """auto_LiRPA keeps an α row for every neuron of a sigmoid's input (no sparse-spec α there: every
    neuron's bound matters, whether or not its interval crosses 0), and so do the ranks: every neuron
    of it has an owner, where a ReLU's input has owners only where its interval crosses 0. (They had
    kept the crossing ones only, the others' α untrained: on dist_shift's index2101 the sigmoid input's
    bounds were 1.7% wider at P = 2 than at P = 1; now equal to float32 rounding.)"""
    out = python(OWNERS)
    assert out.returncode == 0, out.stderr[-3000:]
    found = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [kind for kind, _, _ in found] == ["BoundRelu", "BoundSigmoid", "BoundRelu"], found
    for kind, owners, crossing in found:
        if kind == "BoundSigmoid":
            assert not any(crossing) and min(owners) >= 0, found  # (no sigmoid input crosses 0 here)
        else:
            assert [o >= 0 for o in owners] == crossing, found


RESNET_YAML = """general:
  device: cpu
  complete_verifier: skip
  double_fp: true
solver:
  crown:
    batch_size: 128
  alpha-crown:
    iteration: 2
    lr_alpha: 0.25
    full_conv_alpha: false
attack:
  pgd_order: skip
"""


@needs_abcrown
def test_residual_sums_in_patches_mode_are_dealt(tmp_path):
    """A ResNet in patches mode (α,β-CROWN's default for convs): auto_LiRPA bounds a conv layer's unstable
    neurons in passes, but a residual sum's (``BoundAdd``) in one pass on every rank. The plugin bounds
    the sums in passes too, over the neurons auto_LiRPA bounds, and deals them: at P = 2 under tp every
    rank bounds its share of both kinds, and CROWN is one process's. Where a sum has a dense α of its
    own (α-CROWN, cifar100.yaml's settings), auto_LiRPA bounds every neuron of it, and so do the passes:
    bounding only its unstable neurons there moved α-CROWN's bounds by 1.1e-2 here (after 5 iterations).

    In float64: α-CROWN's iterates on a ResNet are sensitive to float32 rounding (Adam's first step is
    ±lr whatever the gradient's size, and a back-substitution's input coefficients that cancel to about
    0 take their sign from the rounding), so that float32 P = 1 and float64 P = 1 differ by 9e-5 after
    20 iterations on this net, and tp's blockwise sums another way by 9e-5. In float64, P = 2 runs
    P = 1's iterates: 6.5e-12 after 20 iterations (1e-9 asserted here after 2, the second bound after
    one step): a lost or doubled part of a gradient would show at once."""
    import numpy as np
    import onnxruntime as ort

    from complete_verifier_ext.examples.resnet import build
    from complete_verifier_ext.testing import write_vnnlib

    side, eps = 16, 0.004
    onnx = tmp_path / "resnet.onnx"
    build(onnx, stages=(4, 8, 8, 8), side=side, fc=32, classes=10, normalise=False)
    x = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(0)).numpy()
    label = int(ort.InferenceSession(str(onnx)).run(None, {"x": x})[0].argmax())
    spec = write_vnnlib(tmp_path / "r.vnnlib", np.clip(x - eps, 0, 1), np.clip(x + eps, 0, 1), label, 10)
    cfg = config(tmp_path, RESNET_YAML)
    args = ["--onnx_path", str(onnx), "--vnnlib_path", spec]
    p1, ref, _ = run(tmp_path, cfg, *args, name="p1")
    p2, got, _ = run(tmp_path, cfg, *args, P=2, mode="tp", name="p2")
    assert p1.returncode == 0 and p2.returncode == 0, p2.stderr[-2000:]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-9
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-9
    assert ref["rows_dealt"] == [{}]
    assert all(r.get("BoundAdd", 0) > 0 and r.get("BoundConv", 0) > 0 for r in got["rows_dealt"])
    # the four sums wider than a pass (1024, 1024, 512, 512 neurons) have a dense α: each of α-CROWN's 2
    # iterations bounds all their 3072 neurons again, half of them on each rank
    assert all(r["BoundAdd"] >= 2 * 3072 // 2 for r in got["rows_dealt"]), got["rows_dealt"]


CNN7_YAML = """general:
  device: cpu
  complete_verifier: skip
solver:
  crown:
    batch_size: 512
  alpha-crown:
    iteration: 5
    full_conv_alpha: {full}
attack:
  pgd_order: skip
"""


@pytest.fixture(scope="module")
def cnn7(tmp_path_factory):
    """A CNN7 of 2 channels on 8x8 inputs (five convs, 512-wide fc) whose every layer has fewer unstable
    neurons than ``crown.batch_size`` (the most, fc1's 511, of 512): the layers auto_LiRPA bounds in
    one pass; and the P = 1 references, per-neuron and per-channel conv α."""
    import numpy as np
    import onnxruntime as ort

    from complete_verifier_ext.examples.cnn7 import build
    from complete_verifier_ext.testing import write_vnnlib

    tmp = tmp_path_factory.mktemp("cnn7")
    onnx = tmp / "cnn7.onnx"
    build(onnx, width=2, shape=(3, 8, 8))
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(3)).numpy()
    label = int(ort.InferenceSession(str(onnx)).run(None, {"x": x})[0].argmax())
    spec = write_vnnlib(tmp / "s.vnnlib", np.clip(x - 0.01, 0, 1), np.clip(x + 0.01, 0, 1), label, 10)
    args = ["--onnx_path", str(onnx), "--vnnlib_path", spec]
    refs = {}
    for full in ("true", "false"):
        cfg = config(tmp, CNN7_YAML.format(full=full), f"{full}.yaml")
        proc, refs[full], _ = run(tmp, cfg, *args, name=f"p1{full}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp, args, refs


@needs_abcrown
@pytest.mark.parametrize(("P", "mode", "full"), [(2, "fsdp", "true"), (3, "tp", "false")])
def test_conv_layers_below_the_pass_size_are_dealt(cnn7, P, mode, full):
    """Every layer of a small CNN7 has fewer unstable neurons than ``crown.batch_size``: at P > 1 their
    rows are dealt all the same (auto_LiRPA would bound each in one pass on every rank), with their α
    kept by row (per neuron, or per channel with ``full_conv_alpha: false``), and so are the output
    node's spec rows and α in α-CROWN's iterations. Every rank bounds conv rows (whole channels where α
    is per channel: this net's first layers have two), CROWN is P = 1's within 1e-6 and α-CROWN within
    1e-5 after the same iterations, and every rank issues the same collectives."""
    tmp, args, refs = cnn7
    ref = refs[full]
    cfg = config(tmp, CNN7_YAML.format(full=full), f"{full}.yaml")
    proc, got, _ = run(tmp, cfg, *args, P=P, mode=mode, name=f"p{P}{mode}{full}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dealt = got["rows_dealt"]
    assert len(dealt) == P and all(d.get("BoundConv", 0) > 0 and d.get("BoundLinear", 0) > 0 for d in dealt)
    assert len(set(got["collectives"])) == 1, got["collectives"]
    assert rel(ref["bounds"]["crown"], got["bounds"]["crown"]) < 1e-6
    assert rel(ref["bounds"]["alpha_crown"], got["bounds"]["alpha_crown"]) < 1e-5
    assert max(got["alpha_elements"]) < 0.75 * ref["alpha_elements"][0]  # each rank holds its share
