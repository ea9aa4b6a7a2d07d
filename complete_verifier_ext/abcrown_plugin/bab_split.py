"""β-CROWN branch and bound inside α,β-CROWN with each round's domains split over the ranks.

α,β-CROWN's BaB round (``bab.act_split_round``) picks a batch of domains out of its domain list,
branches them (BaBSR, FSB, kFSB: decided per domain), bounds the children with β-CROWN and adds them
back. Under P > 1 the domain list stays replicated (every rank holds the same list and picks the same
batch), and the work and memory of the round are split:

* ``bab.split_domain`` gets the rank's contiguous block of the picked domains (``shard_range``); a rank
  whose block is empty skips it. The split depth is computed from the whole batch
  (``bab.get_split_depth``), as at P = 1.
* Inside, everything is rank-local: the weights are replicated for the search (gathered once when BaB
  starts; ``parallel.bab_weights: replicated``), the rows of intermediate layers are not dealt, and
  the clock is the rank's own, so β-CROWN may stop early or prune on one rank only.
* ``BatchedDomainList.add`` does not add there: it keeps the children. After the round every rank
  all-gathers the kept children (moved to the CPU) and adds them in rank order, so the lists stay
  identical; ``stats.visited`` is summed, and "all neurons split" holds if it holds on any rank.

So every rank issues the same collectives (one gather per round, the synced clock between rounds) no
matter what happens inside its block. The children of a domain do not depend on which other domains
share its batch, up to β-CROWN's early stop; the tree can differ from P = 1's in that and in the order
the children are listed, so verdicts agree on instances that finish, not necessarily the domain count.

Refused under P > 1 (one line, before any rank starts): cuts / BICCOS / multi-tree search, BaB attack,
input splits, clip-and-verify, MIP (``complete_verifier: mip`` / ``bab-refine``), and
``enable_opt_interm_bounds`` (its intermediate α would be the row-sharded ones).
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel import comm

_round: list | None = None  # the children BatchedDomainList.add keeps during a split round
_global_batch: int | None = None  # the whole round's batch, for get_split_depth


def unsupported(all_args: dict) -> list[str]:
    """The configured features that BaB with domains split over ranks cannot run yet."""
    bab, solver, general = all_args["bab"], all_args["solver"], all_args["general"]
    if general["complete_verifier"] == "skip":
        return []
    found = []
    if general["complete_verifier"] in ("mip", "bab-refine"):
        found.append(f"general.complete_verifier: {general['complete_verifier']} (MIP)")
    if bab["cut"]["enabled"]:
        found.append("bab.cut.enabled (cuts, BICCOS)")
    if bab["attack"]["enabled"]:
        found.append("bab.attack.enabled")
    if bab["branching"]["input_split"]["enable"] or bab["branching"]["branching_input_and_activation"]:
        found.append("input splits (bab.branching.input_split / branching_input_and_activation)")
    clip = bab["clip_n_verify"]
    if clip["clip_input_domain"]["enabled"] or clip["clip_interm_domain"]["enabled"]:
        found.append("bab.clip_n_verify")
    if solver["beta-crown"]["enable_opt_interm_bounds"]:
        found.append("solver.beta-crown.enable_opt_interm_bounds")
    return found


def _rows(t: Any, lo: int, hi: int, dim: int = 0) -> Any:
    return t.narrow(dim, lo, hi - lo) if isinstance(t, torch.Tensor) else t


def slice_domains(d: dict, lo: int, hi: int) -> dict:
    """Domains ``[lo, hi)`` of a batch from ``BatchedDomainList.pick_out`` (its α have the batch in
    dimension 2, everything else in dimension 0 or as list items)."""
    out = dict(d)
    for key in ("mask", "lAs", "lower_bounds", "upper_bounds"):
        if d.get(key) is not None:
            out[key] = {k: _rows(v, lo, hi) for k, v in d[key].items()}
    if d.get("alphas") is not None:
        alphas = d["alphas"].items()
        out["alphas"] = {k: {kk: _rows(vv, lo, hi, 2) for kk, vv in v.items()} for k, v in alphas}
    for key in ("betas", "intermediate_betas", "history", "split_history", "depths"):
        if d.get(key) is not None:
            out[key] = d[key][lo:hi]
    for key in ("global_lb", "cs", "thresholds", "x_Ls", "x_Us", "input_split_idx"):
        out[key] = _rows(d.get(key), lo, hi)
    return out


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _batch_of(d: dict) -> int:
    return int(next(iter(d["lower_bounds"].values())).shape[0])


def wrap_split_domain(orig, add):
    """``orig``: α,β-CROWN's ``bab.split_domain``; ``add``: the unwrapped ``BatchedDomainList.add``."""

    def split_domain(net, domains, d, batch, stats=None, **kwargs):
        global _round, _global_batch
        from . import patches

        n = _batch_of(d)
        lo, hi = comm.shard_range(n)
        visited = stats.visited
        _round, _global_batch = [], n
        try:
            with patches.local_clock():
                if hi > lo:
                    orig(net, domains, slice_domains(d, lo, hi), batch, stats=stats, **kwargs)
            kept = _round
        finally:
            _round, _global_batch = None, None
        all_split = bool(getattr(stats, "all_node_split", False))
        mine = (_cpu(kept), stats.visited - visited, all_split, getattr(stats, "all_split_result", "unknown"))
        every = comm.all_gather_object(mine)
        for children, *_ in every:
            for bounds, dd, check in children:
                add(domains, bounds, dd, check)
        stats.visited = visited + sum(e[1] for e in every)
        if any(e[2] for e in every):
            results = [e[3] for e in every if e[2]]
            stats.all_node_split = True
            stats.all_split_result = "unsafe" if "unsafe" in results else "unknown"
        return None

    return split_domain


def wrap_add(orig):
    def add(self, bounds, d, check_infeasibility):
        if _round is None:
            return orig(self, bounds, d, check_infeasibility)
        kept = {k: d[k] for k in ("history", "thresholds", "depths")}
        _round.append((bounds, kept, check_infeasibility))
        return None

    return add


def wrap_get_split_depth(orig):
    def get_split_depth(batch_size, min_batch_size, min_depth):
        return orig(_global_batch or batch_size, min_batch_size, min_depth)

    return get_split_depth


def wrap_general_bab(orig):
    def general_bab(net, x, c, rhs, reference_dict=None, timeout=None, max_iterations=None):
        from . import fsdp, rows

        with fsdp.replicated(), rows.inactive():
            return orig(net, x, c, rhs, reference_dict, timeout, max_iterations)

    return general_bab


def install(p) -> None:
    import bab as abcrown_bab
    import branching_domains
    import complete_verifier_func

    add = p.original("branching_domains.BatchedDomainList.add")
    p.set(abcrown_bab, "split_domain", wrap_split_domain(abcrown_bab.split_domain, add))
    p.set(abcrown_bab, "get_split_depth", wrap_get_split_depth(abcrown_bab.get_split_depth))
    p.set(branching_domains.BatchedDomainList, "add", wrap_add(add))
    p.set(complete_verifier_func, "general_bab", wrap_general_bab(complete_verifier_func.general_bab))
