"""``parallel/oom.py``: a rank that runs out of memory midway through a pass in lockstep replays the rest
over a dummy row, the ranks vote, and every rank runs the pass again in halves (real gloo ranks)."""

from __future__ import annotations


def _toy_passes(limit: int) -> list:
    """Two gloo ranks, each with one pass of its own rows (6 on rank 0, 8 on rank 1), every pass
    issuing the same collectives (a weight gather, a decision that the rest hangs on, a ring pass, a
    shard pass, a sized all-gather) whatever its rows (0: a dummy pass); rank 1 runs out of memory after
    the first two in any pass of more than ``limit`` rows. Returns every rank's (passes run,
    collectives issued, collective counts)."""
    import torch

    from complete_verifier_ext.parallel import comm, oom

    w = torch.arange(4.0) + comm.rank()

    def one_pass(n: int) -> float:
        out = torch.empty(4 * comm.world_size())
        comm.all_gather_into(out, w)
        if not comm.all_reduce_flag(comm.rank() == 0):  # True: a replay must be told so, not guess
            return 0.0
        if comm.rank() == 1 and n > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        got = comm.ring_pass_start(w, recv_shape=(4,)).wait()
        comm.shard_pass(w, torch.empty(4), 1)
        both = comm.all_gather_cat(w[None], 0, sizes=[1, 1])
        return float(out.sum() + got.sum() + both.sum()) + n

    queue, done = [6 if comm.rank() == 0 else 8], []
    while queue:
        n = queue.pop(0)
        out, failed = oom.lockstep_on_oom(lambda n=n: one_pass(n), lambda: one_pass(0), n, "toy")
        if out is None:  # every rank: this pass again as two of half its rows
            assert failed > limit
            queue[:0] = [n - n // 2, n // 2]
            continue
        done.append((n, out))
    stats = {k: v["calls"] for k, v in comm.stats().items()}
    return comm.all_gather_object((done, comm.issued(), stats))


def test_a_pass_that_runs_out_on_one_rank_runs_again_in_halves_on_every_rank(capfd) -> None:
    """Rank 1 runs out of memory midway through its pass (after the weight gather and a decision): it
    issues the rest of the pass's collectives over one dummy row without issuing those two again (the
    decision as it was), the ranks vote, and every rank runs its pass again as two of half its rows,
    until rank 1's fit. No hang; both ranks issue the same collectives; every row is bounded once; one
    line per pass that ran out."""
    from complete_verifier_ext.parallel import launch

    ranks = launch.run(_toy_passes, 2, (2,), backend="gloo")
    (done0, issued0, stats0), (done1, issued1, stats1) = ranks
    assert issued0 == issued1 and stats0 == stats1
    assert sum(n for n, _ in done0) == 6 and sum(n for n, _ in done1) == 8
    assert len(done0) == len(done1) and max(n for n, _ in done1) <= 2
    w0, w1 = sum(range(4)), sum(range(4)) + 4  # every pass saw both ranks' real weights
    assert all(out == 2 * (w0 + w1) + w1 + n for n, out in done0)
    assert all(out == 2 * (w0 + w1) + w0 + n for n, out in done1)
    err = capfd.readouterr().err
    assert "warning: out of memory on rank 1 in a pass of 8 rows of toy; every rank runs that" in err
    assert err.count("warning: out of memory on rank 1") == 3  # 8, then 4 and 4


def test_a_rank_out_of_memory_on_one_row_ends_every_rank_with_the_error(capfd) -> None:
    """Where a rank runs out on a pass of one row, every rank raises (no hang), after one line."""
    import pytest

    from complete_verifier_ext.parallel import launch

    with pytest.raises(launch.RankFailure, match="OutOfMemoryError"):
        launch.run(_toy_passes, 2, (0,), backend="gloo")
    err = capfd.readouterr().err
    assert "out of memory on rank 1 in a pass of 1 of toy's rows (the smallest pass): every rank stops" in err
