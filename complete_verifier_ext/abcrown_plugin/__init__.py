"""The α,β-CROWN plugin: ``general.engine: abcrown`` runs the user's α,β-CROWN checkout
(``$ABCROWN_PATH``) with our sharding patched into it at runtime. The only package that imports it.

* :mod:`.locate`: find the checkout, make it importable, refuse unsupported versions;
* :mod:`.bridge`: our keys inside α,β-CROWN's config, each rank's command line;
* :mod:`.runner`: the ``abcrown`` command on this engine (every rank runs ``ABCROWN(args).main()``),
  and ``--help`` from the user's checkout;
* :mod:`.table`: every upstream attribute the plugin changes, one row each: who, when, in which
  order; installed and undone by walking it;
* :mod:`.patches`: the patcher (signature-checked, undoable), the probe, spec cache and clocks;
* :mod:`.inputs`: α,β-CROWN's loaders' bad-input failures as one line naming the file;
* :mod:`.rows`: the neurons of each bounded layer dealt over the ranks, with α-CROWN's gradient protocol;
* :mod:`.shards`: which auto_LiRPA weights are sharded (the native ``ShardedWeight``), ``replicated()``;
* :mod:`.fsdp`: 1/P row shards of every Linear/MatMul/Conv weight, gathered per call;
* :mod:`.tp`: no whole weight on any rank (column-parallel forward and IBP, ``A @ W`` around a ring);
* :mod:`.bab_split`: the BaB domain list split over the ranks, in lockstep rounds;
* :mod:`.input_bab`: the input-split BaB box list split over the ranks, in the same rounds;
* :mod:`.mip_split`: MIP solves (OR labels, refined neurons) dealt over the ranks;
* :mod:`.customized`: a ``Customized`` verifier run once, on rank 0 alone;
* :mod:`.cuts_split`: BICCOS cuts merged over the ranks each round, multi-tree search on rank 0;
* :mod:`.witness`: a ``sat`` re-checked on onnxruntime before it stands;
* :mod:`.vnncomp`: the VNN-COMP route (``run_instance.sh`` with ``ABCROWN_PATH``).
"""

__all__ = ["main", "keys_help"]


def main(config, overrides, summary, quiet, started_wall=None) -> int:
    """The ``abcrown`` command on this engine (:func:`.runner.main`)."""
    from .runner import main as run

    return run(config, overrides, summary, quiet, started_wall)


def keys_help(checkout=None) -> str:
    """``--help``'s key table from the user's checkout (:func:`.runner.keys_help`)."""
    from .locate import find
    from .runner import keys_help as table

    return table(checkout or find())
