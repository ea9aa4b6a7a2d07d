"""``general.proof`` inside α,β-CROWN: how each instance was proved, recorded as it happens, each rank
its own share (:class:`~.run.Proofs`); :mod:`.proof_write` gathers the shares at the instance's end and
writes the proof (docs/proofs.md, "The α,β-CROWN engine").

What is recorded, by the step that proved a clause:

* the incomplete bounds (``LiRPANet.build``, CROWN or α-CROWN over the whole box): the output rows
  they proved (a row ``c · y > rhs`` over the box proves every clause that holds the row ``c · y <=
  rhs``) and every ReLU's pre-activation bounds (the claims its proof leaf stands under);
* activation BaB (``general_bab``): the clauses it searched and those proved at its root, unsplit; the
  split history of every domain it drops as verified (``BatchedDomainList.add`` keeps the others; a
  dropped domain has a lower bound above its threshold, or infeasible bounds);
* input-split BaB (``input_bab_parallel``): each clause's root box, and a log keyed by the exact box:
  every box split into boxes (``input_split_and_repeat``), bounded above its threshold (``get_bounds``),
  clipped (``clip_domains``), from which :func:`~complete_verifier_ext.proofs.logged_tree` rebuilds the
  tree from the root box.

A clause is named by its rows (:func:`clause`), a box by ``(clause, lower bytes, upper bytes)`` in
float64: the same on every rank, so that the ranks' shares join. What cannot be recorded (a split at a
point other than 0 or of another activation, cuts, bounds under constraints the proof does not carry)
refuses the instance's proof with one reason (:meth:`~.run.Proofs.refuse`), and so does a failure to
record: a proof is never written for more than was recorded, and recording never changes a verdict.

Every function here but the helpers is a replacement's ``make(run, original)`` (:mod:`.table`); the rows
apply with ``general.proof`` set only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from ..parallel import comm
from .inputs import short
from .rows.alpha import alpha_rows
from .run import Bounded, Proofs, Run, StartSlopes


class Refused(Exception):
    """What happened cannot be recorded: no proof for the instance (the message says why)."""


def _guarded(proof: Proofs | None, record: Callable, *args: Any) -> None:
    """``record(proof, *args)``; a refusal, or any failure, refuses the proof (never the run)."""
    if proof is None:
        return
    try:
        record(proof, *args)
    except Refused as e:
        proof.refuse(str(e))
    except Exception as e:  # a record that fails is no proof; the verification goes on as it would
        proof.refuse(f"recording it failed ({short(e)})")


def _flat(t) -> np.ndarray:
    """A batch of tensors ``(B, ...)`` as ``(B, n)`` float64 with -0.0 as 0.0 (one key per box)."""
    return t.detach().flatten(1).cpu().double().numpy() + 0.0


def row_key(c: np.ndarray, rhs: float) -> bytes:
    """One output row ``c · y <= rhs`` as bytes: float32 (α,β-CROWN's reading and ours agree there),
    -0.0 as 0.0."""
    return c_key(c) + (np.float32(rhs) + np.float32(0)).tobytes()


def c_key(c: np.ndarray) -> bytes:
    """An output row's coefficients as bytes, as :func:`row_key` has them."""
    return (np.asarray(c, dtype=np.float32) + np.float32(0)).tobytes()


def clause(C: np.ndarray, d: np.ndarray) -> frozenset[bytes]:
    """A clause (``C y <= d``, a conjunction) by its rows; rows of zeros (α,β-CROWN's padding) left out."""
    return frozenset(row_key(c, v) for c, v in zip(C, d, strict=True) if np.any(c))


def _clauses(proof: Proofs, cs, thresholds) -> list[frozenset[bytes]]:
    """The clause of each of a batch's specs (``cs`` (B, k, n_out), ``thresholds`` (B, k))."""
    C = cs.detach().cpu().float().numpy()
    d = thresholds.detach().cpu().float().numpy().reshape(len(C), -1)
    out = []
    for c, t in zip(C, d, strict=True):
        raw = c.tobytes() + t.tobytes()
        if raw not in proof.names:
            proof.names[raw] = clause(c, t)
        out.append(proof.names[raw])
    return out


def box_keys(proof: Proofs, x_L, x_U, cs, thresholds) -> list[tuple]:
    """The key of each box of a batch: ``(its clause, lower bytes, upper bytes)``."""
    lo, hi = _flat(x_L), _flat(x_U)
    names = _clauses(proof, cs, thresholds)
    return [(n, a.tobytes(), b.tobytes()) for n, a, b in zip(names, lo, hi, strict=True)]


def _bound(orig: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``orig`` by parameter name, defaults filled in."""
    bound = inspect.signature(orig).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


# ----------------------------------------------------------------------------------------------------------
# The incomplete bounds
# ----------------------------------------------------------------------------------------------------------


def build(run: Run, orig):
    """``LiRPANet.build``: the rows its bounds proved and its ReLUs' pre-activation bounds, per box."""

    def build(self, x, c, rhs, *args, **kwargs):
        if run.proof is not None:
            run.proof.slopes = {}
        try:
            global_lb, result = orig(self, x, c, rhs, *args, **kwargs)
            _guarded(run.proof, _record_build, run.rows.alpha, self, x, c, rhs, global_lb, result)
        finally:
            if run.proof is not None:
                run.proof.slopes = None
        return global_lb, result

    return build


def _record_build(proof: Proofs, layouts, lirpa, x, c, rhs, global_lb, result) -> None:
    relus, sigmoids = list(lirpa.net.relus), sigmoid_nodes(lirpa.net)
    proof.relu_sizes = [int(np.prod(r.inputs[0].output_shape[1:])) for r in relus]
    proof.sigmoid_sizes = [int(np.prod(s.inputs[0].output_shape[1:])) for s in sigmoids]
    traced = [id(n) for n in lirpa.net.nodes() if id(n) in {id(r) for r in relus}]  # the ONNX graph's order
    proof.relu_order = [traced.index(id(r)) for r in relus]
    if getattr(x.ptb, "x_L", None) is None:
        raise Refused("the input set is not a box")
    lo, hi = _flat(x.ptb.x_L), _flat(x.ptb.x_U)  # (B, n)
    acts = layer_keys(relus, sigmoids)
    bounds = _pre_bounds(list(acts.values()), result or {})
    proven = _proven_rows(global_lb, c, rhs, len(lo))
    groups: dict[bytes, list[int]] = {}
    for b in range(len(lo)):
        groups.setdefault(lo[b].tobytes() + hi[b].tobytes(), []).append(b)
    for members in groups.values():
        claims = _claims(bounds, list(acts), members, len(lo), len(groups) == 1)
        rows = frozenset().union(*(proven[b] for b in members))
        alone = claims is not None and len(lo) == 1
        alpha = _claim_slopes(acts, claims, proof.slopes or {}) if alone else {}
        output = _output_slopes(layouts, lirpa, relus, claims) if alone else {}
        proof.builds.append(Bounded(lo[members[0]], hi[members[0]], claims, rows, alpha, output))


def _output_slopes(layouts, lirpa, relus: list, claims: dict) -> dict:
    """The lower slopes α-CROWN kept for each output row it optimised (the build's ``c``: the rows initial
    CROWN left open), by :func:`c_key`: per ReLU index, at the neurons the claims leave unstable, a
    leaf's ``alpha`` (docs/proofs.md); at P > 1 each rank gives those of the spec rows it holds."""
    final, c = lirpa.final_name, getattr(lirpa, "c", None)
    if c is None or c.shape[0] != 1:
        return {}
    rows, out = c[0].detach().cpu().float().numpy(), {}
    for i, relu in enumerate(relus):
        a = (getattr(relu, "alpha", None) or {}).get(final)
        if a is None or a.ndim < 4 or a.shape[2] != 1 or i not in claims:
            continue
        layout = (layouts.get(relu) or {}).get(final)
        if layout is not None and layout.owns(a):
            held, local = layout.held[comm.rank()].tolist(), range(1, 1 + layout.sizes[comm.rank()])
        elif a.shape[1] == len(rows):
            held = local = range(len(rows))
        else:
            continue
        values, flat = a[0, :, 0].detach().flatten(1).cpu().double().numpy(), _feature_index(relu)
        if len(flat) != values.shape[1]:
            continue
        keep = (claims[i][0][flat] < 0) & (claims[i][1][flat] > 0)
        for g, m in zip(held, local, strict=True):
            given = np.round(values[m, keep], 7).tolist()
            out.setdefault(c_key(rows[g]), {})[i] = dict(zip(flat[keep].tolist(), given, strict=True))
    return out


def sigmoid_nodes(module) -> list:
    """The network's Sigmoid nodes, in the traced graph's order (the ONNX graph's)."""
    from auto_LiRPA.operators import BoundSigmoid

    return [n for n in module.nodes() if type(n) is BoundSigmoid]


def layer_keys(relus: list, sigmoids: list) -> dict:
    """The activations whose inputs a proof's bounds nodes claim, by their keys there (docs/proofs.md):
    α,β-CROWN's ReLU ``i`` as ``i``, its Sigmoid ``m`` as ``"sm"``."""
    return {**dict(enumerate(relus)), **{f"s{m}": s for m, s in enumerate(sigmoids)}}


def _pre_bounds(acts: list, result: dict) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Each activation's input bounds ``(B, size)`` as the build left them (its result's where it has
    them: every spec's, before any pruning), None where some are missing."""
    lower, upper = result.get("lower_bounds") or {}, result.get("upper_bounds") or {}
    out = []
    for r in acts:
        node = r.inputs[0]
        lo, hi = lower.get(node.name, node.lower), upper.get(node.name, node.upper)
        if lo is None or hi is None:
            return None
        out.append((_flat(lo), _flat(hi)))
    return out


def update_best(run: Run, orig):
    """``optimized_bounds._update_optimizable_activations`` (α-CROWN keeping its best iteration), inside
    a build: the slopes of each pre-activation bound's best iteration (:class:`~.run.StartSlopes`;
    auto_LiRPA keeps only those of its best *output* iteration)."""

    def update(optimizable_activations, interm_bounds, fix_interm_bounds, *args):
        if run.proof is not None and run.proof.slopes is not None:
            _guarded(run.proof, _record_slopes, run.rows.alpha, optimizable_activations, interm_bounds,
                     fix_interm_bounds, args[0] if args else None)  # fmt: skip
        return orig(optimizable_activations, interm_bounds, fix_interm_bounds, *args)

    return update


def _record_slopes(
    proof: Proofs, layouts, acts: list, interm_bounds: dict | None, fixed: bool, kept: dict | None
) -> None:
    """(``layouts``: ReLU -> start node name -> the :class:`~.rows.alpha.AlphaLayout` of α rows this rank
    keeps, at P > 1: it records those, :mod:`.proof_write` joins the ranks'; ``kept``: auto_LiRPA's best
    intermediate bounds, which hold iteration 0's at the first call: α-CROWN calls this only at an
    iteration whose output improved, often a later one. A neuron's slopes are those of the iteration
    that strictly improved its bound: one that left it alone did not use its α rows.)"""
    import torch

    for node in acts:
        start = node.inputs[0]
        if (interm_bounds and fixed and start.name in interm_bounds) or getattr(start, "lower", None) is None:
            continue  # bounds not optimised here
        if start.lower.shape[0] != 1:
            continue  # one box only
        lo, hi = start.lower.detach().flatten(), start.upper.detach().flatten()
        rec, new = proof.slopes.get(start.name), start.name not in proof.slopes
        if new:
            zero = [b.detach().flatten().clone() for b in (kept or {}).get(node.name, ())]
            first = tuple(zero) if len(zero) == 2 and zero[0].shape == lo.shape else (lo.clone(), hi.clone())
            rec = proof.slopes[start.name] = StartSlopes(first, [lo.clone(), hi.clone()])
        better = (new | (lo > rec.best[0]), new | (hi < rec.best[1]))
        rec.best = [torch.maximum(rec.best[0], lo), torch.minimum(rec.best[1], hi)]
        for relu in acts:  # (or a sigmoid)
            alpha = (getattr(relu, "alpha", None) or {}).get(start.name)
            lookup = (getattr(relu, "alpha_lookup_idx", None) or {}).get(start.name)
            if alpha is None or alpha.ndim < 4 or alpha.shape[2] != 1:
                continue
            layout = (layouts.get(relu) or {}).get(start.name)
            if layout is not None and alpha.shape[1] == 1 + layout.sizes[comm.rank()]:  # this rank's rows
                local = layout.flat_lookup.cpu()
                spec = (local.nonzero().flatten().numpy(), local[local > 0].numpy())
            else:
                spec = _spec_rows(lookup, alpha.shape[1], tuple(start.output_shape[1:]))
            if spec is None:
                continue
            values = _act_values(relu, alpha.detach()[:, :, 0].flatten(2).float())
            if values is None:
                continue
            if relu.name not in rec.alpha:
                rec.alpha[relu.name] = [torch.full((len(lo), v.shape[1]), float("nan")) for v in values]
                rec.features[relu.name] = _feature_index(relu)
            neurons, rows = (torch.as_tensor(x, dtype=torch.long) for x in spec)
            for k, (store, v) in enumerate(zip(rec.alpha[relu.name], values, strict=True)):
                mask = better[k % 2][neurons].cpu()  # (a pass from +z: its lower bound; from -z: upper)
                store[neurons[mask]] = v[rows[mask]].cpu()


def _act_values(act, a) -> list | None:
    """What α (``a``: ``(params, S, features)``) gives the proof: a ReLU's lower slopes of the lower and
    the upper bound's pass; a Sigmoid's tangent points (auto_LiRPA's, per case: ``[0:2]`` the upper line's
    where its input is ``>= 0``, ``[2:4]`` the lower line's where ``<= 0``, ``[4:6]``, ``[6:8]`` the lower
    and upper line's across 0; at the input bounds of this iteration) of its lower line in each pass,
    then of its upper line. None where its input bounds are not known."""
    import torch

    if len(a) == 2:
        return [a[0], a[1]]
    lower, upper = getattr(act.inputs[0], "lower", None), getattr(act.inputs[0], "upper", None)
    if lower is None or upper is None or len(a) < 8 or lower.shape[0] != 1:
        return None
    l, u = lower.detach().flatten().float(), upper.detach().flatten().float()
    lo_line = [torch.where(u <= 0, a[2 + s], a[4 + s]) for s in (0, 1)]
    return lo_line + [torch.where(l >= 0, a[s], a[6 + s]) for s in (0, 1)]


def _claim_slopes(acts: dict, claims: dict, slopes: dict) -> dict:
    """The ``alpha`` entries (docs/proofs.md) of each activation's input bounds, by its key
    (:func:`layer_keys`), from the slopes recorded while the build optimised them (``slopes``,
    :class:`~.run.StartSlopes`): for the neurons unstable at the first iteration seen (a ReLU's: a
    stable one's claim changes no bound the checker uses; a Sigmoid's: all), each side's slopes at the
    neurons the claims leave unstable in every ReLU before it, and the tangent points of every Sigmoid
    before it."""
    import torch

    out = {}
    for key, act in acts.items():
        rec = slopes.get(act.inputs[0].name)
        if rec is None:
            continue
        lo0, hi0 = rec.first
        rows = (lo0 < 0) & (hi0 > 0) if isinstance(key, int) else torch.ones_like(lo0, dtype=torch.bool)
        known = {}  # layer key -> (the recorded values, their flat neurons)
        for other, node in acts.items():
            values, flat = rec.alpha.get(node.name), rec.features.get(node.name)
            if values is not None and len(flat) == values[0].shape[1]:
                rows &= ~torch.stack([v.isnan().any(1) for v in values]).any(0)
                known[other] = (values, flat)
        neurons = rows.nonzero().flatten().cpu().numpy()
        if not len(neurons) or not known:
            continue
        entry: dict = {"neurons": neurons.tolist(), "lower": {}, "upper": {}}
        for other, (values, flat) in known.items():
            for s, side in enumerate(("lower", "upper")):
                if isinstance(other, int):
                    keep = np.flatnonzero((claims[other][0][flat] < 0) & (claims[other][1][flat] > 0))
                    given = {"values": _rows(values[s], neurons, keep)}
                else:
                    keep = np.arange(len(flat))
                    given = {"lower_line": _rows(values[s], neurons, keep),
                             "upper_line": _rows(values[2 + s], neurons, keep)}  # fmt: skip
                entry[side][str(other)] = {"index": flat[keep].tolist(), **given}
        out[key] = entry
    return out


def _rows(values, neurons: np.ndarray, columns: np.ndarray) -> list:
    return np.round(values[neurons][:, columns].double().numpy(), 7).tolist()


def _spec_rows(lookup, size: int, shape: tuple) -> tuple[np.ndarray, np.ndarray] | None:
    """A start node's neurons that have slopes of their own, and their rows in the α's spec dimension
    (``size`` rows; :func:`.rows.alpha.alpha_rows`: a sparse-spec lookup table's, per channel or per
    neuron). None for a layout not known (slopes shared by every row, a table naming rows the α has
    not)."""
    n = int(np.prod(shape))
    if lookup is None and size != n:
        return None
    per_channel = lookup is not None and lookup.dim() == 1 and len(shape) == 3 and lookup.numel() == shape[0]
    rows = alpha_rows(lookup, list(shape), per_channel)[0].numpy()
    neurons = np.flatnonzero(rows) if lookup is not None else np.arange(n)
    if len(rows) != n or (len(neurons) and rows[neurons].max() >= size):
        return None
    return neurons, rows[neurons]


def _feature_index(relu) -> np.ndarray:
    """The flat neurons of a ReLU's α features (all, or its sparse-feature ``alpha_indices``)."""
    shape = tuple(relu.inputs[0].output_shape[1:])
    index = getattr(relu, "alpha_indices", None)
    if index is None:
        return np.arange(int(np.prod(shape)))
    return np.ravel_multi_index(tuple(t.cpu().numpy() for t in index), shape)


def _claims(bounds, keys: list, members: list[int], n_boxes: int, single: bool) -> dict | None:
    """The bounds that hold over the box of the batch elements ``members``, by layer key: a shared row,
    or the intersection of theirs (each a valid bound over the box; all of them where there is one box)."""
    if bounds is None:
        return None
    out = {}
    for key, (lo, hi) in zip(keys, bounds, strict=True):
        if len(lo) == 1:
            rows = [0]
        elif len(lo) == n_boxes:
            rows = members
        elif single:
            rows = list(range(len(lo)))
        else:
            return None
        out[key] = (lo[rows].max(0), hi[rows].min(0))
    return out


def above(lb, thresholds):
    """Where a lower bound is above its threshold (NaN and -inf prove nothing; +inf is α,β-CROWN's mark
    of a row that α-CROWN verified and pruned before its last iteration). What this records only says
    which step proved a clause: the checker re-derives every bound, so a row taken wrongly could make
    the proof invalid, never the verdict wrong."""
    lb = lb.detach()
    return lb > thresholds.to(lb.device)


def _proven_rows(global_lb, c, rhs, n_boxes: int) -> list[set[bytes]]:
    """For each box of the build: the rows whose lower bound is above the threshold (NaN proves
    nothing)."""
    proven: list[set[bytes]] = [set() for _ in range(n_boxes)]
    if global_lb is None or not hasattr(global_lb, "shape") or tuple(global_lb.shape) != tuple(rhs.shape):
        return proven
    if len(c) != n_boxes and n_boxes != 1:
        return proven
    hit = above(global_lb, rhs).cpu().numpy()
    C, d = c.detach().cpu().double().numpy(), rhs.detach().cpu().double().numpy()
    for b, s in zip(*np.nonzero(hit), strict=True):
        proven[b if n_boxes > 1 else 0].add(row_key(C[b, s], d[b, s]))
    return proven


# ----------------------------------------------------------------------------------------------------------
# Activation (ReLU-split) BaB
# ----------------------------------------------------------------------------------------------------------


def general_bab(run: Run, orig):
    """``complete_verifier_func.general_bab``: the clauses searched, the ReLU each split node feeds, and
    the clauses proved at the root."""

    def general_bab(net, x, c, rhs, reference_dict=None, timeout=None, max_iterations=None):
        _guarded(run.proof, _bab_start, net, x, c, rhs, reference_dict)
        ret = orig(net, x, c, rhs, reference_dict, timeout, max_iterations)
        _guarded(run.proof, _bab_end, c, rhs, ret)
        return ret

    return general_bab


def _bab_start(proof: Proofs, net, x, c, rhs, reference: dict | None) -> None:
    import arguments

    bab = arguments.Config["bab"]
    if bab["cut"]["enabled"]:
        raise Refused("cutting planes (bab.cut) bound the domains with constraints the proof does not carry")
    if bab["branching"]["branching_input_and_activation"]:
        raise Refused("input splits inside activation BaB (branching_input_and_activation)")
    if bab["clip_n_verify"]["clip_interm_domain"]["enabled"]:
        raise Refused("clip_interm_domain tightens a domain's bounds by constraints the proof does not carry")
    if bab["vanilla_crown"]:
        raise Refused("bab.vanilla_crown keeps no split histories")
    boxes = np.concatenate([_flat(x.ptb.x_L), _flat(x.ptb.x_U)], 1)
    if not (boxes == boxes[0]).all():
        raise Refused("activation BaB over several input boxes")
    proof.split_relu = _split_relus(net.net)
    proof.bab_relus = list(net.net.relus)
    proof.bab_specs.update(_clauses(proof, c, rhs))
    proof.bab_claims = proof.builds[-1] if proof.builds else None
    if reference and reference.get("lower_bounds") and proof.bab_claims is not None:
        _check_not_refined(
            proof.bab_claims, layer_keys(list(net.net.relus), sigmoid_nodes(net.net)), reference
        )


def _split_relus(module) -> dict[str, int]:
    """Split node name -> the index of the one ReLU it feeds (α,β-CROWN's order)."""
    index = {id(r): i for i, r in enumerate(module.relus)}
    out = {}
    for name, acts in module.split_activations.items():
        if len(acts) != 1 or type(acts[0][0]).__name__ != "BoundRelu" or id(acts[0][0]) not in index:
            kinds = ", ".join(type(a).__name__ for a, _ in acts)
            raise Refused(f"node {name} is split for {kinds}: only ReLU splits are recorded")
        out[name] = index[id(acts[0][0])]
    return out


def _check_not_refined(build: Bounded, acts: dict, reference: dict) -> None:
    """The bounds BaB starts from are no tighter than the build's (else a step in between, MIP
    refinement, tightened them: a proof cannot re-derive that)."""
    if build.claims is None:
        return
    for key, (lo, hi) in build.claims.items():
        name = acts[key].inputs[0].name
        ref_lo, ref_hi = reference["lower_bounds"].get(name), reference["upper_bounds"].get(name)
        if ref_lo is None or ref_hi is None:
            continue
        if (_flat(ref_lo).max(0) > lo).any() or (_flat(ref_hi).min(0) < hi).any():
            raise Refused("intermediate bounds refined after the incomplete bounds (MIP refinement)")


def _bab_end(proof: Proofs, c, rhs, ret) -> None:
    if proof.bab_claims is None and proof.builds:  # a build inside the search (no incomplete phase)
        proof.bab_claims = proof.builds[-1]
    if isinstance(ret, tuple) and len(ret) > 2 and ret[2] == "safe" and int(ret[1]) == 0:
        proof.roots_closed.update(_clauses(proof, c, rhs))


def domain_add(run: Run, orig):
    """``BatchedDomainList.add``: the split history of every domain it drops as verified."""

    def add(self, bounds, d, check_infeasibility):
        _guarded(run.proof, _record_domains, self, bounds, d, check_infeasibility)
        return orig(self, bounds, d, check_infeasibility)

    return add


def _record_domains(proof: Proofs, dl, bounds: dict, d: dict, check_infeasibility: bool) -> None:
    lb = bounds["lower_bounds"][dl.final_name]
    thr = d["thresholds"][: len(lb)].to(lb.device)
    kept, proven = (lb <= thr).all(1), (lb > thr).any(1)
    if check_infeasibility:
        from utils import check_infeasible_bounds

        infeasible = check_infeasible_bounds(bounds["lower_bounds"], bounds["upper_bounds"]).to(lb.device)
        kept, proven = kept & ~infeasible, proven | infeasible
    if (~kept & ~proven).any():
        raise Refused("BaB dropped a domain whose lower bound is not a number")
    names = _clauses(proof, bounds["c"][: len(lb)], thr)
    slopes = _round_slopes(proof, dl.final_name, bounds, d) if proven.any() else []
    for j in proven.nonzero().view(-1).tolist():
        leaf = (names[j], _splits(d["history"][j], proof.split_relu))
        proof.phase_leaves.add(leaf)
        row = int((lb[j] - thr[j]).argmax())
        if lb[j, row] > thr[j, row]:  # (an infeasible domain has no proving row)
            C = bounds["c"][j, row].detach().cpu().double().numpy()
            key = row_key(C, float(thr[j, row]))
            proof.phase_evidence[leaf] = _leaf_evidence(proof, slopes, bounds, d, j, row, key)


def _round_slopes(proof: Proofs, final: str, bounds: dict, d: dict) -> list[tuple]:
    """Per split ReLU whose α is laid out as expected, of one round (``bounds``: what it returned,
    ``d``: the domains it bounded): (its index, the lower slopes (rows, domains, k) of the α the round
    kept (half precision in α,β-CROWN's domains), its k α-features' flat neurons, the domains' input
    bounds (domains, n))."""
    out = []
    lower, upper = d.get("lower_bounds") or {}, d.get("upper_bounds") or {}
    for i, relu in enumerate(proof.bab_relus):
        slopes, z = bounds["alphas"].get(relu.name, {}).get(final), relu.inputs[0].name
        if slopes is None or z not in lower or z not in upper:
            continue
        lo, hi = _flat(lower[z]), _flat(upper[z])
        values, flat = slopes[0].detach().flatten(2).cpu().double().numpy(), _feature_index(relu)
        if len(flat) == values.shape[2]:
            out.append((i, values, flat, lo, hi))
    return out


def _leaf_evidence(
    proof: Proofs, slopes: list[tuple], bounds: dict, d: dict, j: int, row: int, key: bytes
) -> dict:
    """Domain ``j``'s evidence (docs/proofs.md): its proving row (by key), that row's lower slopes at the
    neurons the domain has unstable (``slopes``: :func:`_round_slopes`) and the β of its splits; layers
    whose α or β is not laid out as expected are left out (the checker takes its own slopes there, its
    LP where they fall short)."""
    alpha: dict[int, dict[int, float]] = {}
    for i, values, flat, lo, hi in slopes:
        unstable = (lo[j, flat] < 0) & (hi[j, flat] > 0)
        alpha[i] = dict(zip(flat[unstable].tolist(), values[row, j, unstable].tolist(), strict=True))
    beta: dict[int, dict[int, float]] = {}
    betas = bounds["betas"][j] if bounds.get("betas") else {}
    for name, entry in d["history"][j].items():
        value = betas.get(name) if isinstance(betas, dict) else None
        neurons = _as_list(entry[0])
        if name not in proof.split_relu or value is None or not hasattr(value, "reshape"):
            continue
        value = value.detach().reshape(-1).cpu().double().numpy()
        if len(value) == len(neurons) and neurons:
            beta[proof.split_relu[name]] = dict(zip(map(int, neurons), value.tolist(), strict=True))
    return {"row": key, "alpha": alpha, "beta": beta}


def _splits(history: dict | None, split_relu: dict[str, int]) -> tuple[tuple[int, int, int], ...]:
    """A domain's split history ``{node: (neurons, ±1, points, scores, depths)}`` (points, scores and
    depths may be None; a node's splits in the order made) as ``(ReLU index, neuron, ±1)``, in the
    order of the splits where the depths give it."""
    if history is None:
        raise Refused("a domain without a split history")
    out = []
    for name, entry in history.items():
        idx, signs, points = (_as_list(v) for v in entry[:3])
        depths = _as_list(entry[4]) if len(entry) > 4 else []
        if idx and name not in split_relu:
            raise Refused(f"a split of node {name}, which feeds no ReLU")
        if any(float(p) != 0.0 for p in points):
            raise Refused("a ReLU split at a point other than 0")
        depths = depths if len(depths) == len(idx) else [0] * len(idx)
        for pos, (i, s, k) in enumerate(zip(idx, signs, depths, strict=True)):
            out.append((float(k), pos, split_relu.get(name), int(i), 1 if float(s) > 0 else -1))
    return tuple(x[2:] for x in sorted(out))


def _as_list(v) -> list:
    return [] if v is None else v.tolist() if hasattr(v, "tolist") else list(v)


# ----------------------------------------------------------------------------------------------------------
# Input-split BaB
# ----------------------------------------------------------------------------------------------------------


def input_bab_parallel(run: Run, orig):
    """``complete_verifier_func.input_bab_parallel``: each clause's root box (those its incomplete bounds
    proved closed)."""

    def input_bab_parallel(net, x, c, rhs, or_spec_size, reference_dict=None, timeout=None,
                           max_iterations=None, vnnlib=None, return_domains=False, index=None):  # fmt: skip
        _guarded(run.proof, _input_start, x, c, rhs, or_spec_size, reference_dict)
        kwargs = dict(reference_dict=reference_dict, timeout=timeout, max_iterations=max_iterations,
                      vnnlib=vnnlib, return_domains=return_domains, index=index)  # fmt: skip
        return orig(net, x, c, rhs, or_spec_size, **kwargs)

    return input_bab_parallel


def _input_start(proof: Proofs, x, c, rhs, or_spec_size, reference: dict | None) -> None:
    import arguments

    split = arguments.Config["bab"]["branching"]["input_split"]
    clip = arguments.Config["bab"]["clip_n_verify"]["clip_input_domain"]
    if split["presplit_domains"]:
        raise Refused("pre-split input domains (input_split.presplit_domains) are not recorded")
    if split["update_rhs_with_attack"]:
        raise Refused("input_split.update_rhs_with_attack moves the thresholds")
    if clip["enabled"] and clip["clip_type"] == "complete":
        raise Refused("complete clipping bounds boxes under constraints the proof does not carry")
    if not bool((or_spec_size == or_spec_size[0]).all()):
        raise Refused("clauses with different numbers of rows in one input-split search")
    lo, hi = (t.expand(len(c), *t.shape[1:]) for t in (x.ptb.x_L, x.ptb.x_U))
    roots = box_keys(proof, lo, hi, c, rhs)
    proof.input_roots += roots
    proof.last = list(roots)
    lb = (reference or {}).get("global_lb")
    if lb is not None and tuple(lb.shape) == tuple(rhs.shape):
        proven = (lb.detach() > rhs.to(lb.device)).any(1).tolist()
        proof.verified.update(k for k, p in zip(roots, proven, strict=True) if p)


def input_split_and_repeat(run: Run, orig):
    """``input_split_and_repeat``: each box and the boxes it was split into (box ``j`` of ``N`` into
    ``j``, ``j + N``, ``j + 2N``, ...; that they tile it is checked when the tree is built). A box
    split into copies of itself (cut across a fixed input) is recorded as not split."""

    def input_split_and_repeat(*args, **kwargs):
        out = orig(*args, **kwargs)
        a = _bound(orig, args, kwargs)
        _guarded(run.proof, _record_split, a["x_L"], a["x_U"], a["cs"], a["thresholds"], out)
        return out

    return input_split_and_repeat


def _record_split(proof: Proofs, x_L, x_U, cs, thresholds, out: tuple) -> None:
    parents, kids = box_keys(proof, x_L, x_U, cs, thresholds), box_keys(proof, *out[:4])
    n, m = len(parents), len(kids)
    if n and m % n:
        raise Refused(f"{n} boxes split into {m}")
    for j, p in enumerate(parents):
        # a cut across a dimension of width 0 (a fixed input) gives copies of the box: one of each
        children = tuple(dict.fromkeys(kids[j + n * r] for r in range(m // n)))
        if children == (p,):
            continue
        if any(k[0] != p[0] for k in children):
            raise Refused("a box's parts are searched for another clause")
        if proof.splits.setdefault(p, children) != children:
            raise Refused("a box split twice, two ways")
    proof.last = kids


def get_bounds(run: Run, orig):
    """Input-split ``get_bounds``: the boxes bounded above their threshold; the others are what a clip
    gets next."""

    def get_bounds(net, dm_lb, x_L, x_U, alphas, cs, thresholds, constraints, bounding_method,
                   branching_method, stop_func, stats):  # fmt: skip
        out = orig(net, dm_lb, x_L, x_U, alphas, cs, thresholds, constraints, bounding_method,
                   branching_method, stop_func, stats)  # fmt: skip
        _guarded(run.proof, _record_bounded, x_L, x_U, cs, thresholds, constraints, out[0])
        return out

    return get_bounds


def _record_bounded(proof: Proofs, x_L, x_U, cs, thresholds, constraints, lb) -> None:
    if constraints is not None:
        raise Refused("boxes bounded under linear constraints (complete clipping)")
    keys = box_keys(proof, x_L, x_U, cs, thresholds)
    proven = above(lb, thresholds).any(1).tolist()
    proof.verified.update(k for k, p in zip(keys, proven, strict=True) if p)
    proof.last = [k for k, p in zip(keys, proven, strict=True) if not p]


def clip_domains(run: Run, orig):
    """``clip_domains``: each box (the last split's or bounding's open boxes, in order) and the box it
    was clipped to (empty: the whole box verified)."""

    def clip_domains(*args, **kwargs):
        out = orig(*args, **kwargs)
        a = _bound(orig, args, kwargs)
        _guarded(run.proof, _record_clip, a["x_L"], a["x_U"], out)
        return out

    return clip_domains


def _record_clip(proof: Proofs, x_L, x_U, out: tuple) -> None:
    lo, hi, new_lo, new_hi = _flat(x_L), _flat(x_U), _flat(out[0]), _flat(out[1])
    last = proof.last
    held = len(last) == len(lo) and all(
        k[1] == a.tobytes() and k[2] == b.tobytes() for k, a, b in zip(last, lo, hi, strict=True)
    )
    if not held:
        raise Refused("a clipped box that the search log does not hold")
    if not (np.isfinite(new_lo).all() and np.isfinite(new_hi).all()):
        raise Refused("a box clipped to bounds that are not finite")
    for k, a, b, a2, b2 in zip(last, lo, hi, new_lo, new_hi, strict=True):
        if (a2 > b2).any():
            proof.clips[k] = None
        elif not (np.array_equal(a, a2) and np.array_equal(b, b2)):
            proof.clips[k] = (k[0], a2.tobytes(), b2.tobytes())
    proof.last = []
