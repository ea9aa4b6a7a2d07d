"""What both VNN-LIB readers (1.x in :mod:`.v1`, 2.0 in :mod:`.v2`) produce before a
:class:`~.model.Spec` is assembled: located errors, linear rows in disjunctive normal form, and a 2.0
query's layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import UserError

__all__ = ["Dnf", "Layout", "NetworkSlots", "Row", "Slot", "Source", "SpecError", "Var"]


class SpecError(UserError):
    """Malformed or unsupported VNN-LIB file; the message starts with ``"<file>:<line>: "``."""


class Source(NamedTuple):
    """The file name and text being parsed; positions are character offsets into ``text``."""

    file: str
    text: str

    def error(self, pos: int, message: str) -> SpecError:
        """A :class:`SpecError` located at the line containing offset ``pos``."""
        return SpecError(f"{self.file}:{self.text.count(chr(10), 0, pos) + 1}: {message}")


# A variable is ("X", i) (an input of the verified model) or ("Y", j) (an output).
Var = tuple[str, int]


class Row(NamedTuple):
    """One constraint ``sum(coef * var) <= bound`` with the offset of its atom."""

    coefs: dict[Var, float]
    bound: float
    pos: int


Dnf = list[list[Row]]  # a disjunction of conjunctions of rows


@dataclass(frozen=True)
class Slot:
    """A tensor a VNN-LIB 2.0 network declares: its name, shape and, for each element in row-major
    order, its position in the joint input vector (inputs tied by ``==`` share one) or output vector."""

    name: str
    shape: tuple[int, ...]
    index: tuple[int, ...]
    dtype: str = "real"  # the type as a witness names it: real, float32, ...
    onnx_name: str | None = None  # the ONNX tensor it names (None: matched by position)


@dataclass(frozen=True)
class NetworkSlots:
    """One ``declare-network``: its inputs and outputs, in declaration order; ``equal_to``: the
    network it is declared equal to (it may then share that network's ONNX file), else ``""``."""

    name: str
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    equal_to: str = ""


@dataclass(frozen=True)
class Layout:
    """How a VNN-LIB 2.0 query's networks sit in the one model that is verified: the joint input is
    the query's free input elements (after ``==`` ties), the joint output every network's outputs
    concatenated (network by network, tensor by tensor, row-major)."""

    networks: tuple[NetworkSlots, ...]

    @property
    def single(self) -> bool:
        """One network with one input and one output, in the model's own order: its ONNX file is the
        model as it is."""
        if len(self.networks) != 1 or len(self.networks[0].inputs) != 1 or len(self.networks[0].outputs) != 1:
            return False
        slot = self.networks[0].inputs[0]
        return slot.index == tuple(range(len(slot.index)))
