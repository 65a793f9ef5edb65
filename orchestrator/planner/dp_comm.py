"""Data parallelism's collectives per step, as the trainer issues them: the bytes one rank sends
(a ring all-reduce of the gradients for DDP, compressed where ``comm.compression`` says; FSDP's
gathers of the parameters and one reduce-scatter of the gradients) and the calls (one per DDP
bucket; per FSDP unit, its gathers and its reduce-scatter). Both are counted on the trainer's own
ranks by ``tests/test_dp_collectives.py``; :mod:`.step_time` prices them."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from orchestrator.planner.memory import state_bytes
from orchestrator.planner.shapes import MiB, ModelShape, ParallelShape


def allreduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    return 2.0 * size * (n - 1) / n if n > 1 else 0.0


def _overlap(comm: DictConfig) -> bool:
    return bool(comm.overlap)


def dp_traffic_bytes(
    m: ModelShape, s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig, planner: DictConfig
) -> float:
    """Bytes one rank sends per step for data parallelism."""
    if s.dp == 1:
        return 0.0
    pb, gb, _ = state_bytes(precision, planner)
    if s.fsdp:  # of the bytes FSDP moves through the rank, a ring sends (dp - 1) / dp
        return fsdp_bytes(s, n_params, precision, comm, planner) * (s.dp - 1) / s.dp
    if comm.compression in ("fp16", "bf16"):
        return allreduce_bytes(n_params * 2, s.dp)
    if comm.compression == "powersgd":  # P and Q factors of every matrix, vectors in full
        mats = m.matrices()
        dense = m.n_params - sum(a * b for a, b in mats)
        low_rank = sum(int(comm.powersgd_rank) * (a + b) for a, b in mats)
        return allreduce_bytes((low_rank + dense) * gb, s.dp)
    if comm.compression == "topk":  # all-gather of k values + int32 indices from every rank
        return float(comm.topk_ratio) * n_params * (gb + 4) * (s.dp - 1)
    return allreduce_bytes(n_params * gb, s.dp)


def fsdp_bytes(
    s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig, planner: DictConfig
) -> float:
    """Bytes FSDP moves through a rank per step, parameters gathered (:func:`fsdp_gathers`
    times) and gradients reduce-scattered once: the DP traffic's source, and what a CPU host's
    cores copy (``chip.host_copy_gbps``)."""
    if not s.fsdp or s.dp <= 1:
        return 0.0
    pb, gb, _ = state_bytes(precision, planner)
    return n_params * (fsdp_gathers(s, _overlap(comm)) * pb + gb)


def fsdp_host_s(
    s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> float:
    """Seconds a CPU rank's cores spend moving FSDP's bytes per step (:func:`fsdp_bytes` at
    ``chip.host_copy_gbps``: gloo's sends and receives, FSDP's buffer copies; measured by
    ``bench/fsdp_host.py``); 0 where the device moves them (the key is 0)."""
    gbps = float(chip.host_copy_gbps or 0.0)
    return fsdp_bytes(s, n_params, precision, comm, planner) / (gbps * 1e9) if gbps > 0 else 0.0


def fsdp_gathers(s: ParallelShape, overlap: bool) -> int:
    """All-gathers of each FSDP unit per step, as torch 2.13's FSDP2 issues them under the trainer
    (counted by ``tests/test_dp_collectives.py``). Without a pipeline, the micro-batches run one
    after another and each unit reshards after its backward: a block unit (``comm.overlap``,
    ``reshard_after_forward=True``) is gathered for each micro-batch's forward and again for its
    backward, 2 m; the one root unit without overlap (``reshard_after_forward=False``) once per
    micro-batch, m. Under a pipeline, torch's stage keeps the units gathered after every backward
    but the last (``set_reshard_after_backward(False)``, ``pipelining/stage.py``): a block unit is
    gathered for the first forward and for each backward, m + 1; the root, never resharded
    between, once. The gradients are reduce-scattered once a step (on the last micro-batch)."""
    m = s.microbatches
    if s.pp > 1:
        return m + 1 if overlap else 1
    return 2 * m if overlap else m


def dp_calls(
    m: ModelShape,
    s: ParallelShape,
    n_params: float,
    layers: int,
    precision: DictConfig,
    comm: DictConfig,
    planner: DictConfig,
) -> int:
    """Data-parallel collectives per step: one per DDP bucket; per FSDP unit (with overlap each
    block and each stage chunk's root, without one root per chunk), its gathers
    (:func:`fsdp_gathers`) and one reduce-scatter."""
    if s.dp <= 1:
        return 0
    if s.fsdp:
        overlap = _overlap(comm)
        units = layers + s.chunks_per_rank if overlap else s.chunks_per_rank
        return units * (fsdp_gathers(s, overlap) + 1)
    return math.ceil(n_params * state_bytes(precision, planner)[1] / (float(comm.bucket_mb) * MiB))
