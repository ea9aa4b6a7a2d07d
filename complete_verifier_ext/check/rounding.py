"""Outward rounding in float64: the error model every bound of the checker rests on.

Arithmetic is IEEE 754 binary64 with rounding to nearest (numpy's, on every platform this runs on),
unit roundoff ``u = 2^-53``, smallest subnormal ``η = 2^-1074``; :func:`subnormals_kept` refuses a
process whose floating-point unit flushes subnormals to zero. What the bounds use:

* one operation: ``fl(a ∘ b)`` lies within half a gap of the exact result, so
  ``down(fl(a ∘ b)) <= a ∘ b <= up(fl(a ∘ b))`` (``down``/``up``: the next float towards ``∓∞``);
* a dot product of length ``n``, in any order (BLAS blocking, FMA): ``|fl(a·b) - a·b| <= γ_n |a|·|b| +
  n·η``, ``γ_n = n·u / (1 - n·u)``; the float value ``t`` of ``|a|·|b|`` is below the exact one by at most
  that much too.

:func:`gamma` is ``2(n + 4)·u``: at least ``γ_n (1 + γ_n)`` and eight units of roundoff, room for the
few roundings of evaluating an error bound itself (``n·u < 0.01`` always holds here).
"""

from __future__ import annotations

import numpy as np

U = 2.0**-53
ETA = 2.0**-1074


def gamma(n: int) -> float:
    """``2(n + 4)·u``: bounds ``γ_n (1 + γ_n)`` (see the module docstring)."""
    return 2.0 * (n + 4) * U


def down(x):
    """The float below ``fl(x)``: a lower bound of the exact result of the one operation giving ``x``."""
    return np.nextafter(x, -np.inf)


def up(x):
    """The float above ``fl(x)``: an upper bound of the exact result of the one operation giving ``x``."""
    return np.nextafter(x, np.inf)


def err(t, n: int):
    """An upper bound of ``γ_n T + n·η`` where ``T`` is the exact sum of ``n`` non-negative products
    whose float value is ``t``: the rounding error of a length-``n`` dot product, ``t`` the float value
    of the same product in absolute values; also any small multiple (up to ``8u``) of such a sum."""
    return up(gamma(n) * t + 2.0 * n * ETA)


def sum_up(t, n: int):
    """An upper bound of the exact sum of ``n`` non-negative products whose float value is ``t``."""
    return up(t + err(t, n))


def subnormals_kept() -> bool:
    """Whether the floating-point unit keeps subnormal results (no flush-to-zero): the error model's
    absolute term ``n·η`` assumes it."""
    tiny = np.float64(2.0**-1022)
    return bool(tiny / np.float64(4.0) != 0.0 and np.float64(ETA) * np.float64(1.0) != 0.0)
