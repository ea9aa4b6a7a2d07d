"""β-CROWN branch and bound inside α,β-CROWN with the domain list split over the ranks.

α,β-CROWN's BaB (``complete_verifier_func.general_bab`` → ``bab.general_bab``) runs rounds
(``bab.act_split_round``): pick a batch of domains out of the list (``BatchedDomainList``, tensors on
the CPU), branch them (BaBSR, FSB, kFSB: decided per domain), bound the children with β-CROWN and add
the unverified ones back. Under P > 1 each rank keeps its own share of the list, and a round becomes:

1. one ``all_gather_object`` of (domains held, batch size); the batch is the smallest over the ranks
   (``AutoBatchSize`` may enlarge it on one rank only), and a rank's share of it is ⌈B / P⌉;
2. a rebalance when the queues differ by more than a share, or when some rank cannot fill its share
   while another holds more than its own: the native engine's ``redistribute`` evens the counts out,
   the domains move (from the top of the sender's stack, as ``pick_out`` would take them) in one
   ``all_gather_object``;
3. each rank picks up to its share and runs α,β-CROWN's own ``split_domain`` on it, rank-local: the
   rows of intermediate layers are not dealt, and the clock is the rank's own, so β-CROWN may stop
   early or prune on one rank only, and a rank with nothing to pick skips it. The weights are either
   replicated for the search (gathered once when BaB starts; ``parallel.bab_weights: replicated``, the
   default under ``fsdp``) or stay sharded (``sharded``, and always under ``tp``): the round then runs
   inside :func:`~complete_verifier_ext.parallel.serve.serving`, where every weight a rank needs is
   fetched on request (the whole weight under ``fsdp``, one shard at a time under ``tp``) and a rank
   that is done serves the others until all are, so the ranks need not run the same passes. The
   split depth is computed from the number picked on all ranks together (``get_split_depth``), so
   each rank bounds its share of P = 1's batch;
4. one ``all_gather_object`` of (domains held, worst domain's lb − rhs, domains visited, "all neurons
   split"): the global lower bound is the worst over the ranks, ``stats.visited`` the sum, and
   ``len(domains)`` reports the global count to ``general_bab`` (its loop, ``bab.max_domains``).

Every rank therefore issues the same collectives whatever happens inside its share, and the time-limit
check between rounds reads the synced clock. Every rank builds the same one-domain list; before the
first round, ranks other than 0 empty theirs. The children of a domain do not depend on which other
domains share its batch, up to β-CROWN's early stop; the tree can differ from P = 1's in the order the
domains are picked, so verdicts agree on instances that finish, not necessarily the domain count.

Input-split BaB (``bab.branching.input_split``) has its own round, split the same way
(:mod:`.input_bab`); BICCOS's new cuts travel with each round's agreement (:mod:`.cuts_split`); MIP
(``complete_verifier: mip`` / ``bab-refine``) deals its solves over the ranks (:mod:`.mip_split`).
Every α saved after α-CROWN (the intermediate ones too, which input BaB keeps per box) is made whole on
every rank when BaB starts (it was kept by row while α-CROWN ran). Refused under P > 1 (one line,
before any rank starts): CPLEX cuts and input splits inside activation BaB
(``branching_input_and_activation``).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..bab.search import redistribute
from ..parallel import comm, serve
from . import cuts_split

_picked_total: int | None = None  # domains picked this round on all ranks, for get_split_depth
round_collectives: list[int] = []  # lockstep collectives each BaB round issued on this rank (this run)


def lockstep_calls() -> int:
    """Collectives issued so far on this rank, point-to-point messages (whose number differs per rank
    while weights are served) left out: equal on every rank at every point, or the ranks diverged."""
    return sum(v["calls"] for name, v in comm.stats().items() if name != "exchange")


# the per-domain lists of a BatchedDomainList (beside its TensorStorages)
LISTS = ("all_betas", "all_intermediate_betas", "histories", "split_histories", "depths")


def refused_upstream(all_args: dict, complete_verifier: Path | None = None) -> str | None:
    """What α,β-CROWN itself refuses at P = 1 (an assertion, or a missing part of the checkout
    ``complete_verifier``): refused alike at every P, before anything runs."""
    if all_args["bab"]["attack"]["enabled"]:
        why = "'Bab attack is not out of date and to be fixed.', abcrown.py"
        return f"bab.attack.enabled: alpha-beta-CROWN refuses it ({why})"
    opt_interm = all_args["solver"]["beta-crown"]["enable_opt_interm_bounds"]
    if opt_interm and all_args["general"]["complete_verifier"] != "skip":
        why = "asserted off in complete_verifier_func.complete_verifier"
        return f"solver.beta-crown.enable_opt_interm_bounds: alpha-beta-CROWN refuses it ({why})"
    cut = all_args["bab"]["cut"]
    if complete_verifier is not None and cut["enabled"] and cut["cplex_cuts"]:
        get_cuts = complete_verifier / "cuts" / "CPLEX_cuts" / "get_cuts"
        if not get_cuts.is_file() and all_args["general"]["complete_verifier"] != "skip":
            why = f"{get_cuts} is not built in this checkout ('make' there, with CPLEX installed)"
            return f"bab.cut.cplex_cuts: alpha-beta-CROWN needs its CPLEX cut generator ({why})"
    return None


def unsupported(all_args: dict) -> list[str]:
    """The configured features that cannot run split over ranks yet (under fsdp and tp alike)."""
    bab, general = all_args["bab"], all_args["general"]
    if general["complete_verifier"] == "skip":
        return []
    found = []
    if bab["cut"]["enabled"] and bab["cut"]["cplex_cuts"]:
        found.append("bab.cut.cplex_cuts (GCP-CROWN cuts from a CPLEX process)")
    input_split = bab["branching"]["input_split"]["enable"]
    if bab["branching"]["branching_input_and_activation"] and not input_split:
        found.append(  # upstream fails on it at P = 1 too (prune.py recover: input_split_idx is a tensor)
            "bab.branching.branching_input_and_activation (input splits in activation BaB, on which "
            "alpha-beta-CROWN 0.7.0 itself fails at world_size 1)"
        )
    return found


# ----------------------------------------------------------------------------------------------------------
# Moving domains between the ranks' lists
# ----------------------------------------------------------------------------------------------------------


def _storages(dl) -> dict[tuple, Any]:
    """Every per-domain ``TensorStorage`` of a ``BatchedDomainList`` (the ones ``pick_out`` pops), by key.
    The other layers' bounds are static (one entry, rebuilt from each domain's history)."""
    out: dict[tuple, Any] = {("lA", k): s for k, s in dl.all_lAs.items()}
    final = dl.final_name
    out[("global_lb",)], out[("global_ub",)] = dl.all_global_lbs, dl.all_global_ubs
    out[("thresholds",)], out[("c",)] = dl.all_thresholds, dl.Cs
    out[("lb", final)], out[("ub", final)] = dl.all_lb_alls[final], dl.all_ub_alls[final]
    for name in ("all_x_Ls", "all_x_Us", "all_input_split_idx"):
        if getattr(dl, name) is not None:
            out[(name,)] = getattr(dl, name)
    for k, v in dl.all_alphas.items():
        for kk, s in v.items():
            out[("alpha", k, kk)] = s
    for k, pair in (dl.unstable_interm_bounds or {}).items():
        if pair is not None:
            out[("unstable", k, 0)], out[("unstable", k, 1)] = pair
    return out


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


@dataclass
class Moved:
    """Domains removed from a list by :func:`take`: each storage's tensor (its domain axis in ``dims``)
    and each per-domain list, on the CPU. A slice over the domains is a ``Moved`` too (a rebalancing
    receiver gets its slice of the sender's part)."""

    tensors: dict[tuple, torch.Tensor]
    dims: dict[tuple, int]
    lists: dict[str, list]

    def __getitem__(self, part: slice) -> Moved:
        tensors = {k: t[(slice(None),) * self.dims[k] + (part,)] for k, t in self.tensors.items()}
        return Moved(tensors, self.dims, {k: v[part] for k, v in self.lists.items()})


def take(dl, k: int) -> Moved:
    """Remove the ``k`` domains ``pick_out`` would take next."""
    n = dl.num_domains
    if k > n:
        raise RuntimeError(f"asked for {k} of {n} domains")
    stores = _storages(dl)
    wrong = [key for key, s in stores.items() if len(s) != n]
    if wrong:
        raise RuntimeError(f"domain list storages {wrong} do not hold {n} domains: not the supported layout")
    tensors = {key: s.pop(k).detach().clone() for key, s in stores.items()}
    lists = {}
    for name in LISTS:
        items = getattr(dl, name)
        if isinstance(items, deque):  # breadth first: pick_out takes from the front
            lists[name] = [items.popleft() for _ in range(k)]
        else:
            lists[name] = items[n - k : n]
            setattr(dl, name, items[: n - k])
    dl.num_domains = n - k
    return Moved(to_cpu(tensors), {key: s.concat_dim for key, s in stores.items()}, to_cpu(lists))


def put(dl, moved: Moved) -> None:
    """Append domains removed from another rank's list by :func:`take`."""
    from tensor_storage import get_tensor_storage

    stores = _storages(dl)
    for key, t in moved.tensors.items():
        if key in stores:
            stores[key].append(t)
        elif key[0] == "unstable":  # this rank never added children yet
            if dl.unstable_interm_bounds is None:
                dl.unstable_interm_bounds = {}
            pair = dl.unstable_interm_bounds.setdefault(key[1], [None, None])
            pair[key[2]] = get_tensor_storage(t, concat_dim=moved.dims[key])
        elif key[0] == "alpha":
            dl.all_alphas[key[1]][key[2]] = get_tensor_storage(t, concat_dim=moved.dims[key])
        else:
            raise RuntimeError(f"domain list storage {key} missing on rank {comm.rank()}")
    for name in LISTS:
        getattr(dl, name).extend(moved.lists[name])
    dl.num_domains = len(dl.histories)


def needs_rebalance(counts: list[int], share: int) -> bool:
    """Queues differ by more than a share, or this round's picks would differ by more than a sixteenth
    of their mean (early in the search, when all domains fit in one rank's share, and late)."""
    picks = [min(share, n) for n in counts]
    slack = max(1, sum(picks) // (16 * len(picks)))
    return max(counts) - min(counts) > share or max(picks) - min(picks) > slack


class ListQueue:
    """One of α,β-CROWN's domain lists as a queue of :func:`~complete_verifier_ext.bab.search.redistribute`:
    ``take(dl, k)`` removes the ``k`` domains its next pick would take, ``put(dl, moved)`` adds them."""

    def __init__(self, dl, take=take, put=put) -> None:
        self.dl, self._take, self._put = dl, take, put

    def take_spread(self, count: int) -> Moved | None:
        return self._take(self.dl, count) if count else None

    def exchange(self, part: Moved | None, sizes: list[int]) -> list[Moved | None]:
        return comm.all_gather_object(part)

    def put(self, part: Moved) -> None:
        self._put(self.dl, part)


def even_out(q: ListQueue, counts: list[int]) -> list[int]:
    """Even the ranks' lists out (the native engine's ``redistribute``); returns the new counts."""
    new = redistribute(q, counts)
    if len(q.dl) != new[comm.rank()]:  # a domain lost here would be a domain never verified
        raise RuntimeError(
            f"rank {comm.rank()} holds {len(q.dl)} domains after rebalancing, not {new[comm.rank()]}"
        )
    return new


# ----------------------------------------------------------------------------------------------------------
# The round
# ----------------------------------------------------------------------------------------------------------


def deal_round(q: ListQueue, batch: int) -> tuple[list[int], int]:
    """The start of a round on a list split over the ranks (activation or input BaB): the first time,
    ranks other than 0 empty their copy; one all-gather of (held, batch size), the batch the smallest
    over the ranks; a rebalance when needed. Returns every rank's picks (up to ⌈B / P⌉ each) and the
    batch. ``len()`` of the list is this rank's own until the round's agreement."""
    dl = q.dl
    dl._global_len = None
    if not dl.__dict__.get("_split", False):
        dl._split = True
        if comm.rank() != 0 and len(dl) > 0:
            q.take_spread(len(dl))
    counts, batches = zip(*comm.all_gather_object((len(dl), int(batch))), strict=True)
    counts, batch = list(counts), min(batches)
    share = -(-batch // comm.world_size())
    if needs_rebalance(counts, share):
        counts = even_out(q, counts)
    return [min(share, n) for n in counts], batch


def worst_over_ranks(candidates: list) -> torch.Tensor:
    """α,β-CROWN's ``check_worst_domain`` over the ranks: the lb − rhs of the domain whose best spec is
    worst; 1e-7 (its value for an empty list) when no rank holds a domain."""
    held = [w for w in candidates if w is not None]
    if not held:
        return torch.tensor(1e-7)

    def margin(w: torch.Tensor) -> float:  # NaN proves nothing: the worst there is
        m = float(w.max())
        return -math.inf if math.isnan(m) else m

    return min(held, key=margin)


def wrap_act_split_round(split_domain, check_worst_domain, weights_sharded: bool):
    """``split_domain``, ``check_worst_domain``: α,β-CROWN's own (``bab`` module); ``weights_sharded``:
    whether BaB keeps the weights sharded (``parallel.bab_weights`` resolved: ``tp`` always)."""

    def act_split_round(domains, net, batch, iter_idx, stats=None, branching_heuristic=None):
        global _picked_total
        import arguments

        from . import patches

        bab_args, me, calls = arguments.Config["bab"], comm.rank(), lockstep_calls()
        cuts_split.begin_round(net)
        picks, batch = deal_round(ListQueue(domains), batch)
        visited = stats.visited
        with patches.local_clock(), fetched(weights_sharded):
            if picks[me] > 0:
                stats.timer.start("pickout")
                d = domains.pick_out(batch=picks[me], device=net.device)
                if bab_args["vanilla_crown"]:
                    d["history"] = None
                stats.timer.add("pickout")
                _picked_total = sum(picks)
                try:
                    fix = not bab_args["recompute_interm"]
                    split_domain(net, domains, d, batch, stats=stats, fix_interm_bounds=fix,
                                 branching_heuristic=branching_heuristic, iter_idx=iter_idx)  # fmt: skip
                finally:
                    _picked_total = None
            interval = bab_args["sort_domain_interval"]
            if interval > 0 and iter_idx % interval == 0:
                domains.sort()
            worst = to_cpu(check_worst_domain(domains)) if len(domains) > 0 else None
        global_lb = _agree(domains, stats, worst, visited, net).to(net.device)
        if not comm.is_solo():
            round_collectives.append(lockstep_calls() - calls)
        return global_lb

    return act_split_round


def _agree(domains, stats, worst: torch.Tensor | None, visited: int, net) -> torch.Tensor:
    """After a round: one all-gather of (domains held, worst lb − rhs, domains visited, "all neurons
    split" and its result, BICCOS's new cuts); sets the global count, ``stats``, the agreed cuts;
    returns the global lower bound."""
    import arguments

    all_split = bool(stats.all_node_split)
    result = getattr(stats, "all_split_result", "unknown")
    cuts = cuts_split.mine(net)
    every = comm.all_gather_object((len(domains), worst, stats.visited - visited, all_split, result, cuts))
    cuts_split.agree(net, [e[5] for e in every])
    domains._global_len = None if comm.is_solo() else sum(e[0] for e in every)  # solo: its own count
    stats.visited = visited + sum(e[2] for e in every)
    if any(e[3] for e in every):
        stats.all_node_split = True
        stats.all_split_result = "unsafe" if any(e[3] and e[4] == "unsafe" for e in every) else "unknown"
    global_lb = worst_over_ranks([e[1] for e in every])
    offset = arguments.Config["specification"]["rhs_offset"]
    if offset is not None:
        global_lb = global_lb + offset
    print(f"Length of domains: {len(domains)} (this rank: {every[comm.rank()][0]})")
    print(f"Current (lb-rhs): {global_lb.max().item()}")
    print(f"{stats.visited} domains visited")
    stats.timer.print()
    return global_lb


def wrap_len(orig):
    """``len(domains)`` is the count over all ranks between rounds (what ``general_bab`` reads)."""

    def __len__(self):
        n = self.__dict__.get("_global_len")
        return orig(self) if n is None else n

    return __len__


def wrap_get_split_depth(orig):
    def get_split_depth(batch_size, min_batch_size, min_depth):
        return orig(_picked_total or batch_size, min_batch_size, min_depth)

    return get_split_depth


def fetched(weights_sharded: bool):
    """Around rank-local work of a round: the weights a rank needs fetched on request when they stay
    sharded (:func:`~complete_verifier_ext.parallel.serve.serving`), nothing to do when replicated."""
    return serve.serving() if weights_sharded else contextlib.nullcontext()


@contextlib.contextmanager
def searching(reference_dict: dict | None, weights_sharded: bool):
    """Around a whole BaB search (activation or input BaB): the α saved after α-CROWN whole on every
    rank, the weights replicated (unless ``weights_sharded``), the rows of each bound not dealt (the
    domains are). Collective on entry."""
    from . import rows, shards

    rows.whole_alphas(reference_dict)
    whole = contextlib.nullcontext() if weights_sharded else shards.replicated()
    with whole, rows.inactive():
        yield


def wrap_general_bab(orig, weights_sharded: bool):
    """``general_bab`` inside :func:`searching`."""

    def general_bab(net, x, c, rhs, reference_dict=None, timeout=None, max_iterations=None):
        with searching(reference_dict, weights_sharded):
            return orig(net, x, c, rhs, reference_dict, timeout, max_iterations)

    return general_bab
