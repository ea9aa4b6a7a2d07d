"""The α,β-CROWN plugin: ``general.engine: abcrown`` runs the user's α,β-CROWN checkout
(``$ABCROWN_PATH``) with our sharding patched into it at runtime. The only package that imports it.

* :mod:`.locate`: find the checkout, make it importable, refuse unsupported versions;
* :mod:`.bridge`: our keys inside α,β-CROWN's config, each rank's command line;
* :mod:`.patches`: the patcher (signature-checked, undoable), the probe, spec cache and synced clock;
* :mod:`.fsdp`: 1/P row shards of every Linear/MatMul/Conv weight, gathered per call;
* :mod:`.rows`: the neurons of each bounded layer dealt over the ranks, with α-CROWN's gradient protocol;
* :mod:`.runner`: the ``abcrown`` command on this engine.
"""
