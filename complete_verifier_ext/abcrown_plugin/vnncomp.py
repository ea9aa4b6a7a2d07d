"""The VNN-COMP route through the plugin: ``run_instance.sh`` with ``ABCROWN_PATH`` set (or
``CVE_ENGINE=abcrown``, or a category config saying ``engine: abcrown``) runs α,β-CROWN's own config
for the category, the way α,β-CROWN's ``vnncomp_main.py`` picks it, on ``engine: abcrown``.

    python -m complete_verifier_ext.abcrown_plugin.vnncomp CATEGORY ONNX VNNLIB RESULTS TIMEOUT \
        [--ours configs/CATEGORY.yaml] [extra abcrown flags...]

The sharding comes from the ``parallel`` section of our category config (``--ours``), if it has
``mode`` and ``world_size``; extra flags (``ABCROWN_EXTRA_ARGS``) come last and win. Without CUDA,
``--device cpu`` is added (α,β-CROWN's default device is ``cuda``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import clock
from ..errors import end_cleanly_on_signals

USAGE = "vnncomp CATEGORY ONNX VNNLIB RESULTS TIMEOUT [--ours CONFIG] [abcrown flags...]"

# VNN-COMP category -> α,β-CROWN config under complete_verifier/exp_configs (its vnncomp_main.py's
# choices for these benchmarks); a callable picks by the ONNX file name.
CONFIGS = {
    "acasxu": "vnncomp21/acasxu.yaml",
    "cifar2020": "vnncomp22/cifar2020_2_255.yaml",
    "cifar_biasfield": "vnncomp22/cifar_biasfield.yaml",
    "collins_rul_cnn": "vnncomp22/collins-rul-cnn.yaml",
    "mnist_fc": lambda onnx: "vnncomp22/mnistfc_small.yaml" if "256x2" in onnx else "vnncomp22/mnistfc.yaml",
    "oval21": "vnncomp22/oval22.yaml",
    "sri_resnet_a": "vnncomp22/resnet_A.yaml",
    "sri_resnet_b": "vnncomp22/resnet_B.yaml",
    "tllverifybench": "vnncomp22/tllVerifyBench.yaml",
    "vggnet16_2022": "vnncomp22/vggnet16.yaml",
}
ALIASES = {"mnistfc": "mnist_fc", "acasxu_2023": "acasxu", "collins-rul-cnn": "collins_rul_cnn"}


def abcrown_config(checkout_root: Path, category: str, onnx: str) -> Path:
    from .locate import PluginError

    key = ALIASES.get(category, category)
    choice = CONFIGS.get(key)
    if choice is None:
        known = ", ".join(sorted(CONFIGS))
        raise PluginError(f"no alpha-beta-CROWN config known for category {category!r} (known: {known})")
    rel = choice(onnx) if callable(choice) else choice
    path = checkout_root / "complete_verifier" / "exp_configs" / rel
    if not path.is_file():
        raise PluginError(f"{path}: not found in the alpha-beta-CROWN checkout")
    return path


def _parallel_of(ours: str | None) -> list[str]:
    if not ours or not Path(ours).is_file():
        return []
    import yaml

    par = (yaml.safe_load(Path(ours).read_text()) or {}).get("parallel") or {}
    if "mode" not in par or "world_size" not in par:
        return []
    return ["--parallel.mode", str(par["mode"]), "--parallel.world_size", str(par["world_size"])]


def command(category: str, onnx: str, vnnlib: str, results: str, timeout: str, ours: str | None) -> list[str]:
    """The ``abcrown`` arguments for one instance."""
    from . import locate

    args = [
        "--config",
        str(abcrown_config(locate.find().complete_verifier.parent, category, onnx)),
        "--general.engine",
        "abcrown",
        "--onnx_path",
        onnx,
        "--vnnlib_path",
        vnnlib,
        "--results_file",
        results,
        "--timeout",
        timeout,
    ]
    import torch

    if not torch.cuda.is_available():
        args += ["--device", "cpu"]
    return args + _parallel_of(ours)


def main(argv: list[str]) -> int:
    import argparse

    from ..errors import UserError
    from ..results import report_error
    from .runner import main as run

    ours = None
    if "--ours" in argv:
        i = argv.index("--ours")
        ours, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    if len(argv) < 5:
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    category, onnx, vnnlib, results, timeout, *extra = argv
    try:
        args = command(category, onnx, vnnlib, results, timeout, ours)
    except UserError as e:
        return report_error(results, True, str(e))
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--summary")
    p.add_argument("--quiet", action="store_true")
    opts, rest = p.parse_known_args(extra)
    return run(args[1], [*args[2:], *rest], opts.summary, True, clock.started_wall())


if __name__ == "__main__":
    end_cleanly_on_signals()
    sys.exit(main(sys.argv[1:]))
