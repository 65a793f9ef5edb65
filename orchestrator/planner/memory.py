"""Memory per rank (GiB, 2**30 bytes, as device memory and ``peak_mem_gb`` are counted).

- parameters, gradients and Adam states from the bytes per parameter of the precision: FP32
  training keeps 4 (params) + 4 (grads) + 8 (two FP32 moments); 16-bit parameters with FP32
  master weights keep 2 + 2 + 12 (master + moments), the 16 bytes/param of the ZeRO paper
  (Rajbhandari et al. 2020, sec. 3.1), or 2 + 4 + 12 = 18 with FP32 gradient buffers
  (``planner.grad_accum_fp32``), Megatron's ``theoretical_memory_usage.py``; 16-bit parameters
  without master weights keep 2 + 2 + 4 (16-bit moments). The element counts are exact per rank
  (:func:`model_state`, the tensors of :mod:`orchestrator.planner.shapes`): tensor parallelism
  shards the layer matrices and the vocabulary; pipeline parallelism gives each rank its
  stages' layers (the embedding on the first, the head on the last; ZB-V's V shape puts both on
  rank 0); FSDP shards all three over ``dp``. ``tests/test_state_bytes.py`` holds these to the
  bytes the trainer really holds (``model_state_bytes`` of its summary), rank by rank.
- activations per layer and microbatch, Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", Table 2), in 16-bit bytes: ``s b h (34 + 5 a s/h)``
  without parallelism, ``s b h (10 + 24/t + 5 a s/(h t))`` with tensor parallelism, ``s b h (34 +
  5 a s/h) / t`` with sequence parallelism, and ``2 s b h`` (the layer input, ``/t`` with sequence
  parallelism) under full activation checkpointing, plus one layer's full set while it is
  recomputed. Generalised as Megatron does to any MLP width: ``34 = 18 + 4 f/h`` with f = 4h;
  SwiGLU keeps four f-wide tensors instead of two (``8 f/h``). A fused (flash) attention kernel
  keeps no score matrix, which removes the ``5 a s/h`` term (what Korthikanti's selective
  recomputation does for it); the decomposed matmul + softmax + matmul keeps it. FP32 compute
  doubles everything. Each rank holds the activations of its in-flight microbatches: 1 without a
  pipeline, all m for GPipe, ``min(m, p - rank)`` for 1F1B, Megatron's interleaved warm-up
  ``((p - rank - 1) 2 + (v - 1) p + 1) / v`` (for rank 0, ``p (1 + (p-1)/(p v))``), and ``min(m,
  p)`` on every rank for ZB-V (Qi et al. 2024: the same peak as 1F1B). The last stage also keeps
  the FP32 log-probabilities of the loss and their gradient, ``2 x 4 s b V / t``.
- buffers: HCCL allocates ``2 x HCCL_BUFFSIZE`` per communicator (CANN environment variable
  reference, HCCL_BUFFSIZE: "每个通信域占用 2*HCCL_BUFFSIZE 大小的内存"), NCCL per channel and
  ring neighbour its three protocols' buffers (:func:`communicator_bytes`, ~294 MiB with 16
  channels: an estimate, ``planner.nccl_channels``, calibrated by ``bench/comm_memory.py``);
  communicators are the world, dp, tp groups and the pipeline neighbours a rank talks to. Data parallelism
  (:func:`dp_buffer_bytes`): DDP keeps a flat copy of every gradient in its buckets unless
  ``gradient_as_bucket_view`` (torch docs), else about two buckets in flight; FSDP gathers one
  block's parameters while prefetching the next. Without overlap (``comm.overlap=false``) there
  is no DDP wrapper: after the backward pass the gradients are copied into flat buckets of
  ``comm.bucket_mb``, all of them all-reduced at once and then waited on (``trainers/comm.py``
  ``allreduce_after_backward``), so a flat copy of every gradient is in flight; and FSDP is one
  unit per stage (``trainers/assembly.py``: ``fully_shard`` of the stage root only,
  ``reshard_after_forward=False``), whose parameters are all gathered from the forward through
  the backward and whose full gradients exist before the reduce-scatter.
- a stated runtime reserve: ``planner.runtime_overhead_gb`` plus ``planner.overhead_fraction`` of
  the rest; it is reported inside ``buffers`` in the ``--json`` contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from orchestrator.planner.shapes import (
    BYTES,
    GiB,
    MiB,
    ModelShape,
    ParallelShape,
    block_params,
    local_numel,
    rank_contents,
    rank_params,
    rank_tensors,
)


def state_bytes(precision: DictConfig, planner: DictConfig) -> Tuple[int, int, int]:
    """Bytes per parameter of (parameters, gradients, Adam states)."""
    p = BYTES[precision.param_dtype]
    g = 4 if planner.grad_accum_fp32 else p
    master = p < 4 and bool(precision.master_weights_fp32)
    moment = 4 if (p == 4 or master) else p
    return p, g, 2 * moment + (4 if master else 0)


@dataclass(frozen=True)
class ModelState:
    """Bytes of parameters, gradients and optimizer state one rank holds (the optimizer's 0-d
    step counters left out, as ``trainers/memory.py`` leaves them out)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> Dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def model_state(
    m: ModelShape,
    s: ParallelShape,
    precision: DictConfig,
    planner: DictConfig,
    pp_rank: int,
    tp_rank: int = 0,
    dp_rank: int = 0,
) -> ModelState:
    """What the rank at (dp_rank, pp_rank, tp_rank) holds after an optimizer step. TP and FSDP
    cut as ``torch.chunk`` does, so rank 0 of each group holds the most: the defaults give the
    most loaded rank of pipeline rank ``pp_rank``."""
    pb, gb, ob = state_bytes(precision, planner)
    n = sum(local_numel(t, s, tp_rank, dp_rank) for t in rank_tensors(m, rank_contents(m, s, pp_rank)))
    return ModelState(n * pb, n * gb, n * ob)


def rank_model_state(
    m: ModelShape, s: ParallelShape, precision: DictConfig, planner: DictConfig, rank: int
) -> ModelState:
    """What global rank ``rank`` holds (mesh order (dp, pp, tp), tp innermost)."""
    dp_rank, pp_rank, tp_rank = s.coords(rank)
    return model_state(m, s, precision, planner, pp_rank, tp_rank, dp_rank)


def model_state_bytes(
    m: ModelShape, s: ParallelShape, precision: DictConfig, planner: DictConfig
) -> List[Dict[str, int]]:
    """Every rank's bytes in rank order: the planned twin of the trainer summary's
    ``model_state_bytes``."""
    return [rank_model_state(m, s, precision, planner, r).as_dict() for r in range(s.world)]


def layer_activation_bytes(
    m: ModelShape, seq: int, b: int, tp: int, sp: bool, act_bytes: int, fused_attention: bool
) -> float:
    """Korthikanti et al. 2022, Table 2, per layer and microbatch (see the module docstring)."""
    sbh = seq * b * m.d
    mlp = (8 if m.swiglu else 4) * m.d_ff / m.d  # 16 for a GELU MLP with f = 4h
    scores = 0.0 if fused_attention else 5 * m.heads * seq / m.d
    if sp:
        per = (18 + mlp + scores) / tp
    else:
        per = 10 + (8 + mlp) / tp + scores / tp
    return sbh * per * act_bytes / 2


def checkpointed_layer_bytes(m: ModelShape, seq: int, b: int, tp: int, sp: bool, act_bytes: int) -> float:
    """Full recomputation keeps only each layer's input (Korthikanti et al. 2022: 2 s b h)."""
    return seq * b * m.d * act_bytes / (tp if sp else 1)


def inflight_microbatches(s: ParallelShape, rank: int) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak, in units of the rank's
    whole share of layers."""
    if s.pp == 1:
        return 1.0
    if s.schedule == "gpipe":
        return float(s.microbatches)
    if s.schedule == "interleaved_1f1b":
        v = s.virtual_stages
        chunk_mbs = min(s.microbatches * v, (s.pp - rank - 1) * 2 + (v - 1) * s.pp + 1)
        return chunk_mbs / v
    if s.schedule == "zbv":
        return float(min(s.microbatches, s.pp))
    return float(min(s.microbatches, s.pp - rank))


def communicators(s: ParallelShape, rank: int) -> int:
    """Process groups (HCCL/NCCL communicators) one rank belongs to."""
    n = 1 if s.world > 1 else 0
    n += 1 if 1 < s.dp < s.world else 0
    n += 1 if 1 < s.tp < s.world else 0
    if s.pp > 1:
        n += (rank > 0) + (rank < s.pp - 1)  # send/recv with each pipeline neighbour
        n += 1 if s.schedule == "zbv" else 0  # the V returns to rank 0 from rank p-1
    return n


# NCCL's per-connection buffers beside NCCL_BUFFSIZE's Simple-protocol FIFO: LL128 (120 x 640
# threads x 8 steps x 8 B = 4.6875 MiB) and LL (8 lines x 512 threads x 8 steps x 16 B = 0.5 MiB),
# NCCL's DEFAULT_LL128_BUFFSIZE and DEFAULT_LL_BUFFSIZE (src/include/device.h)
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
NCCL_LL_BYTES = 8 * 512 * 8 * 16


def communicator_bytes(backend: str, comm: DictConfig, planner: DictConfig) -> float:
    """Device memory one communicator allocates outside the caching allocator.

    HCCL: ``2 x HCCL_BUFFSIZE`` (CANN environment variable reference, HCCL_BUFFSIZE: "每个通信域
    占用 2*HCCL_BUFFSIZE 大小的内存", a send and a receive buffer). NCCL: per channel, a ring
    connection to each of its two neighbours, each with the three protocols' buffers
    (``NCCL_BUFFSIZE`` for Simple, plus LL128 and LL); channels are ``planner.nccl_channels``, an
    estimate (NCCL maintainers: memory grows linearly with channels and with communicators;
    NVLS on Hopper adds ~288 MiB per rank beyond 2 GPUs, not counted). gloo: host memory, 0."""
    if backend == "hccl":
        return 2 * float(comm.buffsize_mb) * MiB
    if backend == "nccl":
        simple = float(comm.get("nccl_buffsize_mb", 4.0)) * MiB
        return int(planner.get("nccl_channels", 16)) * 2 * (simple + NCCL_LL128_BYTES + NCCL_LL_BYTES)
    return 0.0


def dp_buffer_bytes(
    m: ModelShape, s: ParallelShape, comm: DictConfig, planner: DictConfig, n: int, pb: int, gb: int
) -> float:
    """Data-parallel buffers of a rank holding ``n`` parameters before FSDP sharding."""
    if s.dp <= 1:
        return 0.0
    overlap = bool(comm.get("overlap", True))
    bucket = float(comm.bucket_mb) * MiB
    if s.fsdp:
        if not overlap:  # one unit per stage: all of the rank's parameters and their full gradients
            return float(n * (pb + gb))
        return float(block_params(m, s) * (2 * pb + gb))  # the gathered block, the prefetched next, its gradient
    if not overlap:  # no DDP wrapper: every bucket's flat copy in flight at once after the backward
        return float(n * gb)
    return float(n * gb) if not planner.ddp_bucket_view else 2 * bucket


@dataclass
class MemoryPlan:
    """Bytes per rank of the most loaded pipeline rank, and whether it fits."""

    params: float
    grads: float
    optimizer: float
    activations: float
    comm_buffers: float
    dp_buffers: float
    overhead: float
    rank: int
    communicators: int
    chip_memory_gb: float
    headroom: float

    @property
    def buffers(self) -> float:
        return self.comm_buffers + self.dp_buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.overhead

    @property
    def usable_gb(self) -> float:
        return self.chip_memory_gb * self.headroom

    @property
    def fits(self) -> bool:
        return self.total / GiB <= self.usable_gb

    def gb(self) -> Dict[str, float]:
        """The ``memory_gb`` object of the public ``--json`` contract (runtime reserve in buffers)."""
        return {
            "params": self.params / GiB,
            "grads": self.grads / GiB,
            "optimizer": self.optimizer / GiB,
            "activations": self.activations / GiB,
            "buffers": (self.buffers + self.overhead) / GiB,
            "total": self.total / GiB,
        }

    def detail(self) -> Dict[str, Any]:
        return {
            "comm_buffers_gb": self.comm_buffers / GiB,
            "dp_buffers_gb": self.dp_buffers / GiB,
            "runtime_overhead_gb": self.overhead / GiB,
            "pipeline_rank": self.rank,
            "communicators": self.communicators,
            "chip_memory_gb": self.chip_memory_gb,
            "headroom": self.headroom,
            "usable_gb": self.usable_gb,
        }


def memory_plan(
    m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> MemoryPlan:
    """Memory of every pipeline rank; the plan is that of the rank with the largest total (of
    each pipeline rank, its TP and DP rank 0, which hold the most)."""
    pb, gb, _ = state_bytes(precision, planner)
    act_b = BYTES[precision.compute_dtype]
    full = layer_activation_bytes(m, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, act_b, m.fused_attention)
    kept = (
        checkpointed_layer_bytes(m, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, act_b)
        if m.checkpointing
        else full
    )
    sb = s.seq_len * s.micro_batch
    best: Optional[MemoryPlan] = None
    for rank in range(s.pp):
        rc = rank_contents(m, s, rank)
        layers = len(rc.layers)
        state = model_state(m, s, precision, planner, rank)
        k = inflight_microbatches(s, rank)
        act = k * layers * kept + (full if m.checkpointing and layers else 0.0)
        if rc.embedding:  # int64 token ids and the embedding's dropout mask, as Megatron counts them
            act += k * (8 * sb + sb * m.d / (s.tp if s.sequence_parallel else 1))
        if rc.head:
            head_k = s.microbatches if s.pp > 1 and s.schedule == "gpipe" else 1
            act += head_k * (2 * 4 * sb * m.vocab / s.tp + act_b * sb * m.d)
        n_comm = communicators(s, rank)
        comm_buf = n_comm * communicator_bytes(chip.dist_backend, comm, planner)
        dp_buf = dp_buffer_bytes(m, s, comm, planner, rank_params(m, s, rc), pb, gb)
        overhead = float(planner.runtime_overhead_gb) * GiB + float(planner.overhead_fraction) * (state.total + act)
        plan = MemoryPlan(
            params=float(state.params),
            grads=float(state.grads),
            optimizer=float(state.optimizer),
            activations=act,
            comm_buffers=comm_buf,
            dp_buffers=dp_buf,
            overhead=overhead,
            rank=rank,
            communicators=n_comm,
            chip_memory_gb=float(chip.memory_gb),
            headroom=float(planner.headroom),
        )
        if best is None or plan.total > best.total:
            best = plan
    assert best is not None
    return best
