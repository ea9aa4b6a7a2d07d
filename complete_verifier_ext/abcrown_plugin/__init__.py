"""The α,β-CROWN plugin: ``general.engine: abcrown`` runs the user's α,β-CROWN checkout
(``$ABCROWN_PATH``) with our sharding patched into it at runtime. The only package that imports it.

Its public face is :data:`__all__` (what ``cli.py`` and the VNN-COMP scripts use). Inside:

* :mod:`.locate`: find the checkout, make it importable, refuse unsupported versions;
* :mod:`.bridge`: our keys inside α,β-CROWN's config, each rank's command line;
* :mod:`.parent`: the ``abcrown`` command on this engine (config check, refusals, the ranks started,
  the result reported), and ``--help`` from the user's checkout; :mod:`.rank`: one rank, α,β-CROWN's
  ``ABCROWN(args).main()`` with the patches installed from a new run;
* :mod:`.run`: one rank's run, every piece of state the replacements share;
* :mod:`.table`: every upstream attribute the plugin changes, one row each (``make(run, original)``);
  :mod:`.patcher` sets and undoes them;
* :mod:`.probe`: what α,β-CROWN computed, for ``--summary``; :mod:`.clocks`: the first instance's clock
  and the ranks' synced clock; :mod:`.inputs`: α,β-CROWN's loaders' bad-input failures as one line;
* :mod:`.weights`: the weights sharded inside auto_LiRPA (``fsdp``, ``tp``) and the rows of each bound
  pass dealt over the ranks;
* :mod:`.search`: the BaB domain and box lists split over the ranks, BICCOS cuts, MIP solves,
  ``Customized`` verifiers, and what cannot run split yet;
* :mod:`.vnncomp`: the VNN-COMP route (``run_instance.sh`` with ``ABCROWN_PATH``).

Process-wide state: :mod:`.locate`'s loaded checkout alone (α,β-CROWN's modules are top-level names in
``sys.modules``: one checkout per process). Everything else lives in a :class:`~.run.Run`.
"""

__all__ = ["available", "exp_config", "keys_help", "main", "vnncomp_main", "warm"]


def available() -> tuple[str | None, str]:
    """Whether an α,β-CROWN checkout is found (``$ABCROWN_PATH``, else an importable
    ``complete_verifier``), without importing it: ``(its root, how it was found)``, or ``(None, why
    not)`` (:func:`.locate.find`'s reason)."""
    import os

    from .locate import ENV, PluginError, find

    try:
        checkout = find()
    except PluginError as e:
        return None, str(e).removeprefix("general.engine abcrown: ")
    how = f"${ENV}" if os.environ.get(ENV) else "an importable complete_verifier"
    return str(checkout.root), how


def main(config, overrides, summary, quiet, started_wall=None) -> int:
    """The ``abcrown`` command on this engine (:func:`.parent.main`)."""
    from .parent import main as run

    return run(config, overrides, summary, quiet, started_wall)


def keys_help(checkout=None) -> str:
    """``--help``'s key table from the user's checkout (:func:`.parent.keys_help`)."""
    from .locate import find
    from .parent import keys_help as table

    return table(checkout or find())


def vnncomp_main(argv: list[str]) -> int:
    """One VNN-COMP instance on this engine (:func:`.vnncomp.main`)."""
    from .vnncomp import main as run

    return run(argv)


def warm() -> None:
    """Everything an instance on this engine imports, imported once without running anything: the
    VNN-COMP route, and α,β-CROWN itself from the checkout found (its import-time prints swallowed).
    The resident worker calls it before it forks instances."""
    import contextlib
    import io

    from . import vnncomp  # noqa: F401
    from .bridge import import_abcrown
    from .locate import find

    with contextlib.redirect_stdout(io.StringIO()):
        import_abcrown(find())
        import abcrown  # noqa: F401


def exp_config(relative: str) -> str:
    """The path of one of the checkout's own configs (``exp_configs/`` + ``relative``)."""
    from .locate import find

    return str(find().complete_verifier / "exp_configs" / relative)
