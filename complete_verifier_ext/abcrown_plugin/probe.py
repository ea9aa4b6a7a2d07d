"""The probe: what α,β-CROWN computed (the initial CROWN bounds, the α-CROWN bounds, each instance's
verdict, time and BaB domains) recorded into the run's :class:`~.run.Probe` for our ``--summary``, and
the phases (``bounds``: ``LiRPANet.build``; ``bab``: a BaB search) announced for their memory peaks.

Every function here is a replacement's ``make(run, original)`` (:mod:`.table`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from . import proof_write
from .run import Run


def bounds_list(t) -> list[float]:
    return [float(v) for v in t.detach().flatten().tolist()]


def _unstable(node) -> int:
    """Neurons of ``node`` whose bounds straddle 0 (for some element of the batch)."""
    if node.lower is None or node.upper is None:
        return 0
    return int(((node.lower < 0) & (node.upper > 0)).flatten(1).any(0).sum())


def bab_proved(global_lb) -> bool:
    """Whether BaB's final worst margin (lower bound minus threshold) proves the property: at least 0
    (+inf when no domain is left). NaN proves nothing."""
    v = float(global_lb)
    return v >= 0.0


def vnncomp_verdict(verified_status: Any) -> str:
    """α,β-CROWN's own mapping of its statuses to VNN-COMP words (single-instance mode)."""
    s = str(verified_status)
    if "unknown" in s or "timeout" in s or "timed out" in s:
        return "timeout"
    if "unsafe" in s:
        return "sat"
    if "safe" in s:
        return "unsat"
    return s


def summarize_results(run: Run, orig):
    """``Logger.summarize_results``: closes the probe's record of the instance with its verdict; with
    ``general.proof``, the instance's proof is written first (:func:`.proof_write.finish`)."""

    def summarize_results(self, verified_status, index):
        elapsed = time.time() - self.start_time - run.clock.shift  # the reserve is not time spent
        verdict = vnncomp_verdict(verified_status)
        if run.proof is not None:  # general.proof: every rank's records to rank 0, which writes it
            proof_write.finish(run, verdict)
        run.next_instance(verdict, elapsed)
        return orig(self, verified_status, index)

    return summarize_results


def init_alpha(run: Run, orig):
    """``BoundedModule.init_alpha``: records the initial CROWN bounds it returns, and how many neurons
    before each ReLU they leave unstable."""

    def init_alpha(self, x, *args, **kwargs):
        ret = orig(self, x, *args, **kwargs)
        run.probe.optimized = False
        if isinstance(ret, tuple) and ret and ret[0] is not None:
            run.probe.current.crown += bounds_list(ret[0])
            run.probe.current.unstable = [_unstable(relu.inputs[0]) for relu in self.relus]
        return ret

    return init_alpha


def get_optimized_bounds(run: Run, orig):
    """``BoundedModule._get_optimized_bounds``: notes that α-CROWN ran and how many α it holds."""

    def _get_optimized_bounds(self, *args, **kwargs):
        probe = run.probe
        probe.optimized = True
        alphas = (getattr(node, "alpha", None) or {} for node in self.nodes())
        held = sum(a.numel() for per_start in alphas for a in per_start.values())
        probe.alpha_elements = max(probe.alpha_elements, held)
        return orig(self, *args, **kwargs)

    return _get_optimized_bounds


def build(run: Run, orig):
    """``LiRPANet.build``: the ``bounds`` phase; records its CROWN or α-CROWN bounds of the output."""

    def build(self, *args, **kwargs):
        import arguments

        probe = run.probe
        probe.optimized = False
        probe.phase("bounds", True)
        global_lb, result = orig(self, *args, **kwargs)
        probe.phase("bounds", False)
        method = kwargs.get("bounding_method") or arguments.Config["solver"]["bound_prop_method"]
        lower = (result or {}).get("lower_bounds") or {}
        if self.final_name in lower:
            if method == "crown" and not probe.current.crown:
                probe.current.crown += bounds_list(lower[self.final_name])
            elif method == "alpha-crown" and probe.optimized:
                probe.current.alpha_crown += bounds_list(lower[self.final_name])
        return global_lb, result

    return build


def _bab_phase(run: Run, orig, input_split: bool):
    """A BaB search (``general_bab``; ``input_bab_parallel`` with ``input_split``): the ``bab`` phase,
    its time and domains; a "safe" that activation BaB did not prove is unknown (input BaB says "safe"
    only with no box left, and returns other values than a margin)."""

    def search(*args, **kwargs):
        probe = run.probe
        probe.phase("bab", True)
        t0 = time.monotonic()
        ret = orig(*args, **kwargs)
        if not input_split and isinstance(ret, tuple) and len(ret) > 2 and ret[2] == "safe":
            if not bab_proved(ret[0]):
                # α,β-CROWN's BaB says "safe" when bab.max_iterations stops it with domains left (their
                # worst lower bound still below the threshold): that is no proof
                print("warning: BaB stopped by bab.max_iterations, domains open: unknown", file=sys.stderr)
                ret = (ret[0], ret[1], "unknown", *ret[3:])
        probe.current.bab_s += time.monotonic() - t0
        probe.current.bab_domains += int(ret[1]) if isinstance(ret, tuple) and len(ret) > 1 else 0
        probe.phase("bab", False)
        return ret

    return search


def general_bab(run: Run, orig):
    """``complete_verifier_func.general_bab``: activation BaB as a ``bab`` phase."""
    return _bab_phase(run, orig, input_split=False)


def input_bab_parallel(run: Run, orig):
    """``complete_verifier_func.input_bab_parallel``: input BaB as a ``bab`` phase."""
    return _bab_phase(run, orig, input_split=True)
