"""What is sharded inside auto_LiRPA's bound passes: the Linear/MatMul/Conv weights (:mod:`.shards`,
the registry and ``shard_net``; :mod:`.fsdp`, gathered per call; :mod:`.tp`, never whole) and the rows
of the A-matrices with their α (:mod:`.rows`)."""
