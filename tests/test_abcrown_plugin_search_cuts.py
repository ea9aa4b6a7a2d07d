"""``abcrown_plugin/search/cuts.py``: BICCOS cuts with the BaB domain list split over the ranks."""

from __future__ import annotations

import types

from plugin_support import BENCH, VENDOR, config, needs_abcrown, run

from complete_verifier_ext.parallel import launch

OVAL = BENCH / "oval21"


def _biccos_yaml() -> str:
    """α,β-CROWN's own ``BICCOS/oval22/biccos_only_cs.yaml`` as a user runs it here, with one round of
    multi-tree search (its default runs until the instance is done here, leaving no regular round) and
    20 α-CROWN iterations."""
    import yaml

    data = yaml.safe_load(
        (VENDOR / "complete_verifier/exp_configs/BICCOS/oval22/biccos_only_cs.yaml").read_text()
    )
    data["general"] = {"device": "cpu"}
    data["bab"]["cut"]["biccos"]["multi_tree_branching"] = {"iterations": 1}
    data["solver"]["alpha-crown"] = {"iteration": 20}  # a shorter incomplete phase (default 100)
    return yaml.safe_dump(data)


def _oval(img: str) -> list[str]:
    onnx, spec = OVAL / "onnx" / "cifar_base_kw.onnx", OVAL / "vnnlib" / f"cifar_base_kw-{img}.vnnlib"
    return ["--onnx_path", str(onnx), "--vnnlib_path", str(spec), "--timeout", "200"]


@needs_abcrown
def test_biccos_multi_tree_search_then_split_rounds_at_p2(tmp_path):
    """oval21 cifar_base_kw img4763 with α,β-CROWN's BICCOS config: fewer than three labels are left,
    so α,β-CROWN switches multi-tree branching on. Rank 0 runs that search alone (it infers the first
    cuts) while rank 1 waits; then the regular rounds are split, BICCOS inferring on each rank's share
    and the new cuts merged on every rank. P = 1's verdict and domains (912); the ranks issue the same
    collectives every round."""
    cfg = config(tmp_path, _biccos_yaml())
    proc, s, results = run(tmp_path, cfg, *_oval("img4763-eps0.024705882352941175"), P=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.strip() == "unsat" and s["bab"]["domains"] == 912
    assert "Shallow-BaB round 1" in proc.stdout and "BICCOS cuts are added to the cut module." in proc.stdout
    rounds = s["bab_collectives"]
    assert rounds[0] == rounds[1] and len(rounds[0]) >= 2


class _Biccos:
    """Stands in for α,β-CROWN's BICCOS: a list of cuts, merged as a union in order."""

    def __init__(self, cuts: list[dict]) -> None:
        self.biccos_cuts, self.cplex_cuts = cuts, []

    def merge_cuts(self, new: dict) -> list[dict]:
        return self.biccos_cuts + [c for c in new.values() if c not in self.biccos_cuts]


def _agree(vendor: str) -> list:
    import sys

    from complete_verifier_ext.abcrown_plugin import bridge, locate
    from complete_verifier_ext.abcrown_plugin.search import cuts
    from complete_verifier_ext.parallel import comm

    bridge.import_abcrown(locate.find(vendor))
    import arguments

    sys.argv = ["abcrown"]
    arguments.Config.parse_config()
    arguments.Config["bab"]["cut"]["enabled"] = arguments.Config["bab"]["cut"]["biccos"]["enabled"] = True
    built = []
    cutter = types.SimpleNamespace(
        cuts=None, construct_cut_module=lambda: built.append(list(cutter.cuts)) or "m"
    )
    relu = types.SimpleNamespace(cut_module=None)
    net = types.SimpleNamespace(
        biccos=_Biccos([{"a": 0}]), cutter=cutter, net=types.SimpleNamespace(relus=[relu])
    )
    cuts.begin_round(net)
    net.biccos.biccos_cuts = [{"a": 0}, {"r": comm.rank()}, {"shared": 1}]  # what this rank's share inferred
    cuts.agree(net, comm.all_gather_object(cuts.mine(net)))
    first = (net.biccos.biccos_cuts, built[-1], relu.cut_module)
    cuts.begin_round(net)  # a round with nothing new anywhere: no rebuild
    cuts.agree(net, comm.all_gather_object(cuts.mine(net)))
    return comm.all_gather_object((first, len(built)))


@needs_abcrown
def test_new_cuts_merged_in_rank_order_on_every_rank():
    """Each rank's new cuts, merged onto the agreed list in rank order: the same list and one rebuilt
    cut module on every rank; a round without new cuts rebuilds nothing."""
    (a, n0), (b, n1) = launch.run(_agree, 2, (str(VENDOR),), backend="gloo")
    assert a == b and n0 == n1 == 1
    assert a[0] == [{"a": 0}, {"r": 0}, {"shared": 1}, {"r": 1}] and a[2] == "m"
