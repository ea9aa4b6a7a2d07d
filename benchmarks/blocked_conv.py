"""What tp's products cost on this CPU: a convolution's backward product by weight shards against one
product with the whole weight.

Under ``tp`` no rank builds a whole weight: CROWN's backward product through a conv layer,
``conv_transpose2d(A, W)``, is the sum over the P weight shards (rows of W: blocks of the layer's output
channels) of ``conv_transpose2d(A[:, block], W_q)``, each taken as its shard comes round the ring
(``parallel/sharded.py``, ``_Transposed.accumulate``: the first block's result, then each next one
added in place); α-CROWN's gradient runs the adjoint, ``conv2d(G, W_q)`` per block, into its block of
the result (``ShardedWeight._adjoint``). Every block writes a result the size of the whole product,
so on a CPU whose convolutions are bound by their output the P blocks cost up to P whole products.
``fsdp`` gathers the weight and runs one product, as one process does.

Here the shards are the blocks of one tensor (no ring, no collective: only the arithmetic of the
products), on dense A-matrices of the layer shapes of ``conv_scale.py``'s CNN7 at width ``--width``
(c = 16 by default; rows of a pass × output channels × map) and on auto_LiRPA's patches (the same
products on a batch of small windows, how α,β-CROWN bounds conv layers by default), with ``--threads``
torch threads (1: a rank's share of this 2-core machine at P = 2). Median of ``--repeat`` runs, in ms.

    python benchmarks/blocked_conv.py [--width 16] [--threads 1] [--repeat 9] [--out DIR]

Writes ``blocked_conv.{md,json}`` into ``--out`` (``benchmarks/results/blocked_conv``) with the commit
and command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from complete_verifier_ext.parallel.sharded import conv_output_padding, conv_t

REPO = Path(__file__).resolve().parents[1]


def shapes(c: int) -> list[tuple]:
    """(name, rows N, output channels, input channels, output map side, kernel, stride, padding) of the
    CNN7's conv layers at width ``c`` (channels c, c, 2c stride 2, 2c, 2c)."""
    return [
        (f"dense: conv2 of cnn7-c{c}", 128, c, c, 32, 3, 1, 1),
        ("dense: conv3 (stride 2)", 128, 2 * c, c, 16, 3, 2, 1),
        ("dense: conv4", 128, 2 * c, 2 * c, 16, 3, 1, 1),
        ("patches 3x3: conv4", 8192, 2 * c, 2 * c, 3, 3, 1, 0),
        ("patches 5x5: conv4", 8192, 2 * c, 2 * c, 5, 3, 1, 0),
        ("patches 7x7: conv3 (stride 2)", 4096, 2 * c, c, 7, 3, 2, 0),
        ("patches 9x9: conv2", 2048, c, c, 9, 3, 1, 0),
    ]


def _ms(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def one(shape: tuple, worlds: list[int], repeat: int) -> list[dict]:
    """The shape's whole products and, for each P, its blocked ones, timed in turns (``repeat`` rounds
    after two warm-up rounds: every variant meets the same allocator and caches); medians in ms."""
    name, n, c_out, c_in, side, k, s, p = shape
    g = torch.Generator().manual_seed(0)
    A = torch.randn(n, c_out, side, side, generator=g)
    W = torch.randn(c_out, c_in, k, k, generator=g)
    in_side = (side - 1) * s - 2 * p + k if name.startswith("patches") else side * s
    pad = conv_output_padding((in_side, in_side), (side, side), (k, k), (s, s), (p, p), (1, 1))
    kind = conv_t((s, s), (p, p), (1, 1), pad)
    G = kind.apply(A, W)
    variants = {"product": lambda: kind.apply(A, W), "adjoint": lambda: kind.adjoint(G, W)}
    for P in worlds:
        sizes = [c_out // P + (q < c_out % P) for q in range(P)]
        starts = [sum(sizes[:q]) for q in range(P)]
        blocks = [
            (a, A.narrow(1, a, m), W.narrow(0, a, m).contiguous()) for a, m in zip(starts, sizes, strict=True)
        ]

        def blocked(blocks=blocks):  # tp's product: each block's result added into the first's
            out = None
            for _, A_q, W_q in blocks:
                out = kind.accumulate(out, A_q, W_q)
            return out

        def adjoint_blocked(blocks=blocks):  # tp's adjoint: each block's result into its block
            grad = G.new_empty(A.shape)
            for a, A_q, W_q in blocks:
                grad.narrow(1, a, A_q.shape[1]).copy_(kind.adjoint(G, W_q))
            return grad

        err = (blocked() - G).abs().max().item() / G.abs().max().item()
        assert err < 1e-5, (name, P, err)  # the same product
        variants[f"product {P}"], variants[f"adjoint {P}"] = blocked, adjoint_blocked
    times: dict[str, list[float]] = {key: [] for key in variants}
    for r in range(repeat + 2):
        for key, f in variants.items():
            t = _ms(f)
            if r >= 2:
                times[key].append(t)
    med = {key: round(statistics.median(v), 2) for key, v in times.items()}
    return [
        {"shape": name, "P": P, "A": list(A.shape), "W": list(W.shape), "product_ms": med["product"],
         "blocked_ms": med[f"product {P}"], "adjoint_ms": med["adjoint"],
         "adjoint_blocked_ms": med[f"adjoint {P}"]}
        for P in worlds
    ]  # fmt: skip


def main() -> None:
    from measure import provenance

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=16, help="the CNN7's c (cnn7: 64, wide_cnn7: 128)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "blocked_conv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for shape in shapes(args.width) for row in one(shape, args.worlds, args.repeat)]
    prov = provenance()
    onednn = "on" if torch.backends.mkldnn.enabled else "off"
    lines = [
        f"# tp's blocked convolution products against one whole product (CNN7 at c = {args.width})",
        "",
        f"Commit `{prov['commit']}`, command `{prov['command']}`; {prov['machine']}; torch "
        f"{torch.__version__}, {args.threads} thread(s), oneDNN {onednn}; median of {args.repeat} rounds, "
        "the variants timed in turns. `× whole`: the P blocks' time over one product with the whole weight.",
        "",
        "| shape | A | W | P | product ms | P blocks ms | × whole | adjoint ms | P blocks ms | × whole |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        whole, adjoint = r["product_ms"], r["adjoint_ms"]
        lines.append(
            f"| {r['shape']} | {'×'.join(map(str, r['A']))} | {'×'.join(map(str, r['W']))} | {r['P']} | "
            f"{whole} | {r['blocked_ms']} | {r['blocked_ms'] / whole:.2f} | "
            f"{adjoint} | {r['adjoint_blocked_ms']} | {r['adjoint_blocked_ms'] / adjoint:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "blocked_conv.md").write_text(text)
    (out / "blocked_conv.json").write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
