"""The logistic sigmoid ``σ(z) = 1 / (1 + e^-z)`` made rigorous: enclosures of its values and, on an
interval ``[l, u]``, a lower line ``k_lo z + c_lo <= σ(z)`` and an upper line ``σ(z) <= k_up z + c_up``
that hold in real arithmetic for the float coefficients returned.

Values: ``σ`` in float64 (``e^z / (1 + e^z)`` for ``z < 0``, so nothing overflows) is within a relative
``ε + 3u`` of the exact value, ``ε`` the error of ``exp``; :data:`REL` (``2^-44``) is far above that
(libm and numpy's ``exp`` err by a few ``u``), plus an absolute ``2η`` for underflow.

Lines: any slope ``k`` gives a valid line once its intercept is a lower bound of ``g(z) = σ(z) - k z``
over ``[l, u]``. ``σ`` is convex on ``z <= 0`` and concave on ``z >= 0``. On the concave part ``g`` is
concave: its minimum is at an end. On the convex part ``[a, b]`` ``g`` is convex: for any ``d`` in it,
``g(z) >= g(d) + g'(d)(z - d)``, so ``min g >= g(d) - max((g'(d))⁺ (d - a), (-g'(d))⁺ (b - d))``, with
``g'(d) = σ'(d) - k`` enclosed. ``d`` is where ``σ'(d) = k`` (bisection; only a choice, the formula is
valid at any ``d``). The slope is CROWN's as auto_LiRPA draws it (its default "smoothness"): on a
convex interval the tangent at the midpoint ``m``, on a concave one the chord, across 0 the tangent at
``min(d, m)``, ``d <= 0`` the point whose tangent passes through ``(u, σ(u))`` (the chord where none
does): the hull's line tightest at ``m``. The upper line is the lower line of the mirror image, as
``σ(z) = 1 - σ(-z)``. :func:`lines_at` chooses the slopes of the convex hull's lines tightest at given
points instead (the bound pass's second try), :func:`tangents` more lines for the LP.
"""

from __future__ import annotations

import numpy as np

from .rounding import ETA, U, down, up

REL = 2.0**-44  # the relative error allowed to a float64 value of σ or σ'
_STEPS = 60  # bisection steps (each halves an interval of at most the input's width)


def _sigma(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _slope(z: np.ndarray) -> np.ndarray:
    """``σ'(z) = e / (1 + e)²``, ``e = e^-|z|`` (within a relative :data:`REL`)."""
    e = np.exp(-np.abs(z))
    return e / ((1.0 + e) * (1.0 + e))


def value_bounds(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lower, upper)`` enclosing the exact ``σ(z)`` of each float ``z``."""
    s = _sigma(z)
    return down(down(s * (1.0 - REL)) - 2 * ETA), up(up(s * (1.0 + REL)) + 2 * ETA)


def lines(l: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(k_lo, c_lo, k_up, c_up)`` of each neuron's interval ``[l, u]`` (module docstring)."""
    with np.errstate(all="ignore"):  # (an infinite bound: NaN lines, which prove nothing)
        return lines_at(l, u, 0.5 * (l + u))


def tangents(l: np.ndarray, u: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """More lines for the LP, ``(slopes, lower intercepts, upper intercepts)`` each ``(n, count)``: the
    slopes ``σ'`` at ``count`` points spread over ``[l, u]``, each with both intercepts made valid (a
    tangent where ``σ`` is convex is a tight lower line, where concave a tight upper one): together an
    outer approximation of ``σ``'s convex hull on the interval, which CROWN's one pair of lines is not."""
    l, u = l[:, None], u[:, None]
    at = l + (u - l) * ((np.arange(count) + 0.5) / count)
    with np.errstate(all="ignore"):
        k = _slope(at)
        return k, _intercept(l, u, k), up(1.0 - _intercept(-u, -l, k))


def lines_at(
    l: np.ndarray, u: np.ndarray, p: np.ndarray, p_up: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(k_lo, c_lo, k_up, c_up)`` as :func:`lines` gives them, but each line the one of ``σ``'s convex
    hull on ``[l, u]`` that is tightest at the point ``p`` (the upper line at ``p_up`` where given; per
    neuron, or per row and neuron: broadcast against ``l`` and ``u``): the lower line's slope is ``σ'``
    at ``p`` moved into the part of ``[l, u]`` where the hull is ``σ`` itself (``z <= 0``, left of where
    the tangent through ``(u, σ(u))`` touches), CROWN's chord where there is none; the upper line by
    symmetry. Valid for any point, as every slope is (a NaN point leaves NaN the lines it chooses, which
    prove nothing)."""
    with np.errstate(all="ignore"):
        k_lo = _hull_slope(l, u, p)
        k_up = _hull_slope(-u, -l, -(p if p_up is None else p_up))
        return k_lo, _intercept(l, u, k_lo), k_up, up(1.0 - _intercept(-u, -l, k_up))


def sigma(z: np.ndarray) -> np.ndarray:
    """``σ(z)`` in float64, not enclosed (for choosing, never for bounding)."""
    return _sigma(z)


def _hull_slope(l: np.ndarray, u: np.ndarray, p: np.ndarray) -> np.ndarray:
    d, touches = _touch(l, u)
    convex = (l < 0) & ((u <= 0) | touches)
    return np.where(convex, _slope(np.clip(p, l, np.where(u <= 0, u, d))), _chord(l, u))


def _chord(l: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The chord's slope (``σ'(l)`` on a point): the hull's lower line where ``σ`` is concave, or where no
    tangent left of 0 passes through ``(u, σ(u))`` (only a choice: any slope is made valid by its
    intercept)."""
    return np.where(u > l, (_sigma(u) - _sigma(l)) / np.where(u > l, u - l, 1.0), _slope(l))


def _touch(l: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(d, whether it exists)``: the ``d`` in ``[min(l, 0), 0]`` whose tangent passes through
    ``(u, σ(u))``, which exists where ``l``'s tangent passes below it (bisection: any ``d`` right of it
    has a tangent above ``σ(u)`` at ``u``, no lower line)."""
    su = _sigma(u)

    def h(d):
        return _sigma(d) + _slope(d) * (u - d) - su

    return _bisect(lambda m: h(m) < 0, np.minimum(l, 0.0), np.zeros_like(l)), h(l) < 0


def _bisect(left, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The left end of ``[a, b]`` after :data:`_STEPS` halvings, keeping the half right of each midpoint
    ``m`` where ``left(m)`` (the point sought lies right of it), else the left half."""
    for _ in range(_STEPS):
        m = 0.5 * (a + b)
        right = left(m)
        a, b = np.where(right, m, a), np.where(right, b, m)
    return a


def _g_low(z: np.ndarray, k: np.ndarray) -> np.ndarray:
    """A lower bound of ``σ(z) - k z``."""
    return down(value_bounds(z)[0] - up(k * z))


def _intercept(l: np.ndarray, u: np.ndarray, k: np.ndarray) -> np.ndarray:
    """A lower bound of ``min over [l, u] of σ(z) - k z``."""
    concave = np.where(u >= 0, np.minimum(_g_low(np.maximum(l, 0.0), k), _g_low(u, k)), np.inf)
    a, b = l, np.minimum(u, 0.0)
    d = np.clip(_bisect(lambda m: _slope(m) < k, a, b), a, b)  # σ' increases on z <= 0: σ'(d) = k
    sd = _slope(d)
    gp = sd - k
    delta = up(up(REL * sd + U * np.abs(gp)) + 4 * ETA)  # |g'(d) - gp|
    loss = np.maximum(up(up(gp + delta) * up(d - a)), up(up(delta - gp) * up(b - d)))
    convex = np.where(l <= 0, down(_g_low(d, k) - np.maximum(loss, 0.0)), np.inf)
    return np.minimum(concave, convex)
