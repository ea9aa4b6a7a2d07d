"""The plugin's cost at P = 1 against unpatched α,β-CROWN, and BaB domains per second at P = 1 and 2.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_overhead.py [--repeats 3]

Overhead: each instance runs ``--repeats`` times through unpatched α,β-CROWN (its own ``abcrown.py``,
with onnx2pytorch and our torchvision stand-in on the path: ``locate.activate``, nothing patched) and
through the plugin at P = 1 (``abcrown --general.engine abcrown``), alternating which goes first, each a
fresh process timed from outside (start-up included, as VNN-COMP counts it): the median and the
fastest of the repeats. Instances: mnist_fc 256x2 (α-CROWN then BaB), oval21 cifar_base_kw
(α,β-CROWN's ``BICCOS/oval22/beta.yaml``: β-CROWN BaB on a conv net; its ``oval22.yaml`` asks for
CPLEX cuts, absent here), ACAS Xu 1_1 prop_1 (``acasxu.yaml``: input split).

Domains per second: the plugin's summary (``bab.domains`` / ``bab.time_s``) at P = 1 and P = 2 (fsdp)
on mnist-net_256x6 prop_2_0.05 (an MLP) and oval21 (the conv net), each with a fixed time limit.

Writes ``results/abcrown_overhead/abcrown_overhead.{json,md,png}`` with the commit and command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, checkout, run_abcrown
from measure import REPO, provenance

EXP = "complete_verifier/exp_configs"
MNIST_BAB = """general:
  device: cpu
  complete_verifier: bab
solver:
  batch_size: 64
  alpha-crown:
    iteration: 20
bab:
  timeout: {timeout}
attack:
  pgd_order: skip
"""


def instances(tmp: Path, root: Path) -> list[dict]:
    mnist, oval, acas = BENCH / "mnist_fc", BENCH / "oval21", BENCH / "acasxu"
    mnist_cfg = tmp / "mnist_bab.yaml"
    mnist_cfg.write_text(MNIST_BAB.format(timeout=120))
    return [
        {
            "name": "mnist 256x2 prop_9_0.05 (α-CROWN, BaB)",
            "config": str(mnist_cfg),
            "onnx": mnist / "onnx" / "mnist-net_256x2.onnx",
            "vnnlib": mnist / "vnnlib" / "prop_9_0.05.vnnlib",
        },
        {
            "name": "oval21 base img4763 (BICCOS/oval22/beta.yaml, conv BaB)",
            "config": str(root / EXP / "BICCOS" / "oval22" / "beta.yaml"),
            "onnx": oval / "onnx" / "cifar_base_kw.onnx",
            "vnnlib": oval / "vnnlib" / "cifar_base_kw-img4763-eps0.024705882352941175.vnnlib",
        },
        {
            "name": "ACAS Xu 1_1 prop_1 (acasxu.yaml, input split)",
            "config": str(root / EXP / "vnncomp21" / "acasxu.yaml"),
            "onnx": acas / "onnx" / "ACASXU_run2a_1_1_batch_2000.onnx",
            "vnnlib": acas / "vnnlib" / "prop_1.vnnlib",
        },
    ]


UNPATCHED = """
import runpy, sys
from complete_verifier_ext.abcrown_plugin import locate
checkout = locate.find()
locate.activate(checkout)  # its folders on sys.path and the torchvision stand-in; nothing patched
sys.argv = ["abcrown.py", *sys.argv[1:]]
runpy.run_path(str(checkout.complete_verifier / "abcrown.py"), run_name="__main__")
"""


def _args(inst: dict, tmp: Path, verifier_timeout: float = 300) -> list[str]:
    return [
        "--config",
        inst["config"],
        "--onnx_path",
        str(inst["onnx"]),
        "--vnnlib_path",
        str(inst["vnnlib"]),
        "--device",
        "cpu",
        "--results_file",
        str(tmp / "out.txt"),
        "--timeout",
        str(verifier_timeout),
    ]


def run_unpatched(
    inst: dict, tmp: Path, env: dict | None = None, timeout: float = 900, verifier_timeout: float = 300
) -> dict:
    """α,β-CROWN's own ``abcrown.py`` (nothing patched): verdict and wall time; ``env`` added to the
    environment (the plugin's runs' ``EXACT_MEMORY_ENV`` where the two are timed side by side);
    ``verifier_timeout``: its ``--timeout`` (``bab.timeout``, which also limits α-CROWN's time: the
    plugin runs it is compared with must have the same)."""
    cmd = [sys.executable, "-c", UNPATCHED, *_args(inst, tmp, verifier_timeout)]
    t0 = time.monotonic()
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env={**os.environ, **(env or {})}
    )
    wall = time.monotonic() - t0
    verdict = (
        (tmp / "out.txt").read_text().split("\n", 1)[0].strip() if (tmp / "out.txt").exists() else "none"
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200], "wall_s": wall}
    return {"verdict": verdict, "wall_s": wall}


def run_plugin(inst: dict, tmp: Path, world: int = 1) -> dict:
    res = run_abcrown(_args(inst, tmp), tmp, 900, world=world)
    if "error" in res:
        return res
    return {
        "verdict": res["verdict"],
        "wall_s": res["wall_s"],
        "bab": res.get("bab"),
    }


def overhead(root: Path, repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for inst in instances(tmp, root):
            runs = {"unpatched": [], "plugin": []}
            for k in range(repeats):
                order = ("unpatched", "plugin") if k % 2 == 0 else ("plugin", "unpatched")
                for which in order:
                    (tmp / "out.txt").unlink(missing_ok=True)
                    r = run_unpatched(inst, tmp) if which == "unpatched" else run_plugin(inst, tmp)
                    runs[which].append(r)
                    print(
                        f"{inst['name'][:40]:40s} {which:9s} {r.get('verdict', r.get('error'))} "
                        f"{r.get('wall_s', 0):.1f} s",
                        flush=True,
                    )
            rows.append({"instance": inst["name"], **runs})
    return rows


def domains_per_second(root: Path) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        mnist6 = {
            "name": "mnist-net_256x6 prop_2_0.05 (MLP)",
            "config": str(tmp / "bab.yaml"),
            "onnx": BENCH / "mnist_fc" / "onnx" / "mnist-net_256x6.onnx",
            "vnnlib": BENCH / "mnist_fc" / "vnnlib" / "prop_2_0.05.vnnlib",
        }
        (tmp / "bab.yaml").write_text(MNIST_BAB.format(timeout=60))
        oval = {**instances(tmp, root)[1], "name": "oval21 base img4763 (conv)"}
        for inst in (mnist6, oval):
            for world in (1, 2):
                r = run_plugin(inst, tmp, world)
                bab = r.get("bab") or {}
                rate = bab["domains"] / bab["time_s"] if bab.get("time_s") else None
                rows.append({"instance": inst["name"], "P": world, **r, "domains_per_s": rate})
                print(
                    f"{inst['name']:40s} P={world} {r.get('verdict', r.get('error'))} "
                    f"domains {bab.get('domains')} "
                    f"in {bab.get('time_s')} s: {rate}",
                    flush=True,
                )
    return rows


def _median(rs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table(over: list[dict], rates: list[dict]) -> str:
    lines = [
        "| instance | verdict (unpatched / plugin) | wall s, median (unpatched / plugin) | overhead | "
        "wall s, fastest (unpatched / plugin) | overhead |",
        "|---|---|---|---|---|---|",
    ]
    for row in over:
        u, p = row["unpatched"], row["plugin"]
        wu, wp = _median(u, "wall_s"), _median(p, "wall_s")
        tu, tp = min(r["wall_s"] for r in u), min(r["wall_s"] for r in p)
        both = [{r.get("verdict", "error") for r in rs} for rs in (u, p)]
        verdicts = " / ".join("/".join(sorted(v)) for v in both)
        lines.append(
            f"| {row['instance']} | {verdicts} | {wu:.1f} / {wp:.1f} | {100 * (wp / wu - 1):+.1f}% | "
            f"{tu:.2f} / {tp:.2f} | {100 * (tp / tu - 1):+.1f}% |"
        )
    if rates:
        lines += ["", "| instance | P | verdict | BaB domains | BaB s | domains/s |"]
        lines += ["|---|---|---|---|---|---|"]
    for r in rates:
        bab = r.get("bab") or {}
        rate = f"{r['domains_per_s']:.0f}" if r.get("domains_per_s") else "-"
        lines.append(
            f"| {r['instance']} | {r['P']} | {r.get('verdict', r.get('error'))} | {bab.get('domains')} | "
            f"{bab.get('time_s')} | {rate} |"
        )
    return "\n".join(lines) + "\n"


def plot(over: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["instance"].split(" (")[0] for r in over]
    for k, which in enumerate(("unpatched", "plugin")):
        vals = [_median(r[which], "wall_s") for r in over]
        ax.bar([i + 0.4 * k for i in range(len(over))], vals, width=0.4, label=which)
    ax.set_xticks([i + 0.2 for i in range(len(over))], names, fontsize=8)
    ax.set_ylabel("wall s (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-rates", action="store_true", help="the overhead table only (no domains/s runs)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_overhead"))
    args = ap.parse_args()
    root = checkout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    over = overhead(root, args.repeats)
    rates = [] if args.no_rates else domains_per_second(root)
    data = {"provenance": provenance(), "overhead": over, "domains_per_second": rates}
    (out / "abcrown_overhead.json").write_text(json.dumps(data, indent=1, default=str))
    prov = data["provenance"]
    text = table(over, rates)
    (out / "abcrown_overhead.md").write_text(
        "# The plugin at P = 1 against unpatched α,β-CROWN; BaB domains/s at P = 1 and 2\n\n"
        f"commit {prov['commit']}, `{prov['command']}`, {prov['machine']}; "
        f"each instance {args.repeats} times "
        "per variant, alternating which runs first; wall time from outside (start-up included)\n\n" + text
    )
    plot(over, out / "abcrown_overhead.png")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
