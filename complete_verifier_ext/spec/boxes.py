"""Real boxes rounded to float32 boxes: outward for sound bounds, inward for attacks."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_float64(a: Any, name: str) -> np.ndarray:
    """Return ``a`` as a flat float64 array, rejecting NaN."""
    arr = np.asarray(a, dtype=np.float64).reshape(-1)
    if np.isnan(arr).any():
        raise ValueError(f"{name} contains NaN")
    return arr


def float32_box(lower: Any, upper: Any, inward: bool) -> tuple[np.ndarray, np.ndarray]:
    """Round the real box ``[lower, upper]`` to a float32 box.

    ``inward=True`` rounds ``lower`` up and ``upper`` down, so every float32 point of the result lies in
    the real box (used for attacks).  ``inward=False`` rounds ``lower`` down and ``upper`` up, so the result
    contains the real box (used for sound bounds), also where ``lower``/``upper`` are the float64 nearest
    to a decimal of the file (a value a float32 holds exactly steps one float32 ulp out). Values beyond
    the float32 range round to ``±inf`` outward and to ``±float32_max`` inward.

    If inward rounding empties a dimension (the real interval holds no float32 value, as a pinned
    ``X = 0.1``), that dimension is the float32 nearest to the interval's midpoint: the value the
    float32 network reads for those real inputs (the VNN-COMP checkers cast a witness to the model's
    input type and accept it within their input tolerance).

    Raises ``ValueError`` on NaN, on shape mismatch, or when ``lower > upper`` somewhere.
    """
    lo = as_float64(lower, "lower")
    hi = as_float64(upper, "upper")
    if lo.shape != hi.shape:
        raise ValueError(f"lower and upper have different sizes: {lo.size} != {hi.size}")
    if (lo > hi).any():
        raise ValueError("lower > upper in some dimension")
    with np.errstate(over="ignore"):
        lo32 = lo.astype(np.float32)
        hi32 = hi.astype(np.float32)
    if inward:
        lo32 = np.where(lo32.astype(np.float64) < lo, np.nextafter(lo32, np.float32(np.inf)), lo32)
        hi32 = np.where(hi32.astype(np.float64) > hi, np.nextafter(hi32, np.float32(-np.inf)), hi32)
        empty = lo32 > hi32
        if empty.any():
            with np.errstate(over="ignore"):
                mid32 = (0.5 * (lo[empty] + hi[empty])).astype(np.float32)
            lo32[empty] = mid32
            hi32[empty] = mid32
    else:  # a float64 that a float32 holds exactly may be the nearest float64 of a decimal just beyond
        # it (0.05000000074505806 reads as float32(0.05)): one float32 step out there too, so that the
        # box holds the real one whatever the decimal was (the float64's error is below half a float32 ulp)
        lo32 = np.where(lo32.astype(np.float64) >= lo, np.nextafter(lo32, np.float32(-np.inf)), lo32)
        hi32 = np.where(hi32.astype(np.float64) <= hi, np.nextafter(hi32, np.float32(np.inf)), hi32)
    return lo32.astype(np.float32), hi32.astype(np.float32)
