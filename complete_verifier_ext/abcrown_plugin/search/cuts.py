"""BICCOS cuts with the BaB domain list split over the ranks.

α,β-CROWN's BICCOS (``cuts.infered_cuts.BICCOS``) infers cuts from the domains a BaB round verified
(``update_cut``, called inside ``split_domain``), merges them into its list (``merge_cuts``) and rebuilds
the one cut module every bound pass uses. Under P > 1 each rank infers cuts from its own share, so after
every round (:func:`agree`, carried by the round's agreement all-gather):

* each rank's new cuts (those not in the list agreed after the previous round) are gathered;
* every rank starts again from the agreed list and merges all the new cuts, rank 0's first, with
  α,β-CROWN's own ``merge_cuts``, then rebuilds the cut module: the same list and module everywhere.

Multi-tree branching (``multi_tree_branching``, which ``auto_param`` switches on when fewer than three
OR clauses are left) is one search over a few trees, ending in a choice of the best tree: it runs on
rank 0 alone (:func:`multi_tree_bab`, with the weights replicated) while the others wait, and its
cuts, domain count and settings are then every rank's; the regular rounds after it are split.
GCP-CROWN's CPLEX cuts are not split (refused at P > 1).
"""

from __future__ import annotations

import json
from typing import Any

from ...parallel import comm
from ..clocks import local_clock
from ..locate import PluginError
from ..run import Run


def _key(cut: dict) -> str:
    return json.dumps(cut, sort_keys=True)


def _biccos(net) -> Any:
    import arguments

    cut = arguments.Config["bab"]["cut"]
    return getattr(net, "biccos", None) if cut["enabled"] and cut["biccos"]["enabled"] else None


def begin_round(net) -> None:
    """Before a round: the agreed list is what every rank holds (the first time: the list as BaB starts
    it, the same everywhere)."""
    biccos = _biccos(net)
    if biccos is not None and "_cve_agreed" not in biccos.__dict__:
        biccos._cve_agreed = list(biccos.biccos_cuts)


def mine(net) -> tuple[list[dict], bool] | None:
    """After this rank's share of a round: (its new cuts, whether its list differs from the agreed one)."""
    biccos = _biccos(net)
    if biccos is None:
        return None
    agreed = {_key(c) for c in biccos._cve_agreed}
    new = [c for c in biccos.biccos_cuts if _key(c) not in agreed]
    return new, {_key(c) for c in biccos.biccos_cuts} != agreed


def agree(net, every: list[tuple[list[dict], bool] | None]) -> None:
    """Merge every rank's new cuts (in rank order) into the agreed list on every rank; one cut module."""
    biccos = _biccos(net)
    if biccos is None or not any(part and part[1] for part in every):
        return
    new = {_key(c): c for part in every if part for c in part[0]}
    biccos.biccos_cuts = list(biccos._cve_agreed)
    biccos.biccos_cuts = biccos.merge_cuts(new)
    biccos._cve_agreed = list(biccos.biccos_cuts)
    _rebuild(net, biccos)


def _rebuild(net, biccos) -> None:
    net.cutter.cuts = biccos.biccos_cuts + biccos.cplex_cuts
    if not net.cutter.cuts:
        return
    module = net.cutter.construct_cut_module()
    net.net.cut_module = module
    for relu in net.net.relus:
        relu.cut_module = module


def multi_tree_bab(run: Run, orig):
    """Multi-tree branching on rank 0 alone; its outcome (cuts, domains left, visited, the batch-size
    ratio it may reset) every rank's. Ranks other than 0 keep their copy of the initial domain, which
    the first regular round empties."""

    def multi_tree_bab(net, domains, batch, stop_criterion_func, biccos_args, stats, *rest):
        import arguments

        if run.weights_sharded:
            raise PluginError(
                "bab.cut.biccos.multi_tree_branching needs the weights whole during its search: "
                "use parallel.bab_weights: replicated (parallel.mode: fsdp)"
            )

        def search():
            with local_clock(run):
                global_lb = orig(net, domains, batch, stop_criterion_func, biccos_args, stats, *rest)
            biccos = _biccos(net)
            return (global_lb.cpu(), len(domains), stats.visited,
                    arguments.Config["solver"]["min_batch_size_ratio"],
                    list(biccos.biccos_cuts) if biccos is not None else None)  # fmt: skip

        global_lb, count, visited, ratio, cuts = comm.from_rank0(search)
        domains.use_bfs = False
        domains._global_len = count
        stats.visited = visited
        arguments.Config["solver"]["min_batch_size_ratio"] = ratio
        biccos = _biccos(net)
        if biccos is not None:
            if comm.rank() != 0:
                biccos.biccos_cuts = cuts
                _rebuild(net, biccos)
            biccos._cve_agreed = list(cuts)
        return global_lb.to(net.device)

    return multi_tree_bab
