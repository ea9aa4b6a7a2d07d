"""VNN-COMP conformance: a benchmark folder's instances through ``prepare_instance.sh`` and
``run_instance.sh``, as the competition harness runs them, at P = 1 and at every P / mode asked for.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/conformance.py \\
        BENCHMARK_DIR [BENCHMARK_DIR ...] [--runs 1 fsdp:2 tp:2 fsdp:3 tp:3] [--engines abcrown native] \\
        [--results vnncomp2024_results/alpha_beta_crown/results.csv] [--models 3] [--per-model 1] \\
        [--timeout 60] [--only nn4sys] [--proofs] [--out benchmarks/results/conformance]

``BENCHMARK_DIR`` is one category's folder (with its ``instances.csv``) or a folder of them (a VNN-COMP
benchmarks repository's ``benchmarks/``); the category is the folder's name, as the competition names it.
Fetched benchmarks stay where they are: nothing is copied into the repository.

Which instances: of each category, ``--models`` networks (the cheapest first where ``--results`` gives
the official run time), ``--per-model`` instances of each; with ``--results``, only instances the
official tool answered (``sat`` / ``unsat``), so that every row has a verdict to agree with, and only
those whose files are all present (a fetched repository lacks its files of 4 MiB and more).

Each instance runs under every ``--runs`` entry (``1``: one process; ``MODE:P``: P gloo ranks, through
``ABCROWN_EXTRA_ARGS``) and every engine (``abcrown``: ``ABCROWN_PATH`` set; ``native``:
``CVE_ENGINE=native``),
with ``TIMEOUT`` = the smaller of ``--timeout`` and the instance's own. Recorded per run: the verdict,
the last line of stderr where it is ``error``, the wall time of ``run_instance.sh`` and the peak per rank
(the ``--summary`` it writes). Agreement: with P = 1 of the same engine, and with the official verdict;
``wrong`` is a ``sat`` / ``unsat`` that contradicts either.

``--proofs``: each run also writes a proof (``--general.proof`` through ``ABCROWN_EXTRA_ARGS``), and
each ``unsat``'s proof is checked by ``complete-verifier-ext check`` (``--workers`` = P); recorded: the
checker's answer (``none`` where no proof was written) and its wall time.

Writes ``conformance.json`` (every row, with provenance; rows already there are kept, so a stopped run
resumes), ``conformance.md`` (a table per category and a summary) and ``conformance.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from measure import REPO, provenance

SCRIPTS = REPO / "vnncomp_scripts"
ANSWERS = ("sat", "unsat")


def categories(dirs: list[Path]) -> dict[str, Path]:
    """Category name -> its folder: each dir holding an ``instances.csv``, or each sub-folder that does."""
    found = {}
    for d in dirs:
        if (d / "instances.csv").is_file():
            found[d.name] = d
        else:
            found.update({s.name: s for s in sorted(d.iterdir()) if (s / "instances.csv").is_file()})
    if not found:
        sys.exit(f"no instances.csv in {', '.join(map(str, dirs))} or its sub-folders")
    return found


CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "complete_verifier_ext" / "conformance"
)


def _present(folder: Path, rel: str) -> Path | None:
    """The instance file ``rel`` of ``folder``, decompressed as the competition's setup does before
    running a tool (some tools' loaders read plain ONNX only): itself, or its ``.gz`` unpacked once into
    a cache outside the repository; None if neither is there (a fetched repository lacks its large
    files)."""
    p = folder / rel.removesuffix(".gz")
    if p.is_file() and p.stat().st_size > 0:
        return p
    gz = Path(f"{p}.gz")
    if not (gz.is_file() and gz.stat().st_size > 0):
        return None
    out = CACHE / folder.name / rel.removesuffix(".gz")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        with gzip.open(gz, "rb") as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.replace(out)
    return out


def within(path: str, category: str) -> str:
    """A file's path inside its category's folder (what ``instances.csv`` lists), ``.gz`` left out: the
    part after the category's folder where a results csv gives a longer path. Not the file name alone:
    a category may hold one file name in two folders (safenlp's ``medical/`` and ``ruarobot/``)."""
    parts = [p for p in Path(path.strip().removesuffix(".gz")).parts if p != "."]
    if category in parts:
        parts = parts[len(parts) - parts[::-1].index(category) :]
    return "/".join(parts)


def official(path: Path | None) -> dict[tuple[str, str, str], tuple[str, float]]:
    """(category, onnx path, vnnlib path) -> (verdict, run time) of a VNN-COMP results csv, the paths
    inside the category's folder (:func:`within`)."""
    if path is None:
        return {}
    out = {}
    for row in csv.reader(path.open()):
        if len(row) < 6:
            continue
        key = (row[0], within(row[1], row[0]), within(row[2], row[0]))
        try:
            out[key] = (row[4].strip(), float(row[5]))
        except ValueError:
            continue
    return out


def instances(
    category: str, folder: Path, results: dict, models: int, per_model: int
) -> list[dict[str, str | float]]:
    """The chosen instances of one category (see the module docstring)."""
    by_model: dict[str, list[dict]] = defaultdict(list)
    for row in csv.reader((folder / "instances.csv").open()):
        if len(row) < 3:
            continue
        onnx, spec = _present(folder, row[0].strip()), _present(folder, row[1].strip())
        if onnx is None or spec is None:
            continue
        key = (category, within(row[0], category), within(row[1], category))
        verdict, gpu_s = results.get(key, ("", float("nan")))
        if results and verdict not in ANSWERS:
            continue
        own = float(row[2]) if row[2].strip() else 300.0
        by_model[str(onnx)].append(
            {
                "category": category,
                "onnx": str(onnx),
                "vnnlib": str(spec),
                "timeout": own,
                "official": verdict,
                "official_s": gpu_s,
            }  # fmt: skip
        )

    def cost(item: dict) -> float:
        return item["official_s"] if item["official_s"] == item["official_s"] else 0.0

    # the cheapest instance of each (network, verdict); the cheapest network of each verdict first, so
    # that a category with both has both, then the others by cost
    cheapest: dict[tuple[str, str], dict] = {}
    for onnx, items in by_model.items():
        for i in sorted(items, key=cost):
            cheapest.setdefault((onnx, i["official"]), i)
    ranked = sorted(cheapest.values(), key=lambda i: (cost(i), i["onnx"]))
    firsts = list({i["official"]: i for i in reversed(ranked)}.values())
    order = [i["onnx"] for i in firsts] + [i["onnx"] for i in ranked]
    chosen = []
    for onnx in list(dict.fromkeys(order))[:models]:
        items = sorted(by_model[onnx], key=cost)
        mine = [i for i in firsts if i["onnx"] == onnx]
        chosen += (mine + [i for i in items if i not in mine])[:per_model]
    return chosen


def parse_run(text: str) -> tuple[str, int]:
    """``1`` -> ("none", 1); ``fsdp:2`` -> ("fsdp", 2)."""
    if ":" not in text:
        return "none", int(text)
    mode, world = text.split(":")
    return mode, int(world)


def run_one(
    inst: dict, engine: str, mode: str, world: int, timeout: float, tmp: Path, proofs: bool = False
) -> dict:
    """``prepare_instance.sh`` then ``run_instance.sh`` for one instance; returns the row's results.
    ``proofs``: with ``--general.proof`` in ``ABCROWN_EXTRA_ARGS``, and an ``unsat``'s proof checked."""
    results, summary, proof = tmp / "out.txt", tmp / "summary.json", tmp / "proof.json"
    for f in (results, summary, proof):
        f.unlink(missing_ok=True)
    env = {**os.environ, "CVE_ENGINE": engine, "CVE_WORKER": "off"}
    if engine == "native":
        env.pop("ABCROWN_PATH", None)
    extra = ["--summary", str(summary)]
    if world > 1:
        extra += ["--parallel.mode", mode, "--parallel.world_size", str(world)]
    if proofs:
        extra += ["--general.proof", str(proof)]
    env["ABCROWN_EXTRA_ARGS"] = " ".join(extra)
    category, onnx, spec = inst["category"], inst["onnx"], inst["vnnlib"]
    prep = subprocess.run(
        [str(SCRIPTS / "prepare_instance.sh"), "v1", category, onnx, spec],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if prep.returncode != 0:
        return {"verdict": "error", "error": (prep.stderr.strip().splitlines() or ["prepare failed"])[-1]}
    t0 = time.monotonic()
    cmd = [str(SCRIPTS / "run_instance.sh"), "v1", category, onnx, spec, str(results), f"{timeout:g}"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 120, cwd=tmp)
    except subprocess.TimeoutExpired:
        return {
            "verdict": "hang",
            "error": f"run_instance.sh still running {timeout + 120:.0f} s after its start",
        }
    wall = time.monotonic() - t0
    text = results.read_text().strip() if results.is_file() else ""
    verdict = text.splitlines()[0].strip() if text else "none"
    row = {"verdict": verdict, "wall_s": round(wall, 1), "rc": out.returncode}
    if verdict in ("error", "none"):
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        row["error"] = (lines or ["(no stderr)"])[-1][:300]
    if summary.is_file():
        try:
            peaks = json.loads(summary.read_text()).get("peak_mb")
        except json.JSONDecodeError:
            peaks = None
        if peaks is not None:
            row["peak_mb"] = peaks if isinstance(peaks, list) else [peaks]
    if proofs and verdict == "unsat":
        row |= check(inst, proof, world)
    return row


def check(inst: dict, proof: Path, workers: int) -> dict:
    """``complete-verifier-ext check`` on an ``unsat``'s proof: ``{"proof": answer, "check_s": s}``;
    ``none`` where the run wrote no proof."""
    if not proof.is_file():
        return {"proof": "none"}
    cmd = [sys.executable, "-m", "complete_verifier_ext.solver_cli", "check", inst["vnnlib"],
           f"--network=N={inst['onnx']}", "--proof", str(proof), "--workers", str(workers)]  # fmt: skip
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"proof": "check still running after 1800 s"}
    answer = out.stdout.strip() or (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"proof": answer[:300], "check_s": round(time.monotonic() - t0, 1)}


def agreement(rows: list[dict]) -> None:
    """Each row's ``vs_p1`` (same engine, same instance, P = 1) and ``vs_official``:
    ``same`` / ``wrong`` (two answers that contradict) / ``lost`` (P = 1 answered, this did not) /
    ``gained`` / ``n/a``."""
    p1 = {(r["engine"], r["onnx"], r["vnnlib"]): r["verdict"] for r in rows if r["world"] == 1}

    def compare(mine: str, ref: str | None) -> str:
        if ref not in ANSWERS:
            return "gained" if mine in ANSWERS and ref is not None else "n/a"
        if mine == ref:
            return "same"
        return "wrong" if mine in ANSWERS else "lost"

    for r in rows:
        r["vs_p1"] = (
            "" if r["world"] == 1 else compare(r["verdict"], p1.get((r["engine"], r["onnx"], r["vnnlib"])))
        )
        r["vs_official"] = compare(r["verdict"], r.get("official") or None)


def label(r: dict) -> str:
    return "P=1" if r["world"] == 1 else f"{r['mode']} P={r['world']}"


def table(rows: list[dict], prov: dict) -> str:
    """The markdown: provenance, a summary per category and run, and every instance's row."""
    runs = sorted({(r["engine"], r["world"], r["mode"]) for r in rows}, key=lambda t: (t[0], t[1], t[2]))
    cats = sorted({r["category"] for r in rows})
    out = [
        "# VNN-COMP conformance through prepare_instance.sh / run_instance.sh",
        "",
        f"commit {prov['commit']}; `{prov['command']}`; {prov['machine']}",
        "",
        "Per category and run: answered (sat/unsat) / instances; same = the verdict of P = 1 (P > 1) or of",
        "the official run (P = 1); lost = P = 1 answered, this did not; wrong = a contradicting answer.",
        "",
        "| category | " + " | ".join(f"{e} {label({'world': w, 'mode': m})}" for e, w, m in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for c in cats:
        cells = []
        for e, w, m in runs:
            mine = [
                r for r in rows if r["category"] == c and (r["engine"], r["world"], r["mode"]) == (e, w, m)
            ]
            if not mine:
                cells.append("")
                continue
            key = "vs_official" if w == 1 else "vs_p1"
            answered = sum(r["verdict"] in ANSWERS for r in mine)
            tally = {k: sum(r[key] == k for r in mine) for k in ("same", "lost", "wrong")}
            errors = sum(r["verdict"] in ("error", "hang", "none") for r in mine)
            cell = f"{answered}/{len(mine)} same {tally['same']}"
            cell += "".join(f", {k} {v}" for k, v in (("lost", tally["lost"]), ("WRONG", tally["wrong"]),
                                                       ("error", errors)) if v)  # fmt: skip
            proved = [r for r in mine if "proof" in r]
            if proved:
                cell += f", proofs valid {sum(r['proof'] == 'valid' for r in proved)}/{len(proved)}"
            cells.append(cell)
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    out += ["", "## Every run", "",
            "| category | network | spec | official | engine | run | verdict | vs P=1 | vs official | wall s "
            "| peak MB per rank | proof (check s) | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(
        rows, key=lambda r: (r["category"], r["onnx"], r["vnnlib"], r["engine"], r["world"], r["mode"])
    ):
        peaks = "/".join(f"{p:.0f}" for p in r.get("peak_mb") or [])
        err = (r.get("error") or "").replace("|", "\\|")
        proof = (r.get("proof", "") + (f" ({r['check_s']})" if "check_s" in r else "")).replace("|", "\\|")
        out.append(
            f"| {r['category']} | {Path(r['onnx']).name} | {Path(r['vnnlib']).name} "
            f"| {r.get('official', '')} "
            f"| {r['engine']} | {label(r)} | {r['verdict']} | {r['vs_p1']} | {r['vs_official']} "
            f"| {r.get('wall_s', '')} | {peaks} | {proof} | {err} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Per category, the share of instances each run answered with P = 1's verdict (P = 1: the official)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted({(r["engine"], r["world"], r["mode"]) for r in rows})
    cats = sorted({r["category"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(cats) * max(1, len(runs)) / 2), 4))
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        shares = []
        for c in cats:
            mine = [r for r in rows if r["category"] == c and (r["engine"], r["world"], r["mode"]) == run]
            key = "vs_official" if run[1] == 1 else "vs_p1"
            shares.append(sum(r[key] == "same" for r in mine) / len(mine) if mine else 0.0)
        ax.bar([i + j * width for i in range(len(cats))], shares, width,
               label=f"{run[0]} {label({'world': run[1], 'mode': run[2]})}")  # fmt: skip
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=45, ha="right")
    ax.set_ylabel("same verdict (P = 1: official; P > 1: P = 1)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="a category folder or a folder of them")
    ap.add_argument("--runs", nargs="+", default=["1", "fsdp:2", "tp:2", "fsdp:3", "tp:3"])
    ap.add_argument("--engines", nargs="+", default=["abcrown"], choices=["abcrown", "native"])
    ap.add_argument("--results", type=Path, help="an official VNN-COMP results csv")
    ap.add_argument("--models", type=int, default=3, help="networks per category")
    ap.add_argument("--per-model", type=int, default=1, help="instances per network")
    ap.add_argument("--timeout", type=float, default=60.0, help="cap on each instance's own timeout (s)")
    ap.add_argument("--only", nargs="*", default=[], help="categories whose name contains one of these")
    ap.add_argument("--skip", nargs="*", default=[], help="categories whose name contains one of these")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "conformance")
    ap.add_argument("--proofs", action="store_true", help="write a proof with each unsat and check it")
    args = ap.parse_args()
    if "abcrown" in args.engines and not os.environ.get("ABCROWN_PATH"):
        sys.exit("set ABCROWN_PATH to an alpha-beta-CROWN checkout for --engines abcrown")
    results = official(args.results)
    chosen = []
    for name, folder in categories(args.dirs).items():
        if args.only and not any(o in name for o in args.only):
            continue
        if any(s in name for s in args.skip):
            continue
        chosen += instances(name, folder, results, args.models, args.per_model)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "conformance.json"
    old = json.loads(store.read_text())["rows"] if store.is_file() else []
    for r in old:  # kept rows take the official verdict of the csv given now
        cat = r["category"]
        r["official"], r["official_s"] = results.get(
            (cat, within(r["onnx"], cat), within(r["vnnlib"], cat)), (r["official"], r["official_s"])
        )
    done = {(r["engine"], r["onnx"], r["vnnlib"], r["world"], r["mode"]) for r in old}
    rows = list(old)
    runs = [parse_run(r) for r in args.runs]
    with tempfile.TemporaryDirectory() as tmp:
        for inst in chosen:
            for engine in args.engines:
                for mode, world in runs:
                    key = (engine, inst["onnx"], inst["vnnlib"], world, mode)
                    if key in done:
                        continue
                    timeout = min(args.timeout, float(inst["timeout"]))
                    got = run_one(inst, engine, mode, world, timeout, Path(tmp), args.proofs)
                    row = {**inst, "engine": engine, "mode": mode, "world": world, "timeout": timeout, **got}
                    rows.append(row)
                    print(
                        f"{inst['category']} {Path(inst['onnx']).name} {Path(inst['vnnlib']).name} {engine} "
                        f"{mode}:{world}: {got['verdict']} ({got.get('wall_s', '-')} s) "
                        f"official {inst['official'] or '-'} {got.get('error', '')} {got.get('proof', '')}",
                        flush=True,
                    )
                    prov = provenance()
                    store.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    agreement(rows)
    prov = provenance()
    store.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1))
    (args.out / "conformance.md").write_text(table(rows, prov))
    plot(rows, args.out / "conformance.png")
    print((args.out / "conformance.md").read_text().split("## Every run")[0])


if __name__ == "__main__":
    main()
