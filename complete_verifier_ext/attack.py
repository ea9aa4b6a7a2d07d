"""Falsification by projected gradient descent (PGD) and counterexample checking.

A region (see :mod:`complete_verifier_ext.spec`) is an input box plus a disjunction of clauses; a clause
``(C, d)`` holds at an output ``y`` iff ``all(C @ y <= d)``.  A counterexample is a point of the box at
which some clause holds.  This module

* uses the float32 boxes of :func:`spec.float32_box`,
* searches for counterexamples with a batched, deterministic sign-gradient PGD (:func:`pgd_attack`),
* re-checks a candidate with the torch model and optionally onnxruntime (:func:`check_counterexample`),
* formats it in the VNN-COMP results format (:func:`format_counterexample`).

Lockstep contract of :func:`pgd_attack` (several processes may run it in lockstep): each step first calls
``should_stop()`` exactly once; if it returns False, ``forward`` is called exactly once on the whole batch.
The loop ends after ``cfg.pgd_steps`` steps, when ``should_stop()`` returns True, or (with
``cfg.pgd_early_stop``) at the first step where some point satisfies some clause.  After the loop,
``forward`` is called once more (on a single point) iff a candidate was found.  Apart from the results of
``forward`` and ``should_stop``, the sequence of calls depends only on the arguments (seed included), never
on the clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .spec import Clauses, as_float64, float32_box

if TYPE_CHECKING:
    from complete_verifier_ext.spec import Clause, Region

__all__ = [
    "check_counterexample",
    "clause_margins",
    "format_counterexample",
    "pgd_attack",
]

Forward = Callable[[torch.Tensor], torch.Tensor]

# Defaults mirroring config.AttackConfig; read with getattr so any object with these attributes works.
_CFG_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "pgd_steps": 100,
        "pgd_restarts": 30,
        "pgd_alpha": "auto",
        "pgd_early_stop": True,
        "pgd_lr_decay": 0.99,
        "pgd_odi_steps": 0,
    }
)


# ----------------------------------------------------------------------------------------------------
# Clause margins
# ----------------------------------------------------------------------------------------------------


def clause_margins(y: np.ndarray, clauses: Sequence[Clause]) -> np.ndarray:
    """Return, for each clause, ``max(C @ y - d)`` (float64, shape ``(num_clauses,)``): the margins of
    :class:`spec.Clauses` at one output ``y``.

    A margin ``<= 0`` means the clause holds at ``y``.  A clause with no rows always holds (margin -inf).
    A NaN margin (a NaN output, or inf - inf) is no counterexample: it counts as ``+inf``.
    """
    yv = torch.from_numpy(np.asarray(y, dtype=np.float64).reshape(1, -1))
    return Clauses.of(clauses, yv.shape[1]).point_margins(yv)[0].numpy()


# ----------------------------------------------------------------------------------------------------
# PGD
# ----------------------------------------------------------------------------------------------------


def _step_sizes(cfg: Any, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Initial per-dimension step size: ``(hi - lo) / 4`` for "auto", else the given absolute value."""
    alpha = getattr(cfg, "pgd_alpha", _CFG_DEFAULTS["pgd_alpha"])
    if isinstance(alpha, str):
        if alpha != "auto":
            raise ValueError(f"pgd_alpha must be 'auto' or a number, got {alpha!r}")
        return (hi.double() - lo.double()) / 4.0
    if not float(alpha) > 0.0:
        raise ValueError(f"pgd_alpha must be positive, got {alpha!r}")
    return torch.full_like(lo, float(alpha), dtype=torch.float64)


def _initial_points(
    lo: torch.Tensor, hi: torch.Tensor, restarts: int, n_clauses: int, gen: torch.Generator
) -> torch.Tensor:
    """Starting points ``(restarts, K, n)``: restart 0 is the box centre, the others uniform in the box."""
    lo64, hi64 = lo.double(), hi.double()
    u = torch.rand((restarts, n_clauses, lo.numel()), generator=gen, dtype=torch.float64, device=gen.device)
    u = u.to(lo.device)  # drawn on the generator's device: the same points on every device
    u[0] = 0.5
    x = (lo64 + (hi64 - lo64) * u).to(torch.float32)
    return torch.minimum(torch.maximum(x, lo), hi)


def _forward_flat(forward: Forward, x: torch.Tensor, input_shape: tuple[int, ...]) -> torch.Tensor:
    """Run ``forward`` on flat points ``(N, n)`` and return the outputs as ``(N, n_out)``."""
    y = forward(x.reshape(x.shape[0], *input_shape))
    return y.reshape(x.shape[0], -1)


def _diversify(
    forward: Forward,
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    steps: int,
    keep: int,
    input_shape: tuple[int, ...],
    gen: torch.Generator,
    should_stop: Callable[[], bool],
) -> torch.Tensor:
    """Output-diversified initialisation (Tashiro et al., 2020): points ``x[keep:]`` take ``steps`` sign
    steps of half the box width that increase ``w . f(x)`` for their own random ``w`` in [-1, 1]^n_out.
    Plain uniform starts of a deep net all land on nearly the same outputs; these do not."""
    w = None
    for _ in range(steps):
        if should_stop():
            break
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            y = _forward_flat(forward, xg, input_shape)
            if w is None:
                w = torch.rand(y.shape, generator=gen, dtype=torch.float64, device=gen.device).to(y) * 2 - 1
                w[:keep] = 0
            (grad,) = torch.autograd.grad((y * w).sum(), xg, allow_unused=True)
        if grad is None:
            break
        grad = torch.nan_to_num(grad, nan=0.0)  # an overflowing network gives no direction, never NaN points
        x = torch.minimum(
            torch.maximum(x + (hi / 2 - lo / 2) * torch.sign(grad), lo), hi
        ).detach()  # no overflow
    return x


@dataclass(frozen=True)
class _PgdSettings:
    """The ``attack`` keys PGD reads, with :data:`_CFG_DEFAULTS` for those ``cfg`` lacks."""

    steps: int
    restarts: int  # at least 1
    early_stop: bool
    decay: float
    odi_steps: int

    @classmethod
    def of(cls, cfg: Any) -> _PgdSettings:
        def get(name: str) -> Any:
            return getattr(cfg, name, _CFG_DEFAULTS[name])

        return cls(
            steps=int(get("pgd_steps")),
            restarts=max(1, int(get("pgd_restarts"))),
            early_stop=bool(get("pgd_early_stop")),
            decay=float(get("pgd_lr_decay")),
            odi_steps=int(get("pgd_odi_steps")),
        )


def _attack_box(region: Region, input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inward-rounded float32 box of ``region`` (flat ``lo``, ``hi``). ValueError when its size is
    not ``input_shape``'s or it is unbounded."""
    lo_np, hi_np = float32_box(region.lower, region.upper, inward=True)
    n_in = math.prod(input_shape)
    if lo_np.size != n_in:
        raise ValueError(f"region has {lo_np.size} inputs but input_shape {input_shape} has {n_in}")
    if not (np.isfinite(lo_np).all() and np.isfinite(hi_np).all()):
        raise ValueError("pgd_attack needs a bounded input box")
    return torch.from_numpy(lo_np), torch.from_numpy(hi_np)


def _keep_best(
    x: torch.Tensor, margins: torch.Tensor, best_x: torch.Tensor | None, best_margin: float
) -> tuple[torch.Tensor | None, float]:
    """The point of ``x`` (B, n) with the lowest clause margin (``margins``: (B, K)) and that margin, if
    it is at most 0 and below ``best_margin``; else ``best_x`` and ``best_margin`` unchanged."""
    point_best, _ = margins.min(dim=1)
    b = int(torch.argmin(point_best))
    if point_best[b].item() <= 0.0 and point_best[b].item() < best_margin:
        return x[b].clone(), point_best[b].item()
    return best_x, best_margin


def sign_step(
    x: torch.Tensor, grad: torch.Tensor | None, step_size: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """One descent step of ``step_size`` (per dimension) along ``-sign(grad)``, projected onto the box;
    no gradient (or NaN) leaves a coordinate where it is. The one PGD step of the attack and of BaB's
    search for counterexamples among its domains' minimisers."""
    if grad is None:
        grad = torch.zeros_like(x)
    grad = torch.nan_to_num(grad, nan=0.0)
    return torch.minimum(torch.maximum(x - step_size.to(torch.float32) * torch.sign(grad), lo), hi).detach()


def _pgd_steps(
    forward: Forward,
    x: torch.Tensor,
    box: tuple[torch.Tensor, torch.Tensor],
    alpha: torch.Tensor,
    clauses: tuple[Clause, ...],
    pgd: _PgdSettings,
    input_shape: tuple[int, ...],
    should_stop: Callable[[], bool],
) -> torch.Tensor | None:
    """The PGD loop from the points ``x`` (B, n), point ``i`` attacking clause ``i % K``: the point with
    the lowest non-positive margin seen (the first step's best with early stop), or None."""
    # clause attacked by each point (layout: restart-major)
    own = torch.arange(x.shape[0], device=x.device) % len(clauses)
    best_x: torch.Tensor | None = None
    best_margin = math.inf
    stacked: Clauses | None = None
    for step in range(pgd.steps):
        if should_stop():
            break
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            y = _forward_flat(forward, xg, input_shape).double()
            if stacked is None:
                stacked = Clauses.of(clauses, y.shape[1])
                attacked = stacked.owner.to(x.device)[None, :] == own[:, None]  # (B, S): each point's rows
            rows = stacked.point_rows(y)  # (B, S)
            best_x, best_margin = _keep_best(x, stacked.per_clause(rows.detach()), best_x, best_margin)
            if best_x is not None and pgd.early_stop:
                break
            if step == pgd.steps - 1:
                break  # the update would never be evaluated
            loss = torch.where(attacked, torch.relu(rows), 0.0).sum()
            grad = torch.autograd.grad(loss, xg, allow_unused=True)[0] if loss.requires_grad else None
        x = sign_step(x, grad, alpha * pgd.decay**step, *box)
    return best_x


def _confirmed(
    forward: Forward, best_x: torch.Tensor, clauses: tuple[Clause, ...], input_shape: tuple[int, ...]
) -> np.ndarray | None:
    """``best_x`` as a flat float32 array if ``forward`` on exactly that point satisfies a clause."""
    with torch.no_grad():
        y_check = _forward_flat(forward, best_x.reshape(1, -1), input_shape)
    x_out = best_x.cpu().numpy().astype(np.float32)
    if np.min(clause_margins(y_check.double().cpu().numpy()[0], clauses)) > 0.0:
        return None
    return x_out


def pgd_attack(
    forward: Forward,
    input_shape: tuple[int, ...],
    region: Region,
    cfg: Any,
    *,
    seed: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
    device: torch.device | str = "cpu",
) -> np.ndarray | None:
    """Search for a counterexample of ``region`` with batched sign-gradient PGD.

    Every clause gets its own attack (loss: sum of the positive parts of its row margins), with
    ``cfg.pgd_restarts`` starts each (the first at the box centre, the others uniform in the box), all run
    together in one forward call of batch size ``restarts * num_clauses`` per step.  Points live in the
    inward-rounded float32 box (:func:`float32_box`) and are projected back after each step.  Step size at
    step ``t`` is ``alpha * cfg.pgd_lr_decay**t``, with ``alpha = (upper - lower) / 4`` for ``"auto"`` or
    the given number.  Deterministic for a given ``seed`` (a private CPU ``torch.Generator`` is used, so
    the starting points are the same on every ``device``, where the points live and ``forward`` runs).

    ``should_stop`` is the only time-based stop (see the module docstring for the exact call pattern).
    Returns a flat float32 counterexample, re-checked by running ``forward`` on exactly that point, or None
    (also for a region without clauses).
    """
    clauses = tuple(region.clauses)
    if not clauses:
        return None
    box = lo, hi = tuple(t.to(device) for t in _attack_box(region, input_shape))
    pgd = _PgdSettings.of(cfg)
    gen = torch.Generator().manual_seed(int(seed))
    alpha = _step_sizes(cfg, lo, hi)
    x = _initial_points(lo, hi, pgd.restarts, len(clauses), gen).reshape(-1, lo.numel())
    if pgd.odi_steps > 0 and pgd.restarts > 1:  # restart 0 (the box centre) is kept as it is
        x = _diversify(forward, x, lo, hi, pgd.odi_steps, len(clauses), input_shape, gen, should_stop)
    best_x = _pgd_steps(forward, x, box, alpha, clauses, pgd, input_shape, should_stop)
    return None if best_x is None else _confirmed(forward, best_x, clauses, input_shape)


# ----------------------------------------------------------------------------------------------------
# Checking and formatting
# ----------------------------------------------------------------------------------------------------


def _ort_input(session: Any, x: np.ndarray, input_shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
    """Shape and type ``x`` for the first input of an onnxruntime session."""
    inp = session.get_inputs()[0]
    dtype = np.float64 if inp.type == "tensor(double)" else np.float32
    dims = [dim if isinstance(dim, int) and dim > 0 else 1 for dim in (inp.shape or [])]
    shape: tuple[int, ...] = tuple(dims) if math.prod(dims) == x.size else (1, *input_shape)
    return inp.name, x.astype(dtype).reshape(shape)


def ort_session(onnx_path: str):
    """An onnxruntime session (CPU) of the ONNX file ``onnx_path`` (``.gz`` too)."""
    import gzip

    import onnxruntime as ort

    source: str | bytes = onnx_path
    if onnx_path.endswith(".gz"):
        with gzip.open(onnx_path, "rb") as f:
            source = f.read()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def ort_output(onnx_path: str, x: np.ndarray, input_shape: tuple[int, ...]) -> np.ndarray:
    """Run the ONNX model on ``x`` with onnxruntime (CPU) and return its first output, flat float64."""
    session = ort_session(onnx_path)
    name, feed = _ort_input(session, x, input_shape)
    out = session.run(None, {name: feed})[0]
    return np.asarray(out, dtype=np.float64).reshape(-1)


def check_counterexample(
    forward: Forward,
    input_shape: tuple[int, ...],
    x: np.ndarray,
    region: Region,
    onnx_path: str | None = None,
    device: torch.device | str = "cpu",
) -> tuple[bool, np.ndarray]:
    """Check that ``x`` is a counterexample of ``region``.

    ``x`` (flat, cast to float32) must lie in the inward float32 box (:func:`float32_box`: the real box,
    where a dimension holds no float32 value its nearest one), and some clause must hold, without any
    tolerance, at the torch output and, when ``onnx_path`` is given, at the onnxruntime output too (the
    same clause for both).  ``forward`` runs on ``device``.  Returns ``(is_counterexample, y)`` with ``y``
    the flat float64 torch output.
    """
    x32 = np.asarray(x, dtype=np.float32).reshape(-1)
    with torch.no_grad():
        y_t = _forward_flat(forward, torch.from_numpy(x32.copy()).reshape(1, -1).to(device), input_shape)
    y = y_t.double().cpu().numpy().reshape(-1)
    lo = as_float64(region.lower, "lower")
    if x32.size != lo.size:
        return False, y
    lo32, hi32 = float32_box(lo, region.upper, inward=True)
    if not (np.all(lo32 <= x32) and np.all(x32 <= hi32)):
        return False, y
    holds = clause_margins(y, region.clauses) <= 0.0
    if onnx_path is not None and holds.any():
        holds &= clause_margins(ort_output(onnx_path, x32, input_shape), region.clauses) <= 0.0
    return bool(holds.any()), y


def format_counterexample(x: np.ndarray, y: np.ndarray) -> str:
    """Format a counterexample in the VNN-COMP results format: ``((X_0 v)\\n (X_1 v)\\n ... (Y_j v))``.

    Values are written with ``repr`` of the Python float, which round-trips exactly (float32 values are
    written exactly as float64 numbers).
    """
    entries = [f"(X_{i} {float(v)!r})" for i, v in enumerate(np.asarray(x).reshape(-1))]
    entries += [f"(Y_{j} {float(v)!r})" for j, v in enumerate(np.asarray(y).reshape(-1))]
    return "(" + "\n ".join(entries) + ")"
