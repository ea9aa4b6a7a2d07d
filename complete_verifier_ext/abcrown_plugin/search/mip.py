"""α,β-CROWN's MIP (``complete_verifier: mip`` and ``bab-refine``) with the solves dealt over the ranks.

α,β-CROWN builds one Gurobi model of the network on every rank (the same model: the weights are whole
in it, gathered under ``fsdp``) and solves many small problems on it in a ``multiprocessing.Pool`` of
``solver.mip.parallel_solvers`` processes:

* ``mip`` with an OR spec (``build_the_model_mip_or``): one problem per output label still unproved;
* ``bab-refine`` (``build_the_model_mip_refine``): layer by layer, one problem per unstable neuron,
  each layer's bounds needed before the next layer's model is built; α-CROWN runs between layers.

Under P > 1 the pool is dealt (:class:`DealtPool`, in place of ``multiprocessing`` in those two
modules): rank r solves problems r, r + P, ... (α,β-CROWN sorts a layer's neurons by score first, so
every rank gets a share of the hard ones) in a pool of 1/P of the solvers; the results are put back in
α,β-CROWN's order on every rank, after the ranks wait for each other without a collective timeout
(:func:`~complete_verifier_ext.parallel.comm.wait_patiently`: one rank's share may take minutes more)
and one ``all_gather_object``. Everything else (model building, α-CROWN between layers, the decisions
on the bounds) runs on every rank on the same gathered results, with the synced clock (a solver
process forked from a rank reads its own clock). ``mip`` with an AND spec is one problem: rank 0
solves it while the others wait, and the result is broadcast.
"""

from __future__ import annotations

import multiprocessing as _mp
import types
from typing import Any

from ...parallel import comm
from ..clocks import local_clock
from ..locate import PluginError
from ..run import Run


class _Dealt:
    """The result of :meth:`DealtPool.starmap_async`; :meth:`get` is collective."""

    def __init__(self, local: Any, n: int) -> None:
        self.local, self.n = local, n

    def get(self, timeout: float | None = None) -> list:
        mine = self.local.get(timeout) if self.local is not None else []
        comm.wait_patiently()
        every = comm.all_gather_object(list(mine))
        out: list = [None] * self.n
        for r, part in enumerate(every):
            out[r :: len(every)] = part
        return out


class DealtPool:
    """``multiprocessing.Pool(n)`` whose ``starmap``/``starmap_async`` solve this rank's share of the
    problems in a pool of ``n / P`` processes (at least one)."""

    def __init__(self, processes: int | None = None, *args: Any, **kwargs: Any) -> None:
        P = comm.world_size()
        self.pool = _mp.Pool(max(1, (processes or _mp.cpu_count()) // P), *args, **kwargs)

    def starmap_async(self, func, iterable, chunksize=None, *args: Any, **kwargs: Any) -> _Dealt:
        items = list(iterable)
        mine = items[comm.rank() :: comm.world_size()]
        local = self.pool.starmap_async(func, mine, chunksize, *args, **kwargs) if mine else None
        return _Dealt(local, len(items))

    def starmap(self, func, iterable, chunksize=None) -> list:
        return self.starmap_async(func, iterable, chunksize).get()

    def __enter__(self) -> DealtPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.pool.terminate()

    def close(self) -> None:
        self.pool.close()

    def terminate(self) -> None:
        self.pool.terminate()

    def join(self) -> None:
        self.pool.join()


def multiprocessing(run: Run, orig: types.ModuleType) -> types.ModuleType:
    """A stand-in for the ``multiprocessing`` module (``orig``) of α,β-CROWN's MIP modules: ``Pool`` is
    :class:`DealtPool`, everything else the module's own."""

    class Dealt(types.ModuleType):
        Pool = DealtPool

        def __getattr__(self, name: str) -> Any:
            return getattr(orig, name)

    return Dealt("multiprocessing")


def mip_solver_lb_ub_and(run: Run, orig):
    """One problem (``mip`` with an AND spec): solved on rank 0, the others wait, the result is every
    rank's."""

    def solve(*args: Any, **kwargs: Any) -> Any:
        def compute():
            with local_clock(run):
                return orig(*args, **kwargs)

        return comm.from_rank0(compute)

    return solve


def handle_gurobi_error(run: Run, orig):
    """``lp_mip_solver.utils.handle_gurobi_error`` (in a solver process or the rank): Gurobi's refusal
    (a size-limited licence, a missing one) becomes one line and ``error`` at every P. Unpatched
    α,β-CROWN prints it and then fails re-raising it across its pool (a ``TypeError`` traceback)."""

    def handle_gurobi_error(message):
        raise PluginError(f"Gurobi: {message} (solver.mip needs a Gurobi licence that accepts this model)")

    return handle_gurobi_error
