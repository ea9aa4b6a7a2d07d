"""α,β-CROWN's input-split BaB with the domain list split over the ranks.

α,β-CROWN's input BaB (``input_split.batch_branch_and_bound.input_bab_parallel``) runs rounds
(``batch_verification_input_split``): pick a batch of input boxes out of the list
(``UnsortedInputDomainList``, or ``UnsortedMultiSpecInputDomainList`` when the OR clauses have different
numbers of ANDs), optionally tighten the spec's threshold with an attack, split each box (the
dimensions chosen per box: ``naive``, ``sb``, ``brute-force``), bound the halves with CROWN or α-CROWN,
drop the verified ones, clip the rest (``bab.clip_n_verify.clip_input_domain``: each box shrunk by the
linear bounds of its own spec) and add them back. Under P > 1 each rank keeps its own share of the
list, and a round becomes, as in activation BaB (:mod:`.rounds`):

1. one ``all_gather_object`` of (boxes held, batch size): the batch is the smallest over the ranks and a
   rank's share of it ⌈B / P⌉;
2. a rebalance when the queues are uneven (the native engine's ``redistribute``): the boxes move with
   everything the list keeps per box (its lower bounds, spec, threshold, split dimensions, α, the
   clip-and-verify constraints), popped as ``pick_out_batch`` pops them and added as children are;
3. each rank runs α,β-CROWN's own round on its share (its clock the rank's own; with the weights
   sharded inside :func:`~complete_verifier_ext.parallel.serve.serving`); the split depth comes from the
   number picked on all ranks together, so each rank splits as P = 1 would have split that batch;
4. one ``all_gather_object`` of (boxes held, worst box's lb − rhs, boxes bounded, volume left): the
   global lower bound is the worst over the ranks, ``stats.visited`` the sum, ``len(domains)`` the
   global count (what ``input_bab_parallel`` reads to stop), the progress the global volume.

The attack inside input BaB (``attack.input_split_check_adv``, and the ``pgd_order: after`` attack on
the initial boxes) runs where the boxes are (on rank 0 before the first round, on every rank's own
share after), and its verdict is agreed: any rank's counterexample is every rank's ``unsafe``, and the
first finder's counterexample file is copied to the other ranks' (rank 0's is the user's). Every rank
issues the same collectives whatever its share holds, and the time limit reads the synced clock.

Pre-split domains (``input_split.presplit_domains``) are loaded and bounded on every rank before the
first round (the same work on each, once), then dealt like the rest.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...parallel import comm
from ..clocks import local_clock
from ..run import Run
from .rounds import ListQueue, Moved, deal_round, fetched, lockstep_calls, searching, to_cpu, worst_over_ranks

# ----------------------------------------------------------------------------------------------------------
# Moving boxes between the ranks' lists
# ----------------------------------------------------------------------------------------------------------


def take(dl, k: int) -> Moved:
    """Remove the ``k`` boxes ``pick_out_batch`` would take next, with all the list keeps per box."""
    picked = dl.pick_out_batch(k, device="cpu")
    alpha, lb, dm_l, dm_u, cs, threshold, constraints, spec_sizes, split_idx = picked
    tensors: dict[Any, torch.Tensor] = {
        "lb": lb, "dm_l": dm_l, "dm_u": dm_u, "cs": cs, "threshold": threshold, "spec_sizes": spec_sizes,
    }  # fmt: skip
    if split_idx is not None:
        tensors["split_idx"] = split_idx
    if constraints is not None:
        tensors["constraint_A"], tensors["constraint_b"] = constraints
    for k0, per_start in alpha.items():
        for k1, t in per_start.items():
            tensors[("alpha", k0, k1)] = t  # (2, spec, boxes, ...): the boxes on dim 2
    dims = {key: 2 if isinstance(key, tuple) else 0 for key in tensors}
    return Moved(to_cpu({k: t.detach().clone() for k, t in tensors.items()}), dims, {})


def put(dl, moved: Moved) -> None:
    """Add boxes taken from another rank's list by :func:`take` (as α,β-CROWN adds children)."""
    t = moved.tensors
    alpha: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in t.items():
        if isinstance(key, tuple):
            alpha.setdefault(key[1], {})[key[2]] = v
    n = len(t["lb"])
    args = (t["lb"], t["dm_l"], t["dm_u"], alpha, t["cs"], t["threshold"])
    common = dict(split_idx=t.get("split_idx"), remaining_index=torch.arange(n), check_dm_lbs=False,
                  check_input_boxes=False)  # fmt: skip
    if hasattr(dl, "spec_domain_lists"):  # one list per number of ANDs: add() sorts them by spec size
        dl.add(*args, spec_sizes=t["spec_sizes"], **common)
    else:
        constraints = (t["constraint_A"], t["constraint_b"]) if "constraint_A" in t else None
        dl.add(*args, constraints=constraints, **common)


# ----------------------------------------------------------------------------------------------------------
# The round
# ----------------------------------------------------------------------------------------------------------


def _local_worst(dl) -> torch.Tensor | None:
    """What α,β-CROWN's round returns for a list: the lb − rhs of its worst box (or of box 0 with
    ``skip_getting_worst_domain``); None for an empty list."""
    import arguments

    if len(dl) == 0:
        return None
    skip = arguments.Config["bab"]["branching"]["input_split"]["skip_getting_worst_domain"]
    box = dl[0 if skip else dl.get_topk_indices()]
    return to_cpu(box[0] - box[-2])


def batch_verification_input_split(run: Run, orig):
    """α,β-CROWN's round (``orig``) on this rank's share of the boxes; one agreement a round."""

    def batch_verification_input_split(d, net, batch, *args, **kwargs):
        me, calls, stats = comm.rank(), lockstep_calls(), kwargs["stats"]
        picks, _ = deal_round(ListQueue(d, take, put), batch)
        visited = stats.visited
        with local_clock(run), fetched(run):
            if picks[me] > 0:
                run.rounds.picked = (picks[me], sum(picks))
                try:
                    orig(d, net, picks[me], *args, **kwargs)
                finally:
                    run.rounds.picked = None
            worst = _local_worst(d)
        threshold = kwargs.get("decision_thresh", args[1] if len(args) > 1 else None)
        global_lb = _agree(d, stats, worst, visited, threshold)
        run.rounds.collectives.append(lockstep_calls() - calls)
        return global_lb

    return batch_verification_input_split


def _agree(d, stats, worst: torch.Tensor | None, visited: int, decision_thresh) -> torch.Tensor:
    """After a round: one all-gather of (boxes held, worst lb − rhs, boxes bounded, volume left); sets
    the global count and ``stats.visited``; returns the global lower bound (α,β-CROWN's value for an
    empty list when no rank holds a box)."""
    import arguments

    volume = getattr(d, "volume", None)
    every = comm.all_gather_object((len(d), worst, stats.visited - visited, volume))
    d._global_len = sum(e[0] for e in every)
    stats.visited = visited + sum(e[2] for e in every)
    device = decision_thresh.device
    print(f"Length of domains: {d._global_len} (this rank: {every[comm.rank()][0]})")
    print(f"{stats.visited} domains visited")
    if d._global_len == 0:
        print("No domains left on any rank, verification finished!")
        return (decision_thresh.max() + 1e-7).to(device)
    global_lb = worst_over_ranks([e[1] for e in every])
    print(f"Current (lb-rhs): {global_lb.max().item()}")
    total = getattr(d, "all_volume", None)
    if arguments.Config["bab"]["branching"]["input_split"]["show_progress"] and total:
        print(f"Progress: {1 - sum(e[3] or 0 for e in every) / total:.10f}")
    return global_lb.to(device)


def get_split_depth(run: Run, orig):
    """``input_split.split.get_split_depth`` from the round's boxes on all ranks (scaled from this
    rank's count, which after ``reorder_bab``'s filtering is its unverified boxes)."""

    def get_split_depth(current_domain_num, split_partitions=2):
        if run.rounds.picked is not None and current_domain_num > 0:
            mine, total = run.rounds.picked
            current_domain_num = max(1, round(current_domain_num * total / mine))
        return orig(current_domain_num, split_partitions)

    return get_split_depth


def pgd_attack_on_domains(run: Run, orig):
    """The attack on the boxes where they are; any rank's counterexample is every rank's."""

    def pgd_attack_on_domains(model_ori, domains, stage, vnnlib):
        import arguments

        saved, domains._global_len = domains.__dict__.get("_global_len"), None  # the rank's own boxes
        try:
            attack_here = (domains.__dict__.get("_split", False) or comm.rank() == 0) and len(domains) > 0
            with local_clock(run), fetched(run):
                found = bool(orig(model_ori, domains, stage, vnnlib)) if attack_here else False
        finally:
            domains._global_len = saved
        path = arguments.Config["attack"]["cex_path"]
        text = _read(path) if found else None
        every = comm.all_gather_object((found, text))
        first = next((r for r, (f, _) in enumerate(every) if f), None)
        if first is None:
            return False
        if first != comm.rank() and every[first][1] is not None:
            with open(path, "w") as f:
                f.write(every[first][1])
        return True

    return pgd_attack_on_domains


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def input_bab_parallel(run: Run, orig):
    """``input_bab_parallel`` inside :func:`.rounds.searching` (the initial α whole on every rank:
    input BaB stores every layer's α per box)."""

    def input_bab_parallel(*args, **kwargs):
        with searching(run, kwargs.get("reference_dict")):
            return orig(*args, **kwargs)

    return input_bab_parallel
