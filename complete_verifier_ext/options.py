"""The engine's option objects made from a :class:`~.config.Config`: α-CROWN's, BaB's, the split
refinement's, the CROWN pass size and this rank's device. One place, so that every stage (``verify.py``,
the benchmarks) builds them alike."""

from __future__ import annotations

import math
import os

import torch

from .bab.common import BabOptions
from .bounds.alpha import AlphaOptions
from .bounds.graph import Graph
from .bounds.split_refine import SplitOptions
from .config import Config
from .parallel import comm
from .parallel.memory import available_mb


def split_options(cfg: Config) -> SplitOptions:
    m, beta = cfg.solver.mip, cfg.solver.beta_crown
    return SplitOptions(
        depth=m.refine_split_depth,
        layers=m.refine_layers,
        iteration=beta.iteration,
        lr_alpha=cfg.solver.alpha_crown.lr_alpha,  # α starts afresh, as in α-CROWN
        lr_beta=beta.lr_beta,
        lr_decay=beta.lr_decay,
        max_domains=8 * cfg.solver.batch_size,
        passes=m.refine_split_passes,
    )


def alpha_options(cfg: Config) -> AlphaOptions:
    a = cfg.solver.alpha_crown
    return AlphaOptions(
        iteration=a.iteration,
        lr_alpha=a.lr_alpha,
        lr_decay=a.lr_decay,
        chunk=cfg.solver.crown.batch_size,
        sparse=cfg.general.sparse_alpha,
        claim_alpha=cfg.general.proof is not None,
    )


A_MATRICES_IN_FLIGHT = 4  # A-matrices of one width alive at once in a back-substitution (measured: 3-4)


def crown_chunk(cfg: Config, graph: Graph, batch: int = 1) -> int:
    """``solver.crown.batch_size``, or for 0 the most neurons per pass whose A-matrices (``2 chunk ×
    batch × widest layer`` floats, ``A_MATRICES_IN_FLIGHT`` of them) fit in an eighth of the memory
    available to each rank of this host; the same on every rank (a pass issues collectives)."""
    if cfg.solver.crown.batch_size > 0:
        return cfg.solver.crown.batch_size
    widest = max(math.prod(node.shape) for node in graph.nodes)
    per_neuron = 2 * batch * widest * 4 * A_MATRICES_IN_FLIGHT
    local = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))  # ranks sharing this host
    budget = available_mb(compute_device(cfg)) * 2**20 / 8 / max(1, local)
    chunk = max(1, int(min(budget / per_neuron, 2**31 - 1)))
    return int(comm.all_reduce(torch.tensor([float(chunk)], dtype=torch.float64), "min")[0])


def bab_options(cfg: Config) -> BabOptions:
    b, beta = cfg.bab.branching, cfg.solver.beta_crown
    return BabOptions(
        batch_size=cfg.solver.batch_size,
        max_domains=cfg.bab.max_domains,
        branching=b.method,
        candidates=b.candidates,
        reduceop=b.reduceop,
        iteration=beta.iteration,
        lr_alpha=beta.lr_alpha,
        lr_beta=beta.lr_beta,
        lr_decay=beta.lr_decay,
        input_split=b.input_split.enable,
        store_dtype=torch.float16 if cfg.solver.alpha_crown.alpha_dtype == "float16" else torch.float32,
        record=cfg.general.proof is not None,
    )


def compute_device(cfg: Config) -> torch.device:
    """This rank's device: its GPU under NCCL, else ``general.device`` for one process, else the CPU."""
    if comm.world_size() > 1:
        return comm.device()
    return torch.device(cfg.general.device)
