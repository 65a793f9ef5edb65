"""Data parallelism's collectives per step, as the trainer issues them for each mode of
``parallel.dp_shard`` (``trainers/rules.py DP_MODES``): the bytes one rank sends (``ddp``: a ring
all-reduce of the gradients, compressed where ``comm.compression`` says; ``zero1`` and ``fsdp``:
FSDP2's gathers of the parameters, once a step for ``zero1``, and one reduce-scatter of the
gradients) and the calls (one per gradient bucket; per FSDP unit, its gathers and its
reduce-scatter), and which of them the compute can hide (:func:`dp_windows`). Counted on the
trainer's own ranks by ``tests/test_dp_collectives.py``; :mod:`.step_time` prices them."""

from __future__ import annotations

import math
from typing import Any, Mapping, Tuple

from omegaconf import DictConfig

from orchestrator.planner.memory import state_bytes
from orchestrator.planner.shapes import MiB, ModelShape, ParallelShape
from trainers import rules


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
    return n_params * (fsdp_gathers(s, _overlap(comm)) * pb + fsdp_reduces(s) * gb)


def fsdp_host_s(
    s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> float:
    """Seconds a CPU rank's cores spend moving FSDP's bytes per step (:func:`fsdp_bytes` at
    ``chip.host_copy_gbps``: gloo's sends and receives, FSDP's buffer copies; measured by
    ``bench/fsdp_host.py``); 0 where the device moves them (the key is 0)."""
    gbps = float(chip.host_copy_gbps or 0.0)
    return fsdp_bytes(s, n_params, precision, comm, planner) / (gbps * 1e9) if gbps > 0 else 0.0


def fsdp_gathers(s: ParallelShape, overlap: bool) -> int:
    """All-gathers of each FSDP unit per step (:func:`trainers.rules.fsdp_gathers`)."""
    return rules.fsdp_gathers(s.wrapping, s.pp, s.microbatches, overlap, s.schedule)


def fsdp_reduces(s: ParallelShape) -> int:
    """Reduce-scatters of each FSDP unit per step (:func:`trainers.rules.fsdp_reduces`)."""
    return rules.fsdp_reduces(s.wrapping, s.pp, s.microbatches, s.schedule)


def gather_share(s: ParallelShape, precision: DictConfig, comm: DictConfig, planner: DictConfig) -> float:
    """Of a step's DP bytes, the share that are parameter gathers (the rest: gradient reductions)."""
    if not s.fsdp or s.dp <= 1:
        return 0.0
    pb, gb, _ = state_bytes(precision, planner)
    gathered = fsdp_gathers(s, _overlap(comm)) * pb
    return gathered / (gathered + fsdp_reduces(s) * gb)


def dp_windows(s: ParallelShape, compute_s: float, backward_s: float, comm: DictConfig) -> Tuple[float, float]:
    """Seconds of compute (at 100% efficiency) behind which the step's (gathers, reductions) can
    run, as each mode issues them. Gradients are reduced during the last micro-batch's backward
    (DDP's reducer after ``no_sync``, FSDP2 after ``set_requires_gradient_sync(False)``, the TP
    replicas' armed hooks): ``backward / m``; under a pipeline torch's schedule reduces FSDP's
    gradients after every backward (its REDUCE_GRAD action) and the TP replicas reduce after the
    schedule: nothing hides them. ZeRO-3 reduces each micro-batch's behind its own backward: the
    whole backward. ``fsdp`` gathers a unit for every forward and backward, and
    FSDP2 prefetches the next unit's gather behind the current unit's compute (forward and
    backward): the whole compute; ``zero1`` gathers once, behind the first forward."""
    if s.dp <= 1 or not _overlap(comm):
        return 0.0, 0.0
    m = max(1, s.microbatches)
    forward = compute_s - backward_s
    if rules.zero3(s.wrapping, s.pp, s.schedule):  # every micro-batch's backward reduces its own
        return compute_s, backward_s
    after_schedule = s.pp > 1 and (s.fsdp or s.tp > 1)
    reduce = 0.0 if after_schedule else backward_s / m
    if s.wrapping == "fsdp":
        return compute_s, reduce
    if s.wrapping == "zero1":
        return forward / m, reduce
    return 0.0, reduce


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
        return units * (fsdp_gathers(s, overlap) + fsdp_reduces(s))
    return math.ceil(n_params * state_bytes(precision, planner)[1] / (float(comm.bucket_mb) * MiB))


def hidden(c: Mapping[str, Any], dp, ec, ops: Any):
    """Of ``dp`` seconds of data-parallel collectives (floats, or a calibration's arrays), those
    hidden behind the compute: the gathers' share behind their window, the reductions' behind
    theirs, each at most the ``overlap`` fraction of itself (:func:`dp_windows`); ``c`` is a
    step's parts by name (``step_time.model``)."""
    g = c["dp_gather_share"]
    gathers = ops.minimum(c["overlap"] * dp * g, c["gather_window_s"] / ec)
    return gathers + ops.minimum(c["overlap"] * dp * (1.0 - g), c["reduce_window_s"] / ec)
