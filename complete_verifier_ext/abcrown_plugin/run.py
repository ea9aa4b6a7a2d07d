"""One rank's run of α,β-CROWN with the plugin: every piece of state the replacements share, in one
object built once per rank and ``ABCROWN(args).main()`` call (:func:`.rank.rank_main`), whose
per-instance parts are reset where each instance ends (:meth:`Run.next_instance`).

Each replacement is made from it (``make(run, original)``, one row of :mod:`.table`) and finds it in
its closure, never through a module global; code that runs beside a replacement gets the part it
needs as an argument (the shard registry, the row-dealing state). Nothing of a run outlives it: the
next call in the same process (a csv's next ``main()``, or an instance forked from a resident worker)
builds a new ``Run``. A csv's instances run inside one ``main()`` call and so share a ``Run``: it spans
them because α,β-CROWN loads the model, its config and our patches once per ``main()``, and the
patches hold the run in their closures; what one instance learns (out-of-memory caps, the round's
state) is reset when it ends, and what spans them is the run's statistics.

The parts, each owned by one concern:

* :class:`Probe` (``probe.py``): what α,β-CROWN computed, per instance, for our ``--summary``;
* :class:`Clocks` (``clocks.py``): the first instance's clock, the rank-local clock switch;
* :class:`Shards` (``weights/``): which auto_LiRPA weights are sharded, and whether they are whole now;
* :class:`Rows` (``rows/``): the row dealing of each bound pass, its α kept by row;
* :class:`Rounds` (``search/``): what one BaB round hands to the patches inside it, and its collectives;
* :class:`Proofs` (``proofs.py``, ``proof_write.py``; with ``general.proof`` only): how the instance
  running was proved, as the leaves of its proof trees.

The plugin's one piece of process-wide state is :mod:`.locate`'s loaded checkout: α,β-CROWN's modules
are top-level names in ``sys.modules``, so a process holds one checkout for its lifetime.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ParallelConfig


@dataclass
class Record:
    """What α,β-CROWN computed for one instance, as it computed it."""

    verdict: str = "unknown"
    time_s: float = 0.0
    crown: list[float] = field(default_factory=list)
    alpha_crown: list[float] = field(default_factory=list)
    bab_domains: int = 0  # domains visited by BaB
    bab_s: float = 0.0
    unstable: list[int] = field(default_factory=list)  # unstable neurons before each ReLU, after CROWN
    bab_fits: int | None = None  # after running out of memory: the domains or boxes a round that fit
    started_at: float = field(default_factory=time.time)  # the rank began work on it (the first: when
    #   α,β-CROWN, imported and patched, starts its run)


@dataclass
class Probe:
    """The records of the run's instances (``current``: the one running)."""

    records: list[Record] = field(default_factory=list)
    current: Record = field(default_factory=Record)
    optimized: bool = False  # α-CROWN ran since the last init_alpha
    alpha_elements: int = 0  # the most α elements this rank optimised in one α-CROWN run
    # called with ("bounds", True/False) at the start and end of LiRPANet.build, ("bab", ...) of BaB
    on_phase: Callable[[str, bool], None] | None = None

    def next_instance(self, verdict: str, time_s: float) -> None:
        self.current.verdict, self.current.time_s = verdict, time_s
        self.records.append(self.current)
        self.current = Record()

    def phase(self, name: str, started: bool) -> None:
        """Tell ``on_phase`` (if any) that phase ``name`` starts or ends."""
        if self.on_phase:
            self.on_phase(name, started)


@dataclass
class Clocks:
    started_wall: float  # the verifier's start (time.time()): the first instance's clock
    first: bool = True  # no instance has started yet
    check: bool = False  # the first instance's time is still to be checked once its timeout is known
    local: bool = False  # the rank's own clock, not the ranks' maximum (rank-local work)
    shift: float = 0.0  # seconds the instance's Logger.start_time was moved back beyond its start


@dataclass
class Shards:
    """The weights of auto_LiRPA and of ``model_ori`` that hold 1/P row shards (native
    :class:`~complete_verifier_ext.parallel.sharded.ShardedWeight`)."""

    by_param: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # BoundParams ->
    by_model: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # model_ori -> {
    #   tensor name: (ShardedWeight, transposed)}
    whole_layers: dict[str, str] = field(default_factory=dict)  # tp: layers it cannot shard (why)
    replicated: bool = False  # every weight whole for a while (BaB): the op wrappers pass through
    calling: set[int] = field(default_factory=set)  # ids of the nodes whose wrapped method runs now


@dataclass
class Rows:
    active: bool  # the rows of each bound pass are dealt (P > 1, outside a BaB search)
    dealing: list[str] = field(default_factory=list)  # start nodes being dealt now (innermost last)
    dealt: collections.Counter[str] = field(default_factory=collections.Counter)  # rows by operator
    alpha: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)  # BoundRelu ->
    #   {start name: AlphaLayout}, the α kept by row
    owners: dict[str, Any] = field(default_factory=dict)  # start node -> the rank of each of its neurons
    module: Any = None  # weakref to the BoundedModule whose rows are dealt (set by its get_sparse_C)
    local_lA: list = field(default_factory=list)  # (node, counts): its lA holds this rank's spec rows
    fits: dict[str, int] = field(default_factory=dict)  # layer -> rows per pass that fit after an OOM
    one_pass: bool = False  # P = 1 would bound each layer in one pass (crown.batch_size at its default)
    dense: set[str] = field(default_factory=set)  # conv start nodes bounded densely, by whole channels
    dense_pass: Any = None  # the dense pass running now: (its channels, C, H·W), else None


@dataclass
class Rounds:
    picked: tuple[int, int] | None = None  # inside a round: (this rank's picks, all ranks' picks)
    collectives: list[int] = field(default_factory=list)  # lockstep collectives of each round here
    fits: int | None = None  # after running out of memory, this rank's domains (activation BaB) or boxes
    #   bounded (input-split BaB) a round that fit
    undo: Any = None  # the last pick_out's search.oom.Undo (the round's domains back on the list)


@dataclass(frozen=True)
class Bounded:
    """One box that ``LiRPANet.build`` bounded: the box (float64, flat), the input bounds of each
    α,β-CROWN ReLU and Sigmoid over it (flat float64 ``(lower, upper)`` by the proof's layer key,
    :func:`.proofs.layer_keys`; None: not known for this box alone), the output rows it proved
    (:func:`.proofs.row_key`), and the slopes that made the input bounds (by layer key, the ``alpha``
    entries of docs/proofs.md; empty where unknown), and the output slopes of each row it optimised
    (:func:`.proofs._output_slopes`)."""

    lower: Any
    upper: Any
    claims: dict | None
    proven: frozenset[bytes]
    alpha: dict = field(default_factory=dict)
    output: dict = field(default_factory=dict)  # an output row's c_key -> its leaf's ``alpha``


@dataclass
class StartSlopes:
    """α-CROWN's slopes behind one start node's pre-activation bounds, recorded while a build optimises
    them (flat torch tensors): its bounds at the first iteration seen and the best since, and per ReLU
    before it, the ``[lower, upper]`` slopes ``(neurons, features)`` of the iteration that gave each
    neuron its best bound (NaN: none), with the flat neurons of that ReLU's α features."""

    first: tuple
    best: list
    alpha: dict = field(default_factory=dict)  # ReLU name -> [lower, upper]
    features: dict = field(default_factory=dict)  # ReLU name -> np.ndarray


@dataclass
class Proofs:
    """``general.proof``: what this rank recorded of how the instance running was proved (:mod:`.proofs`
    records, :mod:`.proof_write` gathers every rank's and writes). Clauses are named by their rows (a
    frozenset of :func:`.proofs.row_key`), input-split boxes by ``proofs.Key``."""

    path: str  # where an unsat writes its proof
    refused: str | None = None  # the first reason the instance can have no proof
    relu_sizes: list[int] = field(default_factory=list)  # α,β-CROWN's ReLUs in its order: their neurons
    relu_order: list[int] | None = None  # of each of them, its position among the ONNX graph's Relu nodes
    sigmoid_sizes: list[int] = field(default_factory=list)  # its Sigmoids in the ONNX graph's order
    builds: list[Bounded] = field(default_factory=list)  # every box LiRPANet.build bounded
    bab_claims: Bounded | None = None  # activation BaB: the build whose bounds its root kept
    split_relu: dict[str, int] = field(default_factory=dict)  # split node name -> its ReLU's index
    bab_specs: set[frozenset] = field(default_factory=set)  # clauses activation BaB searched
    roots_closed: set[frozenset] = field(default_factory=set)  # ... and proved at its root, unsplit
    phase_leaves: set[tuple] = field(default_factory=set)  # (clause, ((relu, neuron, ±1), ...)) verified
    phase_evidence: dict[tuple, dict] = field(default_factory=dict)  # such a leaf -> its evidence
    bab_relus: list = field(default_factory=list)  # activation BaB: α,β-CROWN's ReLU nodes, in order
    input_roots: list[tuple] = field(default_factory=list)  # input split: each clause's root box (Key)
    splits: dict[tuple, tuple] = field(default_factory=dict)  # input split: box -> the boxes it was cut into
    clips: dict[tuple, tuple | None] = field(default_factory=dict)  # box -> its clipped box (None: nothing)
    verified: set[tuple] = field(default_factory=set)  # boxes bounded above the threshold
    last: list[tuple] = field(default_factory=list)  # the boxes a clip gets next, in order
    names: dict[bytes, frozenset] = field(default_factory=dict)  # (c, rhs) bytes -> clause (a cache)
    slopes: dict[str, StartSlopes] | None = None  # inside a build: start node name -> its slopes

    def refuse(self, why: str) -> None:
        """No proof for this instance, for the first reason given."""
        self.refused = self.refused or why


@dataclass
class Run:
    """One rank's run: its settings (the source of P for the plugin is ``world``) and state."""

    par: ParallelConfig
    world: int
    spec_cache: str  # this rank's folder for VNN-LIB copies and their α,β-CROWN cache
    started_wall: float
    probe: Probe = field(default_factory=Probe)
    clock: Clocks = field(init=False)
    shards: Shards = field(default_factory=Shards)
    rows: Rows = field(init=False)
    rounds: Rounds = field(default_factory=Rounds)
    served_at_start: dict[str, int] = field(default_factory=dict)  # weight fetches before the run
    calls_at_start: int = 0  # lockstep collectives this process issued before the run
    proof: Proofs | None = None  # general.proof set: the instance's proof records

    def __post_init__(self) -> None:
        self.clock = Clocks(self.started_wall)
        self.rows = Rows(active=self.world > 1)

    def next_instance(self, verdict: str, time_s: float) -> None:
        """The instance ended: its record closed, and what it learned about memory forgotten, so that a
        cap one instance of a csv set (rows per pass, domains per round) does not cap the next."""
        self.probe.current.bab_fits = self.rounds.fits
        self.probe.next_instance(verdict, time_s)
        self.rows.fits.clear()
        self.rounds.fits = self.rounds.picked = self.rounds.undo = None  # (its collectives: statistics)
        if self.proof is not None:
            self.proof = Proofs(self.proof.path)

    @property
    def sharded(self) -> bool:
        """The weights are sharded (P > 1 under fsdp or tp)."""
        return self.world > 1 and self.par.mode in ("fsdp", "tp")

    @property
    def weights_sharded(self) -> bool:
        """BaB keeps the weights sharded (``parallel.bab_weights`` resolved: ``tp`` always)."""
        return self.par.bab_weights_resolved == "sharded"
