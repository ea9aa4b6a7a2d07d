"""``Customized("file", "function")`` in ``abcrown.py`` at P > 1: a verifier, or an ad-hoc tuning.

* A ``Customized`` verifier (``general.complete_verifier``): α,β-CROWN hands the whole instance to the
  user's function (VNN-COMP's cctsdb_yolo config does this). The plugin cannot know what that function
  does, so it is not split: it runs once, on rank 0 alone (``comm.solo()``: as a single process, with
  every weight whole), while the other ranks wait on the group's store; its result is then every
  rank's, and one line says so. A counterexample it wrote (``attack.cex_path``, which α,β-CROWN's
  ``Logger`` reads back for a ``sat``) is written to every rank's own path too.
* Anything else ``abcrown.py`` evaluates so (``general.adhoc_tuning``: nn4sys's and vit's configs set
  α,β-CROWN's settings from the model's size) runs on every rank, so that every rank runs with the same
  settings, with every weight whole (what it measures is the model's, not a shard's).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from ...parallel import comm
from ..clocks import local_clock
from ..run import Run
from ..weights import shards

_CALL = re.compile(r"""Customized\(\s*["']([^"']+)["']\s*,\s*["']([^"']+)["']""")


def _is_verifier(def_file: str, callable_name: str) -> bool:
    """Whether ``Customized(def_file, callable_name)`` is ``general.complete_verifier``."""
    import arguments

    m = _CALL.match(str(arguments.Config["general"]["complete_verifier"]))
    return m is not None and m.groups() == (def_file, callable_name)


def Customized(run: Run, orig):
    """``abcrown.Customized`` (what ``general.complete_verifier`` and ``general.adhoc_tuning`` are
    evaluated with)."""

    def Customized(def_file, callable_name, *args: Any, **kwargs: Any):
        verify = orig(def_file, callable_name, *args, **kwargs)
        if not _is_verifier(def_file, callable_name):

            def every_rank(*a: Any, **kw: Any) -> Any:
                with shards.replicated(run.shards):  # collective on entry: every weight whole
                    return verify(*a, **kw)

            return every_rank

        def on_rank0(*a: Any, **kw: Any) -> Any:
            import arguments

            cex_path = arguments.Config["attack"]["cex_path"]

            def compute():
                name = f"{def_file}:{callable_name}"
                print(f"warning: the Customized verifier {name} is not split: it runs on rank 0 alone "
                      "while the other ranks wait", file=sys.stderr)  # fmt: skip
                before = _stamp(cex_path)
                with local_clock(run):
                    result = verify(*a, **kw)
                written = _stamp(cex_path) not in (None, before)
                return result, Path(cex_path).read_text() if written else None

            with shards.replicated(run.shards):  # collective on entry: the weights whole on every rank
                result, cex = comm.from_rank0(compute)
            if cex is not None and comm.rank() != 0:
                Path(cex_path).write_text(cex)
            return result

        return on_rank0

    return Customized


def _stamp(path: str) -> tuple[int, int] | None:
    """The file's modification time and size, or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
