"""``general.proof`` at an instance's end: every rank's records (:class:`~.run.Proofs`, made by
:mod:`.proofs`) gathered to rank 0, which writes the proof of an ``unsat`` with
:func:`complete_verifier_ext.proofs.write`, or one ``note:`` line saying why it writes none.

The obligations come from our own reading of the VNN-LIB file (:mod:`complete_verifier_ext.spec`: each
region's outward float32 box, each clause's rows ``C y <= d``), never from α,β-CROWN's internals; each
clause is matched to α,β-CROWN's records by its rows (float32, as both read them). Its tree, by the step
that proved it (the first that did):

* the incomplete bounds: a leaf under the build's pre-activation bounds as claims (widened for float32
  rounding, :func:`complete_verifier_ext.proofs.widened`), keyed by the ONNX graph's ReLU ids;
* activation BaB: the case split rebuilt from the verified domains' split histories
  (:func:`~complete_verifier_ext.proofs.phase_tree`), under the claims of the bounds it started from;
* input-split BaB: the splits and clips rebuilt from the root box by
  :func:`~complete_verifier_ext.proofs.logged_tree`.

α,β-CROWN's ReLUs are the ONNX graph's ``Relu`` nodes in order, matched by count and size; where they
do not match, or a clause has no record, no proof is written. The trees depend only on what was
verified, not on which rank verified it, so P = 1 and P > 1 runs of the same search write the same one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .. import proofs
from ..parallel import comm
from .inputs import short
from .proofs import c_key, clause, row_key
from .run import Bounded, Proofs, Run

METHODS = ("incomplete", "activation-bab", "input-split")


class NoProof(Exception):
    """Why the instance's proof cannot be written."""


@dataclass
class Share:
    """What one rank recorded that the others may not have: its searches' leaves and boxes."""

    refused: str | None = None
    bab_specs: set = field(default_factory=set)
    roots_closed: set = field(default_factory=set)
    phase_leaves: set = field(default_factory=set)
    phase_evidence: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    clips: dict = field(default_factory=dict)
    verified: set = field(default_factory=set)
    build_alpha: list = field(default_factory=list)  # per build, its claims' slopes (each rank its rows)
    build_output: list = field(default_factory=list)  # per build, its output rows' slopes (the same)

    @classmethod
    def of(cls, p: Proofs) -> Share:
        builds = ([b.alpha for b in p.builds], [b.output for b in p.builds])
        return cls(p.refused, p.bab_specs, p.roots_closed, p.phase_leaves, p.phase_evidence, p.splits,
                   p.clips, p.verified, *builds)  # fmt: skip

    def join(self, other: Share) -> None:
        """Add another rank's share (a box split or clipped two ways: no proof)."""
        self.refused = self.refused or other.refused
        for mine, theirs in ((self.splits, other.splits), (self.clips, other.clips)):
            for key, value in theirs.items():
                if mine.setdefault(key, value) != value:
                    self.refused = self.refused or "two ranks split or clipped one box differently"
        self.bab_specs |= other.bab_specs
        self.roots_closed |= other.roots_closed
        self.phase_leaves |= other.phase_leaves
        self.phase_evidence.update(other.phase_evidence)
        self.verified |= other.verified
        if not self.build_alpha:
            self.build_alpha, self.build_output = list(other.build_alpha), list(other.build_output)
        elif len(self.build_alpha) == len(other.build_alpha):
            self.build_alpha = [
                _joined_alpha(a, b) for a, b in zip(self.build_alpha, other.build_alpha, strict=True)
            ]
            self.build_output = [a | b for a, b in zip(self.build_output, other.build_output, strict=True)]


def _joined_alpha(mine: dict, theirs: dict) -> dict:
    """Two ranks' slopes of one build's claims (``alpha`` entries by layer key, each rank those of the
    rows it bounded): a layer's rows joined where both name the same slope columns, else one rank's."""
    out = dict(mine)
    for k, b in theirs.items():
        a = out.get(k)
        same = a is not None and all(
            {i: e["index"] for i, e in a[side].items()} == {i: e["index"] for i, e in b[side].items()}
            for side in ("lower", "upper")
        )
        if a is None or not same:
            out[k] = a or b
            continue
        new = [m for m, j in enumerate(b["neurons"]) if j not in set(a["neurons"])]
        out[k] = {"neurons": a["neurons"] + [b["neurons"][m] for m in new]}
        for side in ("lower", "upper"):
            out[k][side] = {
                i: {f: v if f == "index" else v + [b[side][i][f][m] for m in new] for f, v in e.items()}
                for i, e in a[side].items()
            }
    return out


def finish(run: Run, verdict: str) -> None:
    """Every rank at an instance's end (``Logger.summarize_results``), with ``general.proof`` set: one
    all-gather of the records (empty unless ``unsat``), then rank 0 writes the proof or one note."""
    proof = run.proof
    if proof is None:
        return
    every = comm.all_gather_object(Share.of(proof) if verdict == "unsat" else None)
    if comm.rank() != 0 or verdict != "unsat":
        return
    joined = Share()
    for share in every:
        joined.join(share)
    for built, *joins in zip(proof.builds, joined.build_alpha, joined.build_output, strict=False):
        for mine, whole in zip((built.alpha, built.output), map(dict, joins), strict=True):
            mine.clear()  # (a copy first: at P = 1 it is the build's own dict)
            mine.update(whole)
    try:
        _write(run, proof, joined)
    except NoProof as e:
        print(f"note: no proof written: {e}", file=sys.stderr)
    except Exception as e:  # writing a proof never changes the verdict
        print(f"note: no proof written: writing it failed ({short(e)})", file=sys.stderr)


def _write(run: Run, proof: Proofs, share: Share) -> None:
    import arguments

    why = share.refused or _refused_by_config(arguments.Config)
    if why:
        raise NoProof(why)
    arg, vnnlib = _instance_files(arguments.Config)
    from ..model.joint import model_for
    from ..spec import load_vnnlib

    spec = load_vnnlib(vnnlib)
    try:
        model = model_for(arg, spec)
        networks, layers = proofs.named(spec, *model, proof.relu_sizes, proof.relu_order)
        smooth = []  # (no second read of the ONNX graph for a network without sigmoids)
        if proof.sigmoid_sizes:
            smooth = proofs.named(spec, *model, proof.sigmoid_sizes, op="Sigmoid")[1]
    except ValueError as e:
        raise NoProof(str(e)) from None
    obligations, methods, tables = [], set(), {}
    single = len(spec.regions) == 1
    for k, region in enumerate(spec.regions):
        lo, hi = (a.astype(np.float64) for a in _outward(region))
        for i, cl in enumerate(region.clauses):
            tree, method = _clause_tree(proof, share, (region, single, cl), tables, f"region {k} clause {i}")
            obligations.append(proofs.Obligation(lo, hi, cl.C, cl.d, tree))
            methods.add(method)
    method = "+".join(m for m in METHODS if m in methods)
    producer = {"engine": "abcrown", "world_size": run.world, "mode": run.par.mode, "method": method}
    proofs.write(proof.path, vnnlib, networks, layers, obligations, producer, smooth)


def _outward(region) -> tuple[np.ndarray, np.ndarray]:
    from ..spec import float32_box

    return float32_box(region.lower, region.upper, inward=False)


def _refused_by_config(config) -> str | None:
    """Steps the configuration turns on that bound what a proof cannot carry (whether or not they ran)."""
    general, solver, clip = config["general"], config["solver"], config["bab"]["clip_n_verify"]
    if str(general["complete_verifier"]).startswith("Customized"):
        return "a Customized verifier (general.complete_verifier) records nothing a checker can re-derive"
    if config["specification"]["rhs_offset"] is not None:
        return "specification.rhs_offset moves the thresholds"
    if solver["invprop"]["apply_output_constraints_to"] or solver["invprop"]["tighten_input_bounds"]:
        return "invprop bounds under the output constraints, which the proof does not carry"
    if clip["alpha_crown"] or clip["clip_interm_domain"]["clip_in_alpha_crown"]:
        return "clipping inside alpha-CROWN bounds under constraints the proof does not carry"
    return None


def _instance_files(config) -> tuple[str, str]:
    """The instance's ONNX argument (a path, or the VNN-COMP 2026 network list) and VNN-LIB file as
    α,β-CROWN read them."""
    from ..spec.networks import map_paths

    onnx, vnnlib = config["model"]["onnx_path"], config["specification"]["vnnlib_path"]
    if not onnx or not vnnlib:
        raise NoProof("the instance is not an ONNX model with a VNN-LIB query")
    onnx = map_paths(str(onnx), lambda p: os.path.join(config["model"]["onnx_path_prefix"] or "", p))
    return onnx, os.path.join(config["specification"]["vnnlib_path_prefix"] or "", vnnlib)


def _clause_tree(proof: Proofs, share: Share, clause_of: tuple, tables: dict, where: str) -> tuple[dict, str]:
    """The tree of one clause ``cl`` of ``region`` (``clause_of``: ``(region, single, cl)``, ``single``:
    the query's only region), by the first step that proved it, and that step (``tables``: the bounds
    table of each build so far, :func:`_under`)."""
    region, single, cl = clause_of
    name = clause(cl.C, cl.d)
    for built in proof.builds:
        if (single or _near(built.lower, built.upper, region)) and name & built.proven:
            return _under(built, proofs.leaf(**_build_evidence(built, cl)), tables), "incomplete"
    try:
        if name in share.bab_specs:
            if name in share.roots_closed:
                return _under(proof.bab_claims, proofs.leaf(), tables), "activation-bab"
            histories = [h for n, h in share.phase_leaves if n == name]
            evidence = {
                h: _evidence(share.phase_evidence[n, h], cl) for n, h in share.phase_evidence if n == name
            }
            return _under(proof.bab_claims, proofs.phase_tree(histories, evidence), tables), "activation-bab"
        log = proofs.BoxLog(share.splits, share.clips, frozenset(share.verified))
        for root in proof.input_roots:
            if root[0] == name and (single or _near(*proofs.box_of(root), region)):
                return proofs.logged_tree(root, log), "input-split"
    except ValueError as e:
        raise NoProof(f"{where}: the search's records are no proof ({e})") from None
    raise NoProof(f"{where} was proved by a step that records none (such as MIP)")


def _build_evidence(built: Bounded, cl) -> dict:
    """The leaf evidence of a clause a build proved: the first of its rows the build proved with
    output slopes recorded, as ``lambda``, and those slopes (none: the checker's own, as CROWN's)."""
    for c, d in zip(cl.C, cl.d, strict=True):
        slopes = built.output.get(c_key(c))
        if slopes is not None and row_key(c, d) in built.proven:
            return _evidence({"row": row_key(c, d), "alpha": slopes, "beta": None}, cl)
    return {}


def _evidence(recorded: dict, cl) -> dict:
    """A leaf's recorded evidence with its proving row (a row key) as ``lambda`` over the clause's rows."""
    lam = [1.0 if row_key(c, d) == recorded["row"] else 0.0 for c, d in zip(cl.C, cl.d, strict=True)]
    return {"lambda": lam if any(lam) else None, "alpha": recorded["alpha"], "beta": recorded["beta"]}


def _near(lower: np.ndarray, upper: np.ndarray, region) -> bool:
    """α,β-CROWN's float32 box is the region's (to float32 rounding)."""
    return bool(np.allclose(lower, region.lower, rtol=1e-5, atol=1e-6)) and bool(
        np.allclose(upper, region.upper, rtol=1e-5, atol=1e-6)
    )


def _under(built: Bounded | None, child: dict, tables: dict) -> dict:
    """``child`` under the build's input bounds of its activations as claims (those with finite bounds),
    with the slopes that made them: one table per build (``tables``, by the build's id), which every
    clause under it shares (a query's nine clauses: one copy to make and write)."""
    if built is None or built.claims is None:
        return child
    if id(built) not in tables:
        claims = {key: proofs.widened(lo, hi) for key, (lo, hi) in built.claims.items()}
        finite = {i: c for i, c in claims.items() if np.isfinite(c[0]).all() and np.isfinite(c[1]).all()}
        tables[id(built)] = proofs.with_bounds(finite, {}, built.alpha)["bounds"] if finite else None
    table = tables[id(built)]
    return {"bounds": table, "children": [child]} if table is not None else child
