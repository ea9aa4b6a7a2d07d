"""β-CROWN (activation) branch and bound inside α,β-CROWN with the domain list split over the ranks.

α,β-CROWN's BaB (``complete_verifier_func.general_bab`` → ``bab.general_bab``) runs rounds
(``bab.act_split_round``): pick a batch of domains out of the list (``BatchedDomainList``, tensors on
the CPU), branch them (BaBSR, FSB, kFSB: decided per domain), bound the children with β-CROWN and add
the unverified ones back. Under P > 1 each rank keeps its own share of the list, and a round becomes:

1. one ``all_gather_object`` of (domains held, batch size), and a rebalance when needed
   (:func:`.rounds.deal_round`): the domains move from the top of the sender's stack, as ``pick_out``
   would take them (:func:`take`, :func:`put`);
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

BICCOS's new cuts travel with each round's agreement (:mod:`.cuts`). Every α saved after α-CROWN is
made whole on every rank when BaB starts (it was kept by row while α-CROWN ran:
:func:`.rounds.searching`).
"""

from __future__ import annotations

from collections import deque

import torch

from ...parallel import comm
from ..clocks import local_clock
from ..run import Run
from . import cuts
from .oom import LISTS, pick, storages
from .rounds import ListQueue, Moved, deal_round, fetched, lockstep_calls, searching, to_cpu, worst_over_ranks


def _root_unstable(dl, key: tuple, count: int) -> torch.Tensor:
    """The stored bounds of the unstable neurons (``key``: ``("unstable", layer, 0 | 1)``) for ``count``
    domains that have none stored: domains of the initial list, never split, whose intermediate bounds
    are the static ones (``update_interm_bounds`` tightens the static bounds with the stored ones, so
    the static bounds at the unstable neurons are what α,β-CROWN itself would use for them)."""
    _, layer, side = key
    static = (dl.static_lb if side == 0 else dl.static_ub)[layer]
    row = static.detach()[:, dl.unstable_mask[layer][0]].cpu()  # (1, unstable neurons)
    return row.expand(count, *row.shape[1:]).clone()


def _pop(dl, key: tuple, s, k: int) -> torch.Tensor:
    """The entries of the ``k`` domains ``pick_out`` takes next, from storage ``s``. The unstable
    neurons' bounds are stored only for the domains added by a round (α,β-CROWN creates those storages
    at the first ``add``), so below the top ``len(s)`` domains of a depth-first stack the initial
    domains have none: theirs are filled in (:func:`_root_unstable`)."""
    got = s.pop(k).detach().clone()
    missing = k - int(got.shape[s.concat_dim])
    if missing and key[0] == "unstable" and type(s).__name__ == "StackTensorStorage" and s.concat_dim == 0:
        return torch.cat([_root_unstable(dl, key, missing), got.cpu()], 0)  # the chunk is bottom-up
    if missing:
        raise RuntimeError(
            f"domain list storage {key} holds fewer domains than asked: not the supported layout"
        )
    return got


def take(dl, k: int) -> Moved:
    """Remove the ``k`` domains ``pick_out`` would take next."""
    n = dl.num_domains
    if k > n:
        raise RuntimeError(f"asked for {k} of {n} domains")
    stores = storages(dl)
    wrong = [key for key, s in stores.items() if len(s) != n and not (key[0] == "unstable" and len(s) < n)]
    if wrong:
        raise RuntimeError(f"domain list storages {wrong} do not hold {n} domains: not the supported layout")
    tensors = {key: _pop(dl, key, s, k) for key, s in stores.items()}
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
    """Append domains removed from another rank's list by :func:`take`. Where this list stores the
    unstable neurons' bounds and the moved domains carry none (the sender never added a round's
    children), theirs are the static ones (:func:`_root_unstable`): every stored entry stays its own
    domain's."""
    from tensor_storage import get_tensor_storage

    stores = storages(dl)
    count = len(moved.lists["histories"])
    for key, s in stores.items():
        if key[0] == "unstable" and key not in moved.tensors and count:
            s.append(_root_unstable(dl, key, count))
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


# ----------------------------------------------------------------------------------------------------------
# The round
# ----------------------------------------------------------------------------------------------------------


def act_split_round(run: Run, orig):
    """``bab.act_split_round`` (``orig``, replaced whole): each rank picks its share, splits and bounds
    it with α,β-CROWN's own ``split_domain``; one agreement a round."""
    import bab

    split_domain, check_worst_domain = bab.split_domain, bab.check_worst_domain

    def act_split_round(domains, net, batch, iter_idx, stats=None, branching_heuristic=None):
        import arguments

        bab_args, me, calls = arguments.Config["bab"], comm.rank(), lockstep_calls()
        cuts.begin_round(net)
        picks, batch = deal_round(ListQueue(domains, take, put), batch)
        visited = stats.visited
        with local_clock(run), fetched(run):
            mine = min(picks[me], run.rounds.fits or picks[me])  # after running out of memory (oom.py)
            if mine > 0:
                stats.timer.start("pickout")
                d = pick(run, domains, mine, net.device)  # fewer where copying them runs out of memory
                if bab_args["vanilla_crown"]:
                    d["history"] = None
                stats.timer.add("pickout")
                run.rounds.picked = (mine, sum(picks))
                try:
                    fix = not bab_args["recompute_interm"]
                    split_domain(net, domains, d, batch, stats=stats, fix_interm_bounds=fix,
                                 branching_heuristic=branching_heuristic, iter_idx=iter_idx)  # fmt: skip
                finally:
                    run.rounds.picked = None
            interval = bab_args["sort_domain_interval"]
            if interval > 0 and iter_idx % interval == 0:
                domains.sort()
            worst = to_cpu(check_worst_domain(domains)) if len(domains) > 0 else None
        global_lb = _agree(domains, stats, worst, visited, net).to(net.device)
        if not comm.is_solo():
            run.rounds.collectives.append(lockstep_calls() - calls)
        return global_lb

    return act_split_round


def _agree(domains, stats, worst: torch.Tensor | None, visited: int, net) -> torch.Tensor:
    """After a round: one all-gather of (domains held, worst lb − rhs, domains visited, "all neurons
    split" and its result, BICCOS's new cuts); sets the global count, ``stats``, the agreed cuts;
    returns the global lower bound."""
    import arguments

    all_split = bool(stats.all_node_split)
    result = getattr(stats, "all_split_result", "unknown")
    new_cuts = cuts.mine(net)
    every = comm.all_gather_object(
        (len(domains), worst, stats.visited - visited, all_split, result, new_cuts)
    )
    cuts.agree(net, [e[5] for e in every])
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


def get_split_depth(run: Run, orig):
    """``bab.get_split_depth`` from the round's total batch (all ranks' picks), so that each rank
    bounds its share of P = 1's batch."""

    def get_split_depth(batch_size, min_batch_size, min_depth):
        total = run.rounds.picked[1] if run.rounds.picked else None
        return orig(total or batch_size, min_batch_size, min_depth)

    return get_split_depth


def general_bab(run: Run, orig):
    """``complete_verifier_func.general_bab`` inside :func:`.rounds.searching`."""

    def general_bab(net, x, c, rhs, reference_dict=None, timeout=None, max_iterations=None):
        with searching(run, reference_dict):
            return orig(net, x, c, rhs, reference_dict, timeout, max_iterations)

    return general_bab
