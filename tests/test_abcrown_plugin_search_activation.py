"""``abcrown_plugin/search/`` (``rounds``, ``activation``): α,β-CROWN's BaB with the domain list split over
the ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from plugin_support import (
    BAB_YAML,
    VENDOR,
    config,
    instance,
    needs_abcrown,
    plugin_env,
    run,
)


def _visited(stdout: str) -> int:
    lines = [ln for ln in stdout.splitlines() if ln.endswith(" domains visited")]
    return int(lines[-1].split()[0]) if lines else 0


# what unpatched α,β-CROWN (P = 1) gives on 256x2 prop_9_0.05 with BAB_YAML (kFSB, 8 domains a round):
# unsat after 16 domains
BAB_P1 = ("unsat", 16)


@needs_abcrown
@pytest.mark.parametrize(("mode", "P"), [("fsdp", 2), ("tp", 3)])
def test_bab_with_domains_split_over_ranks(tmp_path, mode, P):
    """256x2 prop_9_0.05 needs BaB: every rank keeps its own share of the domain list and bounds up to
    ⌈8 / P⌉ of them a round, rebalanced when the queues drift. Same verdict and (this tree is small
    enough that every round takes all its domains) the same domain count as unpatched P = 1, at P = 2
    and at P = 3 (uneven shares), with the weights replicated for the search (``fsdp``, the default) or
    kept sharded (``tp``: each rank fetches single shards on request, ``parallel.serve``, with its own
    number of bound passes; never a whole weight, none left alive). Every rank issues the same
    collectives in every round (``bab_collectives``): two ``all_gather_object`` (counts, agreement),
    one more for a rebalance, and the serving ticks when the weights stay sharded. ``fsdp`` with
    ``bab_weights: sharded`` runs in the kill test and ``test_parallel_serve``."""
    cfg = config(tmp_path, BAB_YAML)
    args = instance("mnist-net_256x2", "prop_9_0.05.vnnlib")
    env = plugin_env(CVE_ABCROWN_AUDIT="1") if mode == "tp" else None
    proc, s, results = run(tmp_path, cfg, *args, P=P, mode=mode, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (results.strip(), _visited(proc.stdout)) == BAB_P1
    rounds = s["bab_collectives"]
    assert len(rounds) == P and all(r == rounds[0] for r in rounds) and len(rounds[0]) >= 2, rounds
    whole, shards = zip(*s["bab_weight_fetches"], strict=True)
    if mode == "tp":
        assert s["parallel"]["bab_weights"] == "sharded"
        assert sum(whole) == 0 and min(shards) > 0
        assert s["full_weights_live"] == [[[], []]] * P
        assert min(rounds[0]) > 2  # the ticks of the shards served
    else:
        assert s["parallel"]["bab_weights"] == "replicated" and sum(whole) + sum(shards) == 0
        assert set(rounds[0]) <= {2, 3}, rounds


MOVE = """
import sys, types
import torch
from complete_verifier_ext.abcrown_plugin import bridge, locate
from complete_verifier_ext.abcrown_plugin.search import activation
bridge.import_abcrown(locate.find({vendor!r}))
import arguments
sys.argv = ["abcrown"]
arguments.Config.parse_config()
from tensor_storage import get_tensor_storage as S

def domains(n, first, unstable=True):
    v = lambda *shape: torch.arange(first, first + n * int(torch.Size(shape).numel())).float().view(n, *shape)
    a = torch.arange(first, first + 2 * n * 4).float().view(2, 1, n, 4)  # alpha: the batch in dim 2
    return types.SimpleNamespace(
        final_name="out", num_domains=n, all_lAs={{"relu": S(v(3))}}, all_global_lbs=S(v(2)),
        all_global_ubs=S(v(2) + 1), all_thresholds=S(v(2) * 0), Cs=S(v(2, 10)),
        all_lb_alls={{"out": S(v(2)), "x": S(torch.zeros(1, 7))}},
        all_ub_alls={{"out": S(v(2) + 2), "x": S(torch.ones(1, 7))}},
        all_x_Ls=None, all_x_Us=None, all_input_split_idx=None,
        all_alphas={{"relu": {{"out": S(a, concat_dim=2)}}}},
        unstable_interm_bounds={{"l": [S(v(5)), S(v(5) + 1)]}} if unstable else None,
        all_betas=[f"b{{first + i}}" for i in range(n)], all_intermediate_betas=[None] * n,
        histories=[{{"h": first + i}} for i in range(n)], split_histories=[[]] * n, depths=list(range(n)),
    )

a, b = domains(5, 0), domains(0, 100, unstable=False)  # b: a rank that never added children
whole = {{k: s.tensor().clone() for k, s in activation.storages(a).items()}}
moved = activation.take(a, 2)  # the top of the stack, as pick_out takes it
assert a.num_domains == 3 and [h["h"] for h in a.histories] == [0, 1, 2]
activation.put(b, moved)
assert b.num_domains == 2 and [h["h"] for h in b.histories] == [3, 4] and b.all_betas == ["b3", "b4"]
for key, s in activation.storages(b).items():
    dim = 2 if key[0] == "alpha" else 0
    assert torch.equal(s.tensor(), whole[key].narrow(dim, 3, 2)), key
for key, s in activation.storages(a).items():
    dim = 2 if key[0] == "alpha" else 0
    assert torch.equal(s.tensor(), whole[key].narrow(dim, 0, 3)), key
back = activation.take(b, 2)
activation.put(a, back[:1])  # and back in two slices (a rebalancing receiver's part): the list as it was
activation.put(a, back[1:])
for key, s in activation.storages(a).items():
    assert torch.equal(s.tensor(), whole[key]), key
assert [h["h"] for h in a.histories] == [0, 1, 2, 3, 4] and a.num_domains == 5
# the initial domains (the bottom 2 of 5) carry no stored bounds of unstable neurons: α,β-CROWN creates
# those storages at its first add; a domain moved from there gets the static ones, and a list that
# stores them gets the static ones for domains from a rank that never added children
c = domains(5, 0)
c.unstable_interm_bounds = {{"l": [S(torch.full((3, 2), 7.0)), S(torch.full((3, 2), 8.0))]}}
c.static_lb = {{"l": torch.tensor([[-1.0, -2.0, -3.0]])}}
c.static_ub = {{"l": torch.tensor([[1.0, 2.0, 3.0]])}}
c.unstable_mask = {{"l": torch.tensor([[True, False, True]])}}
part = activation.take(c, 4)
assert part.tensors[("unstable", "l", 0)].tolist() == [[-1.0, -3.0]] + [[7.0, 7.0]] * 3
assert part.tensors[("unstable", "l", 1)].tolist() == [[1.0, 3.0]] + [[8.0, 8.0]] * 3
assert len(c.unstable_interm_bounds["l"][0]) == 0 and c.num_domains == 1
d = domains(0, 200, unstable=False)
d.static_lb, d.static_ub, d.unstable_mask = c.static_lb, c.static_ub, c.unstable_mask
activation.put(d, part)
assert d.unstable_interm_bounds["l"][0].tensor().tolist() == [[-1.0, -3.0]] + [[7.0, 7.0]] * 3
plain = activation.take(domains(2, 300, unstable=False), 2)  # from a rank that never added children
activation.put(d, plain)
assert d.num_domains == 6 and d.unstable_interm_bounds["l"][1].tensor()[4:].tolist() == [[1.0, 3.0]] * 2
try:
    activation.take(a, 6)
except RuntimeError as e:
    print("refused:", e)
"""


@needs_abcrown
def test_domains_move_between_lists_whole_and_in_order(tmp_path):
    """The rebalancer's take/put on α,β-CROWN's own TensorStorages: every per-domain tensor and list
    moves (the α with the batch in dim 2, the intermediate bounds created on a rank that had none),
    in order, and a round trip restores the list; the initial domains, which α,β-CROWN stores no
    unstable-neuron bounds for, move with their static ones, so every stored entry stays its own
    domain's (before: a refusal, ``RuntimeError`` on 256x4 prop_1_0.03 at P = 2); asking for more
    domains than held is an error."""
    code = MOVE.format(vendor=str(VENDOR))
    out = subprocess.run(
        [sys.executable, "-c", code], env=plugin_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: asked for 6 of 5 domains" in out.stdout


@needs_abcrown
@pytest.mark.parametrize(
    ("change", "mode", "named"),
    [
        (
            ("  timeout: 120", "  timeout: 120\n  branching:\n    branching_input_and_activation: true"),
            "fsdp",
            "bab.branching.branching_input_and_activation",
        ),
    ],
)
def test_bab_features_not_split_yet_are_refused(tmp_path, change, mode, named):
    cfg = config(tmp_path, BAB_YAML.replace(*change))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=2, mode=mode)
    assert proc.returncode == 1 and results == "error\n"
    assert f"not supported with parallel.world_size > 1 yet: {named}" in proc.stderr


def test_worst_domain_over_the_ranks_treats_nan_as_worst():
    import torch

    from complete_verifier_ext.abcrown_plugin.search.rounds import worst_over_ranks

    nan = torch.tensor([float("nan"), -1.0])
    assert worst_over_ranks([torch.tensor([0.5]), None, nan]) is nan  # NaN proves nothing: never the best
    a = torch.tensor([-0.2, -3.0])  # its best spec (-0.2) is worse than the other domain's (-0.1)
    assert worst_over_ranks([a, torch.tensor([-0.1])]) is a
    assert torch.equal(worst_over_ranks([None, None]), torch.tensor(1e-7))  # α,β-CROWN: empty list


@needs_abcrown
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize(
    ("key", "line"),
    [
        ("  attack:\n    enabled: true", "bab.attack.enabled: alpha-beta-CROWN refuses it "
         "('Bab attack is not out of date and to be fixed.', abcrown.py)"),
        ("  cut:\n    enabled: true\n    cplex_cuts: true", "bab.cut.cplex_cuts: alpha-beta-CROWN needs its "
         "CPLEX cut generator"),
    ],
)  # fmt: skip
def test_what_abcrown_refuses_is_refused_alike_at_every_p(tmp_path, P, key, line):
    """``bab.attack.enabled``: α,β-CROWN asserts it off; ``bab.cut.cplex_cuts`` without the CPLEX cut
    generator built in the checkout: α,β-CROWN stops with an exception when BaB starts. The plugin
    says so in one line at every P, before anything runs."""
    cfg = config(tmp_path, BAB_YAML.replace("  timeout: 120", "  timeout: 120\n" + key))
    proc, s, results = run(tmp_path, cfg, *instance("mnist-net_256x2", "prop_9_0.05.vnnlib"), P=P)
    assert proc.returncode == 1 and results == "error\n"
    assert line in proc.stderr.splitlines()[-1]
