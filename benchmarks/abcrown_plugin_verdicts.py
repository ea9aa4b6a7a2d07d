"""BaB verdicts inside α,β-CROWN with the domain list split over the ranks, against unpatched α,β-CROWN.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_plugin_verdicts.py \
        [--worlds 2 3] [--timeout 150] [--only mnist_fc] [--small | --gpu-s LO HI] \
        [--out benchmarks/results/abcrown_plugin_verdicts]

Instances (``../shared/benchmarks``): the mnist_fc 256x4 and 256x6 instances that α,β-CROWN could not
verify without BaB at VNN-COMP 2022 (its GPU time above 10 s), cheapest first, and two oval21; with
``--small``, the 256x2 ones (above 9 s); with ``--gpu-s LO HI``, the sat and unsat 256x4/6 (with
``--small``: 256x2) ones whose GPU time lies in (LO, HI] (e.g. 7.2 10: those BaB may or may not be
needed for on this machine; P > 1 runs only where P = 1 visited domains). Each runs α,β-CROWN's
own VNN-COMP 2022 config (``mnistfc.yaml``, ``mnistfc_small.yaml`` for 256x2, ``oval22.yaml``) with
``--device cpu``,
``--timeout T`` and plain BaB: ``--complete_verifier bab`` for mnist_fc (its ``bab-refine`` needs
MIP, refused under P > 1) and ``--bab.cut.enabled false`` for oval21 (no CPLEX here).

P = 1 is α,β-CROWN unpatched (the plugin's read-only probe only); P > 1 runs only where P = 1 finished
(a verdict to compare with), with a limit of twice P = 1's wall time plus 60 s (two cores: P = 3 shares
them). Compared: the verdict (``wrong`` if it differs from P = 1's or from the benchmark's expected
one), the domains BaB visited, and the BaB time. Writes ``abcrown_plugin_verdicts[_small][_CATEGORY].json``
and a table of every JSON in ``--out``, ``abcrown_plugin_verdicts.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

from abcrown_common import BENCH, CONFIGS, REPO, checkout, instance_label, run_abcrown
from measure import provenance

OVAL = [
    ("cifar_base_kw.onnx", "cifar_base_kw-img8194-eps0.018300653594771243.vnnlib"),
    ("cifar_deep_kw.onnx", "cifar_deep_kw-img7878-eps0.009934640522875817.vnnlib"),
]


def instances(
    small: bool = False, gpu_s: tuple[float, float] | None = None
) -> list[tuple[str, str, str, str]]:
    """(category, expected, onnx, vnnlib): mnist_fc 256x4/6 (or, ``small``, 256x2) needing BaB,
    cheapest first, then oval21 (not with ``small``). ``gpu_s``: the sat and unsat mnist_fc instances
    whose VNN-COMP 2022 GPU time lies in ``(lo, hi]`` instead (no oval21)."""
    rows = list(csv.DictReader((BENCH / "mnist_fc" / "verdicts.csv").open()))
    lo, hi = gpu_s or ((9.0 if small else 10.0), float("inf"))

    def needs_bab(r: dict) -> bool:  # a band also takes the sat ones (BaB may find the counterexample)
        wanted = ("sat", "unsat") if gpu_s else ("unsat",)
        return r["expected"] in wanted and lo < float(r["abcrown_vnncomp2022_gpu_time_s"]) <= hi

    hard = [r for r in rows if ("256x2" in r["onnx"]) == small and needs_bab(r)]
    hard.sort(key=lambda r: float(r["abcrown_vnncomp2022_gpu_time_s"]))
    out = [("mnist_fc", r["expected"], Path(r["onnx"]).name, Path(r["vnnlib"]).name) for r in hard]
    if small or gpu_s:
        return out
    oval = {
        Path(r["vnnlib"]).name: r["expected"]
        for r in csv.DictReader((BENCH / "oval21" / "verdicts.csv").open())
    }
    return out + [("oval21", oval[spec], onnx, spec) for onnx, spec in OVAL]


def run_one(path: Path, inst: tuple, world: int, timeout: float, tmp: Path) -> dict:
    category, _, onnx, spec = inst
    config = {"mnist_fc": "mnistfc_small.yaml" if "256x2" in onnx else "mnistfc.yaml"}.get(
        category, "oval22.yaml"
    )
    args = ["--config", str(path / CONFIGS / config), "--device", "cpu", "--timeout", str(int(timeout))]
    args += ["--onnx_path", str(BENCH / category / "onnx" / onnx)]
    args += ["--vnnlib_path", str(BENCH / category / "vnnlib" / spec), "--results_file", str(tmp / "out.txt")]
    args += ["--complete_verifier", "bab"] if category == "mnist_fc" else ["--bab.cut.enabled", "false"]
    s = run_abcrown(args, tmp, timeout=3 * timeout + 120, world=world)
    if "error" in s:
        return s
    bab = s.get("bab") or {}
    return {
        "verdict": s["verdict"],
        "domains": bab.get("domains", 0),
        "bab_s": bab.get("time_s"),
        "wall_s": s["wall_s"],
    }


FINISHED = ("sat", "unsat")


def table(rows: list[dict]) -> str:
    out = [
        "| category | instance | expected | P | verdict | domains | BaB s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['category']} | {instance_label(r)} | {r['expected']} | {r['P']} |"
        if "error" in r:
            out.append(f"{head} error: {r['error']} | | | |")
            continue
        out.append(
            f"{head} {r['verdict']}{' **wrong**' if r.get('wrong') else ''} | {r['domains']} | "
            f"{r['bab_s']} | {r['wall_s']} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--timeout", type=float, default=150, help="α,β-CROWN's --timeout at P = 1")
    ap.add_argument("--only", nargs="*", default=None, help="categories (default: all)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many instances per category")
    ap.add_argument("--small", action="store_true", help="the 256x2 instances that need BaB instead")
    ap.add_argument(
        "--gpu-s",
        type=float,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="the sat/unsat mnist_fc instances with VNN-COMP 2022 GPU time in (LO, HI] instead; P > 1 "
        "runs only where P = 1 needed BaB",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_plugin_verdicts"))
    ap.add_argument("--report", action="store_true", help="only write the table from --out's JSON files")
    a = ap.parse_args()
    if a.report:
        return write_report(Path(a.out))
    path = checkout()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta, rows = provenance(), []
    stem = (
        "abcrown_plugin_verdicts"
        + ("_small" if a.small else "")
        + (f"_gpu{a.gpu_s[0]:g}-{a.gpu_s[1]:g}s" if a.gpu_s else "")
        + (f"_{'_'.join(a.only)}" if a.only else "")
    )
    todo = [i for i in instances(a.small, a.gpu_s) if not a.only or i[0] in a.only]
    if a.limit:
        todo = [
            i for c in dict.fromkeys(i[0] for i in todo) for i in [j for j in todo if j[0] == c][: a.limit]
        ]
    with tempfile.TemporaryDirectory() as d:
        for inst in todo:
            base = None
            for P in [1, *a.worlds]:
                if P > 1 and (base is None or base.get("verdict") not in FINISHED):
                    break
                if P > 1 and a.gpu_s and not base.get("domains"):
                    break  # verified without BaB
                limit = a.timeout if P == 1 else 2 * base["wall_s"] + 60
                r = {"category": inst[0], "expected": inst[1], "onnx": inst[2], "vnnlib": inst[3], "P": P}
                r.update(run_one(path, inst, P, limit, Path(d)))
                verdict = r.get("verdict")
                r["wrong"] = verdict in FINISHED and (
                    verdict != inst[1] or (base is not None and verdict != base["verdict"])
                )
                base = base or r
                rows.append(r)
                print(json.dumps(r), flush=True)
                (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    write_report(out)


def write_report(out: Path) -> None:
    """``abcrown_plugin_verdicts.md`` from every ``*.json`` in ``out`` (one section per run)."""
    md = ["# BaB verdicts inside alpha-beta-CROWN, domain list split over the ranks", ""]
    md += [
        "α,β-CROWN's VNN-COMP 2022 configs with plain BaB (mnist_fc `--complete_verifier bab`, oval21 cuts "
        "off), `--device cpu`; P = 1 is α,β-CROWN unpatched, P > 1 the plugin (`fsdp`, gloo), run only "
        "where P = 1 finished.",
        "",
    ]
    wrong = 0
    for path in sorted(out.glob("*.json")):
        run = json.loads(path.read_text())
        wrong += sum(bool(r.get("wrong")) for r in run["rows"])
        md += [
            f"## `{path.name}`",
            "",
            f"Commit `{run['commit']}`; command `{run['command']}`; {run['machine']}.",
        ]
        md += ["", table(run["rows"]), ""]
    md.append(f"Wrong verdicts: {wrong}.")
    (out / "abcrown_plugin_verdicts.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
