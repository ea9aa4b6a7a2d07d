"""Weights of Linear / Conv2d layers sharded along dim 0 (output neurons / channels).

Lifecycle of a sharded weight ``W`` (``(out, in)`` or ``(out, in, kh, kw)``), modes ``"fsdp"`` / ``"tp"``:

* at rest, rank ``r`` keeps rows ``shard_range(out)`` only (``local``, a clone: the caller frees ``W``);
* forward / IBP (``linear``, ``conv2d``) are column-parallel in both modes: rank ``r`` computes its output
  slice with its shard, one ``all_gather`` assembles the (small) output; backward: one ``reduce_scatter``;
* CROWN's backward product (``linear_t``: ``A @ W``, ``conv_transpose2d``) needs W's rows against A's
  columns:

  - ``fsdp``: ``gathered()`` all-gathers W into one process-wide reusable flat buffer (bitwise the
    original), the product is computed, and the buffer is overwritten by the next gather of any layer;
  - ``tp``: W is never built; every owner sends its resident shard to each other rank in turn
    (``P - 1`` passes) and the matching column block of ``A`` is multiplied into the result by each
    shard as it arrives. Resident: the own shard plus one foreign shard, in one reused buffer.

  Under autograd both are a custom ``torch.autograd.Function`` that saves no tensor at all (only a
  reference to this object, i.e. the local shard) and re-gathers / re-streams W in backward, like FSDP's
  reshard-after-forward. Weights are constants: no gradient wrt W is ever computed.

Mode ``"none"`` keeps the full weight and uses the plain torch ops: the reference the sharded modes are
compared against, and the right choice at world size 1.

Collectives per call at ``P > 1`` (``comm.stats()`` names):

=====================================  ===========================  ==============================
operation                              forward                      backward (grad wrt the input)
=====================================  ===========================  ==============================
``linear`` / ``conv2d`` (fsdp, tp)     1 ``all_gather``             1 ``reduce_scatter``
``linear_t`` / ``conv_transpose2d``    fsdp: 1 ``all_gather``       fsdp: 1 ``all_gather``
                                       tp: P-1 ``shard_pass``       tp: P-1 ``shard_pass``
``gathered()`` (fsdp, tp)              1 ``all_gather``             --
any op in mode ``"none"``              0                            0
=====================================  ===========================  ==============================

Construct a ``ShardedWeight`` after ``comm.init``: the world size and rank are read at construction.
Only ``groups=1`` convolutions are supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import comm, serve

__all__ = ["MODES", "ShardedWeight", "conv_output_padding", "release_gather_buffers"]

MODES = ("none", "fsdp", "tp")

IntOrPair = int | tuple[int, int]


# ----------------------------------------------------------------------------------------------------------
# The process-wide gather buffer
# ----------------------------------------------------------------------------------------------------------

_BUFFERS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _gather_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat view of ``numel`` elements of the reusable buffer for (dtype, device), grown on demand."""
    key = (dtype, device)
    if key not in _BUFFERS or _BUFFERS[key].numel() < numel:
        _BUFFERS.pop(key, None)  # free the small one before allocating the larger one
        _BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return _BUFFERS[key][:numel]


def release_gather_buffers() -> None:
    """Drop the reusable gather buffers (e.g. between verification instances)."""
    _BUFFERS.clear()


def _compact_rows(flat: Tensor, sizes: list[int], most: int, row: int) -> None:
    """Move padded blocks (rank q at ``q*most`` rows) to their packed places (at ``sum(sizes[:q])``).

    Blocks move left in ascending order, so a block can only overlap itself; such a block is cloned
    first (a transient of at most one shard).
    """
    start = 0
    for q, n in enumerate(sizes):
        src, dst = q * most * row, start * row
        if n > 0 and src != dst:
            block = flat[src : src + n * row]
            flat[dst : dst + n * row].copy_(block.clone() if src - dst < n * row else block)
        start += n


# ----------------------------------------------------------------------------------------------------------
# The transposed products (CROWN's backward through a layer)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Transposed:
    """How W enters a backward product: ``apply(A_q, W_q)`` and its adjoint ``adjoint(G, W_q)``.

    ``dim`` is the axis of A that runs over W's rows; the product is linear in A's blocks along it:
    ``apply(A, W) = sum_q apply(A_q, W_q)`` and ``adjoint(G, W)`` = the blocks ``adjoint(G, W_q)``.
    """

    dim: int
    apply: Callable[[Tensor, Tensor], Tensor]
    adjoint: Callable[[Tensor, Tensor], Tensor]

    def accumulate(self, out: Tensor | None, A_q: Tensor, W_q: Tensor) -> Tensor:
        """``out + apply(A_q, W_q)`` (or the product alone when ``out`` is None), in place in ``out``: a
        linear block is multiplied straight into it, a convolution's block result is freed at once, so
        a ring pass holds no A-sized temporary beside ``out``."""
        if out is None:
            return self.apply(A_q, W_q)
        if self.dim == -1:  # A_q (..., n_q) is a column block of a contiguous A: a (rows, n_q) view
            out.view(-1, out.shape[-1]).addmm_(A_q.reshape(-1, A_q.shape[-1]), W_q)
        else:
            out.add_(self.apply(A_q, W_q))
        return out


def _matmul_t(g: Tensor, w: Tensor) -> Tensor:
    """(..., in) x (rows, in) -> (..., rows)."""
    return torch.matmul(g, w.t())


_LINEAR_T = _Transposed(dim=-1, apply=torch.matmul, adjoint=_matmul_t)


def conv_output_padding(
    in_hw: tuple[int, int], out_hw: tuple[int, int], kernel: tuple[int, int], stride, padding, dilation
) -> tuple[int, int]:
    """The ``output_padding`` of the transposed convolution that maps a ``(H', W')`` map back onto the
    ``(H, W)`` input of a strided convolution: the rows/cols that the convolution never reached."""
    s, p, d, k = stride, padding, dilation, kernel
    reached = [(int(out_hw[i]) - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + 1 for i in (0, 1)]
    return int(in_hw[0]) - reached[0], int(in_hw[1]) - reached[1]


def conv_t(
    stride: IntOrPair, padding: IntOrPair, dilation: IntOrPair, output_padding: IntOrPair
) -> _Transposed:
    """conv_transpose2d(A, W) with the given geometry; its adjoint is conv2d(G, W) (same geometry)."""
    apply = partial(
        F.conv_transpose2d,
        bias=None,
        stride=stride,
        padding=padding,
        output_padding=output_padding,
        groups=1,
        dilation=dilation,
    )
    adjoint = partial(F.conv2d, bias=None, stride=stride, padding=padding, dilation=dilation, groups=1)
    return _Transposed(dim=1, apply=apply, adjoint=adjoint)


class _TransposedProduct(torch.autograd.Function):
    """``kind.apply(A, W)`` for a sharded W; saves no tensor, re-gathers / re-streams W in backward."""

    @staticmethod
    def forward(ctx: Any, A: Tensor, weight: ShardedWeight, kind: _Transposed) -> Tensor:
        ctx.weight, ctx.kind, ctx.a_shape = weight, kind, A.shape
        return weight._product(A, kind)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return ctx.weight._adjoint(grad, ctx.kind, ctx.a_shape), None, None


# ----------------------------------------------------------------------------------------------------------
# ShardedWeight
# ----------------------------------------------------------------------------------------------------------


class ShardedWeight:
    """A Linear ``(out, in)`` or Conv2d ``(out, in, kh, kw)`` weight, sharded along dim 0.

    Attributes: ``shape`` (the full shape), ``mode``, ``rows`` (this rank's ``[start, end)``),
    ``local`` (this rank's rows, ``requires_grad`` False).
    """

    def __init__(self, full: Tensor, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown sharding mode {mode!r}; expected one of {MODES}")
        self.mode = mode
        self.shape = full.shape
        self._world = comm.world_size() if mode != "none" else 1
        self._rank = comm.rank() if mode != "none" else 0
        out = full.shape[0]
        self._sizes = comm.shard_sizes(out, self._world)
        self.rows = comm.shard_range(out, self._rank, self._world)
        if mode == "none":
            self._padded = full.detach()
        else:
            self._padded = full.new_zeros((max(self._sizes), *full.shape[1:]))  # (m, *rest)
            self._padded[: self.n_local].copy_(full.detach()[self.rows[0] : self.rows[1]])
        self.local = self._padded[: self.n_local]
        if mode != "none":
            serve.register(self)

    @property
    def n_local(self) -> int:
        """Number of rows this rank holds."""
        return self.rows[1] - self.rows[0]

    @property
    def sharded(self) -> bool:
        """True when the weight is really split (mode fsdp/tp and world size > 1)."""
        return self._world > 1

    def to(self, device: torch.device | str) -> ShardedWeight:
        """Move this rank's shard to ``device`` (in place; the full weight is never moved)."""
        self._padded = self._padded.to(device)
        self.local = self._padded[: self.n_local]
        return self

    def apply_elementwise(self, fn: Callable[[Tensor], Tensor]) -> ShardedWeight:
        """A new ShardedWeight of ``fn(W)`` for an element-wise ``fn`` (e.g. ``abs``, ``clamp(min=0)``),
        computed on the shard only."""
        new = object.__new__(ShardedWeight)
        new.__dict__.update(self.__dict__)
        new._padded = fn(self._padded)
        if new._padded.shape != self._padded.shape:
            raise ValueError("apply_elementwise needs a shape-preserving function")
        new.local = new._padded[: self.n_local]
        return new

    # ---- the full weight (fsdp) ------------------------------------------------------------------------

    def gathered(self) -> Tensor:
        """The full weight, bitwise the original: a view of the process-wide gather buffer.

        Valid until the next ``gathered()`` of any layer overwrites the buffer. One ``all_gather``.
        """
        if not self.sharded:
            return self.local
        if serve.active():
            return serve.full(self)
        most, row = self._padded.shape[0], self._padded[0].numel()
        flat = _gather_buffer(self._world * most * row, self._padded.dtype, self._padded.device)
        comm.all_gather_into(flat, self._padded.reshape(-1))
        _compact_rows(flat, self._sizes, most, row)
        return flat[: self.shape[0] * row].view(self.shape)

    def rows_of(self, idx: Tensor) -> Tensor:
        """``W[idx]``, rows anywhere in W, in a new tensor: through :meth:`gathered` (fsdp), or under tp
        picked from each shard as its owner passes it (P - 1 shard passes), never the whole W."""
        if self.mode != "tp" or not self.sharded:
            return self.gathered()[idx]
        out = self._padded.new_empty((len(idx), *self.shape[1:]))
        for q, shard in self._from_owners():
            lo = self._start(q)
            here = ((idx >= lo) & (idx < lo + shard.shape[0])).nonzero().flatten()
            out[here] = shard[idx[here] - lo]
        return out

    def fresh(self) -> Tensor:
        """The full weight in a new tensor that the caller may keep (``gathered()`` hands out a shared
        buffer): one all-gather, or fetched from the owners while :mod:`.serve` is active."""
        if not self.sharded:
            return self.local
        if serve.active():
            return serve.full(self)
        return comm.all_gather_cat(self.local, 0, sizes=self._sizes)

    # ---- forward: column-parallel ----------------------------------------------------------------------

    @property
    def sizes(self) -> list[int]:
        """Rows of every rank (what ``comm.all_gather_cat(..., sizes=)`` needs for output slices)."""
        return list(self._sizes)

    def linear(self, x: Tensor) -> Tensor:
        """``x @ W.T``: (..., in) -> (..., out). Sharded: own output columns, then one all-gather."""
        y = self.local_linear(x)  # (..., n_local)
        if not self.sharded:
            return y
        return comm.all_gather_cat_grad(y, -1, sizes=self._sizes)

    def conv2d(
        self, x: Tensor, stride: IntOrPair = 1, padding: IntOrPair = 0, dilation: IntOrPair = 1
    ) -> Tensor:
        """``conv2d(x, W)``: (N, in, H, W) -> (N, out, H', W'). Sharded: own output channels, then gather."""
        y = self.local_conv2d(x, stride, padding, dilation)  # (N, n_local, H', W')
        if not self.sharded:
            return y
        return comm.all_gather_cat_grad(y, 1, sizes=self._sizes)

    def local_linear(self, x: Tensor) -> Tensor:
        """This rank's output columns only: (..., in) -> (..., n_local). No communication."""
        return F.linear(x, self.local)

    def local_conv2d(
        self, x: Tensor, stride: IntOrPair = 1, padding: IntOrPair = 0, dilation: IntOrPair = 1
    ) -> Tensor:
        """This rank's output channels only: (N, in, H, W) -> (N, n_local, H', W'), also when n_local = 0
        (``F.conv2d`` rejects an empty weight). No communication."""
        conv = partial(F.conv2d, bias=None, stride=stride, padding=padding, dilation=dilation)
        if self.n_local > 0:
            return conv(x, self.local)
        return conv(x, self._padded.new_zeros((1, *self.shape[1:])))[:, :0]  # one zero channel, dropped

    def columns(self, fn: Callable[[Tensor, tuple[int, int]], Tensor], dim: int) -> Tensor:
        """``fn(W_rows, (lo, hi))`` (the output slice of rows ``lo:hi``) for every rank's rows,
        concatenated along ``dim``: this rank's slice and one all-gather (no autograd), or, while
        :mod:`.serve` is active, every shard fetched and its slice computed here (with autograd)."""
        if not self.sharded:
            return fn(self.local, (0, self.shape[0]))
        if not serve.active():
            return comm.all_gather_cat(fn(self.local, self.rows), dim, sizes=self._sizes)
        parts = {q: fn(w, self._range(q)) for q, w in self._ring() if w.shape[0] > 0}
        return torch.cat([parts[q] for q in sorted(parts)], dim)

    def row_sum(self, fn: Callable[[Tensor, tuple[int, int]], Tensor]) -> Tensor:
        """The sum over every rank's rows of ``fn(W_rows, (lo, hi))`` (e.g. ``C[..., lo:hi] @ W_rows``):
        an all-reduce (no autograd), or, while :mod:`.serve` is active, summed here over fetched shards."""
        if not self.sharded:
            return fn(self.local, (0, self.shape[0]))
        if not serve.active():
            return comm.all_reduce(fn(self.local, self.rows).contiguous(), "sum")
        out: Tensor | None = None
        for q, w in self._ring():  # one fetched shard resident at a time
            if w.shape[0] > 0:
                part = fn(w, self._range(q))
                out = part if out is None else out + part
        assert out is not None
        return out

    def each_shard(self) -> Iterator[tuple[tuple[int, int], Tensor]]:
        """``((lo, hi), W[lo:hi])`` for every rank's rows, each shard here as it comes round the ring (or
        is fetched, while :mod:`.serve` is active), never the whole weight; empty shards skipped. For
        products whose other operand is this rank's own (an A-matrix, differentiable through the
        caller's computation). Collective (in lockstep) unless serving."""
        if not self.sharded:
            yield (0, self.shape[0]), self.local
            return
        for q, w in self._ring():
            if w.shape[0] > 0:
                yield self._range(q), w

    def _range(self, q: int) -> tuple[int, int]:
        return self._start(q), self._start(q) + self._sizes[q]

    # ---- CROWN backward: transposed products -----------------------------------------------------------

    def linear_t(self, A: Tensor) -> Tensor:
        """``A @ W``: (..., out) -> (..., in). A holds this rank's own spec rows (differs per rank)."""
        return self._transposed(A, _LINEAR_T)

    def conv_transpose2d(
        self,
        A: Tensor,
        stride: IntOrPair = 1,
        padding: IntOrPair = 0,
        dilation: IntOrPair = 1,
        output_padding: IntOrPair = 0,
    ) -> Tensor:
        """``conv_transpose2d(A, W)``: (N, out, H', W') -> (N, in, H, W)."""
        return self._transposed(A, conv_t(stride, padding, dilation, output_padding))

    def _transposed(self, A: Tensor, kind: _Transposed) -> Tensor:
        if self.mode == "none":
            return kind.apply(A, self.local)
        return _TransposedProduct.apply(A, self, kind)

    def _product(self, A: Tensor, kind: _Transposed) -> Tensor:
        """``kind.apply(A, W)`` without building W (tp) or through the gather buffer (fsdp)."""
        if self.mode == "fsdp" or not self.sharded:
            return kind.apply(A, self.gathered())
        out: Tensor | None = None
        for q, shard in self._from_owners():
            if shard.shape[0] > 0:
                out = kind.accumulate(out, A.narrow(kind.dim, self._start(q), shard.shape[0]), shard)
        assert out is not None  # at least one shard is non-empty
        return out

    def _adjoint(self, grad: Tensor, kind: _Transposed, a_shape: torch.Size) -> Tensor:
        """Gradient wrt A of ``kind.apply(A, W)``: ``kind.adjoint(grad, W)``, blockwise for tp."""
        if self.mode == "fsdp" or not self.sharded:
            return kind.adjoint(grad, self.gathered())
        grad_a = grad.new_empty(a_shape)
        for q, shard in self._from_owners():
            if shard.shape[0] > 0:
                grad_a.narrow(kind.dim, self._start(q), shard.shape[0]).copy_(kind.adjoint(grad, shard))
        return grad_a

    def _start(self, q: int) -> int:
        return sum(self._sizes[:q])

    def _from_owners(self) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(q, W_q)`` for q = r, r-1, ..., r-P+1 (mod P) like :meth:`_ring`, each foreign shard
        sent by its owner from its resident shard (step k: to rank r + k, from rank r - k) into one
        receive buffer: one foreign shard is here at a time (no overlap of passing and use). The yielded
        tensor is overwritten at the next step: for products that keep no reference to it (the
        transposed products, which save none for backward)."""
        if not self.sharded or serve.active():
            yield from self._ring()
            return
        p, r = self._world, self._rank
        yield r, self.local
        buffer = torch.empty_like(self._padded)  # the largest shard
        for k in range(1, p):
            q = (r - k) % p
            yield q, comm.shard_pass(self.local, buffer[: self._sizes[q]], k)

    def _ring(self) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(q, W_q)`` for q = r, r-1, ..., r-P+1 (mod P); P-1 ring passes.

        The pass of the shard in use to rank+1 overlaps with its use: besides the own shard, the one in
        use and the one arriving are alive, and the one before while the caller's loop variable still
        holds it. Every yielded shard is a new tensor the caller may keep (:meth:`_from_owners` reuses
        one buffer).
        """
        p, r = self._world, self._rank
        if serve.active():  # ranks out of lockstep: one request per shard
            for k in range(p):
                yield (r - k) % p, serve.shard(self, (r - k) % p)
            return
        shard = self.local
        for k in range(p):
            q = (r - k) % p
            nxt = None
            if k < p - 1:
                incoming = (self._sizes[(q - 1) % p], *self.shape[1:])
                nxt = comm.ring_pass_start(shard, incoming)
            yield q, shard
            shard = nxt.wait() if nxt is not None else shard
