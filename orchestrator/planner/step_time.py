"""Step time, per optimizer step.

- compute = model FLOPs / (devices x peak for the compute dtype x ``compute_efficiency``), with
  model FLOPs = (6 N + 12 L h s) x tokens (Chowdhery et al. 2022, PaLM appendix B; MFU's formula
  in trainers/loop.py); activation checkpointing re-runs the forward, 8 N of hardware work instead
  of 6 N; plus the other operators' memory traffic at the chip's ``hbm_gbps`` (:mod:`traffic`).
- pipeline bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved (Narayanan
  et al. 2021, sec. 2.2); ZB-V is counted as interleaved with its 2 stages per rank, an upper
  bound (Qi et al. 2024 reach ~0 only when forward, input-gradient and weight-gradient times
  balance). The trainer's own rule, :func:`trainers.rules.bubble_fraction`.
- DP: a ring all-reduce moves 2 S (N-1)/N bytes per rank for S bytes of gradients (FSDP: the
  parameters all-gathered as often as :func:`fsdp_gathers` says and the gradients reduce-scattered
  once, 1.5x for one micro-batch, as the ZeRO paper's sec. 7.2 counts), over the
  intra-node link when the whole group sits in one node, else the inter-node link; a fraction
  ``dp_overlap`` of it, of the part that can overlap at all, hides behind the compute the trainer
  runs beside it (:func:`dp_comm.dp_windows`: the gradients behind the last micro-batch's
  backward, FSDP's gathers behind every forward and backward it prefetches into, ``zero1``'s one
  gather behind the first forward), never more than that compute takes, and none of it with
  ``comm.overlap=false``. DDP reduces a
  bucket once the backward has made all of its gradients (Li et al. 2020, "PyTorch Distributed",
  sec. 3.2.3), so the bucket holding the first layers' gradients, made last, is reduced after the
  backward: of n buckets (``comm.bucket_mb``) or FSDP collectives, ``(n - 1) / n`` can overlap.
  FSDP without overlap is one unit per stage, the root of the stage module, kept gathered from
  the forward through the backward
  (``reshard_after_forward=False`` in ``trainers/assembly.py``; FSDP2 never reshards a root
  after the forward anyway, torch ``_fully_shard/_fsdp_state.py``).
- TP and PP (:mod:`.mesh_comm`): per layer and microbatch 2 all-reduces of s b h forward and 2
  backward (1 more when recomputing; with sequence parallelism each an all-gather and a
  reduce-scatter, and the norms' gradients all-reduced); each micro-batch's activation and
  gradient across each stage boundary. Not overlapped.
- every collective costs the chip's ``collective_latency_us`` (or the planner's, a calibration's)
  plus ``collective_hop_us`` per log2 of its group's size, plus its bytes over
  ``comm_efficiency`` of the chip's nominal per-device bandwidth (Hockney's alpha-beta model,
  the alpha growing with the group as a tree's depth:
  NCCL's own tuning model, ``src/graph/tuning.cc``, has a base latency per collective of
  6.6-8.4 us and a per-step latency of 0.6 us over NVLink and 5 us over the network for tree
  and ring LL, quoted in NVIDIA/nccl#1334; NVIDIA/nccl-tests#123 measured an 8-byte ring
  all-reduce on a DGX A100 at 10 us on 2 GPUs and 34 us on 8); a pipeline send is one hop. Calls
  per step: one per DDP bucket (``comm.bucket_mb``, with or without the DDP wrapper), an
  FSDP unit's gathers and its reduce-scatter, one per TP collective and pipeline send.
- host fixed costs, what the host spends per call whatever the call computes (:class:`HostCosts`):
  ``layer_host_us`` per layer per micro-batch (the forward and backward's operator dispatch and
  kernel launches: about 100 operators a transformer layer at a few microseconds each, "each
  launch takes on the order of microseconds", Modal's GPU glossary on CUDA graphs; the
  recomputed forward of activation checkpointing adds a third), and, with a pipeline,
  ``stage_host_us`` per stage chunk per micro-batch (the schedule's forward and backward call of
  the chunk, its send/recv setup and the wait that drains the device's queue). Both are per rank
  and stretched by the bubble like the compute they sit beside. An accelerator runs its kernels
  behind the host's dispatch, so the per-layer cost only shows where it exceeds the compute
  (``max``); a CPU "device" runs them on the dispatching thread, so there it adds. The
  per-stage cost always adds: each stage boundary is a wait. With tensor parallelism,
  ``tp_layer_host_us`` per layer and micro-batch more (DTensor's sharding propagation on every
  sharded op, the redistributions, each collective's wait for the slowest rank), counted as the
  dispatch is; none when the blocks are compiled through AOTAutograd, which traces DTensor into
  plain tensors (``ParallelShape.traced``; measured by ``bench/compile_host.py``). Defaults are
  assumptions, to be fitted (``--calibrate``). On a CPU host, FSDP's bytes are the rank's cores'
  work too, at the chip's ``host_copy_gbps`` (:func:`fsdp_host_s`).
- a CPU "device" is a worker process, and a node's workers share the host's cores
  (``planner.host_cores``, 0: this machine's): the trainer gives each ``cores // workers``
  threads, at least one (``trainers/runtime.py select_device``), so the node's demand is
  ``u = workers x threads / cores`` cores a core. A rank's busy time is its share of the compute at
  its threads' speed (``compute / u``) plus its host costs; the step is the longer of the rank's
  critical path (busy time stretched by the bubble, plus its collectives, each stretched by how
  far its group's own demand for cores exceeds the host's) and the node's throughput bound
  (``u`` x busy: workers beyond the cores time-share them and fill each other's bubbles and
  waits, except the waits of a collective every worker of the node is in). On an accelerator
  ``u`` and the stretch are 1 and this is the usual ``busy / (1 - bubble)`` + communication.
  The calibration fits the split between work and wait against the trainer's measured
  ``host_busy`` (the share of the host's cores its ranks kept busy over a step) as well as the
  step time.

Every factor can be fitted to finished trials in MLflow
(:func:`orchestrator.planner.calibration.calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from omegaconf import DictConfig

from orchestrator.planner import shapes, traffic
from orchestrator.planner.cpu_host import cpu_share, group_wait, lockstep
from orchestrator.planner.dp_comm import dp_calls, dp_traffic_bytes, dp_windows, fsdp_host_s, gather_share, hidden
from orchestrator.planner.mesh_comm import dp_link, mesh_comm
from orchestrator.planner.shapes import BYTES, ModelShape, ParallelShape, rank_contents, rank_params
from trainers import rules


def bubble_fraction(s: ParallelShape) -> float:
    """The trainer's rule (:func:`trainers.rules.bubble_fraction`); the trainer reports the same."""
    return rules.bubble_fraction(s.pp, s.microbatches, s.schedule, s.virtual_stages)


def model_flops(m: ModelShape, s: ParallelShape) -> float:
    """(6 N + 12 L h s) per token, PaLM's count (attention scores included, recompute not)."""
    tokens = s.dp * s.microbatches * s.micro_batch * s.seq_len
    return (6.0 * m.n_params + 12.0 * m.layers * m.d * s.seq_len) * tokens


@dataclass(frozen=True)
class HostCosts:
    """The host's fixed costs, seconds: per layer per micro-batch, per pipeline stage chunk per
    micro-batch, and per log2(group size) step of every collective."""

    layer_s: float
    stage_s: float
    hop_s: float
    tp_layer_s: float = 0.0  # added per layer and micro-batch by tensor parallelism

    @classmethod
    def of(cls, planner: DictConfig) -> "HostCosts":
        return cls(
            float(planner.layer_host_us) * 1e-6,
            float(planner.stage_host_us) * 1e-6,
            float(planner.collective_hop_us) * 1e-6,
            float(planner.tp_layer_host_us) * 1e-6,
        )


def collective_latency_s(planner: DictConfig, chip: DictConfig) -> float:
    """Seconds one collective or send costs whatever its size: ``planner.collective_latency_us``
    where set (a calibration's), else the chip's ``collective_latency_us``."""
    us = planner.collective_latency_us
    return float(chip.collective_latency_us if us is None else us) * 1e-6


def hops(calls: int, group: int) -> float:
    """Latency steps of ``calls`` collectives over ``group`` ranks: log2 of the group each."""
    return calls * math.log2(group) if group > 1 else 0.0


def layer_passes(layers: int, s: ParallelShape, m: ModelShape) -> float:
    """Layer forward+backward dispatches per step on the busiest rank (a recomputed forward is a third more)."""
    return layers * s.microbatches * shapes.work_factor(m, s)


def stage_passes(s: ParallelShape) -> int:
    """Stage-chunk forward+backward calls per step on one pipeline rank; none without a pipeline."""
    return s.chunks_per_rank * s.microbatches if s.pp > 1 else 0


@dataclass
class StepParts:
    """Seconds per step at 100% efficiency, collective calls and host passes per step;
    :func:`combine` applies efficiencies, the per-call latency, the host costs and the overlap."""

    compute_s: float
    memory_s: float  # the non-matmul operators' traffic at the chip's bandwidth x memory_efficiency
    fsdp_host_s: float  # a CPU host's cores moving FSDP's bytes (chip.host_copy_gbps); 0 elsewhere
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
    # of the DP seconds, the share that are parameter gathers, and the compute (at 100%
    # efficiency) that the gathers and the gradient reductions can hide behind (dp_comm.dp_windows)
    dp_gather_share: float = 0.0
    gather_window_s: float = 0.0
    reduce_window_s: float = 0.0
    tp_hops: float = 0.0  # sum over the step's TP collectives of log2(tp)
    pp_hops: float = 0.0  # one per pipeline send
    dp_hops: float = 0.0  # sum over the step's DP collectives of log2(dp)
    layer_passes: float = 0.0
    stage_passes: int = 0
    host_async: bool = True  # the device runs kernels behind the host's dispatch (not a CPU)
    host: HostCosts = HostCosts(0.0, 0.0, 0.0)  # the configured host costs
    tp_layer_passes: float = 0.0  # layer_passes under tensor parallelism, else 0
    share: float = 1.0  # cores asked of each host core (cpu_share); 1 on an accelerator
    # per group (TP, a pipeline send's pair, DP): how many times as long its collectives wait for
    # their members to be scheduled (group_wait), and 1.0 where the group holds every worker of
    # its node (lockstep: while it waits, the node's cores idle)
    tp_wait: float = 1.0
    pp_wait: float = 1.0
    dp_wait: float = 1.0
    tp_lockstep: float = 0.0
    dp_lockstep: float = 0.0


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
    host_s: float = 0.0  # host fixed costs not hidden behind the device's work, bubble included
    host: HostCosts = HostCosts(0.0, 0.0, 0.0)
    host_busy: float = 0.0  # share of the host's cores busy over the step (a CPU "device"; trainers' host_busy)
    memory_s: float = 0.0  # of compute_s, the non-matmul operators' memory traffic (planner/traffic.py)


def step_parts(
    m: ModelShape,
    s: ParallelShape,
    precision: DictConfig,
    comm: DictConfig,
    chip: DictConfig,
    planner: DictConfig,
    contents: Optional[Callable[[int], Any]] = None,
    params: Optional[Callable[[Any, int], int]] = None,
    host: Optional[HostCosts] = None,
) -> StepParts:
    """The step's terms. ``contents(rank)`` (:func:`rank_contents`), ``params(rc, rank)``
    (:func:`rank_params`) and ``host`` (``HostCosts.of(planner)``) default to the plain
    functions; the search's fast path (``orchestrator/planner/space.py``) passes its caches of
    the same."""
    contents = contents or (lambda rank: rank_contents(m, s, rank))
    params = params or (lambda rc, rank: rank_params(m, s, rc))
    peak_all = _peak_flops(precision, chip, s)
    flops = model_flops(m, s)
    share = shapes.full_recompute_share(m, s)
    hw = flops * shapes.work_factor(m, s) + shapes.core_flops(m, s) + shapes.head_recompute_flops(m, s)
    compute = hw / peak_all
    # the backward is twice the forward, and holds the recomputed forward: (2 + r) / (3 + r)
    backward = compute * (2.0 + share) / (3.0 + share)
    ranks = [contents(r) for r in range(s.pp)]
    busiest = max(ranks, key=lambda rc: len(rc.layers))
    layers = len(busiest.layers)
    memory = traffic.memory_seconds(m, s, precision, chip, planner)
    tp_s, tp_calls, pp_s, pp_calls = mesh_comm(
        m, s, chip, layers, BYTES[precision.compute_dtype], shapes.recomputed_layers(m, s, busiest)
    )
    n = max(params(rc, r) for r, rc in enumerate(ranks))
    dp_s = dp_traffic_bytes(m, s, n, precision, comm, planner) / dp_link(chip, s)
    n_dp = dp_calls(m, s, n, layers, precision, comm, planner)
    # the bucket (or FSDP unit) whose gradients the backward makes last is reduced after it: at
    # most (n - 1) / n of the traffic can hide (one 25 MiB bucket holding every gradient hides none)
    overlap = float(planner.dp_overlap) * (1.0 - 1.0 / max(1, n_dp)) if comm.overlap else 0.0
    gather_window, reduce_window = dp_windows(s, compute, backward, comm)
    return StepParts(
        compute_s=compute,
        memory_s=memory,
        fsdp_host_s=fsdp_host_s(s, n, precision, comm, chip, planner),
        backward_s=backward,
        bubble=bubble_fraction(s),
        tp_comm_s=tp_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        tp_calls=tp_calls,
        pp_calls=pp_calls,
        dp_calls=n_dp,
        overlap=overlap,
        dp_gather_share=gather_share(s, precision, comm, planner),
        gather_window_s=gather_window,
        reduce_window_s=reduce_window,
        latency_s=collective_latency_s(planner, chip),
        model_flops=flops,
        peak_flops=peak_all,
        tp_hops=hops(tp_calls, s.tp),
        pp_hops=float(pp_calls),
        dp_hops=hops(n_dp, s.dp),
        layer_passes=layer_passes(layers, s, m),
        stage_passes=stage_passes(s),
        host_async=chip.device_type != "cpu",
        host=host or HostCosts.of(planner),
        tp_layer_passes=layer_passes(layers, s, m) if s.tp > 1 and not s.traced else 0.0,
        share=cpu_share(s, chip, planner),
        tp_wait=group_wait(s.tp, s, chip, planner),
        pp_wait=group_wait(2 if s.pp > 1 else 1, s, chip, planner),
        dp_wait=group_wait(s.dp, s, chip, planner),
        tp_lockstep=lockstep(s.tp, s, chip),
        dp_lockstep=lockstep(s.dp, s, chip),
    )


def _peak_flops(precision: DictConfig, chip: DictConfig, s: ParallelShape) -> float:
    """FLOP/s of all the trial's devices in its compute dtype (the fp32 peak where the chip gives
    none for it); a CPU "device" is a worker process: they all share the host, whose peak the cpu
    preset gives."""
    peak = float(chip.peak_tflops.get(precision.compute_dtype, chip.peak_tflops.get("fp32", 0.0))) * 1e12
    return max(peak, 1e-9) * (1 if chip.device_type == "cpu" else s.world)


class _Scalars:
    """:func:`model`'s operations on plain floats (``numpy`` passes its own, on arrays)."""

    maximum = staticmethod(max)
    minimum = staticmethod(min)

    @staticmethod
    def where(cond, a, b):
        return a if cond else b


def model(c: Mapping[str, Any], ec, en, lat, layer, stage, hop, tp_layer, ops: Any = _Scalars) -> Dict[str, Any]:
    """The step-time model over one trial's :class:`StepParts` fields ``c`` (``vars(parts)``) or
    over arrays of many trials' (``ops=numpy``, what the calibration fits with): the step's
    parts at compute efficiency ``ec``, link efficiency ``en``, per-collective latency ``lat``
    and the host terms (seconds), by name. Documented at :func:`combine`."""
    u = c["share"]
    compute = (c["compute_s"] / ec + c["memory_s"]) / u
    layer_host = c["layer_passes"] * layer + c["tp_layer_passes"] * tp_layer
    busy = ops.where(c["host_async"], ops.maximum(compute, layer_host), compute + layer_host)
    busy = busy + c["stage_passes"] * stage + c["fsdp_host_s"]
    stretch = 1.0 / (1.0 - c["bubble"])
    tp, pp, dp = (c[k + "_comm_s"] / en + c[k + "_calls"] * lat + c[k + "_hops"] * hop for k in ("tp", "pp", "dp"))
    waited = dp * c["dp_wait"]
    exposed = waited - hidden(c, waited, ec, ops)
    critical = busy * stretch + tp * c["tp_wait"] + pp * c["pp_wait"] + exposed
    # the host's cores: every worker's busy time, and the waits of a collective every worker of
    # the node is in (no one is left to run while it waits)
    lockstep = tp * c["tp_lockstep"] + (dp - hidden(c, dp, ec, ops)) * c["dp_lockstep"]
    throughput = u * busy + lockstep
    step = ops.maximum(critical, throughput)
    return {
        "compute": compute,
        "busy": busy,
        "stretch": stretch,
        "tp": tp * c["tp_wait"],
        "pp": pp * c["pp_wait"],
        "dp": waited,
        "exposed": exposed,
        "critical": critical,
        "throughput": throughput,
        "step": step,
        "host_busy": u * busy / step,
    }


def combine(
    parts: StepParts,
    compute_efficiency: float,
    comm_efficiency: float,
    latency_s: Optional[float] = None,
    host: Optional[HostCosts] = None,
) -> StepEstimate:
    """Step time = (compute + host fixed costs) / (1 - bubble) + TP + PP + the DP traffic not
    hidden behind backward; each collective costs ``latency_s + hops x host.hop_s + bytes /
    (bandwidth x comm_efficiency)`` (Hockney's alpha-beta model); per layer and micro-batch the
    host costs ``host.layer_s`` (and ``host.tp_layer_s`` more under TP), hidden behind the compute
    on an accelerator up to the compute's length, per stage chunk and micro-batch ``host.stage_s``.

    On a CPU host shared ``u = parts.share`` ways, the compute is ``compute / u`` at a rank's
    threads, and the step is the longer of two bounds. The critical path: a rank's busy time
    stretched by the bubble, plus its collectives, each stretched by its group's own demand for
    cores (``parts.tp_wait``...: a group of more single-thread ranks than cores waits for its
    members to be scheduled in turn). The host's throughput: ``u`` x the busy time (every worker's
    work shares the cores), plus the waits of the collectives whose group holds every worker of
    the node (``parts.tp_lockstep``, ``dp_lockstep``): while such a collective waits, no worker
    has anything to run. A collective of a smaller group waits while other groups' ranks (other
    pipeline stages, other replicas) use the cores: measured on the 2-core host, ``tp2`` keeps
    77% of it busy and ``tp2pp2`` 89%, at a shorter step (``host_busy``, trainers/clock.py).
    On an accelerator ``u`` and every wait factor are 1, no group is in lockstep, and this is the
    usual ``busy / (1 - bubble) + communication``. ``latency_s`` and ``host`` default to the
    parts' own, the configured collective latency (:func:`collective_latency_s`) and host terms."""
    lat = parts.latency_s if latency_s is None else latency_s
    h = parts.host if host is None else host
    r = model(vars(parts), compute_efficiency, comm_efficiency, lat, h.layer_s, h.stage_s, h.hop_s, h.tp_layer_s)
    step, compute, busy = r["step"], r["compute"], r["busy"]
    # the breakdown along the bound that sets the step: the critical path's parts, or the host's
    scale = r["stretch"] if r["critical"] >= r["throughput"] else parts.share
    pipeline, host_s = compute * scale, (busy - compute) * scale
    return StepEstimate(
        step_time_s=step,
        mfu=parts.model_flops / (step * parts.peak_flops) if step > 0 else 0.0,
        bubble_fraction=parts.bubble,
        comm_share=max(0.0, step - pipeline - host_s) / step if step > 0 else 0.0,
        compute_s=pipeline,
        tp_comm_s=r["tp"],
        pp_comm_s=r["pp"],
        dp_comm_s=r["dp"],
        dp_exposed_s=r["exposed"],
        model_flops=parts.model_flops,
        compute_efficiency=compute_efficiency,
        comm_efficiency=comm_efficiency,
        latency_s=lat,
        host_s=host_s,
        host=h,
        host_busy=r["host_busy"],
        memory_s=parts.memory_s / parts.share * scale,
    )


def step_time(
    m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> StepEstimate:
    parts = step_parts(m, s, precision, comm, chip, planner)
    return combine(parts, float(planner.compute_efficiency), float(planner.comm_efficiency))
