"""Which of α,β-CROWN's own configs run split over ranks through the plugin.

    ABCROWN_PATH=../shared/vendor/alpha-beta-CROWN python benchmarks/abcrown_config_coverage.py \
        [--out benchmarks/results/abcrown_config_coverage]

Walks every YAML under the checkout's ``complete_verifier/exp_configs/``, parses it with α,β-CROWN's own
parser (as ``abcrown --general.engine abcrown`` does) and prints, per config, what the plugin does with
it at ``parallel.world_size: 2``, under ``fsdp`` and under ``tp``:

* ``split: <path>``: the work is dealt over the ranks (``bounds``: no BaB, the rows of every bound
  dealt; ``activation BaB`` / ``input BaB``: the domain list split); ``auto`` is decided by α,β-CROWN
  per instance (input BaB, activation BaB, or MIP, which stops with one line at P > 1);
* ``refused: <reasons>``: the exact line a user gets (before any rank starts);
* ``refused by α,β-CROWN at every P``: what α,β-CROWN itself asserts off (the same line at P = 1);
* ``once, on rank 0 alone``: a ``Customized`` verifier (the user's function is not split);
* under ``tp``, convs are sharded in ``conv_mode: patches`` and ``matrix``; a layer ``tp`` cannot shard
  (MatMul, grouped conv) stays whole on every rank, named in the run's warning and summary.

No model is loaded: the column says what the config asks for. Writes ``<out>.json`` (every config, with
the α,β-CROWN commit and provenance) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from abcrown_common import checkout
from measure import REPO, provenance


def classify(all_args: dict, mode: str, complete_verifier: Path | None = None) -> str:
    """What the plugin does with a parsed config at P = 2 under ``mode``."""
    from complete_verifier_ext.abcrown_plugin.search.refusals import refused_upstream, unsupported

    general, bab = all_args["general"], all_args["bab"]
    upstream = refused_upstream(all_args, complete_verifier)
    if upstream:
        return "refused by α,β-CROWN at every P: " + upstream.split(":")[0]
    bad = unsupported(all_args)
    if bad:
        return "refused: " + "; ".join(bad)
    verifier = str(general["complete_verifier"])
    if verifier.startswith("Customized"):
        return "once, on rank 0 alone (Customized verifier)"
    if verifier == "skip":
        path = "bounds"
    elif verifier == "auto":
        path = "auto (per instance: input BaB, activation BaB, or MIP: refused)"
    elif bab["branching"]["input_split"]["enable"]:
        path = "input BaB"
    else:
        path = "activation BaB"
    return f"split: {path}"


def parse(arguments, path: Path) -> dict | str:
    """α,β-CROWN's parse of one config (its full argument tree), or its complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            arguments.Config.parse_config(["--config", str(path)], verbose=False)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return f"parse error: {lines[-1] if lines else 'bad config'}"
    except Exception as e:  # a config this α,β-CROWN cannot read: say so and go on
        return f"parse error: {type(e).__name__}: {e}"
    return json.loads(json.dumps(arguments.Config.all_args, default=str))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "abcrown_config_coverage"))
    args = ap.parse_args()
    root = checkout()
    from complete_verifier_ext.abcrown_plugin import bridge, locate

    arguments = bridge.import_abcrown(locate.find(str(root)))
    configs = root / "complete_verifier" / "exp_configs"
    rows = []
    for path in sorted(configs.rglob("*.yaml")):
        parsed = parse(arguments, path)
        name = str(path.relative_to(configs))
        if isinstance(parsed, str):
            rows.append({"config": name, "fsdp": parsed, "tp": parsed})
        else:
            cv = root / "complete_verifier"
            rows.append(
                {"config": name, "fsdp": classify(parsed, "fsdp", cv), "tp": classify(parsed, "tp", cv)}
            )
        print(f"{name}: fsdp {rows[-1]['fsdp']} | tp {rows[-1]['tp']}", flush=True)
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    meta = {**provenance(), "abcrown_commit": commit.stdout.strip() or "unknown (not a git checkout)"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"configs": rows, "provenance": meta}, indent=1))
    out.with_suffix(".md").write_text(table(rows, meta))
    print(summary(rows))


def _kind(cell: str) -> str:
    return cell.split(":")[0].split(" (")[0]


def summary(rows: list[dict]) -> str:
    lines = []
    for mode in ("fsdp", "tp"):
        counts = Counter(_kind(r[mode]) for r in rows)
        lines.append(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    reasons = Counter(
        part.strip() for r in rows if r["fsdp"].startswith("refused: ") for part in r["fsdp"][9:].split(";")
    )
    lines.append("refusal reasons (fsdp): " + "; ".join(f"{k}: {v}" for k, v in reasons.most_common()))
    return "\n".join(lines)


def table(rows: list[dict], meta: dict) -> str:
    head = [
        f"# α,β-CROWN's own configs through the plugin at parallel.world_size: 2 ({len(rows)} configs)",
        "",
        f"commit {meta['commit']}, α,β-CROWN {meta['abcrown_commit']}, `{meta['command']}`, "
        f"{meta['machine']}",
        "",
        *[f"* {line}" for line in summary(rows).splitlines()],
        "",
        "| config | fsdp | tp |",
        "|---|---|---|",
    ]
    return "\n".join(head + [f"| {r['config']} | {r['fsdp']} | {r['tp']} |" for r in rows]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
