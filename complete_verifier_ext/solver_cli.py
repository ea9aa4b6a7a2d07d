"""``complete-verifier-ext``: the solver command line of the VNN-LIB 2.0 standard (the VNNLIB-Standard
repository's "Verifier interface" chapter), which the VNNLIB-Solver-Database asks every solver::

    complete-verifier-ext --name
    complete-verifier-ext --version
    complete-verifier-ext supports --FLAG            # one of SUPPORTS: what the default engine handles
    complete-verifier-ext verify QUERY [--network NAME=FILE ...] [--timeout S]
        [--serialise-assignments DIR]
        [--config YAML] [--engine native|abcrown] [--world-size P] [--mode fsdp|tp] [--device D]
        [--proof PATH]
    complete-verifier-ext check QUERY --network NAME=FILE --proof PATH [--workers P]

``verify`` prints the verdict on the first line of stdout (``sat``, ``unsat``, ``unknown``,
``timed-out``) and, for ``sat``, every declared variable in declaration order (``NAME TYPE [dims]``,
then one value per line, row-major); ``--serialise-assignments DIR`` also writes ``DIR/NAME.pb``, one
ONNX ``TensorProto`` per variable. A user's mistake (a missing or unnecessary ``--network``, a declared
element type this solver cannot analyse soundly, an unreadable file) is one line on stderr, nothing on
stdout, exit 1; a bad command line exits 2. Everything else the verifier says goes to stderr.

``verify`` has no category: it picks its method from the query and the model, naming the choice in one
stderr line (``--config`` overrides it): few input dimensions, input-split branch and bound (what ACAS
Xu needs); else β-CROWN branch and bound with α-CROWN, on fully connected nets with the split+MILP
refinement of intermediate bounds first (``bab-refine``). The answers of ``supports`` are those of the
default engine (``native``), read from what its loaders accept (:data:`SUPPORTS`); ``--engine abcrown``
runs the user's α,β-CROWN through the plugin instead.

``check`` decides a proof that ``verify … --proof PATH`` wrote with an ``unsat`` (docs/proofs.md), by
the independent checker ``complete_verifier_ext.check``: ``valid``, ``invalid: …`` or ``unsupported: …``
on stdout, exit 0, 1 or 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from types import MappingProxyType

from . import clock

NAME = "complete_verifier_ext: sharded IBP, CROWN, alpha-CROWN and beta-CROWN branch and bound"


def _version() -> str:
    try:
        return metadata.version("complete_verifier_ext")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _operators() -> list[str]:
    from .model.onnx_loader import FOLDED, OPERATORS

    return sorted({*OPERATORS, *FOLDED})


def _opsets() -> list[str]:
    from .model.onnx_loader import OPSETS

    return [str(OPSETS[0]), str(OPSETS[1])]


# each ``supports`` flag -> the lines it answers (the default engine's: native)
SUPPORTS = MappingProxyType(
    {
        "--onnx-opset-versions": _opsets,
        # the analysis is sound for real arithmetic; float32 evaluation is not bounded with certainty
        "--onnx-element-types": lambda: ["real"],
        "--onnx-operators": _operators,
        "--vnnlib-versions": lambda: ["1.0", "2.0"],
        "--hidden-node-theories": lambda: ["NH"],  # declare-hidden is refused
        "--multiple-input-output-theories": lambda: ["SIO", "MIO"],
        "--multiple-network-theories": lambda: ["SNET", "MENET", "MINET", "MNET"],
        "--multiple-node-comparison-theories": lambda: ["SNC"],  # inputs related to outputs are refused
        # inputs in a box (BND) and linear rows over outputs (OUTC and more); a linear constraint over inputs
        # beyond a box or a tie between two networks' inputs (LIN) and a product (POLY) are refused
        "--arithmetic-complexity-theories": lambda: ["BND", "OUTC"],
        "--optimised-disjunctive-reasoning": lambda: ["false"],  # disjunctions become DNF
        "--serialise-assignments": lambda: ["true"],
    }
)


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(message)


def _verify_parser() -> _Parser:
    p = _Parser(prog="complete-verifier-ext verify", add_help=False)
    p.add_argument("query")
    p.add_argument("--network", action="append", default=[], metavar="NAME=FILE")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--serialise-assignments", dest="serialise", default=None, metavar="DIR")
    p.add_argument("--config", default=None)
    p.add_argument("--engine", choices=("native", "abcrown"), default="native")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--mode", choices=("fsdp", "tp"), default="fsdp")
    p.add_argument("--device", default=None)
    p.add_argument("--proof", default=None, metavar="PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args in (["--name"], ["--version"]):
            print(NAME if args[0] == "--name" else _version())
            return 0
        if args and args[0] == "supports":
            if len(args) != 2 or args[1] not in SUPPORTS:
                raise UsageError(f"supports takes one of {', '.join(SUPPORTS)}")
            print("\n".join(SUPPORTS[args[1]]()))
            return 0
        if args and args[0] == "verify":
            a = _verify_parser().parse_args(args[1:])
            # the timeout counts from the command's start, or from the call when called with argv
            a.started_wall = clock.started_wall() if argv is None else time.time()
            return verify(a)
        if args and args[0] == "check":
            from .check.command import main as check

            return check(args[1:])
        raise UsageError(
            "usage: complete-verifier-ext --name | --version | supports --FLAG | verify QUERY ... "
            "| check QUERY ..."
        )
    except UsageError as e:
        print(f"complete-verifier-ext: {e}", file=sys.stderr)
        return 2


def _networks(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--network {pair}: expected NAME=FILE")
        if name in out:
            raise UsageError(f"--network {name} is given twice")
        out[name] = path
    return out


def onnx_argument(spec, networks: dict[str, str], query: str) -> str:
    """The ONNX argument of the verifier (a path, or the network list) from the ``--network`` files:
    one for each declared network not marked ``equal-to`` (an ``isomorphic-to`` one included)."""
    from .errors import UserError

    if spec.layout is None:  # VNN-LIB 1.x: one network, whatever its name
        if len(networks) != 1:
            raise UserError(f"{query}: a VNN-LIB 1.x query takes one --network, {len(networks)} given")
        return next(iter(networks.values()))
    need = [n.name for n in spec.layout.networks if not n.equal_to]
    missing = [n for n in need if n not in networks]
    extra = [n for n in networks if n not in need]
    if missing:
        raise UserError(f"{query}: no --network for the declared network {missing[0]!r}")
    if extra:
        declared = {n.name for n in spec.layout.networks}
        why = "is marked equal-to another" if extra[0] in declared else "is not declared"
        raise UserError(f"{query}: --network {extra[0]}: that network {why}; no file is needed")
    for name in need:
        if not Path(networks[name]).is_file():
            raise UserError(f"--network {name}={networks[name]}: file not found")
    return repr([(name, networks[name]) for name in need])


def check_types(spec, query: str) -> None:
    """The declared element types must be ``real``: the analysis is sound for networks as real-valued
    functions, not for their float32 evaluation (the standard's rule: the user consents to that by
    declaring ``real``)."""
    from .errors import UserError

    for net in spec.layout.networks if spec.layout is not None else ():
        for slot in (*net.inputs, *net.outputs):
            if slot.dtype != "real":
                raise UserError(
                    f"{query}: {slot.name} is declared {slot.dtype}: this solver analyses networks as "
                    "real-valued functions only (supports --onnx-element-types: real); declare it real"
                )


def _assignment(text: str, spec) -> list[tuple[str, str, tuple[int, ...], list[float]]]:
    """The variables of a ``sat`` results file (after its first line): a VNN-LIB 2.0 witness is
    already ``NAME TYPE [dims]`` blocks; a 1.x counterexample's ``(X_i v)`` / ``(Y_j v)`` are scalars."""
    import re

    if spec.layout is None:
        pairs = re.findall(r"\(\s*([XY]_\d+)\s+([^\s()]+)\s*\)", text)
        return [(name, "real", (), [float(v)]) for name, v in pairs]
    out, lines, i = [], [ln for ln in text.splitlines() if ln.strip()], 0
    while i < len(lines):
        name, dtype, dims = lines[i].split(maxsplit=2)
        shape = tuple(int(d) for d in dims.strip("[]").split(",") if d.strip())
        n = math.prod(shape)
        out.append((name, dtype, shape, [float(v) for v in lines[i + 1 : i + 1 + n]]))
        i += 1 + n
    return out


def _print_assignment(variables) -> None:
    for name, dtype, shape, values in variables:
        print(f"{name} {dtype} [{','.join(str(d) for d in shape)}]")
        for v in values:
            print(repr(v))


def serialise(variables, folder: str) -> None:
    """One ONNX ``TensorProto`` per variable, ``folder/NAME.pb`` (``real``: float64)."""
    import numpy as np
    from onnx import numpy_helper

    types = {"real": np.float64, "float64": np.float64, "float32": np.float32, "float16": np.float16}
    os.makedirs(folder, exist_ok=True)
    for name, dtype, shape, values in variables:
        array = np.asarray(values, dtype=types.get(dtype, np.float64)).reshape(shape)
        Path(folder, f"{name}.pb").write_bytes(numpy_helper.from_array(array, name).SerializeToString())


VERDICTS = MappingProxyType({"sat": "sat", "unsat": "unsat", "unknown": "unknown", "timeout": "timed-out"})


def verify(a: argparse.Namespace) -> int:
    """``verify``: the verdict (and a ``sat``'s assignment) on stdout; see the module docstring."""
    from .errors import UserError
    from .spec import load_vnnlib

    started = clock.wall_to_monotonic(a.started_wall)
    try:
        networks = _networks(a.network)
        if not Path(a.query).is_file():
            raise UserError(f"{a.query}: query file not found")
        spec = load_vnnlib(a.query)
        check_types(spec, a.query)
        onnx_arg = onnx_argument(spec, networks, a.query)
        if a.timeout is not None and not (a.timeout > 0 and math.isfinite(a.timeout)):
            raise UserError(f"--timeout {a.timeout}: expected a positive number of seconds")
        a.parallel = _parallel_flags(a)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from . import deadline

    guard = None
    if a.timeout is not None:  # the hard end: "timed-out" 1 s before the timeout, whatever runs then
        guard = deadline.arm(a.started_wall + a.timeout - deadline.MARGIN_S, lambda: print("timed-out"))
    os.environ.pop(deadline.ENV, None)
    with tempfile.TemporaryDirectory(prefix="cve_verify_") as tmp:
        results = os.path.join(tmp, "results.txt")
        try:
            code = _run(a, spec, onnx_arg, results, started)
        finally:
            if guard is not None:
                guard.cancel()
        text = Path(results).read_text() if os.path.isfile(results) else ""
    verdict, _, rest = text.partition("\n")
    verdict = verdict.strip()
    if code != 0 or verdict not in VERDICTS:
        if verdict != "error":
            print("error: the verifier ended without a verdict", file=sys.stderr)
        return 1
    print(VERDICTS[verdict])
    if verdict == "sat":
        variables = _assignment(rest, spec)
        _print_assignment(variables)
        if a.serialise:
            serialise(variables, a.serialise)
    sys.stdout.flush()
    return 0


def _parallel_flags(a: argparse.Namespace) -> list[str]:
    """``--world-size`` and ``--mode`` as the ``parallel`` section both engines read, checked as theirs
    (``config_load.load_parallel``), in the flags that give it."""
    from .config_load import load_parallel, parallel_flags
    from .errors import UserError

    section = {"world_size": a.world_size, **({"mode": a.mode} if a.world_size > 1 else {})}
    if a.world_size < 1:
        raise UserError(f"--world-size {a.world_size}: expected a number of ranks, 1 or more")
    return parallel_flags(load_parallel([(section, "the command line")]))


def _run(a: argparse.Namespace, spec, onnx_arg: str, results: str, started: float) -> int:
    """The verifier on one instance, everything it says on stderr; its exit code."""
    import contextlib

    timeout = a.timeout if a.timeout is not None else 300.0
    with contextlib.redirect_stdout(sys.stderr):
        if a.engine == "abcrown":
            return _run_abcrown(a, spec, onnx_arg, results, timeout)
        from . import cli

        if a.config:
            method, why = ["--config", a.config], f"the methods of {a.config}"
        else:
            from .methods import for_instance

            method, why = for_instance(onnx_arg, a.query, "tp" in a.parallel)
        print(f"complete-verifier-ext: {why}", file=sys.stderr)
        argv = [*method, "--general.engine", "native", "--model.onnx_path", onnx_arg]
        argv += ["--specification.vnnlib_path", a.query]
        argv += ["--general.results_file", results, "--general.csv_name", "null", "--general.root_path", ""]
        argv += ["--bab.timeout", str(timeout), "--quiet"]
        argv += a.parallel + (["--general.proof", os.path.abspath(a.proof)] if a.proof else [])
        if a.device:
            argv += ["--general.device", a.device]
        return cli.main(argv, started=started)


def _run_abcrown(a: argparse.Namespace, spec, onnx_arg: str, results: str, timeout: float) -> int:
    """The user's α,β-CROWN through the plugin: its config for the method (``--config``: the user's)."""
    from . import abcrown_plugin
    from .methods import INPUT_SPLIT_MAX_DIMS

    if a.config:
        config, why = a.config, f"alpha-beta-CROWN with {a.config}"
    elif spec.n_inputs <= INPUT_SPLIT_MAX_DIMS:  # as the native engine's methods.choose
        config = abcrown_plugin.exp_config("vnncomp21/acasxu.yaml")
        why = f"{spec.n_inputs} input dimensions: alpha-beta-CROWN's input split (vnncomp21/acasxu.yaml)"
    else:
        config, why = None, "alpha-beta-CROWN's default: alpha-CROWN, then beta-CROWN branch and bound"
    print(f"complete-verifier-ext: {why}", file=sys.stderr)
    overrides = ["--onnx_path", onnx_arg, "--vnnlib_path", a.query, "--results_file", results]
    overrides += ["--timeout", str(timeout), "--device", a.device or "cpu"]
    overrides += a.parallel + (["--general.proof", os.path.abspath(a.proof)] if a.proof else [])
    return abcrown_plugin.main(config, overrides, None, True, a.started_wall)


if __name__ == "__main__":
    sys.exit(main())
