"""The one model a VNN-LIB 2.0 instance is verified on: its networks composed over the joint input.

VNN-COMP 2026 hands a tool the networks of an instance as a list, ``"[('f', 'a.onnx'), ('g',
'b.onnx')]"``, where earlier years gave one path. :func:`model_for` turns that argument and the spec's
:class:`~complete_verifier_ext.spec.Layout` into one ONNX file that both engines load like any other:

* input ``joint_input`` of shape ``[1, n]``: the query's free input elements (inputs tied by ``==``
  are one element); each network's input is that vector itself where it is the whole of it in order,
  else a constant 0/1 ``MatMul`` picking its elements, reshaped to the network's input shape with the
  batch axis left free (``-1``: α,β-CROWN's attack runs a batch of restarts through the model);
* every network's nodes, names prefixed (a model whose input is 1-D, as the ACAS Xu nets' ``W @ x``,
  is first made batched: ``MatMul(W, x)`` becomes ``MatMul(x, Wᵀ)``);
* output ``joint_output`` of shape ``[1, m]``: every network's outputs flattened and placed at their
  positions by constant ``MatMul`` embeddings that are summed (only ops both engines already bound
  exactly: no ``Concat``).

Composition is exact (0/1 matrices), so the spec's linear rows over the joint output are the
property itself. A 1.x spec, or a 2.0 spec with one network of one input and output given one
path, uses the file as it is. Composed files are cached by content under the package's cache folder.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UserError
from ..spec import Layout, NetworkSlots, Slot, Spec, cache_root
from ..spec.networks import is_network_list, parse_networks
from .onnx_loader import ModelError, read_onnx

__all__ = ["Networks", "compose", "model_for", "network_paths", "origin"]

Networks = dict[str, str]  # declared network name -> its ONNX file

JOINT_INPUT, JOINT_OUTPUT = "joint_input", "joint_output"
_FORMAT = 3  # of the composed files: a change in how they are built makes new ones
_ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "Identity",
        "Neg",
        "Sigmoid",
        "Tanh",
        "Clip",
        "LeakyRelu",
        "Constant",
    }
)


def network_paths(arg: str, layout: Layout, spec_file: str) -> Networks:
    """Each declared network's ONNX file, from the instance's ONNX argument: a list names them; one
    path serves the one network that is not ``equal-to`` another; an ``equal-to`` network left out
    of the list shares its original's file (as the VNN-COMP 2026 checker does)."""
    supplied = parse_networks(arg)
    declared = {n.name: n for n in layout.networks}
    explicit: dict[str, str] = {}
    if supplied[0][0] is None:
        own = [n.name for n in layout.networks if not n.equal_to]
        if len(supplied) != 1 or len(own) != 1:
            names = ", ".join(declared)
            raise UserError(
                f"{spec_file}: declares the networks {names}: give the ONNX argument as a list "
                "[('name', 'file.onnx'), ...]"
            )
        explicit[own[0]] = supplied[0][1]
    else:
        for name, path in supplied:
            if name not in declared:
                raise UserError(
                    f"network list: {name!r} is not declared in {spec_file} ({', '.join(declared)})"
                )
            if name in explicit:
                raise UserError(f"network list: {name!r} is given twice")
            explicit[name] = path
    paths: Networks = {}
    for net in layout.networks:
        path = explicit.get(net.name) or paths.get(net.equal_to)
        if path is None:
            raise UserError(f"network list: no ONNX file for network {net.name!r} of {spec_file}")
        paths[net.name] = path
    return paths


def model_for(arg: str, spec: Spec) -> tuple[str, Networks | None]:
    """The ONNX file to verify for the instance ``(arg, spec)`` and, for a 2.0 spec, each network's
    own file (what a witness is checked on)."""
    if spec.layout is None:
        if is_network_list(arg):
            raise UserError(f"{spec.path}: a VNN-LIB 1.x spec takes one ONNX file, not a network list")
        return arg, None
    paths = network_paths(arg, spec.layout, spec.path)
    if spec.layout.single:  # the model as it is, whatever its input's rank
        return paths[spec.layout.networks[0].name], paths
    return _cached(spec.layout, paths), paths


def origin(tensor: str, layout: Layout) -> tuple[str, str]:
    """The network a tensor of the model :func:`model_for` gives for ``layout`` belongs to, and its
    name in that network's own file (the composed model's names carry their network's prefix)."""
    if layout.single:
        return layout.networks[0].name, tensor
    for k, net in enumerate(layout.networks):
        if tensor.startswith(_prefix(k)):
            return net.name, tensor[len(_prefix(k)) :]
    raise ValueError(f"tensor {tensor!r} is in none of the networks")


def _prefix(k: int) -> str:
    """The names of network ``k``'s tensors and nodes in the composed model start with it."""
    return f"n{k}_"


def _cached(layout: Layout, paths: Networks) -> str:
    """The composed model's file, written once per (layout, files) under the cache folder."""
    key = hashlib.sha256(f"{_FORMAT}\0{layout!r}".encode())
    for name in sorted(paths):
        st = os.stat(paths[name])
        key.update(f"\0{name}\0{os.path.abspath(paths[name])}\0{st.st_mtime_ns}\0{st.st_size}".encode())
    file = cache_root() / "joint" / f"{key.hexdigest()[:32]}.onnx"
    if not file.exists():
        model = compose(layout, paths)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
        onnx.save(model, tmp)
        os.replace(tmp, file)
    return str(file)


def _dims(value: onnx.ValueInfoProto) -> list[int]:
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1
        for d in value.type.tensor_type.shape.dim
    ]


def _match(slots, values, what: str, net: NetworkSlots, path: str) -> list:
    """Pair declared tensors with the ONNX graph's inputs or outputs: by ONNX name where the spec
    gives one, else by position; element counts must agree (as the VNN-COMP checker reshapes)."""
    if len(slots) != len(values):
        raise ModelError(
            f"{path}: network {net.name!r} declares {len(slots)} {what}s, the model has {len(values)}"
        )
    by_name = {v.name: v for v in values}
    pairs = []
    for slot, value in zip(slots, values, strict=True):
        if slot.onnx_name:
            if slot.onnx_name not in by_name:
                raise ModelError(f"{path}: no {what} named {slot.onnx_name!r} (declared for {slot.name})")
            value = by_name[slot.onnx_name]
        dims = _dims(value)
        if int(np.prod(dims)) != len(slot.index):
            raise ModelError(
                f"{path}: {what} {value.name!r} has {int(np.prod(dims))} elements (shape {dims}), "
                f"but {slot.name} declares {len(slot.index)}"
            )
        pairs.append((slot, value))
    return pairs


def _batched(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """A model whose input is 1-D made batched: ``MatMul(W, x)`` with a constant 2-D ``W`` becomes
    ``MatMul(x, Wᵀ)``; elementwise ops broadcast as they are; anything else is refused."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    consts = {t.name: t for t in g.initializer}
    for node in g.node:
        if node.op_type == "MatMul" and node.input[0] in consts and node.input[1] not in consts:
            W = numpy_helper.to_array(consts[node.input[0]])
            if W.ndim != 2:
                raise ModelError(f"{path}: node '{node.name}' (MatMul): W @ x needs a 2-D constant W")
            name = f"{node.input[0]}__T"
            if name not in consts:
                consts[name] = numpy_helper.from_array(np.ascontiguousarray(W.T), name)
                g.initializer.append(consts[name])
            node.input[:] = [node.input[1], name]
        elif node.op_type == "MatMul" and node.input[1] in consts:
            pass  # x @ W is batched as it is
        elif node.op_type not in _ELEMENTWISE:
            raise ModelError(
                f"{path}: node '{node.name}' ({node.op_type}): a model with a 1-D input can be composed only "
                "from MatMul and elementwise operators"
            )
    used = {name for node in g.node for name in node.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    return model


def _const(inits: list, name: str, value: np.ndarray) -> str:
    inits.append(numpy_helper.from_array(value, name))
    return name


def _feed(nodes: list, inits: list, name: str, slot: Slot, n_in: int, shape: list[int]) -> None:
    """The network input ``name`` (per-sample ``shape``) from the joint input: the whole of it in
    order, or the elements a 0/1 ``MatMul`` picks."""
    source = JOINT_INPUT
    if slot.index != tuple(range(n_in)):
        pick = np.zeros((n_in, len(slot.index)), dtype=np.float32)
        pick[list(slot.index), np.arange(len(slot.index))] = 1.0
        source = f"{name}__picked"
        nodes.append(helper.make_node("MatMul", [JOINT_INPUT, _const(inits, f"{source}_W", pick)], [source]))
    shape_const = _const(inits, f"{name}__shape", np.array([-1, *shape], dtype=np.int64))
    nodes.append(helper.make_node("Reshape", [source, shape_const], [name]))


def _place(nodes: list, inits: list, name: str, slot: Slot, n_out: int, alone: bool) -> str:
    """The network output ``name`` flattened and, unless it is the joint output ``alone``, placed at
    its positions by a 0/1 ``MatMul``; returns the tensor to sum into the joint output."""
    flat = f"{name}__flat"
    nodes.append(helper.make_node("Flatten", [name], [flat], axis=1))
    if alone:
        return flat
    embed = np.zeros((len(slot.index), n_out), dtype=np.float32)
    embed[np.arange(len(slot.index)), list(slot.index)] = 1.0
    placed = f"{flat}__placed"
    nodes.append(helper.make_node("MatMul", [flat, _const(inits, f"{placed}_W", embed)], [placed]))
    return placed


def compose(layout: Layout, paths: Networks) -> onnx.ModelProto:
    """The joint model (see the module docstring)."""
    n_in = 1 + max(i for n in layout.networks for s in n.inputs for i in s.index)
    n_out = sum(len(s.index) for n in layout.networks for s in n.outputs)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    opset, ir = 11, 7
    terms: list[str] = []
    for k, net in enumerate(layout.networks):
        path = paths[net.name]
        model = read_onnx(path)
        opset = max([opset] + [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")])
        ir = max(ir, model.ir_version)
        init_names = {t.name for t in model.graph.initializer}
        feeds = [v for v in model.graph.input if v.name not in init_names]
        unbatched = any(len(_dims(v)) == 1 for v in feeds)
        if unbatched:
            model = _batched(model, path)
        ins = _match(net.inputs, feeds, "input", net, path)
        outs = _match(net.outputs, list(model.graph.output), "output", net, path)
        prefix = _prefix(k)
        model = onnx.compose.add_prefix(model, prefix)
        for slot, value in ins:
            _feed(
                nodes, inits, prefix + value.name, slot, n_in, _dims(value) if unbatched else _dims(value)[1:]
            )
        nodes.extend(model.graph.node)
        inits.extend(model.graph.initializer)
        alone = len(net.outputs) == 1 and len(layout.networks) == 1
        terms += [_place(nodes, inits, prefix + value.name, slot, n_out, alone) for slot, value in outs]
    total = terms[0]
    for i, term in enumerate(terms[1:]):
        out = f"joint_sum{i}"
        nodes.append(helper.make_node("Add", [total, term], [out]))
        total = out
    nodes.append(helper.make_node("Identity", [total], [JOINT_OUTPUT]))
    graph = helper.make_graph(
        nodes,
        "joint",
        [helper.make_tensor_value_info(JOINT_INPUT, onnx.TensorProto.FLOAT, [1, n_in])],
        [helper.make_tensor_value_info(JOINT_OUTPUT, onnx.TensorProto.FLOAT, [1, n_out])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    onnx.checker.check_model(model)
    return model
