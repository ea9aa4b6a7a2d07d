"""Bound operators: one small class per operator.

Contract (after auto_LiRPA's operator classes, kept minimal):

* ``forward(*xs)``: the concrete function on tensors of shape ``(B, *in_shape)``.
* ``ibp(*boxes)``: interval bounds; each box is ``(lo, hi)`` of shape ``(B, *in_shape)``.
* ``backward(A, *in_shapes)``: linear back-substitution for a *lower* bound.  ``A`` has shape
  ``(S, B, *out_shape)`` and represents the linear function ``sum(A * y)`` of this node's output
  ``y``; the result is ``(As, bias)`` where ``As[i]`` has shape ``(S, B, *in_shape_i)`` (or ``None``
  when the input does not depend on the network input) and ``bias`` is ``(S, B)`` or a scalar ``0``,
  such that ``sum(A * y) >= sum_i sum(As[i] * x_i) + bias`` for all admissible inputs (an equality
  for affine operators).  Upper bounds are lower bounds of negated rows.

``Relu`` is the only non-linear operator; its backward also takes the pre-activation bounds and an
optional slope tensor ``alpha`` (α-CROWN). The walker calls every op the same way,
``bound_backward(A, in_shapes, in_bounds, alpha)``; an op that ``needs_bounds`` gets its inputs'
bounds.  Weights of ``Linear``/``Conv`` live in a
:class:`~complete_verifier_ext.parallel.sharded.ShardedWeight`, so the same code runs sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..parallel import comm
from ..parallel.sharded import ShardedWeight, conv_output_padding
from .window import Window

Box = tuple[Tensor, Tensor]


def _fold(A: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """(S, B, *shape) -> (S*B, *shape)."""
    return A.reshape(A.shape[0] * A.shape[1], *A.shape[2:]), (A.shape[0], A.shape[1])


class Op:
    """Base class of the bound operators. What the bound code asks of an op beyond its three methods
    are these capabilities (so a new operator touches this file and its loader only):"""

    is_relu = False  # the one nonlinearity: relaxed, split by BaB, encoded exactly by the MILP
    affine = False  # the output is an affine map of its one input (IBP of one such layer is exact)
    weight: ShardedWeight | None = None  # Linear/Conv: the weight that fsdp/tp shard
    folds_spec = False  # IBP of ``C @ y`` folds ``C`` into this op when it is the last node
    windows = False  # ``backward`` also takes a :class:`Window` A-matrix (else the walker densifies it)
    needs_bounds = False  # the backward relaxes the op with its inputs' bounds (and takes α)

    def bound_backward(
        self, A, in_shapes: list, in_bounds: list[Box], alpha=None
    ) -> tuple[list[Tensor | Window | None], Tensor | float]:
        """What the walker calls: ``backward(A, *in_shapes)``; ``in_bounds`` (the inputs' bounds, given
        when ``needs_bounds``) and ``alpha`` are for ops that relax."""
        return self.backward(A, *in_shapes)

    def neuron_bias(self) -> Tensor | None:
        """The constant this op adds to each output neuron, broadcastable to the output shape
        (Linear/Conv: the bias), or None: what BaBSR's score of splitting the ReLU after it uses."""
        return None

    def unit_rows(self, part: Tensor) -> tuple[Tensor, Tensor] | None:
        """``backward`` of the rows ``+e_part`` of this op's output without the product, as ``(A_in (m,
        *in_shape), bias (m,))``, or None where the op has no such shortcut (then the rows go through
        ``backward``). The same collectives on every rank, whatever ``part`` holds."""
        return None

    def compose_affine(self, M: np.ndarray | None, c: np.ndarray, shape) -> tuple[np.ndarray, np.ndarray]:
        """This op applied after ``x -> M x + c`` (``M`` None: the identity), as ``(M', c')`` in float64
        with whole weights (the MILP encoding, collective under FSDP); ``shape``: the op's output shape
        per sample. Raises ``NotImplementedError`` for an op with no such encoding."""
        raise NotImplementedError(type(self).__name__)

    def forward(self, *xs: Tensor) -> Tensor:
        raise NotImplementedError

    def ibp(self, *boxes: Box) -> Box:
        raise NotImplementedError

    def backward(self, A: Tensor, *in_shapes) -> tuple[list[Tensor | None], Tensor | float]:
        raise NotImplementedError


class Input(Op):
    pass


class Linear(Op):
    """y = x @ W.T + b with x: (B, in), W: (out, in) sharded on dim 0, b: (out,) replicated."""

    affine = True
    folds_spec = True

    def __init__(self, weight: Tensor, bias: Tensor | None, mode: str = "none"):
        self.weight = ShardedWeight(weight.detach().to(torch.float32), mode)
        self.bias = None if bias is None else bias.detach().to(torch.float32).clone()

    def neuron_bias(self) -> Tensor | None:
        return self.bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = self.weight.linear(x)
        return y if self.bias is None else y + self.bias

    def ibp(self, box: Box) -> Box:
        """Centre/radius form, column-parallel: this rank's output rows, then an all-gather.

        The gather carries no gradient: inside α-CROWN, IBP values only reach a ReLU relaxation on
        neurons that are stable (exact, slope independent of the bounds) or in a layer whose bounds
        are exact and independent of α, so no gradient is lost.
        """
        lo, hi = box
        mid, rad = (hi + lo) / 2, (hi - lo) / 2
        W = self.weight.local  # (out_r, in)
        r0, r1 = self.weight.rows
        out_mid = mid @ W.T
        if self.bias is not None:
            out_mid = out_mid + self.bias[r0:r1]
        out_rad = rad @ W.abs().T
        both = comm.all_gather_cat(
            torch.cat([out_mid, out_rad], 0), dim=-1, sizes=comm.shard_sizes(self.weight.shape[0])
        )
        out_mid, out_rad = both.chunk(2, 0)
        return out_mid - out_rad, out_mid + out_rad

    def backward(self, A: Tensor, in_shape) -> tuple[list[Tensor | None], Tensor | float]:
        # A: (S, B, out) -> (S, B, in)
        bias = 0.0 if self.bias is None else A @ self.bias  # (S, B)
        return [self.weight.linear_t(A)], bias

    def unit_rows(self, part: Tensor) -> tuple[Tensor, Tensor] | None:
        """``e_i @ W`` is row i of W: a gather instead of a ``(m, out) @ (out, in)`` product, bitwise the
        same (auto_LiRPA's identity start); under ``tp`` from the shards as their owners pass them."""
        b = torch.zeros(len(part)) if self.bias is None else self.bias[part]
        return self.weight.rows_of(part), b

    def compose_affine(self, M, c, shape):
        W = self.weight.gathered().double().cpu().numpy()
        b = np.zeros(W.shape[0]) if self.bias is None else self.bias.double().cpu().numpy()
        return (W.copy() if M is None else W @ M), W @ c + b


class Conv(Op):
    """2-D convolution (groups = 1); W: (out, in, kh, kw) sharded on dim 0; b replicated."""

    affine = True
    windows = True

    def __init__(self, weight: Tensor, bias: Tensor | None, stride, padding, dilation, mode: str = "none"):
        self.weight = ShardedWeight(weight.detach().to(torch.float32), mode)
        self.bias = None if bias is None else bias.detach().to(torch.float32).clone()
        self.stride, self.padding, self.dilation = tuple(stride), tuple(padding), tuple(dilation)

    def neuron_bias(self) -> Tensor | None:
        return None if self.bias is None else self.bias.view(-1, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.weight.conv2d(x, self.stride, self.padding, self.dilation)
        return y if self.bias is None else y + self.bias.view(-1, 1, 1)

    def ibp(self, box: Box) -> Box:
        lo, hi = box
        mid, rad = (hi + lo) / 2, (hi - lo) / 2
        r0, r1 = self.weight.rows
        out_mid = self.weight.local_conv2d(mid, self.stride, self.padding, self.dilation)
        if self.bias is not None:
            out_mid = out_mid + self.bias[r0:r1].view(-1, 1, 1)
        abs_w = self.weight.apply_elementwise(torch.abs)  # this rank's shard only
        out_rad = abs_w.local_conv2d(rad, self.stride, self.padding, self.dilation)
        both = comm.all_gather_cat(
            torch.cat([out_mid, out_rad], 0), dim=1, sizes=comm.shard_sizes(self.weight.shape[0])
        )
        out_mid, out_rad = both.chunk(2, 0)
        return out_mid - out_rad, out_mid + out_rad

    def backward(self, A: Tensor | Window, in_shape) -> tuple[list[Tensor | Window | None], Tensor | float]:
        # A: (S, B, C_out, H', W') -> (S, B, C_in, H, W) by a transposed convolution (never unrolled)
        if isinstance(A, Window):
            return self._window_backward(A, tuple(in_shape))
        flat, (S, B) = _fold(A)
        out_pad = conv_output_padding(
            in_shape[1:], A.shape[3:], self.weight.shape[2:], self.stride, self.padding, self.dilation
        )
        A_in = self.weight.conv_transpose2d(flat, self.stride, self.padding, self.dilation, out_pad)
        bias = 0.0 if self.bias is None else (A.sum((3, 4)) @ self.bias)  # (S, B)
        return [A_in.reshape(S, B, *A_in.shape[1:])], bias

    def _window_backward(self, A: Window, in_shape) -> tuple[list[Tensor | Window], Tensor | float]:
        """The window ``(h, w)`` at corner ``(t, l)`` comes from the input window ``((h - 1) s + d (k - 1)
        + 1, ...)`` at ``(t s - p, l s - p)``: a transposed convolution without padding, whose entries on
        the padding are then dropped. Dense once it covers the input map."""
        flat, (S, B) = _fold(A.values)
        A_in = self.weight.conv_transpose2d(flat, self.stride, 0, self.dilation, 0)
        win = Window(
            A_in.reshape(S, B, *A_in.shape[1:]),
            A.top * self.stride[0] - self.padding[0],
            A.left * self.stride[1] - self.padding[1],
            in_shape,
        ).masked()
        bias = 0.0 if self.bias is None else (A.values.sum((3, 4)) @ self.bias)  # (S, B)
        return [win.dense() if win.covers_map() else win], bias


@dataclass(frozen=True)
class Slopes:
    """α of one ReLU kept for the neurons ``index`` only (``general.sparse_alpha``, auto_LiRPA's
    sparse-features α): ``values`` (S, B, len(index)), ``index`` flat neuron indices (long).

    Every neuron outside ``index`` takes the upper slope ``u/(u-l)`` as its lower slope: exact on a
    stable neuron, and on an unstable one a slope in [0, 1] through the origin, which is a lower
    bound of the ReLU too, so a sparse α is sound whatever ``index`` holds. α-CROWN takes ``index``
    from the bounds it starts from, a superset of the unstable neurons of every later (tighter) step.
    """

    values: Tensor
    index: Tensor

    def dense(self, default: Tensor) -> Tensor:
        """(S, B, *shape): ``values`` at ``index``, ``default`` (B, *shape) elsewhere."""
        S = self.values.shape[0]
        full = default.flatten(1).unsqueeze(0).expand(S, -1, -1)
        return full.index_copy(2, self.index, self.values.to(full.dtype)).view(S, *default.shape)


def _needs_grad(*xs) -> bool:
    return any(
        (x.values if isinstance(x, Slopes) else x).requires_grad
        for x in xs
        if isinstance(x, (Tensor, Slopes))
    )


class _ReluStep(torch.autograd.Function):
    """One ReLU step of back-substitution: ``out = A · where(A < 0, u_s, L)`` (A⁺ times the lower slope
    L, A⁻ times the upper slope u_s) and ``bias = Σ_n where(A < 0, A, 0) · u_b``.

    Inputs, flat: ``A`` (S, B, n); ``up``, ``ub`` (B, n), the upper line (with a gradient through the
    bounds in α-CROWN); ``alpha`` None, dense (S, B, n), or the values (S, B, u) of the neurons
    ``index`` (u,); ``lo_default`` (B, n), the adaptive lower slope (exact on stable neurons), and
    ``unstable`` (B, n). L is α clamped to [0, 1] on unstable neurons and ``lo_default`` elsewhere;
    with a sparse α every neuron outside ``index`` takes ``up`` (see :class:`Slopes`).

    Under autograd it keeps only ``A`` of its own (the rest are references to tensors that live on)
    and computes its gradients directly, recomputing the slopes: no A-sized tensor waits for
    backward, and none is replayed (a checkpointed step kept A and replayed its products under
    autograd; α-CROWN on the 1024x4 MLP peaked at 315 MB with it)."""

    @staticmethod
    def _lower(alpha, index, lo_default, unstable):
        """L: (B, n) without α, (S, B, n) with a dense one; with a sparse one L on ``index`` (S, B, u)."""
        if alpha is None:
            return lo_default
        if index is None:
            return torch.where(unstable, alpha.clamp(0, 1), lo_default)
        return torch.where(unstable[:, index], alpha.clamp(0, 1), lo_default[:, index])

    @staticmethod
    def _slope(A, neg, alpha, index, up, lo_default, unstable):
        """where(A < 0, up, L): what every entry of A is multiplied by, (S, B, n)."""
        L = _ReluStep._lower(alpha, index, lo_default, unstable)
        if index is None:
            return torch.where(neg, up, L)
        slope = up.expand_as(A).clone()
        slope[:, :, index] = torch.where(neg[:, :, index], up[:, index], L)
        return slope

    @staticmethod
    def values(A, up, ub, alpha, lo_default, unstable, index) -> tuple[Tensor, Tensor]:
        """(out, bias) without autograd: the forward pass, and every step outside autograd. With no α or a
        dense one, ``out = A·L + A⁻·(u_s − L)`` (three passes over A, no where: the same products up to
        rounding on the entries where A < 0)."""
        neg_part = A.clamp(max=0)
        bias = torch.einsum("sbn,bn->sb", neg_part, ub)
        if index is None:
            L = _ReluStep._lower(alpha, index, lo_default, unstable)
            return neg_part.mul_(up - L).addcmul_(A, L), bias  # in neg_part's buffer: two A-sized tensors
        del neg_part
        return _ReluStep._slope(A, A < 0, alpha, index, up, lo_default, unstable).mul_(A), bias

    @staticmethod
    def forward(ctx, A, up, ub, alpha, lo_default, unstable, index):
        ctx.save_for_backward(A, up, ub, alpha, lo_default, unstable, index)
        return _ReluStep.values(A, up, ub, alpha, lo_default, unstable, index)

    @staticmethod
    def backward(ctx, g, g_bias):
        """The gradients one after the other, in place where they can be, so that at most about three
        A-sized tensors are alive at once (the two results and one temporary)."""
        A, up, ub, alpha, lo_default, unstable, index = ctx.saved_tensors
        need_A, need_up, need_ub, need_alpha = ctx.needs_input_grad[:4]
        neg = A < 0
        grad_A = grad_up = grad_ub = grad_alpha = None
        if need_alpha:  # A⁺ · g on the kept neurons; clamp passes it on [0, 1], as torch's clamp does
            if index is None:
                grad_alpha = A.clamp(min=0).mul_(g)
                live = unstable & (alpha >= 0) & (alpha <= 1)
            else:
                grad_alpha = A[:, :, index].clamp_(min=0).mul_(g[:, :, index])
                live = unstable[:, index] & (alpha >= 0) & (alpha <= 1)
            grad_alpha.masked_fill_(~live, 0.0)
        if need_ub:
            grad_ub = torch.einsum("sb,sbn->bn", g_bias, torch.where(neg, A, 0.0))
        if need_up:  # out takes up where A < 0, and with a sparse α on every neuron outside index
            on_up = neg if alpha is None or index is None else neg | _outside(index, A.shape[2])
            grad_up = torch.where(on_up, A, 0.0).mul_(g).sum(0)
        if need_A:
            grad_A = _ReluStep._slope(A, neg, alpha, index, up, lo_default, unstable).mul_(g)
            grad_A.add_((g_bias[..., None] * ub).masked_fill_(~neg, 0.0))
        return grad_A, grad_up, grad_ub, grad_alpha, None, None, None


def _outside(index: Tensor, n: int) -> Tensor:
    """(n,) bool: True for the neurons not in ``index``."""
    out = torch.ones(n, dtype=torch.bool, device=index.device)
    out[index] = False
    return out


class Relu(Op):
    """y = max(x, 0) with the CROWN relaxation.

    For pre-activation bounds l < 0 < u the upper line is ``u/(u-l) * (x - l)``; the lower line is
    ``alpha * x`` with ``alpha`` in [0, 1] (α-CROWN) or, by default, the adaptive choice
    ``alpha = 1 if u > -l else 0``.  Stable neurons are exact.
    """

    is_relu = True
    windows = True
    needs_bounds = True

    def bound_backward(self, A, in_shapes, in_bounds, alpha=None):
        return self.backward_relu(A, *in_bounds[0], alpha)

    def __init__(self) -> None:
        self._relax_cache: tuple | None = None  # see _cached_relaxation

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(x)

    def ibp(self, box: Box) -> Box:
        return box[0].clamp(min=0), box[1].clamp(min=0)

    @staticmethod
    def relaxation(lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Upper slope and intercept, adaptive lower slope; all (B, *shape)."""
        unstable = (lower < 0) & (upper > 0)
        active = lower >= 0
        denom = torch.where(unstable, upper - lower, torch.ones_like(upper))
        up_slope = torch.where(unstable, upper / denom, active.to(upper.dtype))
        up_bias = torch.where(unstable, -up_slope * lower, torch.zeros_like(upper))
        lo_slope = torch.where(unstable, (upper > -lower).to(upper.dtype), active.to(upper.dtype))
        return up_slope, up_bias, lo_slope

    @staticmethod
    def branch_scores(
        A: Tensor, lower: Tensor, upper: Tensor, bias: Tensor | None, rows: Tensor, free: Tensor
    ) -> tuple[Tensor, Tensor]:
        """BaBSR's two estimates of what splitting each neuron gains for the lower bounds whose
        A-matrix at this ReLU's output is ``A`` (S, B, *shape), weighted by ``rows`` (S, B) (1 where a
        row is still open), as BaBSR (Bunel et al. 2020) and α,β-CROWN's kfsb define them:

        * the intercept term: the triangle's intercept ``-l u / (u - l)`` that a negative coefficient
          picks up, ``min(A, 0) · intercept``, which a split removes;
        * the score: the intercept term plus the pre-activation ``bias`` (None: 0) carried through the
          relaxation's slope, ``max(b A (slope - 1), b A slope)``, in absolute value.

        Returns ``(score, intercept)``, both (B, *shape) and larger is better (the intercept term is
        negated); -1 where the neuron is stable or not ``free``."""
        lo, up = lower.clamp(max=0), upper.clamp(min=0)
        slope = up / (up - lo).clamp(min=1e-12)
        term = A.clamp(max=0) * (-lo * slope)  # <= 0
        score = term
        if bias is not None:
            bA = A * bias
            score = term + torch.maximum(bA * (slope - 1), bA * slope)
        w = rows.reshape(*rows.shape, *[1] * (A.dim() - 2))
        ok = free & (lower < 0) & (upper > 0)
        score = torch.where(ok, (score.abs() * w).sum(0), -1.0)
        return score, torch.where(ok, -(term * w).sum(0), -1.0)

    @staticmethod
    def split_score(weight: Tensor, lower: Tensor, upper: Tensor, free: Tensor | None = None) -> Tensor:
        """BaBSR's score of splitting a neuron (broadcasts): ``weight`` (how much the bounds of interest
        depend on it, e.g. |A| summed over their rows) × the gap of its triangle relaxation,
        ``-l u / (u - l)``; -1 where the neuron is stable or not ``free``. The score of the refinements
        of intermediate bounds (split refinement, the MILP refinement's order), which tighten both
        bounds of a neuron, so both signs of A pick up the intercept; BaB's branching, on lower bounds
        alone, uses :meth:`branch_scores`."""
        unstable = (lower < 0) & (upper > 0)
        free = unstable if free is None else unstable & free
        gap = -lower * upper / (upper - lower).clamp(min=1e-12)
        return torch.where(free, weight * gap, -1.0)

    def _cached_relaxation(self, lower: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``relaxation`` memoised on the identity (and version) of constant bound tensors: β-CROWN
        back-substitutes through the same fixed bounds at every optimisation step."""
        if lower.requires_grad or upper.requires_grad:
            return self.relaxation(lower, upper)
        key = (lower, upper, lower._version, upper._version)
        cached = self._relax_cache
        if (
            cached is not None
            and cached[0][0] is lower
            and cached[0][1] is upper
            and cached[0][2:] == key[2:]
        ):
            return cached[1]
        value = self.relaxation(lower, upper)
        self._relax_cache = (key, value)
        return value

    def backward_relu(self, A: Tensor, lower: Tensor, upper: Tensor, alpha: Tensor | Slopes | None = None):
        """A: (S, B, *shape); lower/upper: (B, *shape); alpha: (S, B, *shape), :class:`Slopes` or None.

        One :class:`_ReluStep` (with autograd when A, the bounds or α need it: α-CROWN, β-CROWN)."""
        if isinstance(A, Window):
            if alpha is not None and not isinstance(alpha, Slopes):
                return self.backward_relu(A.dense(), lower, upper, alpha)
            return self._window_backward(A, lower, upper, alpha)
        up_slope, up_bias, lo_slope = self._cached_relaxation(lower, upper)
        values, index = (alpha.values, alpha.index) if isinstance(alpha, Slopes) else (alpha, None)
        if index is not None and len(index) == math.prod(lower.shape[1:]):  # every neuron kept: the index is
            index = None  # 0 .. n-1 (sorted, unique), so the values are the dense α
        args = (
            A.flatten(2),
            up_slope.flatten(1),
            up_bias.flatten(1),
            values if values is None or index is not None else values.flatten(2),
            lo_slope.flatten(1),
            ((lower < 0) & (upper > 0)).flatten(1),
            index,
        )
        if torch.is_grad_enabled() and _needs_grad(A, lower, upper, alpha):
            out, bias = _ReluStep.apply(*args)
        else:
            out, bias = _ReluStep.values(*args)
        return [out.view_as(A)], bias

    def _window_backward(self, A: Window, lower: Tensor, upper: Tensor, alpha: Slopes | None):
        """The relaxation read at each row's window (slopes outside the map are 0). With a sparse α,
        the lower slope of a neuron in its index that is unstable is α, of any other the same as in
        :class:`_ReluStep` (the upper slope: exact when stable)."""
        up_slope, up_bias, lo_slope = self._cached_relaxation(lower, upper)
        up = A.gather(up_slope)
        if alpha is None:
            lo = A.gather(lo_slope)
        elif len(alpha.index) == 0:  # no neuron kept: every lower slope is the upper one
            lo = up
        else:
            unstable = A.gather(((lower < 0) & (upper > 0)).to(up.dtype)) > 0
            slot = A.lookup(alpha.index)  # (S, 1, C, h, w): where each window entry sits in alpha.values
            kept = alpha.values.gather(2, slot.clamp(min=0).flatten(2).expand(-1, up.shape[1], -1))
            kept = kept.view(up.shape).clamp(0, 1)
            lo = torch.where(unstable & (slot >= 0), kept, up)
        neg = A.values < 0
        A_in = A.values * torch.where(neg, up, lo)  # A⁺ · lower slope + A⁻ · upper slope
        return [A.with_values(A_in)], (torch.where(neg, A.values, 0.0) * A.gather(up_bias)).flatten(2).sum(-1)


class Flatten(Op):
    """Reshape to ``out_shape`` (per sample); covers ONNX Flatten and Reshape."""

    affine = True

    def __init__(self, out_shape):
        self.out_shape = tuple(out_shape)

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], *self.out_shape)

    def ibp(self, box: Box) -> Box:
        return self.forward(box[0]), self.forward(box[1])

    def backward(self, A: Tensor, in_shape):
        return [A.reshape(A.shape[0], A.shape[1], *in_shape)], 0.0

    def compose_affine(self, M, c, shape):
        return M, c


class Affine(Op):
    """Elementwise y = x * scale + shift with constants broadcast to the per-sample shape.

    Covers Add/Sub/Mul/Div by constants, Neg, BatchNorm in inference mode, Identity/Dropout.
    """

    affine = True
    windows = True

    def __init__(self, scale: Tensor | float = 1.0, shift: Tensor | float = 0.0):
        self.scale = torch.as_tensor(scale, dtype=torch.float32)
        self.shift = torch.as_tensor(shift, dtype=torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift

    def ibp(self, box: Box) -> Box:
        a, b = self.forward(box[0]), self.forward(box[1])
        return torch.minimum(a, b), torch.maximum(a, b)

    def backward(self, A: Tensor | Window, in_shape):
        if isinstance(A, Window):  # scale and shift read at the window, as maps (1, C, H, W)
            scale = A.gather(torch.broadcast_to(self.scale, tuple(in_shape))[None])
            shift = A.gather(torch.broadcast_to(self.shift, tuple(in_shape))[None])
            return [A.with_values(A.values * scale)], (A.values * shift).flatten(2).sum(-1)
        A_in = (A * self.scale).expand(*A.shape[:2], *in_shape)
        bias = (A * torch.broadcast_to(self.shift, tuple(in_shape))).flatten(2).sum(-1)
        return [A_in], bias

    def compose_affine(self, M, c, shape):
        s = np.broadcast_to(self.scale.double().cpu().numpy(), shape).reshape(-1)
        t = np.broadcast_to(self.shift.double().cpu().numpy(), shape).reshape(-1)
        return (np.diag(s) if M is None else s[:, None] * M), s * c + t


class Add(Op):
    """y = x0 + sign * x1 for two graph tensors of the same shape (residual connections)."""

    windows = True

    def __init__(self, sign: float = 1.0):
        self.sign = sign

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a + self.sign * b

    def ibp(self, ba: Box, bb: Box) -> Box:
        if self.sign > 0:
            return ba[0] + bb[0], ba[1] + bb[1]
        return ba[0] - bb[1], ba[1] - bb[0]

    def backward(self, A: Tensor | Window, sa, sb):
        return [A, A if self.sign > 0 else -A], 0.0


def fold_affine_into(prev: Op, aff: Affine) -> bool:
    """Fold a per-channel Affine (BatchNorm) into a preceding Conv/Linear (unsharded only)."""
    if not isinstance(prev, (Conv, Linear)) or prev.weight.mode != "none":
        return False
    out = prev.weight.shape[0]
    scale, shift = aff.scale, aff.shift
    if isinstance(prev, Conv):
        if scale.dim() and tuple(scale.shape) not in ((out, 1, 1),):
            return False
        if shift.dim() and tuple(shift.shape) not in ((out, 1, 1),):
            return False
    else:
        if scale.dim() > 1 or shift.dim() > 1:
            return False
    s = scale.reshape(-1).expand(out) if scale.dim() else scale.expand(out)
    t = shift.reshape(-1).expand(out) if shift.dim() else shift.expand(out)
    W = prev.weight.local * s.reshape(-1, *[1] * (prev.weight.local.dim() - 1))
    b = (prev.bias if prev.bias is not None else torch.zeros(out)) * s + t
    prev.weight = ShardedWeight(W, "none")
    prev.bias = b
    return True
