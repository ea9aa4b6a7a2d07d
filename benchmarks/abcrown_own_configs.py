"""α,β-CROWN's own configs through the plugin at P = 1, 2 (and 3 for one instance): verdict, wall time
and per-rank peak, with the work split over the ranks.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_own_configs.py \
        [--only acasxu] [--timeout 300] [--out benchmarks/results/abcrown_own_configs]

Each config is α,β-CROWN's own file from the checkout (``complete_verifier/exp_configs``), run as a user
runs it here: ``root_path``/``csv_name`` dropped, ``--device cpu``, ``fsdp`` over gloo ranks:

* ``acasxu``: ``vnncomp21/acasxu.yaml`` (what α,β-CROWN's ``vnncomp_main.py`` uses for ``acasxu_2023``:
  input-split BaB, clip-and-verify on the boxes, the attack every round) on 8 ACAS Xu instances;
* ``mip``: ``vnncomp22/mnistfc_small.yaml`` (``complete_verifier: mip``) on mnist-net_256x2;
* ``refine``: ``vnncomp22/mnistfc.yaml`` (``bab-refine``: MIP-refined layers, then BaB) on 256x4;
* ``clip``: ``vnncomp25/cifar100.yaml`` (clip-and-verify in activation BaB) on oval21;
* ``biccos``: ``BICCOS/oval22/biccos_only_cs.yaml`` (BICCOS cuts, multi-tree branching as
  ``auto_param`` decides) on oval21;
* ``tp``: ``vnncomp22/resnet_A.yaml`` (its convs in ``conv_mode: patches``) on sri_resnet_a, P > 1 under
  ``tp`` (the other sets: ``fsdp``).

Compared: the verdict (``wrong`` if it differs from the benchmark's known one, where that is sat or
unsat, or from P = 1's), the wall time of the whole command, and each rank's peak. Writes
``<out>.json`` (every run, with provenance) and ``<out>.md``; a rerun keeps the runs already there
(``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from abcrown_common import BENCH, checkout, run_abcrown, vendor_config
from measure import REPO, provenance

ACAS = [("1_1", "prop_1"), ("2_7", "prop_1"), ("4_2", "prop_2"), ("3_3", "prop_9"), ("4_5", "prop_10"),
        ("1_1", "prop_5"), ("1_1", "prop_6"), ("3_6", "prop_2")]  # fmt: skip
RESNET_A = "onnx/resnet_3b2_bn_mixup_adv_4.0_bs128_lr-1.onnx"
SETS = {
    "acasxu": ("vnncomp21/acasxu.yaml", "acasxu",
               [(f"onnx/ACASXU_run2a_{n}_batch_2000.onnx", f"vnnlib/{p}.vnnlib") for n, p in ACAS]),
    "mip": ("vnncomp22/mnistfc_small.yaml", "mnist_fc",
            [("onnx/mnist-net_256x2.onnx", f"vnnlib/prop_{i}.vnnlib") for i in ("9_0.05", "3_0.03")]),
    "refine": ("vnncomp22/mnistfc.yaml", "mnist_fc",
               [("onnx/mnist-net_256x4.onnx", "vnnlib/prop_3_0.05.vnnlib")]),
    "biccos": ("BICCOS/oval22/biccos_only_cs.yaml", "oval21",
               [("onnx/cifar_base_kw.onnx", "vnnlib/cifar_base_kw-img4763-eps0.024705882352941175.vnnlib"),
                ("onnx/cifar_base_kw.onnx", "vnnlib/cifar_base_kw-img8194-eps0.018300653594771243.vnnlib")]),
    "tp": ("vnncomp22/resnet_A.yaml", "sri_resnet_a",
           [(RESNET_A, "vnnlib/cifar10_spec_idx_8356_eps_0.00350.vnnlib"),
            (RESNET_A, "vnnlib/cifar10_spec_idx_1551_eps_0.00198.vnnlib")]),
    "clip": ("vnncomp25/cifar100.yaml", "oval21",
             [("onnx/cifar_base_kw.onnx", "vnnlib/cifar_base_kw-img4763-eps0.024705882352941175.vnnlib"),
              ("onnx/cifar_base_kw.onnx", "vnnlib/cifar_base_kw-img8194-eps0.018300653594771243.vnnlib")]),
}  # fmt: skip
THREE = ("acasxu", 0)  # the one instance also run at P = 3


def user_config(root: Path, rel: str, tmp: Path) -> Path:
    data = vendor_config(root, rel)
    path = tmp / rel.replace("/", "_")
    path.write_text(yaml.safe_dump(data))
    return path


def expected(folder: str, onnx: str, vnnlib: str) -> str:
    import csv

    with open(BENCH / folder / "verdicts.csv") as f:
        for row in csv.DictReader(f):
            if row["onnx"] == onnx and row["vnnlib"] == vnnlib:
                return row["expected"]
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=list(SETS))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_own_configs"))
    args = ap.parse_args()
    root, out = checkout(), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = (
        {}
        if args.fresh or not out.with_suffix(".json").exists()
        else json.loads(out.with_suffix(".json").read_text())
    )
    runs = done.get("runs", [])
    have = {(r["set"], r["onnx"], r["vnnlib"], r["P"]) for r in runs}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name in args.only:
            rel, folder, instances = SETS[name]
            cfg = user_config(root, rel, tmp)
            for i, (onnx, vnnlib) in enumerate(instances):
                for P in (1, 2, 3) if (name, i) == THREE else (1, 2):
                    if (name, onnx, vnnlib, P) in have:
                        continue
                    files = [
                        "--onnx_path",
                        str(BENCH / folder / onnx),
                        "--vnnlib_path",
                        str(BENCH / folder / vnnlib),
                    ]
                    cmd = ["--config", str(cfg), *files, "--timeout", str(args.timeout)]
                    mode = "tp" if name == "tp" else "fsdp"
                    s = run_abcrown(cmd, tmp, args.timeout * 2 + 120, world=P, mode=mode)
                    bab = s.get("bab") or {}
                    runs.append({
                        "set": name, "config": rel, "onnx": onnx, "vnnlib": vnnlib, "P": P, "mode": mode,
                        "expected": expected(folder, onnx, vnnlib), "verdict": s.get("verdict", "error"),
                        "error": s.get("error"), "wall_s": s.get("wall_s"), "peak_mb": s.get("peak_mb"),
                        "bab_domains": bab.get("domains"),
                    })  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
                    out.with_suffix(".json").write_text(
                        json.dumps({"runs": runs, "provenance": provenance()}, indent=1)
                    )
    out.with_suffix(".md").write_text(table(runs, provenance(), args.timeout))


def wrong(run: dict, p1: dict | None) -> bool:
    v = run["verdict"]
    if v in ("sat", "unsat") and run["expected"] in ("sat", "unsat") and v != run["expected"]:
        return True
    return (
        p1 is not None and v in ("sat", "unsat") and p1["verdict"] in ("sat", "unsat") and v != p1["verdict"]
    )


def table(runs: list[dict], meta: dict, timeout: float) -> str:
    p1 = {(r["set"], r["onnx"], r["vnnlib"]): r for r in runs if r["P"] == 1}
    bad = sum(wrong(r, p1.get((r["set"], r["onnx"], r["vnnlib"]))) for r in runs)
    same = sum(
        1
        for r in runs
        if r["P"] > 1 and r["verdict"] == p1.get((r["set"], r["onnx"], r["vnnlib"]), {}).get("verdict")
    )
    lines = [
        f"# α,β-CROWN's own configs through the plugin, P = 1, 2 (3), {timeout:.0f} s per instance",
        "",
        f"commit {meta['commit']}, `{meta['command']}`, {meta['machine']}",
        "",
        f"* {len(runs)} runs, **{bad} wrong**; {same} of {sum(r['P'] > 1 for r in runs)} runs at P > 1 "
        "give P = 1's verdict",
        "",
        "| config | instance | expected | P | mode | verdict | BaB domains | wall (s) | peak MB per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        inst = f"{Path(r['onnx']).stem} {Path(r['vnnlib']).stem[:32]}"
        peak = " / ".join(f"{v:.0f}" for v in r["peak_mb"] or [])
        verdict = r["verdict"] + (f" ({r['error']})" if r.get("error") else "")
        domains = r["bab_domains"] if r["bab_domains"] is not None else ""
        mode = r.get("mode", "fsdp") if r["P"] > 1 else ""
        head = f"| {r['config']} | {inst} | {r['expected']} | {r['P']} | {mode} | {verdict} | {domains} | "
        lines.append(f"{head}{r['wall_s']} | {peak} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
