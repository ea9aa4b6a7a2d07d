"""TP weights inside auto_LiRPA: no rank ever builds a whole Linear or Conv weight.

The weights are sharded as under FSDP (:func:`.shards.shard_net` with :data:`TP`: 1/P of the output
rows of every ``BoundLinear`` and ``BoundConv`` weight and of its copies in ``model_ori``), each held
as the native engine's :class:`~complete_verifier_ext.parallel.sharded.ShardedWeight` (mode ``tp``).
The op wrappers compute with the shards only:

* ``forward`` and ``interval_propagate``: column-parallel. Each rank computes its own output slice
  (its rows of W, its slice of the bias) and one ``all_gather`` assembles the small output; under
  autograd (α,β-CROWN's attack through the bounded model) the gather keeps the rank's block of the
  gradient and the input's gradient is summed over the ranks. When auto_LiRPA merges the spec C into
  the last layer's IBP (``C @ W``), the merged ``(B, spec, in)`` matrix is the sum of the ranks'
  ``C[..., rows] @ W_rows`` (one ``all_reduce``).
* ``bound_forward`` / ``bound_dynamic_forward`` (forward-mode bounds, ``bound_prop_method:
  forward+backward``, nn4sys's ``forward+crown``): each block of output units from its shard as it
  comes round the ring, the spec merged as for IBP.
* ``bound_backward``: ``A @ W`` by :meth:`ShardedWeight.linear_t`, a conv's ``conv_transpose2d(A, W)``
  by :meth:`ShardedWeight.conv_transpose2d` (with auto_LiRPA's output padding). The shards travel
  around the ring (P - 1 passes, at most two travelling shards resident) and each multiplies the
  matching block of A as it arrives; in backward (α-CROWN's gradient) the ring runs again, no shard
  is saved. ``A @ b`` uses the bias, which is small and replicated. auto_LiRPA's identity and one-hot
  start matrices (``eyeC``, ``OneHotC``) become dense first.
* ``model_ori`` (PGD, the clean output): each ``nn.Linear`` and ``nn.Conv2d`` runs column-parallel
  with autograd (its input's gradient is summed over the ranks, the gathered output's gradient is
  the rank's own block: every rank runs the same attack on the same loss).

Intermediate bounds are computed exactly as unpatched α,β-CROWN computes them (never IBP because of
sharding). Sharded: ``BoundLinear`` from ONNX Gemm (``transB = 1``, ``alpha = beta = 1``) and
``BoundConv`` (2-D, one group), in ``conv_mode: matrix`` and ``patches``. In patches mode a conv's
``bound_backward`` is linear in (the A-patches' block of this layer's output channels, the weight rows
of those channels): each shard, as it comes round the ring, is applied by auto_LiRPA's own
``bound_backward`` to its channel block, and the results are summed (an identity start, which is the
weight itself, gets each shard's rows). Any other layer (a MatMul, another Gemm form, a grouped or 1-D
conv) stays whole on every rank, with one warning line and the summary's ``whole_layers``. MIP/LP
building gathers each weight for the call (a Gurobi model holds every layer whole).

In a BaB round each rank bounds its own domains (:mod:`..search.activation`), so the column-parallel
form, which needs every rank's input, does not apply: inside
:func:`~complete_verifier_ext.parallel.serve.serving` ``ShardedWeight.columns`` / ``row_sum`` /
``linear_t`` fetch the other ranks' shards one at a time and compute every block here (still no whole
weight on any rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...parallel import comm, serve
from ...parallel.sharded import conv_output_padding
from ..locate import PluginError
from ..run import Run, Shards
from . import shards


def whole_reason(node) -> str | None:
    """Why ``tp`` keeps ``node``'s weight whole on every rank (it cannot compute with its shards), or
    None: the layer is sharded."""
    from auto_LiRPA.operators import BoundConv, BoundLinear

    if type(node) is BoundConv:
        if node.conv_dim != 2 or node.groups != 1:
            return f"a {node.conv_dim}-D convolution with {node.groups} group(s)"
        return None
    if type(node) is not BoundLinear:
        return f"a {type(node).__name__} (tp shards Gemm and Conv layers)"
    if node.transA or not node.transB or node.alpha_linear != 1.0 or node.beta_linear != 1.0:
        return "a Gemm with transA/transB/alpha/beta other than 0/1/1/1"
    return None


def _sharded(reg: Shards, op):
    """The ``ShardedWeight`` of ``op``'s weight, or None (not sharded)."""
    _, sw = shards.weight_of(reg, op)
    return sw


def _part(b: Any, rows: tuple[int, int], dim: int) -> Any:
    """Rows ``lo:hi`` of a bias along ``dim`` (a non-tensor passes through)."""
    return b.narrow(dim, rows[0], rows[1] - rows[0]) if isinstance(b, Tensor) else b


def _needs_grad(*ts: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in ts)


def _column_parallel(sw, xs: tuple[Tensor, ...], block, dim: int) -> Tensor:
    """``block(xs, W_rows, (lo, hi))`` (the output slice of rows ``lo:hi``) for every rank's rows,
    concatenated along ``dim``, differentiable in ``xs`` when autograd records (α,β-CROWN's attack takes
    gradients through the bounded model): every rank computes the same loss from the gathered output,
    so the gather's backward keeps the rank's block of the gradient and each input's gradient is summed
    over the ranks. While :mod:`.serve` is active (a BaB round, ranks out of lockstep) every shard is
    fetched and every block computed here."""
    if serve.active() or not _needs_grad(*xs):
        return sw.columns(lambda w, rows: block(xs, w, rows), dim)
    y = block(tuple(comm.reduce_grad(x) if _needs_grad(x) else x for x in xs), sw.local, sw.rows)
    return comm.all_gather_cat_same_loss(y, dim, sizes=sw.sizes)


def forward(run: Run, orig):
    reg = run.shards

    def forward(self, x, w, b=None):
        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, x, w, b)
        y = _column_parallel(sw, (x,), lambda xs, w, rows: orig(self, xs[0], w, _part(b, rows, -1)), -1)
        self.y_shape = torch.Size((sw.shape[1], sw.shape[0]))  # as orig sets it for the whole W
        return y

    forward.__wrapped__ = orig
    return forward


def _constant(t: Tensor):
    """A constant's forward-mode bound, as auto_LiRPA's ``forward_general`` makes it."""
    from auto_LiRPA.linear_bound import LinearBound

    return LinearBound(None, t, None, t, t, t)


def _blocks(sw, one_block, dims: dict[str, int]):
    """A forward-mode bound (auto_LiRPA ``LinearBound``) whose output units are the weight's rows: each
    block from its shard as it comes round the ring (every rank computes every block; no whole
    weight), concatenated along ``dims`` (``lw``/``uw`` and ``lb``/``ub``)."""
    from auto_LiRPA.linear_bound import LinearBound

    blocks = sorted(((rows[0], one_block(w, rows)) for rows, w in sw.each_shard()), key=lambda b: b[0])
    parts = [part for _, part in blocks]
    first = parts[0]
    cat: dict[str, Any] = {}
    for key in ("lw", "lb", "uw", "ub"):
        if getattr(first, key) is None:
            cat[key] = None
            continue
        twin = {"uw": "lw", "ub": "lb"}.get(key)
        same = twin is not None and all(getattr(p, key) is getattr(p, twin) for p in parts)
        cat[key] = cat[twin] if same else torch.cat([getattr(p, key) for p in parts], dims[key[1]])
    return LinearBound(cat["lw"], cat["lb"], cat["uw"], cat["ub"], x_L=first.x_L, x_U=first.x_U,
                       offset=first.offset, tot_dim=first.tot_dim)  # fmt: skip


def _merged(sw, C: Tensor) -> Tensor:
    """``C @ W`` (``(B, spec, in)``) with the spec merged into the layer: the ranks' blocks summed."""
    return sw.row_sum(lambda w, rows: C[..., rows[0] : rows[1]].to(w).matmul(w))


def bound_forward(run: Run, orig):
    """``BoundLinear.bound_forward`` (forward-mode bounds, ``bound_prop_method: forward+...``): each
    output block from its weight shard (:func:`_blocks`); where auto_LiRPA merges the spec into this
    layer (``C``), the merged ``C @ W`` is summed over the ranks' blocks and applied as auto_LiRPA's own
    code applies it (``BoundLinear.bound_forward_mul``)."""
    reg = run.shards

    def bound_forward(self, dim_in, x, w=None, b=None, C=None, weight_has_batch=False):
        from auto_LiRPA.linear_bound import LinearBound
        from auto_LiRPA.operators import BoundLinear

        sw = _sharded(reg, self)
        if sw is None or w is None or weight_has_batch:
            return orig(self, dim_in, x, w, b, C, weight_has_batch)
        bias = b.lower if b is not None else None
        if C is None:

            def one_block(w_q, rows):
                b_q = None if bias is None else _constant(_part(bias, rows, -1))
                return orig(self, dim_in, x, _constant(w_q), b_q, None, False)

            return _blocks(sw, one_block, {"w": -1, "b": -1})
        wt = _merged(sw, C).transpose(-1, -2)  # (B, in, spec)
        lw, lb, uw, ub = BoundLinear.bound_forward_mul(x.lw, x.lb.unsqueeze(1), x.uw, x.ub.unsqueeze(1), wt)
        lb, ub = lb.squeeze(1), ub.squeeze(1)
        if bias is not None:
            cb = C.to(bias).matmul(bias)
            lb, ub = lb + cb, ub + cb
        return LinearBound(lw, lb, uw, ub)

    bound_forward.__wrapped__ = orig
    return bound_forward


def bound_dynamic_forward(run: Run, orig):
    """``BoundLinear.bound_dynamic_forward`` (``dynamic-forward``): as :func:`bound_forward`."""
    reg = run.shards

    def bound_dynamic_forward(self, x, w=None, b=None, C=None, max_dim=None, offset=0):
        from auto_LiRPA.linear_bound import LinearBound

        sw = _sharded(reg, self)
        if sw is None or w is None:
            return orig(self, x, w, b, C, max_dim, offset)
        bias = b.lb if b is not None else None
        if C is None:

            def one_block(w_q, rows):
                b_q = None if bias is None else _constant(_part(bias, rows, -1))
                return orig(self, x, _constant(w_q), b_q, None, max_dim, offset)

            return _blocks(sw, one_block, {"w": -1, "b": -1})
        wt = _merged(sw, C).transpose(-1, -2)  # (B, in, spec)
        w_new = x.lw.matmul(wt)
        b_new = x.lb.unsqueeze(1).matmul(wt).squeeze(1)
        if bias is not None:
            b_new = b_new + C.to(bias).matmul(bias)
        return LinearBound(w_new, b_new, w_new, b_new, x_L=x.x_L, x_U=x.x_U, tot_dim=x.tot_dim)

    bound_dynamic_forward.__wrapped__ = orig
    return bound_dynamic_forward


def _conv_forward_mode(run: Run, orig, lead: int):
    """``BoundConv``'s forward-mode bound, ``orig(self, *lead_args, x, w, b)``: each block of output
    channels from its weight shard (:func:`_blocks`); ``lead``: the arguments before ``x``."""
    reg = run.shards

    def wrapper(self, *args, **kwargs):
        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, *args, **kwargs)
        bias = args[lead + 2].lb if len(args) > lead + 2 else None

        def one_block(w_q, rows):
            rest = [] if bias is None else [_constant(_part(bias, rows, 0))]
            return orig(self, *args[: lead + 1], _constant(w_q), *rest, **kwargs)

        return _blocks(sw, one_block, {"w": -3, "b": -3})

    wrapper.__wrapped__ = orig
    return wrapper


def conv_bound_forward(run: Run, orig):
    """``BoundConv.bound_forward(dim_in, x, w, b)``."""
    return _conv_forward_mode(run, orig, 1)


def conv_bound_dynamic_forward(run: Run, orig):
    """``BoundConv.bound_dynamic_forward(x, w, b)``."""
    return _conv_forward_mode(run, orig, 0)


def interval_propagate(run: Run, orig):
    reg = run.shards

    def interval_propagate(self, *v, C=None, w=None):
        from auto_LiRPA.operators.base import Interval

        sw = _sharded(reg, self)
        if sw is None or w is not None:
            return orig(self, *v, C=C, w=w)

        def bias(fn) -> list:  # the bias interval through fn (the same tensor twice when constant)
            if len(v) < 3:
                return []
            lo = fn(v[2][0])
            return [Interval.make_interval(lo, lo if v[2][1] is v[2][0] else fn(v[2][1]), v[2])]

        if C is None:

            def block(xs, w, rows):  # this block's (lower, upper), stacked
                x = Interval.make_interval(xs[0], xs[1], v[0])
                lo, hi = orig(self, x, Interval(w, w), *bias(lambda b: _part(b, rows, -1)))
                return torch.stack((lo, hi))

            both = _column_parallel(sw, (v[0][0], v[0][1]), block, -1)
            return both[0], both[1]
        merged = sw.row_sum(lambda w, rows: C[..., rows[0] : rows[1]].matmul(w))  # C @ W: (B, spec, in)
        local = Interval(sw.local, sw.local)
        return orig(self, v[0], local, *bias(C.matmul), C=None, w=merged)

    interval_propagate.__wrapped__ = orig
    return interval_propagate


def _dense(A: Any, dtype: torch.dtype) -> Any:
    """auto_LiRPA's ``eyeC`` / ``OneHotC`` start matrices, and patches-mode A, as a dense ``(spec, B,
    out)`` tensor."""
    from auto_LiRPA.patches import Patches
    from auto_LiRPA.utils import OneHotC, eyeC

    if A is None or isinstance(A, Tensor):
        return A
    if isinstance(A, eyeC):
        spec, batch, n = A.shape[0], A.shape[1], int(torch.Size(A.shape[2:]).numel())
        return torch.eye(n, device=A.device, dtype=dtype).unsqueeze(1).expand(spec, batch, n)
    if isinstance(A, OneHotC):
        spec, batch, n = A.shape[0], A.shape[1], int(torch.Size(A.shape[2:]).numel())
        index = A.index if A.index.ndim == 2 else A.index.unsqueeze(1).expand(spec, batch)
        coeffs = torch.ones(index.shape, device=A.device, dtype=dtype) if A.coeffs is None else A.coeffs
        if coeffs.ndim == 1:
            coeffs = coeffs.unsqueeze(1).expand(spec, batch)
        dense = torch.zeros((spec, batch, n), device=A.device, dtype=dtype)
        return dense.scatter(2, index.unsqueeze(-1), coeffs.to(dtype).unsqueeze(-1))
    if isinstance(A, Patches):  # a Linear whose output the next layer reads as an image (cifar_biasfield):
        dense = A.to_matrix(A.input_shape)  # (batch, spec, C, H, W): its A over the output units, spec
        return dense.flatten(2).transpose(0, 1).to(dtype)  # rows in auto_LiRPA's order; a matrix after
    raise RuntimeError(f"tp: unexpected A-matrix type {type(A).__name__}")


def bound_backward(run: Run, orig):
    reg = run.shards

    def bound_backward(self, last_lA, last_uA, *x, start_node=None, reduce_bias=True, **kwargs):
        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, last_lA, last_uA, *x, start_node=start_node, reduce_bias=reduce_bias, **kwargs)
        plain = not any(self.is_input_perturbed(i) for i in range(1, len(x)))
        plain = plain and not (self.swap_x_and_weight or self.batched_weight_and_bias)
        if not plain or self.use_seperate_weights_for_lower_and_upper_bounds:
            raise PluginError(f"parallel.mode: tp: node {self.name} has a non-constant weight: use fsdp")
        if start_node is not None:
            self._start = start_node.name
        bias = x[2].lower if len(x) == 3 else None

        def one_side(A):
            A = _dense(A, sw.local.dtype)
            if A is None:
                return None, 0.0
            return sw.linear_t(A.to(sw.local)), (A.to(bias).matmul(bias) if bias is not None else 0.0)

        lA, lbias = one_side(last_lA)
        uA, ubias = (lA, lbias) if last_uA is last_lA else one_side(last_uA)
        return [(lA, uA), (None, None), (None, None)], lbias, ubias

    bound_backward.__wrapped__ = orig
    return bound_backward


def build_solver(run: Run, orig):
    """MIP/LP model building (``build_solver(self, *v, ...)``, ``v[1]`` the weight): a Gurobi model
    holds every layer whole as its coefficients, so the weight is gathered for the call and dropped
    after (in lockstep: every rank builds the same model)."""
    reg = run.shards

    def build_solver(self, *v, **kwargs):
        sw = _sharded(reg, self)
        if sw is None or len(v) < 2:
            return orig(self, *v, **kwargs)
        return orig(self, v[0], sw.fresh(), *v[2:], **kwargs)

    build_solver.__wrapped__ = orig
    return build_solver


def conv_forward(run: Run, orig):
    """``BoundConv.forward(x, w, b)``: the rank's output channels, then one all-gather."""
    reg = run.shards

    def forward(self, *x):
        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, *x)

        def block(xs, w, rows):
            return orig(self, xs[0], w, *[_part(t, rows, 0) for t in x[2:]])

        return _column_parallel(sw, (x[0],), block, 1)

    forward.__wrapped__ = orig
    return forward


def conv_interval_propagate(run: Run, orig):
    reg = run.shards

    def interval_propagate(self, *v, C=None):
        from auto_LiRPA.operators.base import Interval

        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, *v, C=C)

        def block(xs, w, rows):  # this block's (lower, upper), stacked
            bias = []
            if len(v) == 3:
                lo = _part(v[2][0], rows, 0)
                hi = lo if v[2][1] is v[2][0] else _part(v[2][1], rows, 0)
                bias = [Interval.make_interval(lo, hi, v[2])]
            x = Interval.make_interval(xs[0], xs[1], v[0])
            return torch.stack(orig(self, x, Interval(w, w), *bias, C=C))

        both = _column_parallel(sw, (v[0][0], v[0][1]), block, 2)
        return both[0], both[1]

    interval_propagate.__wrapped__ = orig
    return interval_propagate


def _shard_patches(A, rows: tuple[int, int]):
    """The part of ``A`` (auto_LiRPA ``Patches``) that meets output channels ``lo:hi`` of this layer:
    the patches' channel block, or, for an identity start, its rows in those channels (with their
    positions among ``A``'s rows; None: all, in order)."""
    from auto_LiRPA.patches import Patches

    lo, hi = rows
    if A.identity == 0:
        return A.create_similar(A.patches.narrow(-3, lo, hi - lo)), None
    idx, kept = A.unstable_idx, None
    if idx is not None:
        kept = ((idx[0] >= lo) & (idx[0] < hi)).nonzero().squeeze(1)
        idx = (idx[0][kept] - lo, *(i[kept] for i in idx[1:]))
    shape = (hi - lo if idx is None else kept.numel(), *A.shape[1:])
    part = Patches(
        None, A.stride, A.padding, shape, identity=1, unstable_idx=idx, output_shape=A.output_shape,
        inserted_zeros=A.inserted_zeros, output_padding=A.output_padding, input_shape=A.input_shape,
    )  # fmt: skip
    return part, kept


def _patches_side(self, orig, A, x, sw):
    """One side (``A``: auto_LiRPA ``Patches``) of a conv's ``bound_backward`` in patches mode. It is
    linear in (A's block of this layer's output channels, the weight rows of those channels), so each
    shard as it comes round the ring goes through auto_LiRPA's own ``bound_backward`` with its block,
    and the results are summed; an identity start (the next A is the weight itself) gets each shard's
    rows instead. Returns (next A: ``Patches`` or, where auto_LiRPA switches to matrix mode, a tensor;
    the bias term)."""
    import types

    from auto_LiRPA.patches import Patches

    if A.identity == 0 and not self.relu_followed:  # auto_LiRPA pads here; done once, for all blocks
        A = A.create_similar(A.create_padding(self.output_shape))
    template, total, bias, parts = None, None, 0.0, []
    saved, self.relu_followed = self.relu_followed, True
    try:
        for rows, w in sw.each_shard():
            A_q, kept = _shard_patches(A, rows)
            if kept is not None and kept.numel() == 0:
                continue
            xs = [x[0], types.SimpleNamespace(lower=w)]
            if len(x) > 2:
                xs.append(types.SimpleNamespace(lower=_part(x[2].lower, rows, 0)))
            out, b, _ = orig(self, A_q, None, *xs)
            nxt = out[0][0]
            template = nxt if template is None else template
            t = nxt.patches if isinstance(nxt, Patches) else nxt
            if A.identity == 0:
                total, bias = (t, b) if total is None else (total + t, bias + b)
            else:
                parts.append((rows[0], kept, t, b))
    finally:
        self.relu_followed = saved
    if A.identity != 0:
        total, bias = _rows_in_order(parts, A)
    if isinstance(template, Patches):
        return template.create_similar(total, unstable_idx=A.unstable_idx), bias
    return total, bias


def _rows_in_order(parts: list, A) -> tuple[Tensor, Any]:
    """The identity start's per-shard results (rows first) put back in ``A``'s row order."""
    if A.unstable_idx is None:  # a row block per channel block, in channel order
        parts.sort(key=lambda p: p[0])
        cat = lambda items: torch.cat(items, 0) if isinstance(items[0], Tensor) else 0.0
        return cat([p[2] for p in parts]), cat([p[3] for p in parts])
    n = A.unstable_idx[0].numel()
    t = parts[0][2].new_zeros((n, *parts[0][2].shape[1:]))
    has_bias = isinstance(parts[0][3], Tensor)
    b = parts[0][3].new_zeros((n, *parts[0][3].shape[1:])) if has_bias else 0.0
    for _, kept, tq, bq in parts:
        t[kept] = tq
        if has_bias:
            b[kept] = bq
    return t, b


def _patches_bound_backward(self, orig, last_lA, last_uA, x, sw):
    from auto_LiRPA.patches import Patches

    def side(A):
        if A is None:
            return None, 0
        if isinstance(A, Patches):
            return _patches_side(self, orig, A, x, sw)
        return _matrix_side(self, A, x, sw)

    lA, lbias = side(last_lA)
    uA, ubias = (lA, lbias) if last_uA is last_lA else side(last_uA)
    return [(lA, uA), (None, None), (None, None)], lbias, ubias


def _matrix_side(self, A, x, sw):
    """Matrix mode: ``conv_transpose2d(A, W)`` around the ring of shards, with the output padding
    auto_LiRPA computes; ``A · b`` with the replicated bias."""
    A = _dense(A, sw.local.dtype)
    if A is None:
        return None, 0
    hw = self.input_shape[2:], self.output_shape[2:], sw.shape[2:]
    pad = conv_output_padding(*hw, self.stride, self.padding, self.dilation)
    bias = x[2].lower if self.has_bias else None
    spec, batch = A.shape[:2]
    flat = A.reshape(spec * batch, *A.shape[2:]).to(sw.local)
    nxt = sw.conv_transpose2d(flat, self.stride, self.padding, self.dilation, pad)
    nxt = nxt.view(spec, batch, *nxt.shape[1:])
    return nxt, (torch.einsum("sbc...,c->sb", A, bias) if bias is not None else 0)


def conv_bound_backward(run: Run, orig):
    """``A @ W`` of a conv with its output channels sharded: matrix mode by :func:`_matrix_side`,
    patches mode by :func:`_patches_side`."""
    reg = run.shards

    def bound_backward(self, last_lA, last_uA, *x, **kwargs):
        sw = _sharded(reg, self)
        if sw is None:
            return orig(self, last_lA, last_uA, *x, **kwargs)
        return _patches_bound_backward(self, orig, last_lA, last_uA, x, sw)

    bound_backward.__wrapped__ = orig
    return bound_backward


def lirpanet_init(run: Run, orig):
    """``LiRPANet.__init__``: built on the whole model, then its weights sharded (tp)."""
    return shards.lirpanet_init(run, orig, TP)


# ---------------------------------------------------------------------------------------------------------
# model_ori: column-parallel nn.Linear with autograd
# ---------------------------------------------------------------------------------------------------------


def column_parallel_forward(reg: Shards, model: nn.Module, table: dict[shards.Key, tuple[Any, bool]]) -> None:
    """Every ``nn.Linear`` of ``model`` whose weight is sharded computes its own output columns;
    ``table``: the model's sharded tensors by (module path, attribute) (``reg.by_model[model]``)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for (owner, attr), (shard, transposed) in table.items():
        m = modules.get(owner)
        if attr == "weight" and not transposed and isinstance(m, nn.Linear):
            m.forward = _linear_forward(reg, m, shard)
        elif attr == "weight" and not transposed and isinstance(m, nn.Conv2d) and m.padding_mode == "zeros":
            m.forward = _conv_forward(reg, m, shard)


def _linear_forward(reg: Shards, m: nn.Linear, sw):
    def forward(x: Tensor) -> Tensor:
        if reg.replicated:  # the module holds its whole weight (a LiRPANet being built on it)
            return F.linear(x, m.weight, m.bias)
        if serve.active():  # the ranks out of lockstep (a BaB round): every shard fetched here
            return sw.columns(lambda w, rows: F.linear(x, w, _part(m.bias, rows, 0)), -1)
        y = F.linear(comm.reduce_grad(x), sw.local, _part(m.bias, sw.rows, 0))
        return comm.all_gather_cat_same_loss(y, -1, sizes=sw.sizes)

    return forward


def _conv_forward(reg: Shards, m: nn.Conv2d, sw):
    def with_bias(y: Tensor, rows: tuple[int, int]) -> Tensor:
        return y if m.bias is None else y + _part(m.bias, rows, 0).view(1, -1, 1, 1)

    def forward(x: Tensor) -> Tensor:
        if reg.replicated:  # the module holds its whole weight (a LiRPANet being built on it)
            return type(m).forward(m, x)
        if serve.active():
            conv = lambda w, rows: with_bias(F.conv2d(x, w, None, m.stride, m.padding, m.dilation), rows)
            return sw.columns(conv, 1)
        y = sw.local_conv2d(comm.reduce_grad(x), m.stride, m.padding, m.dilation)
        return comm.all_gather_cat_same_loss(with_bias(y, sw.rows), 1, sizes=sw.sizes)

    return forward


TP = shards.Strategy("tp", whole_reason=whole_reason, model_forward=column_parallel_forward)
