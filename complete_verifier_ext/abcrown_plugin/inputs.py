"""The user's files as α,β-CROWN loads them: a bad ONNX model or VNN-LIB spec is one line naming the
file (and the line), as on the native engine, never α,β-CROWN's traceback.

α,β-CROWN signals bad input with whatever its loaders raise (``AssertionError`` whose message is the
whole spec, protobuf's ``DecodeError``, a reshape's ``RuntimeError``). They are recognised where they
are raised, in the two loading stages, and only when a check of the file itself confirms the mistake:

* ``read_vnnlib``: our own VNN-LIB reader names the file and the line; a file ours reads but
  α,β-CROWN's reader does not (its parser takes a subset of the format) is named with α,β-CROWN's
  first line of complaint;
* ``load_model_onnx``: a file ``onnx`` cannot parse, or a model whose input does not have the spec's
  number of inputs.

α,β-CROWN caches a parsed VNN-LIB file as ``<spec>.compiled`` beside the spec; each rank reads a copy
in its own cache folder instead (inputs may be read-only, and P ranks would race on one file).

A VNN-LIB 2.0 spec (VNN-COMP 2026), which α,β-CROWN's reader does not know, is read by ours
(:mod:`complete_verifier_ext.spec.v2`) and handed to α,β-CROWN in its own structure, exactly (the same
float64 box and ``C y <= d`` rows); its networks, given as a list, are one joint model
(:mod:`complete_verifier_ext.model.joint`) that α,β-CROWN's ONNX loader reads like any other.

Anything else is re-raised unchanged: a bug keeps its traceback.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..spec.networks import is_network_list, map_paths
from .locate import PluginError
from .run import Run

_SHORT = 160  # characters of α,β-CROWN's own message kept in ours (its spec errors hold the whole file)


def short(e: BaseException) -> str:
    """``Type: first line`` of an exception, cut to a readable length."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= _SHORT else text[:_SHORT] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def spec_problem(path: str, error: BaseException | None) -> str:
    """What is wrong with the VNN-LIB file ``path`` that α,β-CROWN's reader rejected with ``error``
    (None: a 1.x file given a network list)."""
    from ..spec import load_vnnlib

    try:
        load_vnnlib(path, cache=False)
    except UserError as e:
        return str(e)
    except Exception:  # our reader failing otherwise says nothing about the file
        pass
    if error is None:
        return f"{path}: a VNN-LIB 1.x spec takes one ONNX file, not a network list"
    return f"{path}: alpha-beta-CROWN's VNN-LIB reader cannot read this file ({short(error)})"


def _onnx_model(path: str):
    import onnx

    data = Path(path).read_bytes()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    return onnx.load_model_from_string(data)


def model_problem(path: str, x: Any) -> str | None:
    """What is wrong with the ONNX file ``path`` (given the spec's inputs ``x``), or None when the file
    looks fine: then the failure is not the user's."""
    try:
        model = _onnx_model(path)
    except OSError:
        return None  # a missing file is reported as such by the caller's FileNotFoundError
    except Exception as e:  # protobuf's DecodeError and friends: the bytes are not an ONNX model
        return f"{path}: not a readable ONNX model ({short(e)})"
    if x is None:
        return None
    init = {t.name for t in model.graph.initializer}
    feeds = [i for i in model.graph.input if i.name not in init]
    if not feeds:
        return f"{path}: the model has no input"
    dims = [d.dim_value for d in feeds[0].type.tensor_type.shape.dim]
    count = 1
    for d in dims:
        count *= max(int(d), 1)
    given = int(getattr(x, "numel", lambda: len(x))())
    if dims and count != given:
        return (
            f"{path}: input '{feeds[0].name}' has {count} elements (shape {dims}) but the VNN-LIB spec "
            f"declares {given} inputs"
        )
    return None


def spec2(path: str) -> Any:
    """Our reading of ``path`` when it is VNN-LIB 2.0, else None (a 1.x file is α,β-CROWN's to read)."""
    from ..spec import load_vnnlib, read_text
    from ..spec.v2 import is_vnnlib2

    try:
        text = read_text(str(path))
    except (OSError, UserError):  # not text: left to α,β-CROWN's reader, whose failure names the file
        return None
    if not is_vnnlib2(text):
        return None
    try:
        return load_vnnlib(path)
    except UserError as e:
        raise PluginError(str(e)) from None


def abcrown_form(spec: Any) -> list:
    """A :class:`~complete_verifier_ext.spec.Spec` as α,β-CROWN's ``read_vnnlib`` returns a file: per
    input box, ``(box as [lower, upper] pairs, [(C, d) per clause])``, float64."""
    return [
        (
            [[float(lo), float(hi)] for lo, hi in zip(r.lower, r.upper, strict=True)],
            [(np.array(c.C, dtype=float), np.array(c.d, dtype=float)) for c in r.clauses],
        )
        for r in spec.regions
    ]


def _cached(orig: Callable, cache_dir: str) -> Callable:
    """α,β-CROWN's ``read_vnnlib`` (``orig``) reading a copy of the spec in ``cache_dir`` (named by its
    content; a gzipped spec, as VNN-COMP 2026 hands them, decompressed: its reader takes text only),
    where its ``.compiled`` cache then lives too."""

    def read_vnnlib(vnnlib_filename, regression=False):
        data = Path(vnnlib_filename).read_bytes()
        if data[:2] == b"\x1f\x8b":
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as e:
                raise PluginError(f"{vnnlib_filename}: not a readable gzip file ({short(e)})") from None
        os.makedirs(cache_dir, exist_ok=True)
        copy = os.path.join(cache_dir, hashlib.sha256(data).hexdigest()[:32] + ".vnnlib")
        if not os.path.exists(copy):
            tmp = f"{copy}.{os.getpid()}.tmp"
            Path(tmp).write_bytes(data)
            os.replace(tmp, copy)
        return orig(copy, regression)

    return read_vnnlib


def read_vnnlib(run: Run, orig: Callable) -> Callable:
    """``read_vnnlib`` whose bad-input failures are one line (see the module docstring), reading a
    VNN-LIB 2.0 file itself, and α,β-CROWN's own reader reading the rank's cached copy
    (``run.spec_cache``); ``vnnlib_filename`` is the user's path, the one named."""
    orig = _cached(orig, run.spec_cache)

    def read_vnnlib(vnnlib_filename, regression=False):
        if not Path(vnnlib_filename).is_file():
            raise PluginError(f"{vnnlib_filename}: VNN-LIB file not found")
        spec = None if regression else spec2(vnnlib_filename)
        if spec is not None:
            return abcrown_form(spec)
        try:
            return orig(vnnlib_filename, regression)
        except (
            AssertionError,
            ValueError,
            IndexError,
            KeyError,
            NotImplementedError,
            UnicodeDecodeError,
        ) as e:
            raise PluginError(spec_problem(str(vnnlib_filename), e)) from None

    return read_vnnlib


def default_onnx_and_vnnlib_loader(run: Run, orig: Callable) -> Callable:
    """α,β-CROWN's ``default_onnx_and_vnnlib_loader`` given a VNN-LIB 2.0 instance's joint model in
    place of its ONNX argument (a path, or the VNN-COMP 2026 network list)."""

    def default_onnx_and_vnnlib_loader(file_root, onnx_path, vnnlib_path):
        spec = spec2(os.path.join(file_root, vnnlib_path))
        if spec is None:
            if is_network_list(onnx_path):  # our reader says what is wrong with the spec, if anything
                raise PluginError(spec_problem(os.path.join(file_root, vnnlib_path), None))
            return orig(file_root, onnx_path, vnnlib_path)
        from ..model import joint

        arg = map_paths(onnx_path, lambda p: os.path.join(file_root, p))
        try:
            model, _ = joint.model_for(arg, spec)
        except UserError as e:
            raise PluginError(str(e)) from None
        return orig("", model, os.path.join(file_root, vnnlib_path))

    return default_onnx_and_vnnlib_loader


def load_model_onnx(run: Run, orig: Callable) -> Callable:
    """``load_model_onnx`` whose failures on a bad file are one line naming it."""

    def load_model_onnx(path, quirks=None, x=None):
        if not Path(path).is_file():
            raise PluginError(f"{path}: ONNX file not found")
        try:
            model, shape = orig(path, quirks, x)
        except Exception:
            problem = model_problem(str(path), x)
            if problem is None:
                raise
            raise PluginError(problem) from None
        count = math.prod(int(d) for d in shape)
        given = int(x.numel()) if x is not None else 0
        if x is not None and count > 0 and given % count != 0:  # α,β-CROWN views the box as (-1, *shape)
            raise PluginError(
                f"{path}: the model's input has {count} elements (shape {list(shape)}) but the VNN-LIB "
                f"spec declares {given} inputs"
            )
        return model, shape

    return load_model_onnx
