"""The native engine's method for an instance whose config leaves it open
(``general.complete_verifier: auto``, as ``configs/default.yaml`` has it for a VNN-COMP category without
its own config; ``complete-verifier-ext verify`` without ``--config``), chosen from the model and the
query, and named in one line:

* few input dimensions (at most :data:`INPUT_SPLIT_MAX_DIMS`; ACAS Xu has 5, the small controllers of
  VNN-COMP's lsnc / tllverifybench 2 to 6): input-split branch and bound with CROWN, the attack after;
* a fully connected net: β-CROWN branch and bound after the split+MILP refinement of intermediate
  bounds (``bab-refine``, as ``configs/mnist_fc.yaml``);
* a convolutional net: β-CROWN branch and bound with α-CROWN (as ``configs/oval21.yaml``).

A method is a list of ``--section.key value`` settings; :func:`settings` drops those the user's YAML or
command line set themselves, so that a config's own keys always win.
"""

from __future__ import annotations

INPUT_SPLIT_MAX_DIMS = 16

INPUT_SPLIT = ("--general.complete_verifier", "bab", "--solver.batch_size", "4096",
               "--solver.bound_prop_method", "crown", "--bab.branching.input_split.enable", "true",
               "--attack.pgd_order", "after", "--attack.pgd_restarts", "100")  # fmt: skip
REFINE = ("--general.complete_verifier", "bab-refine", "--solver.batch_size", "1024",
          "--solver.bound_prop_method", "alpha-crown", "--solver.alpha-crown.iteration", "100",
          "--solver.mip.refine_method", "split+milp", "--bab.branching.method", "kfsb",
          "--attack.pgd_order", "before", "--attack.pgd_restarts", "100")  # fmt: skip
ACTIVATION = ("--general.complete_verifier", "bab", "--solver.batch_size", "256",
              "--solver.bound_prop_method", "alpha-crown", "--solver.alpha-crown.iteration", "50",
              "--bab.branching.method", "kfsb", "--attack.pgd_order", "before",
              "--attack.pgd_restarts", "30")  # fmt: skip


def choose(n_inputs: int, operators: set[str], tp: bool = False) -> tuple[list[str], str]:
    """The method for a query over ``n_inputs`` input dimensions and a model of ``operators`` (ONNX op
    types), and the line that names it; ``tp``: under ``parallel.mode: tp``, which never holds a whole
    layer, so never the MILP refinement."""
    if n_inputs <= INPUT_SPLIT_MAX_DIMS:
        return INPUT_SPLIT, f"{n_inputs} input dimensions: input-split branch and bound (CROWN)"
    if "Conv" not in operators and not tp:
        why = f"{n_inputs} input dimensions, fully connected: β-CROWN BaB after split+MILP refinement"
        return REFINE, why
    kind = "convolutional" if "Conv" in operators else "fully connected, tp"
    return ACTIVATION, f"{n_inputs} input dimensions, {kind}: β-CROWN branch and bound"


def for_instance(onnx_arg: str, vnnlib: str, tp: bool = False) -> tuple[list[str], str]:
    """:func:`choose` for one instance: its spec's input dimensions and its networks' operators."""
    from .model.joint import model_for
    from .model.onnx_loader import read_onnx
    from .spec import load_vnnlib

    spec = load_vnnlib(vnnlib)
    operators: set[str] = set()
    if spec.n_inputs > INPUT_SPLIT_MAX_DIMS:
        operators = {n.op_type for n in read_onnx(model_for(onnx_arg, spec)[0]).graph.node}
    return choose(spec.n_inputs, operators, tp)


def settings(method: list[str], explicit: set[str]) -> list[str]:
    """The method's ``--key value`` pairs whose key the user did not set (``explicit``: dotted keys)."""
    pairs = zip(method[::2], method[1::2], strict=True)
    return [item for key, value in pairs if key.removeprefix("--") not in explicit for item in (key, value)]
