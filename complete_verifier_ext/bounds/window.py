"""A-matrix rows that are zero outside a spatial window: CROWN's rows of conv neurons, kept local.

The row of a neuron at position ``(y, x)`` of a conv feature map depends, k layers back, only on its
receptive field: a window of the earlier map around ``(y, x)`` that grows by ``k - 1`` per 3x3 layer
(and doubles per stride 2). Back-substituting it as a dense ``(C, H, W)`` map wastes memory and time
on zeros, which is what made the first layers of a ResNet the slowest part of CROWN here (a 64x32x32
map against a 3x3 window after one layer). :class:`Window` keeps each row as ``(C, h, w)`` values
and the window's top-left corner on the map (auto_LiRPA's *patches* idea, for the rows of one start
node): all rows of a pass share ``h, w``, and each has its own corner.

Invariant: entries outside the map (a window sticks out where the receptive field reaches the
padding) are zero, so a sum over the window is a sum over the map. Ops that cannot take a window get
:meth:`Window.dense` (the walker does it for them), so a window is always an optimisation, never a
different bound: every product below is the dense one restricted to where it can be nonzero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .concretize import concretize_mid_rad


@dataclass(frozen=True)
class Window:
    """``values`` (S, B, C, h, w); row s covers rows ``top[s] .. top[s] + h`` and columns
    ``left[s] .. left[s] + w`` of a ``shape = (C, H, W)`` map (corners may be negative)."""

    values: Tensor
    top: Tensor  # (S,) long
    left: Tensor  # (S,) long
    shape: tuple[int, int, int]

    @staticmethod
    def of_neurons(flat: Tensor, signs: Tensor, B: int, shape: tuple[int, int, int]) -> Window:
        """Rows ``signs[s] * e_{flat[s]}`` (flat indices into ``shape``) as 1x1 windows."""
        C, H, W = shape
        values = torch.zeros(len(flat), B, C, 1, 1)
        values[torch.arange(len(flat)), :, flat // (H * W), 0, 0] = signs.to(values.dtype)[:, None]
        return Window(values, (flat // W) % H, flat % W, shape)

    @property
    def size(self) -> tuple[int, int]:
        return self.values.shape[3], self.values.shape[4]

    def covers_map(self) -> bool:
        """True once the window is as tall or as wide as the map: dense is then no larger."""
        h, w = self.size
        return h >= self.shape[1] or w >= self.shape[2]

    def _index(self) -> tuple[Tensor, Tensor, Tensor]:
        """Clamped row and column indices (S, h), (S, w) and the in-map mask (S, 1, 1, h, w)."""
        h, w = self.size
        ys = self.top[:, None] + torch.arange(h)
        xs = self.left[:, None] + torch.arange(w)
        vy, vx = (ys >= 0) & (ys < self.shape[1]), (xs >= 0) & (xs < self.shape[2])
        mask = (vy[:, :, None] & vx[:, None, :])[:, None, None]
        return ys.clamp(0, self.shape[1] - 1), xs.clamp(0, self.shape[2] - 1), mask

    @functools.cached_property
    def _padded_index(self) -> tuple[tuple[int, int, int, int], Tensor]:
        """The zero padding ``(left, right, top, bottom)`` that puts every window inside the map, and
        every window entry's flat position in the padded map: (S, h * w)."""
        (h, w), (_, H, W) = self.size, self.shape
        if len(self.top) == 0:
            return (0, 0, 0, 0), torch.zeros(0, h * w, dtype=torch.long)
        pt, pl = max(0, -int(self.top.min())), max(0, -int(self.left.min()))
        pb, pr = max(0, int(self.top.max()) + h - H), max(0, int(self.left.max()) + w - W)
        ys = (self.top + pt)[:, None] + torch.arange(h)  # (S, h)
        xs = (self.left + pl)[:, None] + torch.arange(w)  # (S, w)
        flat = ys[:, :, None] * (W + pl + pr) + xs[:, None, :]
        return (pl, pr, pt, pb), flat.view(len(self.top), h * w)

    def gather(self, t: Tensor) -> Tensor:
        """``t`` (B or 1, C, H, W) read at every row's window: (S, B or 1, C, h, w), 0 outside the map
        (read from the zero-padded map: one indexing pass, no mask)."""
        pads, flat = self._padded_index
        Bt, C = t.shape[:2]
        g = F.pad(t, pads).reshape(Bt * C, -1)[:, flat]  # (B * C, S, h * w)
        return g.view(Bt, C, flat.shape[0], *self.size).permute(2, 0, 1, 3, 4)

    def lookup(self, index: Tensor) -> Tensor:
        """(S, 1, C, h, w): for every window entry its position in ``index`` (flat neurons of the map),
        -1 where it is not there or lies outside the map."""
        C, H, W = self.shape
        slot = torch.full((C * H * W,), -1, dtype=torch.long)
        slot[index] = torch.arange(len(index))
        ys, xs, mask = self._index()
        pos = torch.arange(C)[None, :, None, None] * (H * W) + (ys[:, :, None] * W + xs[:, None, :])[:, None]
        return torch.where(mask[:, 0], slot[pos], -1)[:, None]  # pos: (S, C, h, w)

    def masked(self) -> Window:
        """The same window with every entry outside the map set to zero (restores the invariant)."""
        return Window(self.values * self._index()[2], self.top, self.left, self.shape)

    def with_values(self, values: Tensor) -> Window:
        return Window(values, self.top, self.left, self.shape)

    def dense(self) -> Tensor:
        """(S, B, C, H, W): the rows as full maps."""
        S, B, C, h, w = self.values.shape
        _, H, W = self.shape
        ys, xs, _ = self._index()
        pos = (ys[:, :, None] * W + xs[:, None, :]).view(S, 1, 1, h * w).expand(S, B, C, h * w)
        full = self.values.new_zeros(S, B, C, H * W)
        return full.scatter_add(3, pos, self.values.reshape(S, B, C, h * w)).view(S, B, C, H, W)

    def concretize(self, box: tuple[Tensor, Tensor]) -> Tensor:
        """min over x in box of sum(A * x), as :func:`walk.concretize`: (S, B)."""
        lo, hi = box
        return concretize_mid_rad(self.values, self.gather((hi + lo) / 2), self.gather((hi - lo) / 2))

    def __neg__(self) -> Window:
        return self.with_values(-self.values)


def accumulate(a: Tensor | Window, b: Tensor | Window) -> Tensor | Window:
    """``a + b`` of two A-matrices at the same node: two windows whose corners differ by the same offset
    in every row (two paths of a residual block) stay a window, on the union of both; else dense."""
    if isinstance(a, Window) and isinstance(b, Window):
        dy, dx = b.top - a.top, b.left - a.left
        if len(dy) and bool((dy == dy[0]).all()) and bool((dx == dx[0]).all()):
            return _union(a, b, int(dy[0]), int(dx[0]))
        if not len(dy):
            return _union(a, b, 0, 0)
    return as_dense(a) + as_dense(b)


def _union(a: Window, b: Window, dy: int, dx: int) -> Window:
    (ha, wa), (hb, wb) = a.size, b.size
    y0, x0 = min(0, dy), min(0, dx)
    h, w = max(ha, dy + hb) - y0, max(wa, dx + wb) - x0
    S, B, C = a.values.shape[:3]
    out = a.values.new_zeros(S, B, C, h, w)
    out[..., -y0 : -y0 + ha, -x0 : -x0 + wa] += a.values
    out[..., dy - y0 : dy - y0 + hb, dx - x0 : dx - x0 + wb] += b.values
    return Window(out, a.top + y0, a.left + x0, a.shape)


def as_dense(A: Tensor | Window) -> Tensor:
    return A.dense() if isinstance(A, Window) else A
