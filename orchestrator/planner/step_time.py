"""Step time, per optimizer step.

- compute = model FLOPs / (devices x peak for the compute dtype x ``compute_efficiency``), with
  model FLOPs = (6 N + 12 L h s) x tokens (Chowdhery et al. 2022, PaLM appendix B; the formula
  trainers/loop.py uses for MFU); full activation checkpointing re-runs the forward, 8 N
  instead of 6 N of hardware work (MFU still counts 6 N).
- pipeline bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved (Narayanan
  et al. 2021, sec. 2.2); ZB-V is counted as interleaved with its 2 stages per rank, an upper
  bound (Qi et al. 2024 reach ~0 only when forward, input-gradient and weight-gradient times
  balance). The trainer's own rule, :func:`trainers.rules.bubble_fraction`.
- DP: a ring all-reduce moves 2 S (N-1)/N bytes per rank for S bytes of gradients (FSDP: two
  parameter all-gathers and a gradient reduce-scatter, 1.5x, ZeRO paper sec. 7.2), over the
  intra-node link when the whole group sits in one node, else the inter-node link; a fraction
  ``dp_overlap`` of it hides behind the backward pass (never more than the backward takes), and
  none of it with ``comm.overlap=false``. FSDP without overlap is one unit per stage, the root of
  the stage module, kept gathered from the forward through the backward
  (``reshard_after_forward=False`` in ``trainers/assembly.py``; FSDP2 never reshards a root
  after the forward anyway, torch ``_fully_shard/_fsdp_state.py``): one all-gather and one
  reduce-scatter per stage, 1x.
- TP (Megatron): per layer and microbatch 2 all-reduces of s b h forward and 2 backward (2 more
  when recomputing); sequence parallelism turns each into all-gather + reduce-scatter of the
  same volume (Korthikanti et al. sec. 4.2.2). Over the intra-node link, not overlapped.
- PP: each microbatch sends its activation forward and its gradient back across each of the
  rank's stage boundaries, not overlapped.
- every collective costs ``collective_latency_us`` plus its bytes over ``comm_efficiency`` of the
  chip's nominal per-device bandwidth (Hockney's alpha-beta model); calls per step: one per DDP
  bucket (``comm.bucket_mb``, with or without the DDP wrapper), three per FSDP block with
  overlap and two per stage without, one per TP collective and pipeline send. The three factors
  can be fitted to finished trials in MLflow (:func:`orchestrator.planner.calibration.calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from orchestrator.planner.memory import state_bytes
from orchestrator.planner.shapes import BYTES, MiB, ModelShape, ParallelShape, rank_contents, rank_params
from trainers import rules


def allreduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    return 2.0 * size * (n - 1) / n if n > 1 else 0.0


def bubble_fraction(s: ParallelShape) -> float:
    """The trainer's rule (:func:`trainers.rules.bubble_fraction`); the trainer reports the same."""
    return rules.bubble_fraction(s.pp, s.microbatches, s.schedule, s.virtual_stages)


def model_flops(m: ModelShape, s: ParallelShape) -> float:
    """(6 N + 12 L h s) per token, PaLM's count (attention scores included, recompute not)."""
    tokens = s.dp * s.microbatches * s.micro_batch * s.seq_len
    return (6.0 * m.n_params + 12.0 * m.layers * m.d * s.seq_len) * tokens


def _link(chip: DictConfig, ranks_spanned: int) -> float:
    """Per-device bandwidth, bytes/s, of a group whose ranks span this many consecutive devices."""
    gbps = chip.intra_node_gbps if ranks_spanned <= int(chip.devices_per_node) else chip.inter_node_gbps
    return max(float(gbps), 1e-9) * 1e9


def _overlap(comm: DictConfig) -> bool:
    return bool(comm.get("overlap", True))


def dp_traffic_bytes(
    m: ModelShape, s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig, planner: DictConfig
) -> float:
    """Bytes one rank sends per step for data parallelism."""
    if s.dp == 1:
        return 0.0
    pb, gb, _ = state_bytes(precision, planner)
    if s.fsdp:
        if not _overlap(comm):  # one root unit per stage: gathered once, gradients reduce-scattered
            return (n_params * pb + n_params * gb) * (s.dp - 1) / s.dp
        # all-gather for forward, again for backward, reduce-scatter of gradients
        return (2 * n_params * pb + n_params * gb) * (s.dp - 1) / s.dp
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


def dp_calls(
    m: ModelShape,
    s: ParallelShape,
    n_params: float,
    layers: int,
    precision: DictConfig,
    comm: DictConfig,
    planner: DictConfig,
) -> int:
    """Data-parallel collectives per step: one per DDP bucket; FSDP with overlap gathers twice
    and reduce-scatters once per block; without, one gather and one reduce-scatter per stage."""
    if s.dp <= 1:
        return 0
    if s.fsdp:
        return 3 * layers if _overlap(comm) else 2 * s.chunks_per_rank
    return math.ceil(n_params * state_bytes(precision, planner)[1] / (float(comm.bucket_mb) * MiB))


@dataclass
class StepParts:
    """Seconds per step at 100% efficiency and collective calls per step; :func:`combine`
    applies efficiencies, the per-call latency and the overlap."""

    compute_s: float
    backward_s: float
    bubble: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    tp_calls: int
    pp_calls: int
    dp_calls: int
    overlap: float
    latency_s: float
    model_flops: float
    peak_flops: float  # all devices together


@dataclass
class StepEstimate:
    step_time_s: float
    mfu: float
    bubble_fraction: float
    comm_share: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    model_flops: float
    compute_efficiency: float
    comm_efficiency: float
    latency_s: float


def step_parts(
    m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> StepParts:
    act_b = BYTES[precision.compute_dtype]
    peak = float(chip.peak_tflops.get(precision.compute_dtype, chip.peak_tflops.get("fp32", 0.0))) * 1e12
    # a CPU "device" is a worker process: they all share the host, whose peak the cpu preset gives
    peak_all = max(peak, 1e-9) * (1 if chip.device_type == "cpu" else s.world)
    flops = model_flops(m, s)
    hw = flops * (8.0 / 6.0 if m.checkpointing else 1.0)
    compute = hw / peak_all
    backward = compute * (0.75 if m.checkpointing else 2.0 / 3.0)
    contents = [rank_contents(m, s, r) for r in range(s.pp)]
    layers = max(len(rc.layers) for rc in contents)
    msg = s.seq_len * s.micro_batch * m.d * act_b
    tp_s, tp_calls = 0.0, 0
    if s.tp > 1:
        tp_calls = (6 if m.checkpointing else 4) * layers * s.microbatches
        tp_s = tp_calls * allreduce_bytes(msg, s.tp) / _link(chip, s.tp)
    pp_s, pp_calls = 0.0, 0
    if s.pp > 1:
        pp_calls = 2 * s.microbatches * s.chunks_per_rank
        pp_s = pp_calls * msg / (s.tp if s.sequence_parallel else 1) / _link(chip, s.tp * s.pp)
    n = max(rank_params(m, s, rc) for rc in contents)
    dp_s = dp_traffic_bytes(m, s, n, precision, comm, planner) / _link(chip, s.world)
    overlap = float(planner.dp_overlap) if _overlap(comm) else 0.0
    return StepParts(
        compute_s=compute,
        backward_s=backward,
        bubble=bubble_fraction(s),
        tp_comm_s=tp_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        tp_calls=tp_calls,
        pp_calls=pp_calls,
        dp_calls=dp_calls(m, s, n, layers, precision, comm, planner),
        overlap=overlap,
        latency_s=float(planner.collective_latency_us) * 1e-6,
        model_flops=flops,
        peak_flops=peak_all,
    )


def combine(
    parts: StepParts, compute_efficiency: float, comm_efficiency: float, latency_s: Optional[float] = None
) -> StepEstimate:
    """Step time = compute / (1 - bubble) + TP + PP + the DP traffic not hidden behind backward;
    each collective costs ``latency_s + bytes / (bandwidth x comm_efficiency)`` (Hockney's
    alpha-beta model; ``latency_s`` defaults to the parts' own, planner.collective_latency_us)."""
    lat = parts.latency_s if latency_s is None else latency_s
    compute = parts.compute_s / compute_efficiency
    pipeline = compute / (1.0 - parts.bubble)
    tp, pp, dp = (
        x / comm_efficiency + calls * lat
        for x, calls in (
            (parts.tp_comm_s, parts.tp_calls),
            (parts.pp_comm_s, parts.pp_calls),
            (parts.dp_comm_s, parts.dp_calls),
        )
    )
    exposed = dp - min(parts.overlap * dp, parts.backward_s / compute_efficiency)
    step = pipeline + tp + pp + exposed
    return StepEstimate(
        step_time_s=step,
        mfu=parts.model_flops / (step * parts.peak_flops) if step > 0 else 0.0,
        bubble_fraction=parts.bubble,
        comm_share=(tp + pp + exposed) / step if step > 0 else 0.0,
        compute_s=pipeline,
        tp_comm_s=tp,
        pp_comm_s=pp,
        dp_comm_s=dp,
        dp_exposed_s=exposed,
        model_flops=parts.model_flops,
        compute_efficiency=compute_efficiency,
        comm_efficiency=comm_efficiency,
        latency_s=lat,
    )


def step_time(
    m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> StepEstimate:
    parts = step_parts(m, s, precision, comm, chip, planner)
    return combine(parts, float(planner.compute_efficiency), float(planner.comm_efficiency))
