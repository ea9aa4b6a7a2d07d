"""Proofs with every ``unsat`` (``general.proof``, ``docs/proofs.md``): how many are written and valid,
their size, what writing them costs the verifier, and what checking them costs the independent checker.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/proofs.py \\
        [--suites acasxu mnist_fc oval21 sri_resnet_a vnnlib2 vnncomp] \\
        [--engines native abcrown] [--ranks 1 2] [--repeat N] [--limit N] \\
        [--acasxu DIR --acasxu-results CSV] [--vnncomp DIR --vnncomp-results CSV] \\
        [--match REGEX] [--every K] [--timeout 120] \\
        [--abcrown-set KEY=VALUE ...] [--out benchmarks/results/proofs]

Instances: the known ``unsat`` ones of ``../shared/benchmarks/SUITE/verdicts.csv`` (mnist_fc 256x2 and
256x4, oval21, sri_resnet_a, ACAS Xu's); with ``--acasxu DIR`` (a VNN-COMP 2022 ``acasxu`` folder:
all 45 networks, properties 1–4 and more) and ``--acasxu-results`` (an official results csv), the
ACAS Xu instances of properties 1–4 that the csv answers ``unsat``. ``--match REGEX``: the instances
whose ``onnx|vnnlib`` names it finds; ``--every K``: every K-th of those; ``--limit N``: the first N
of each suite. ``vnnlib2``: VNN-LIB 2.0 queries of one network and of two
(:func:`vnnlib2_instances`). ``vnncomp``: a VNN-COMP category folder ``--vnncomp DIR`` (its
``instances.csv``, files plain or ``.gz``; e.g. VNN-COMP 2024's ``dist_shift_2023``), the instances
that the official results csv ``--vnncomp-results`` answers ``unsat``, under the category's name; its
configs are the ones the VNN-COMP scripts pick (α,β-CROWN's for the category,
``abcrown_plugin.vnncomp``; ours ``configs/CATEGORY.yaml`` or ``default.yaml``).

Each instance, engine and P: the verifier once without and once with ``--general.proof`` (a fresh
process each, the native engine through its resident worker; the instance's own time from its
``--summary``, start-up left out; ``--repeat N``: N times each, in the order without, with, with,
without, …, and the median time of each: one run of each can differ by 10% on this machine's noise
alone), then ``complete-verifier-ext check --workers P`` (the leaves dealt over as many processes as
the run had ranks). The configs: the native engine's bundled ``configs/SUITE.yaml``; α,β-CROWN's own
``vnncomp21/acasxu.yaml``, ``vnncomp22/mnistfc.yaml``, ``vnncomp22/oval22.yaml`` and
``vnncomp22/resnet_A.yaml``, with and without a proof alike without MILP refinement and cuts
(``ABCROWN_OFF``: no proof can carry their bounds); ``--abcrown-set
solver.bound_prop_method=alpha-crown``: a key of α,β-CROWN's config changed in every run. Recorded:
both verdicts and times, the proof's size, the checker's answer, time, leaves, and how many it closed
by the leaves' own bounds or by its LP fallback. The checker's time is given with its process start-up
(``check_s``, the wall time of the command, about 1.5 s of it importing onnx, numpy and HiGHS) and
without (``check_inner_s``, what it reports), the latter comparable to the verifier's own time (its
``--summary``, start-up left out). Writes ``proofs.json`` (every row, with provenance; kept rows are
not run again), ``proofs.md`` and ``proofs.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import csv
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from abcrown_common import BENCH, REPO
from conformance import official, within
from measure import provenance, run_summarized

from complete_verifier_ext.spec.networks import label

CONFIGS = {"acasxu": "acasxu.yaml", "mnist_fc": "mnist_fc.yaml", "oval21": "oval21.yaml",
           "sri_resnet_a": "sri_resnet_a.yaml", "vnnlib2": "acas_xu_vnnlib2.yaml"}  # fmt: skip
ABCROWN_CONFIGS = {"acasxu": "vnncomp21/acasxu.yaml", "mnist_fc": "vnncomp22/mnistfc.yaml",
                   "oval21": "vnncomp22/oval22.yaml", "sri_resnet_a": "vnncomp22/resnet_A.yaml",
                   "vnnlib2": "vnncomp21/acasxu.yaml"}  # fmt: skip
# vnnlib2's two-network queries: a net and its pruned copy (../shared/benchmarks/vnnlib2/acasxu_isomorphic,
# the box of its query) whose first outputs differ by at least this much
GAP = 0.2
# with and without a proof alike: the steps whose bounds no proof can carry (MILP refinement; cuts,
# whose CPLEX is absent here) left out, so that the two runs search alike
ABCROWN_OFF = {"mnist_fc": ["--general.complete_verifier", "bab"], "oval21": ["--bab.cut.enabled", "false"]}


def instances(suite: str, args: argparse.Namespace) -> list[dict]:
    """The suite's known ``unsat`` instances: ``{"suite", "onnx", "vnnlib", "timeout"}`` with paths
    (``onnx``: a VNN-COMP 2026 network list where ``networks`` names several)."""
    if suite == "vnnlib2":
        out = vnnlib2_instances(args.out / "queries")
    elif suite == "acasxu" and args.acasxu:
        rows = [
            r
            for r in csv.reader(args.acasxu_results.open())
            if r and r[0] == "acasxu" and "acasxu/" in r[1] and r[4] == "unsat"
        ]
        rows = list({(r[1], r[2]): r for r in rows}.values())  # a csv may list an instance twice
        at = args.acasxu
        limits = {(o, v): float(t) for o, v, t in csv.reader((at / "instances.csv").open())}
        out = [{"onnx": at / r[1].split("acasxu/")[1], "vnnlib": at / r[2].split("acasxu/")[1],
                "timeout": limits[r[1].split("acasxu/")[1], r[2].split("acasxu/")[1]]}
               for r in rows]  # fmt: skip
        out = [r for r in out if r["vnnlib"].stem in ("prop_1", "prop_2", "prop_3", "prop_4")]
        out = [{k: gzipped(v) if k != "timeout" else v for k, v in r.items()} for r in out]
    elif suite == "vnncomp":
        out = vnncomp_instances(args.vnncomp, args.vnncomp_results)
        suite = args.vnncomp.name
    else:
        folder = BENCH / suite
        rows = [r for r in csv.DictReader((folder / "verdicts.csv").open()) if r["expected"] == "unsat"]
        if suite == "mnist_fc":
            rows = [r for r in rows if "256x6" not in r["onnx"]]
        out = [{"onnx": folder / r["onnx"], "vnnlib": folder / r["vnnlib"], "timeout": float(r["timeout_s"])}
               for r in rows]  # fmt: skip
    out = [r for r in out if re.search(args.match, f"{label(str(r['onnx']))}|{r['vnnlib'].name}")]
    return [{"suite": suite, **r} for r in out[:: args.every][: args.limit or None]]


def vnncomp_instances(folder: Path, results: Path) -> list[dict]:
    """The instances of a VNN-COMP category folder that the results csv (its rows: category, onnx,
    vnnlib, …, verdict; paths within the category's folder after its name) answers ``unsat``, with the
    configs the VNN-COMP scripts would run."""
    from complete_verifier_ext.abcrown_plugin.locate import PluginError
    from complete_verifier_ext.abcrown_plugin.vnncomp import abcrown_config

    verdicts = official(results)
    ours = REPO / "configs" / f"{folder.name}.yaml"
    out = []
    for onnx, spec, timeout in csv.reader((folder / "instances.csv").open()):
        where = (folder.name, within(onnx, folder.name), within(spec, folder.name))
        if verdicts.get(where, ("",))[0] != "unsat":
            continue
        try:
            theirs = abcrown_config(Path(os.environ.get("ABCROWN_PATH", ".")), folder.name, onnx, spec)
        except PluginError as e:
            sys.exit(str(e))
        config = ours if ours.exists() else REPO / "configs" / "default.yaml"
        files = {"onnx": gzipped(folder / onnx), "vnnlib": gzipped(folder / spec)}
        out.append({**files, "timeout": float(timeout), "config": str(config), "abcrown_config": str(theirs)})
    return out


def vnnlib2_instances(folder: Path) -> list[dict]:
    """VNN-LIB 2.0: ACAS Xu properties 1 and 2 on one network where their 1.x forms are ``unsat``
    (``vnnlib2/acasxu``); and on each isomorphic pair, written into ``folder``: its query's box, both
    networks' first outputs at least ``GAP`` apart (whose verdict the runs give)."""
    one = BENCH / "vnnlib2" / "acasxu"
    known = {(r["onnx"], r["vnnlib"]) for r in csv.DictReader((BENCH / "acasxu" / "verdicts.csv").open())
             if r["expected"] == "unsat"}  # fmt: skip
    out = [{"onnx": one / o, "vnnlib": one / v, "timeout": float(t)}
           for o, v, t in csv.reader((one / "instances.csv").open()) if (o, v) in known]  # fmt: skip
    pairs = BENCH / "vnnlib2" / "acasxu_isomorphic"
    folder.mkdir(parents=True, exist_ok=True)
    for arg, query, t in csv.reader((pairs / "instances.csv").open()):
        text = (pairs / query).read_text().split("; Output Constraints")[0]
        gap = f"(assert (or (>= (- Y_g[0] Y_f[0]) {GAP}) (<= (- Y_g[0] Y_f[0]) -{GAP})))\n"
        spec = folder / f"gap_{Path(query).name}"
        spec.write_text(text + gap)
        networks = {name: pairs / path for name, path in ast.literal_eval(arg)}
        out.append({"onnx": repr([(k, str(v)) for k, v in networks.items()]), "networks": networks,
                    "vnnlib": spec, "timeout": float(t)})  # fmt: skip
    return out


def gzipped(path: Path) -> Path:
    """``path``, or ``path.gz`` where only that exists (as VNN-COMP's folders ship them)."""
    gz = path.with_name(path.name + ".gz")
    return gz if not path.exists() and gz.exists() else path


def plain(path: Path | str, tmp: Path) -> Path | str:
    """A ``.gz`` file decompressed into ``tmp`` (α,β-CROWN reads text), else the file itself (or the
    network list)."""
    if isinstance(path, str) or path.suffix != ".gz":
        return path
    out = tmp / path.stem
    if not out.exists():
        with gzip.open(path, "rb") as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def verifier(
    row: dict, engine: str, P: int, proof: Path | None, tmp: Path, timeout: float, extra: list[str]
) -> dict:
    """One run: its summary (verdict, time_s) plus the wall time, or ``{"error": ...}``; ``extra``:
    α,β-CROWN's config keys, ``KEY=VALUE``."""
    summary = tmp / "summary.json"
    onnx, spec = plain(row["onnx"], tmp), plain(row["vnnlib"], tmp)
    if engine == "native":
        cmd = [sys.executable, "-m", "complete_verifier_ext.worker", "run", "native", "cli",
               "--config", row.get("config") or str(REPO / "configs" / CONFIGS[row["suite"]]),
               "--general.csv_name", "null",
               "--model.onnx_path", str(onnx), "--specification.vnnlib_path", str(spec)]  # fmt: skip
    else:
        config = row.get("abcrown_config") or (
            Path(os.environ["ABCROWN_PATH"])
            / "complete_verifier"
            / "exp_configs"
            / ABCROWN_CONFIGS[row["suite"]]
        )
        cmd = ["abcrown", "--config", str(config), "--general.engine", "abcrown", "--device", "cpu",
               "--onnx_path", str(onnx), "--vnnlib_path", str(spec), "--general.root_path", ".",
               "--general.csv_name", "null", *ABCROWN_OFF.get(row["suite"], [])]  # fmt: skip
        for key, value in (kv.split("=", 1) for kv in extra):
            cmd += [f"--{key}", value]
    cmd += ["--bab.timeout", str(timeout), "--general.results_file", str(tmp / "out.txt"),
            "--summary", str(summary), "--quiet"]  # fmt: skip
    cmd += ["--parallel.mode", "fsdp", "--parallel.world_size", str(P)] if P > 1 else []
    cmd += ["--general.proof", str(proof)] if proof else []
    s = run_summarized(cmd, tmp, summary, timeout + 120)
    if "error" in s:
        return s
    notes = [ln for ln in s["stderr"].splitlines() if ln.startswith("note:")]
    return {"verdict": s["verdict"], "time_s": s["time_s"], "wall_s": round(s["wall_s"], 2), "notes": notes}


# the counts the checker's command reports on stderr, by their labels there
COUNTS = ("leaves", "closed by their bounds", "in halves", "by the LP fallback", "s$")


def checker(row: dict, proof: Path, tmp: Path, P: int) -> dict:
    """``complete-verifier-ext check --workers P`` on the proof: its answer, time and leaf counts."""
    networks = row.get("networks", {"N": plain(row["onnx"], tmp)})
    cmd = [sys.executable, "-m", "complete_verifier_ext.solver_cli", "check", str(plain(row["vnnlib"], tmp)),
           *(f"--network={k}={v}" for k, v in networks.items()), "--proof", str(proof),
           "--workers", str(P)]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    counts = next((ln for ln in out.stderr.splitlines() if ln.startswith("complete-verifier-ext check:")), "")
    found = {label: float(m.group(1)) for label in COUNTS if (m := re.search(rf"([\d.]+) {label}", counts))}
    leaves, by_bounds, by_halves, by_lp, seconds = (found.get(label, 0) for label in COUNTS)
    answer = out.stdout.strip() or out.stderr.strip()[-200:]
    return {"answer": answer, "check_s": round(time.monotonic() - t0, 2), "check_inner_s": seconds,
            "by_halves": int(by_halves),
            "leaves": int(leaves), "by_bounds": int(by_bounds), "by_lp": int(by_lp)}  # fmt: skip


def measure(row: dict, engine: str, P: int, timeout: float, extra: list[str], repeat: int = 1) -> dict:
    """Without and with a proof, ``repeat`` times each in the order bare, proved, proved, bare, … (a
    drift in the machine's speed then weighs on both alike), then the check of the last proof."""
    with tempfile.TemporaryDirectory(prefix="cve_proofs_") as t:
        tmp = Path(t)
        proof = tmp / "proof.json"
        runs: dict[str, list[dict]] = {"bare": [], "proved": []}
        for i in range(repeat):
            for kind in ("bare", "proved") if i % 2 == 0 else ("proved", "bare"):
                if kind == "proved":
                    proof.unlink(missing_ok=True)
                given = proof if kind == "proved" else None
                runs[kind].append(verifier(row, engine, P, given, tmp, timeout, extra))
        out = {kind: _median(r) for kind, r in runs.items()}
        if proof.exists():
            out |= {"proof_bytes": proof.stat().st_size, **checker(row, proof, tmp, P)}
    return out


def _median(runs: list[dict]) -> dict:
    """One verifier's runs as one: the last, with the median of their times (and each in ``times_s``);
    the first error, or a note where the verdicts differ."""
    bad = next((r for r in runs if "error" in r), None)
    if bad is not None or len(runs) == 1:
        return bad or runs[0]
    out = dict(runs[-1])
    for k in ("time_s", "wall_s"):
        out[k] = round(statistics.median(r[k] for r in runs), 4)
    out["times_s"] = [r["time_s"] for r in runs]
    if len({r["verdict"] for r in runs}) > 1:
        verdicts = " ".join(r["verdict"] for r in runs)
        out["notes"] = [*out["notes"], f"note: verdicts differ between runs: {verdicts}"]
    return out


def key(row: dict, engine: str, P: int) -> str:
    return f"{row['suite']}|{label(str(row['onnx']))}|{Path(row['vnnlib']).name}|{engine}|{P}"


def summarize(rows: dict) -> list[dict]:
    """Per (suite, engine, P): instances, unsat, proofs written, valid, sizes, overhead, checker/verifier."""
    groups: dict[tuple, list[dict]] = {}
    for k, r in rows.items():
        suite, _, _, engine, P = k.split("|")
        groups.setdefault((suite, engine, int(P)), []).append(r)
    out = []
    for (suite, engine, P), rs in sorted(groups.items()):
        unsat = [r for r in rs if r["proved"].get("verdict") == "unsat"]
        written = [r for r in unsat if "answer" in r]
        both = [r for r in written if r["bare"].get("verdict") == "unsat" and r["bare"]["time_s"] > 0]
        ratio = [r["proved"]["time_s"] / r["bare"]["time_s"] for r in both]
        check = [r["check_s"] / max(r["proved"]["time_s"], 1e-3) for r in written]
        inner = [r["check_inner_s"] / max(r["proved"]["time_s"], 1e-3) for r in written]
        verify_s = sum(r["proved"]["time_s"] for r in written)
        kb = [r["proof_bytes"] / 1024 for r in written]
        bare_s, proved_s = (sum(r[k]["time_s"] for r in both) for k in ("bare", "proved"))
        out.append({
            "suite": suite, "engine": engine, "P": P, "instances": len(rs), "unsat": len(unsat),
            "written": len(written), "valid": sum(r["answer"] == "valid" for r in written),
            "median_kb": round(statistics.median(kb), 1) if kb else None,
            "overhead_total": round(proved_s / bare_s, 3) if both else None,
            "overhead_median": round(statistics.median(ratio), 3) if ratio else None,
            "check_vs_verify_median": round(statistics.median(check), 2) if check else None,
            "inner_vs_verify_median": round(statistics.median(inner), 2) if inner else None,
            "inner_vs_verify_total": round(sum(r["check_inner_s"] for r in written) / verify_s, 2)
            if written and verify_s > 0 else None,
            "leaves": sum(r["leaves"] for r in written), "by_bounds": sum(r["by_bounds"] for r in written),
            "by_halves": sum(r.get("by_halves", 0) for r in written),
            "by_lp": sum(r["by_lp"] for r in written),
            "not_written": sorted({n for r in unsat if "answer" not in r for n in r["proved"]["notes"]}),
        })  # fmt: skip
    return out


def table(summary: list[dict]) -> str:
    cols = ["suite", "engine", "P", "instances", "unsat", "written", "valid", "median_kb", "overhead_total",
            "overhead_median", "check_vs_verify_median", "inner_vs_verify_median", "inner_vs_verify_total",
            "leaves", "by_bounds", "by_halves", "by_lp"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(s[c]) for c in cols) + " |" for s in summary]
    notes = [
        f"* {s['suite']} {s['engine']} P = {s['P']}: no proof: {n}" for s in summary for n in s["not_written"]
    ]
    return "\n".join(lines + [""] + notes) + "\n"


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k, r in rows.items():
        if "answer" not in r or r["bare"].get("verdict") != "unsat":
            continue
        suite, _, _, engine, P = k.split("|")
        name = f"{suite} {engine} P={P}"
        a.scatter(
            r["bare"]["time_s"], r["proved"]["time_s"] / max(r["bare"]["time_s"], 1e-3), s=10, label=name
        )
        b.scatter(r["proved"]["time_s"], r["check_s"], s=10, label=name)
    a.set(
        xscale="log",
        xlabel="verifier time without a proof (s)",
        ylabel="with / without",
        title="cost of writing",
    )
    a.axhline(1.1, color="grey", ls="--")
    b.set(
        xscale="log",
        yscale="log",
        xlabel="verifier time (s)",
        ylabel="checker time (s)",
        title="cost of checking",
    )
    lo, hi = b.get_xlim()
    b.plot([lo, hi], [lo, hi], color="grey", ls="--")
    handles, labels = a.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    fig.legend(uniq.values(), uniq.keys(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=["acasxu", "mnist_fc", "oval21"],
                    choices=[*CONFIGS, "vnncomp"])  # fmt: skip
    ap.add_argument("--engines", nargs="+", default=["native", "abcrown"], choices=["native", "abcrown"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--limit", type=int, default=0, help="the first N instances of each suite (0: all)")
    ap.add_argument("--match", default="", help="only instances whose 'onnx|vnnlib' names match")
    ap.add_argument("--every", type=int, default=1, help="every K-th instance of each suite")
    ap.add_argument("--acasxu", type=Path, help="a VNN-COMP 2022 acasxu folder (all 45 networks)")
    ap.add_argument("--acasxu-results", type=Path, help="an official results csv giving its verdicts")
    ap.add_argument("--vnncomp", type=Path, help="a VNN-COMP category folder (suite vnncomp)")
    ap.add_argument("--vnncomp-results", type=Path, help="an official results csv giving its verdicts")
    ap.add_argument("--timeout", type=float, default=120.0, help="cap on each instance's own timeout (s)")
    ap.add_argument("--abcrown-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="α,β-CROWN config keys changed in its every run")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1,
                    help="each verifier run N times, with and without a proof in turn (medians)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "proofs")
    args = ap.parse_args()
    if any("=" not in kv for kv in args.abcrown_set):
        sys.exit("--abcrown-set takes KEY=VALUE (e.g. solver.bound_prop_method=alpha-crown)")
    if "vnncomp" in args.suites and not (args.vnncomp and args.vnncomp_results):
        sys.exit("suite vnncomp takes --vnncomp DIR (a category folder) and --vnncomp-results CSV")
    for path in [args.vnncomp / "instances.csv", args.vnncomp_results] if "vnncomp" in args.suites else []:
        if not path.is_file():
            sys.exit(f"{path}: not found (--vnncomp names a VNN-COMP category folder with its instances.csv)")
    if "abcrown" in args.engines and not os.environ.get("ABCROWN_PATH"):
        sys.exit("set ABCROWN_PATH for --engines abcrown (../shared/vendor/alpha-beta-CROWN)")
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "proofs.json"
    rows = json.loads(store.read_text())["rows"] if store.exists() else {}
    subprocess.run([sys.executable, "-m", "complete_verifier_ext.worker", "start", "native"], check=False)
    for suite in args.suites:
        for row in instances(suite, args):
            for engine in args.engines:
                for P in args.ranks:
                    k = key(row, engine, P)
                    if k in rows:
                        continue
                    timeout = min(args.timeout, row["timeout"])
                    rows[k] = measure(row, engine, P, timeout, args.abcrown_set, args.repeat)
                    print(k, rows[k]["proved"].get("verdict", rows[k]["proved"].get("error")),
                          rows[k].get("answer", "-"), flush=True)  # fmt: skip
                    store.write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=1))
    summary = summarize(rows)
    prov = provenance()
    (args.out / "proofs.md").write_text(f"commit {prov['commit']}, `{prov['command']}`, {prov['machine']}\n\n"
                                        + table(summary))  # fmt: skip
    plot(rows, args.out / "proofs.png")
    print(table(summary))


if __name__ == "__main__":
    main()
