"""A ``Customized`` verifier (``general.complete_verifier: Customized("file", "function")``) at P > 1.

α,β-CROWN hands the whole instance to the user's function (VNN-COMP's nn4sys and cctsdb_yolo configs do
this). The plugin cannot know what that function does, so it is not split: it runs once, on rank 0
alone (``comm.solo()``: as a single process, with every weight whole), while the other ranks wait on
the group's store; its result is then every rank's, and one line says so.
"""

from __future__ import annotations

import sys
from typing import Any

from ...parallel import comm
from ..clocks import local_clock
from ..run import Run
from ..weights import shards


def Customized(run: Run, orig):
    """``abcrown.Customized`` (what ``general.complete_verifier`` is evaluated with)."""

    def Customized(def_file, callable_name, *args: Any, **kwargs: Any):
        verify = orig(def_file, callable_name, *args, **kwargs)

        def on_rank0(*a: Any, **kw: Any) -> Any:
            def compute():
                name = f"{def_file}:{callable_name}"
                print(f"warning: the Customized verifier {name} is not split: it runs on rank 0 alone "
                      "while the other ranks wait", file=sys.stderr)  # fmt: skip
                with local_clock(run):
                    return verify(*a, **kw)

            with shards.replicated(run.shards):  # collective on entry: the weights whole on every rank
                return comm.from_rank0(compute)

        return on_rank0

    return Customized
