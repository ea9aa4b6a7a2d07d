"""What the plugin refuses before any rank starts, with one line: what α,β-CROWN itself refuses (at
every P, instead of its assertion traceback), and the BaB features that do not run split over ranks
yet (P > 1)."""

from __future__ import annotations

from pathlib import Path


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
