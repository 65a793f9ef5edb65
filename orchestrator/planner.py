"""The planner: will a trial fit, does every operator run on the chip, and how fast will it be,
answered on a laptop before any device is used.

Memory per rank (GiB, 2**30 bytes, as device memory and ``peak_mem_gb`` are counted):

- parameters, gradients and Adam states from the bytes per parameter of the precision: FP32
  training keeps 4 (params) + 4 (grads) + 8 (two FP32 moments); 16-bit parameters with FP32
  master weights keep 2 + 2 + 12 (master + moments), the 16 bytes/param of the ZeRO paper
  (Rajbhandari et al. 2020, sec. 3.1), or 2 + 4 + 12 = 18 with FP32 gradient buffers
  (``planner.grad_accum_fp32``), Megatron's ``theoretical_memory_usage.py``. Tensor parallelism
  divides the layer matrices and the vocabulary; pipeline parallelism gives each rank its
  stages' layers (the embedding on the first, the head on the last; ZB-V's V shape puts both on
  rank 0); FSDP divides all three by ``dp``.
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
  reference, HCCL_BUFFSIZE: "每个通信域占用 2*HCCL_BUFFSIZE 大小的内存"), NCCL is counted the
  same way (it really scales with channels and peers: an estimate); communicators are the world,
  dp, tp groups and the pipeline neighbours a rank talks to. DDP keeps a flat copy of every
  gradient in its buckets unless ``gradient_as_bucket_view`` (torch docs), else about two buckets
  in flight; FSDP gathers one block's parameters while prefetching the next.
- a stated runtime reserve: ``planner.runtime_overhead_gb`` plus ``planner.overhead_fraction`` of
  the rest; it is reported inside ``buffers`` in the ``--json`` contract.

Step time, per optimizer step:

- compute = model FLOPs / (devices x peak for the compute dtype x ``compute_efficiency``), with
  model FLOPs = (6 N + 12 L h s) x tokens (Chowdhery et al. 2022, PaLM appendix B; the formula
  trainers/loop.py uses for MFU); full activation checkpointing re-runs the forward, 8 N
  instead of 6 N of hardware work (MFU still counts 6 N).
- pipeline bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p - 1) interleaved (Narayanan
  et al. 2021, sec. 2.2); ZB-V is assumed bubble-free (Qi et al. 2024 reach ~0 when forward,
  input-gradient and weight-gradient times balance: optimistic).
- DP: a ring all-reduce moves 2 S (N-1)/N bytes per rank for S bytes of gradients (FSDP: two
  parameter all-gathers and a gradient reduce-scatter, 1.5x, ZeRO paper sec. 7.2), over the
  intra-node link when the whole group sits in one node, else the inter-node link; a fraction
  ``dp_overlap`` of it hides behind the backward pass (never more than the backward takes).
- TP (Megatron): per layer and microbatch 2 all-reduces of s b h forward and 2 backward (2 more
  when recomputing); sequence parallelism turns each into all-gather + reduce-scatter of the
  same volume (Korthikanti et al. sec. 4.2.2). Over the intra-node link, not overlapped.
- PP: each microbatch sends its activation forward and its gradient back across each of the
  rank's stage boundaries, not overlapped.
- every collective costs ``collective_latency_us`` plus its bytes over ``comm_efficiency`` of the
  chip's nominal per-device bandwidth (Hockney's alpha-beta model); calls per step: one per DDP
  bucket, three per FSDP block, one per TP collective and pipeline send. The three factors can
  be fitted to finished trials in MLflow (:func:`calibrate`), which reports its own error on them.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf

from orchestrator import chips
from orchestrator.validate import Layout, layout, validate
from trainers import rules

GiB = 2**30
MiB = 2**20
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NOT_YET = "not yet supported"  # trainer-capability lines of validate(): a plan may go beyond them


# ---------------------------------------------------------------------------------------------
# shapes


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a GPT-style decoder that memory and FLOPs depend on (model config section)."""
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    max_seq_len: int
    swiglu: bool
    layernorm: bool
    learned_pos: bool
    tied: bool
    fused_attention: bool
    checkpointing: bool

    @classmethod
    def of(cls, model: DictConfig | Dict[str, Any]) -> "ModelShape":
        kv = model["n_kv_heads"] if model.get("n_kv_heads", -1) not in (-1, 0, None) else model["n_heads"]
        return cls(vocab=int(model["vocab_size"]), d=int(model["d_model"]), layers=int(model["n_layers"]),
                   heads=int(model["n_heads"]), kv_heads=int(kv), d_ff=int(model["d_ff"]),
                   max_seq_len=int(model["max_seq_len"]), swiglu=model.get("mlp", "gelu") == "swiglu",
                   layernorm=model.get("norm", "layernorm") == "layernorm",
                   learned_pos=model.get("pos_emb", "learned") == "learned",
                   tied=bool(model.get("tie_embeddings", True)),
                   fused_attention=model.get("attn_impl", "fused") == "fused",
                   checkpointing=bool(model.get("activation_checkpointing", False)))

    @property
    def layer_matrices(self) -> List[Tuple[int, int]]:
        """Weight matrices of one block (no biases, as trainers/model.py): wq wk wv wo w1 w2 (w3)."""
        kv_dim = self.kv_heads * (self.d // self.heads)
        mats = [(self.d, self.d), (self.d, kv_dim), (self.d, kv_dim), (self.d, self.d),
                (self.d, self.d_ff), (self.d_ff, self.d)]
        return mats + ([(self.d, self.d_ff)] if self.swiglu else [])

    @property
    def layer_sharded(self) -> int:  # split by tensor parallelism
        return sum(a * b for a, b in self.layer_matrices)

    @property
    def norm_params(self) -> int:
        return 2 * self.d if self.layernorm else self.d

    @property
    def layer_replicated(self) -> int:  # two norms per block, replicated across TP ranks
        return 2 * self.norm_params

    @property
    def embedding(self) -> int:
        return self.vocab * self.d

    @property
    def positions(self) -> int:
        return self.max_seq_len * self.d if self.learned_pos else 0

    @property
    def n_params(self) -> int:
        """All parameters, a tied head counted once (trainers.model.count_params)."""
        head = 0 if self.tied else self.embedding
        return (self.embedding + self.positions + self.layers * (self.layer_sharded + self.layer_replicated)
                + self.norm_params + head)

    def matrices(self) -> List[Tuple[int, int]]:
        """Every 2-D parameter of the model (for PowerSGD's compressed size)."""
        mats = self.layer_matrices * self.layers + [(self.vocab, self.d)]
        mats += [(self.max_seq_len, self.d)] if self.learned_pos else []
        return mats + ([] if self.tied else [(self.vocab, self.d)])


@dataclass(frozen=True)
class ParallelShape:
    """One layout and how each replica's batch is cut (parallel and trainer sections).

    With a pipeline the replica's batch is split into ``parallel.microbatches`` microbatches (the
    trainer does so itself); without one, ``microbatches`` counts gradient-accumulation steps of
    ``trainer.micro_batch`` sequences."""
    dp: int
    tp: int
    pp: int
    microbatches: int
    micro_batch: int
    seq_len: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False

    @classmethod
    def of(cls, parallel: DictConfig, trainer: DictConfig, lay: Layout) -> "ParallelShape":
        per_replica = max(1, int(trainer.global_batch) // lay.dp)
        if lay.pp > 1:
            m = max(1, int(parallel.microbatches))
            b = max(1, per_replica // m)
        else:
            b = max(1, min(int(trainer.micro_batch), per_replica))
            m = max(1, per_replica // b)
        return cls(dp=lay.dp, tp=lay.tp, pp=lay.pp, microbatches=m, micro_batch=b, seq_len=int(trainer.seq_len),
                   schedule=str(parallel.schedule), virtual_stages=int(parallel.virtual_stages),
                   sequence_parallel=bool(parallel.sequence_parallel) and lay.tp > 1,
                   fsdp=rules.dp_wrapping(lay.dp, lay.tp, str(parallel.dp_shard)) == "fsdp")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def chunks_per_rank(self) -> int:
        if self.pp == 1:
            return 1
        return 2 if self.schedule == "zbv" else (self.virtual_stages if self.schedule == "interleaved_1f1b" else 1)


@dataclass(frozen=True)
class RankContents:
    layers: int
    embedding: bool
    head: bool


def rank_contents(m: ModelShape, s: ParallelShape, rank: int) -> RankContents:
    """Which layers a pipeline rank holds: its chunk(s) of the model cut into p x chunks pieces
    (interleaved: chunks rank, rank + p, ...; ZB-V: rank and 2p-1-rank, so rank 0 holds both
    ends of the model)."""
    n_chunks = s.pp * s.chunks_per_rank
    base, extra = divmod(m.layers, n_chunks)
    size = [base + (1 if c < extra else 0) for c in range(n_chunks)]
    if s.schedule == "zbv" and s.pp > 1:
        mine = [rank, n_chunks - 1 - rank]
    else:
        mine = list(range(rank, n_chunks, s.pp))
    return RankContents(sum(size[c] for c in mine), 0 in mine, n_chunks - 1 in mine)


def rank_params(m: ModelShape, s: ParallelShape, rc: RankContents) -> float:
    """Parameters a rank holds before FSDP sharding: its layers' matrices / tp, the norms, the
    vocabulary-parallel embedding / tp on the first stage and the head (a copy of a tied
    embedding when the stages differ) / tp on the last."""
    n = rc.layers * (m.layer_sharded / s.tp + m.layer_replicated)
    if rc.embedding:
        n += m.embedding / s.tp + m.positions
    if rc.head:
        n += m.norm_params
        if not m.tied or not rc.embedding:
            n += m.embedding / s.tp
    return n


# ---------------------------------------------------------------------------------------------
# memory


def state_bytes(precision: DictConfig, planner: DictConfig) -> Tuple[int, int, int]:
    """Bytes per parameter of (parameters, gradients, Adam states)."""
    p = BYTES[precision.param_dtype]
    g = 4 if planner.grad_accum_fp32 else p
    master = p < 4 and bool(precision.master_weights_fp32)
    moment = 4 if (p == 4 or master) else p
    return p, g, 2 * moment + (4 if master else 0)


def layer_activation_bytes(m: ModelShape, seq: int, b: int, tp: int, sp: bool, act_bytes: int,
                           fused_attention: bool) -> float:
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
        return {"params": self.params / GiB, "grads": self.grads / GiB, "optimizer": self.optimizer / GiB,
                "activations": self.activations / GiB, "buffers": (self.buffers + self.overhead) / GiB,
                "total": self.total / GiB}

    def detail(self) -> Dict[str, Any]:
        return {"comm_buffers_gb": self.comm_buffers / GiB, "dp_buffers_gb": self.dp_buffers / GiB,
                "runtime_overhead_gb": self.overhead / GiB, "pipeline_rank": self.rank,
                "communicators": self.communicators, "chip_memory_gb": self.chip_memory_gb,
                "headroom": self.headroom, "usable_gb": self.usable_gb}


def memory_plan(m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig,
                planner: DictConfig) -> MemoryPlan:
    """Memory of every pipeline rank; the plan is that of the rank with the largest total."""
    pb, gb, ob = state_bytes(precision, planner)
    act_b = BYTES[precision.compute_dtype]
    shard = s.dp if s.fsdp else 1
    full = layer_activation_bytes(m, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, act_b, m.fused_attention)
    kept = (checkpointed_layer_bytes(m, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, act_b)
            if m.checkpointing else full)
    sb = s.seq_len * s.micro_batch
    best: Optional[MemoryPlan] = None
    for rank in range(s.pp):
        rc = rank_contents(m, s, rank)
        n = rank_params(m, s, rc)
        k = inflight_microbatches(s, rank)
        act = k * rc.layers * kept + (full if m.checkpointing and rc.layers else 0.0)
        if rc.embedding:  # int64 token ids and the embedding's dropout mask, as Megatron counts them
            act += k * (8 * sb + sb * m.d / (s.tp if s.sequence_parallel else 1))
        if rc.head:
            head_k = s.microbatches if s.pp > 1 and s.schedule == "gpipe" else 1
            act += head_k * (2 * 4 * sb * m.vocab / s.tp + act_b * sb * m.d)
        n_comm = communicators(s, rank)
        # HCCL: HCCL_BUFFSIZE twice per communicator (CANN docs). NCCL: NCCL_BUFFSIZE per channel
        # and peer; counted here as twice per communicator too, a rough lower bound
        per_comm = {"hccl": float(comm.buffsize_mb), "nccl": float(comm.get("nccl_buffsize_mb", 4.0))}
        comm_buf = 2 * n_comm * per_comm.get(chip.dist_backend, 0.0) * MiB
        dp_buf = 0.0
        if s.dp > 1 and s.fsdp:
            block = m.layer_sharded / s.tp + m.layer_replicated
            dp_buf = block * (2 * pb + gb)  # the gathered block, the prefetched next, its full gradient
        elif s.dp > 1:
            dp_buf = n * gb if not planner.ddp_bucket_view else 2 * float(comm.bucket_mb) * MiB
        states = n * (pb + gb + ob) / shard
        overhead = float(planner.runtime_overhead_gb) * GiB + float(planner.overhead_fraction) * (states + act)
        plan = MemoryPlan(params=n * pb / shard, grads=n * gb / shard, optimizer=n * ob / shard, activations=act,
                          comm_buffers=comm_buf, dp_buffers=dp_buf, overhead=overhead, rank=rank,
                          communicators=n_comm, chip_memory_gb=float(chip.memory_gb),
                          headroom=float(planner.headroom))
        if best is None or plan.total > best.total:
            best = plan
    assert best is not None
    return best


# ---------------------------------------------------------------------------------------------
# step time


def allreduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size`` bytes over ``n`` ranks."""
    return 2.0 * size * (n - 1) / n if n > 1 else 0.0


def bubble_fraction(s: ParallelShape) -> float:
    """(p-1)/(v m + p - 1): v = 1 for GPipe and 1F1B, the stages per rank when interleaved. ZBV
    is counted as interleaved with its 2 stages per rank: an upper bound, as its weight-gradient
    work fills the rest of the bubble only when forward, input- and weight-backward times
    balance (Qi et al. 2024). The trainer reports the same figure (trainers/parallel.py)."""
    return rules.bubble_fraction(s.pp, s.microbatches, s.schedule, s.virtual_stages)


def model_flops(m: ModelShape, s: ParallelShape) -> float:
    """(6 N + 12 L h s) per token, PaLM's count (attention scores included, recompute not)."""
    tokens = s.dp * s.microbatches * s.micro_batch * s.seq_len
    return (6.0 * m.n_params + 12.0 * m.layers * m.d * s.seq_len) * tokens


def _link(chip: DictConfig, ranks_spanned: int) -> float:
    """Per-device bandwidth, bytes/s, of a group whose ranks span this many consecutive devices."""
    gbps = chip.intra_node_gbps if ranks_spanned <= int(chip.devices_per_node) else chip.inter_node_gbps
    return max(float(gbps), 1e-9) * 1e9


def dp_traffic_bytes(m: ModelShape, s: ParallelShape, n_params: float, precision: DictConfig, comm: DictConfig,
                     planner: DictConfig) -> float:
    """Bytes one rank sends per step for data parallelism."""
    if s.dp == 1:
        return 0.0
    pb, gb, _ = state_bytes(precision, planner)
    if s.fsdp:  # all-gather for forward, again for backward, reduce-scatter of gradients
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


def step_parts(m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig,
               planner: DictConfig) -> StepParts:
    act_b = BYTES[precision.compute_dtype]
    peak = float(chip.peak_tflops.get(precision.compute_dtype, chip.peak_tflops.get("fp32", 0.0))) * 1e12
    # a CPU "device" is a worker process: they all share the host, whose peak the cpu preset gives
    peak_all = max(peak, 1e-9) * (1 if chip.device_type == "cpu" else s.world)
    flops = model_flops(m, s)
    hw = flops * (8.0 / 6.0 if m.checkpointing else 1.0)
    compute = hw / peak_all
    backward = compute * (0.75 if m.checkpointing else 2.0 / 3.0)
    rc = max((rank_contents(m, s, r) for r in range(s.pp)), key=lambda c: c.layers)
    msg = s.seq_len * s.micro_batch * m.d * act_b
    tp_s, tp_calls = 0.0, 0
    if s.tp > 1:
        tp_calls = (6 if m.checkpointing else 4) * rc.layers * s.microbatches
        tp_s = tp_calls * allreduce_bytes(msg, s.tp) / _link(chip, s.tp)
    pp_s, pp_calls = 0.0, 0
    if s.pp > 1:
        pp_calls = 2 * s.microbatches * s.chunks_per_rank
        pp_s = pp_calls * msg / (s.tp if s.sequence_parallel else 1) / _link(chip, s.tp * s.pp)
    n = max(rank_params(m, s, rank_contents(m, s, r)) for r in range(s.pp))
    dp_s = dp_traffic_bytes(m, s, n, precision, comm, planner) / _link(chip, s.world)
    dp_calls = 0
    if s.dp > 1:  # one collective per DDP bucket; FSDP: gather, gather, reduce-scatter per block
        dp_calls = 3 * rc.layers if s.fsdp else math.ceil(n * state_bytes(precision, planner)[1]
                                                          / (float(comm.bucket_mb) * MiB))
    overlap = float(planner.dp_overlap) if comm.overlap else 0.0
    return StepParts(compute_s=compute, backward_s=backward, bubble=bubble_fraction(s), tp_comm_s=tp_s,
                     pp_comm_s=pp_s, dp_comm_s=dp_s, tp_calls=tp_calls, pp_calls=pp_calls, dp_calls=dp_calls,
                     overlap=overlap, latency_s=float(planner.collective_latency_us) * 1e-6, model_flops=flops,
                     peak_flops=peak_all)


def combine(parts: StepParts, compute_efficiency: float, comm_efficiency: float,
            latency_s: Optional[float] = None) -> StepEstimate:
    """Step time = compute / (1 - bubble) + TP + PP + the DP traffic not hidden behind backward;
    each collective costs ``latency_s + bytes / (bandwidth x comm_efficiency)`` (Hockney's
    alpha-beta model; ``latency_s`` defaults to the parts' own, planner.collective_latency_us)."""
    lat = parts.latency_s if latency_s is None else latency_s
    compute = parts.compute_s / compute_efficiency
    pipeline = compute / (1.0 - parts.bubble)
    tp, pp, dp = (x / comm_efficiency + calls * lat for x, calls in
                  ((parts.tp_comm_s, parts.tp_calls), (parts.pp_comm_s, parts.pp_calls),
                   (parts.dp_comm_s, parts.dp_calls)))
    exposed = dp - min(parts.overlap * dp, parts.backward_s / compute_efficiency)
    step = pipeline + tp + pp + exposed
    return StepEstimate(step_time_s=step, mfu=parts.model_flops / (step * parts.peak_flops) if step > 0 else 0.0,
                        bubble_fraction=parts.bubble, comm_share=(tp + pp + exposed) / step if step > 0 else 0.0,
                        compute_s=pipeline, tp_comm_s=tp, pp_comm_s=pp, dp_comm_s=dp, dp_exposed_s=exposed,
                        model_flops=parts.model_flops, compute_efficiency=compute_efficiency,
                        comm_efficiency=comm_efficiency, latency_s=lat)


def step_time(m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig,
              planner: DictConfig) -> StepEstimate:
    parts = step_parts(m, s, precision, comm, chip, planner)
    return combine(parts, float(planner.compute_efficiency), float(planner.comm_efficiency))


# ---------------------------------------------------------------------------------------------
# operator coverage


@functools.lru_cache(maxsize=32)
def _captured(model_json: str, seq_len: int, compute_dtype: str) -> Tuple[Tuple[str, int], ...]:
    from trainers.ops import capture_ops

    cap = capture_ops(json.loads(model_json), seq_len=seq_len, compute_dtype=compute_dtype)
    return tuple(sorted(cap.counts.items()))


def captured_ops(model: DictConfig | Dict[str, Any], seq_len: int, compute_dtype: str) -> Dict[str, int]:
    """aten op -> calls in one forward + backward of the model, run on the meta device."""
    body = OmegaConf.to_container(model, resolve=True) if isinstance(model, DictConfig) else dict(model)
    return dict(_captured(json.dumps(body, sort_keys=True), int(seq_len), str(compute_dtype)))


@dataclass
class OpPlan:
    op: str
    plan: str  # native | mapped | custom
    via: str = ""  # the decomposition (model.KEY=VALUE) or why a custom kernel is needed
    calls: int = 0


@dataclass
class OpCoverage:
    """The seed article's two figures over the model's distinct operators: coverage
    N_supported / N_total and replacement rate (N_mapped + N_fused + N_custom) / N_total."""
    ops: List[OpPlan]
    model_overrides: Dict[str, Any]
    unresolved: List[str]  # operators with neither support nor a usable decomposition
    n_fused: int = 0  # operator fusion (graph compilers) is not planned here

    def count(self, plan: str) -> int:
        return sum(1 for o in self.ops if o.plan == plan)

    @property
    def n_total(self) -> int:
        return len(self.ops)

    @property
    def coverage(self) -> float:
        return self.count("native") / self.n_total if self.ops else 1.0

    @property
    def replacement_rate(self) -> float:
        return (self.count("mapped") + self.n_fused + self.count("custom")) / self.n_total if self.ops else 0.0

    def to_dict(self) -> Dict[str, Any]:
        return {"n_total": self.n_total, "n_supported": self.count("native"), "n_mapped": self.count("mapped"),
                "n_fused": self.n_fused, "n_custom": self.count("custom"), "coverage": self.coverage,
                "replacement_rate": self.replacement_rate, "model_overrides": dict(self.model_overrides),
                "unresolved": list(self.unresolved), "ops": [asdict(o) for o in self.ops]}


def _matches(op: str, patterns: Iterable[str]) -> Optional[str]:
    """The first pattern naming ``op``: a glob, or a prefix (``chip.decompositions`` keys become
    MLflow param names, which may not contain ``*``)."""
    return next((p for p in patterns if fnmatch(op, p) or op.startswith(p)), None)


def _model_override(value: str, model: DictConfig | Dict[str, Any]) -> Optional[Tuple[str, str]]:
    key, sep, val = str(value).partition("=")
    if not sep or not key.startswith("model.") or key[len("model."):] not in model:
        return None
    return key[len("model."):], val


def op_coverage(model: DictConfig, seq_len: int, compute_dtype: str, chip: DictConfig) -> OpCoverage:
    """Plan every operator of the model against the chip's table (``chip.unsupported_ops``,
    ``chip.decompositions``: glob or prefix -> ``model.KEY=VALUE``): native, mapped to a decomposition
    the trainer applies through that model option, or a custom kernel to write. The mapped
    model is captured again, so a decomposition that itself needs a missing operator shows up
    as unresolved."""
    unsupported = list(chip.unsupported_ops)
    decomps = {str(k): str(v) for k, v in chip.decompositions.items()}
    counts = captured_ops(model, seq_len, compute_dtype)
    plans: List[OpPlan] = []
    overrides: Dict[str, Any] = {}
    for op, calls in sorted(counts.items()):
        if not _matches(op, unsupported):
            plans.append(OpPlan(op, "native", calls=calls))
            continue
        pattern = _matches(op, decomps)
        kv = _model_override(decomps[pattern], model) if pattern else None
        if kv is None:
            why = (f"chip.decompositions[{pattern!r}]={decomps[pattern]!r} is not a model.KEY=VALUE option"
                   if pattern else "no decomposition in the chip table")
            plans.append(OpPlan(op, "custom", why, calls))
        else:
            overrides[kv[0]] = yaml.safe_load(kv[1]) if kv[1] else kv[1]
            plans.append(OpPlan(op, "mapped", f"model.{kv[0]}={kv[1]}", calls))
    unresolved = [p.op for p in plans if p.plan == "custom"]
    if overrides:
        mapped_model = {**OmegaConf.to_container(model, resolve=True), **overrides} \
            if isinstance(model, DictConfig) else {**model, **overrides}
        for op in captured_ops(mapped_model, seq_len, compute_dtype):
            if op not in counts and _matches(op, unsupported):
                unresolved.append(op)
                plans.append(OpPlan(op, "custom", "needed by the decomposition and unsupported", 0))
    return OpCoverage(plans, overrides, sorted(set(unresolved)))


# ---------------------------------------------------------------------------------------------
# one layout, a sweep of layouts, the preflight report


@dataclass
class LayoutPlan:
    shape: ParallelShape
    memory: MemoryPlan
    step: StepEstimate

    def contract(self) -> Dict[str, Any]:
        """One object of ``python -m orchestrator.plan --json`` (DESIGN.md public contract)."""
        return {"dp": self.shape.dp, "tp": self.shape.tp, "pp": self.shape.pp,
                "microbatches": self.shape.microbatches, "schedule": self.shape.schedule,
                "memory_gb": self.memory.gb(), "fits": self.memory.fits,
                "bubble_fraction": self.step.bubble_fraction, "comm_share": self.step.comm_share,
                "step_time_s": self.step.step_time_s, "mfu": self.step.mfu}


def with_model_overrides(cfg: DictConfig, overrides: Dict[str, Any]) -> DictConfig:
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        out.model[key] = value
    return out


def plan_layout(cfg: DictConfig) -> LayoutPlan:
    """Memory and step time of ``cfg`` as composed (apply the coverage's model overrides first)."""
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg))
    return LayoutPlan(s, memory_plan(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner),
                      step_time(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner))


def resolved(cfg: DictConfig) -> DictConfig:
    """A copy with the chip filled in (detected when no ``+chip=NAME`` was given)."""
    cfg = copy.deepcopy(cfg)
    return chips.resolve(cfg)


def planning_errors(cfg: DictConfig) -> List[str]:
    """validate() of ``cfg`` as a plan: what the trainer cannot run yet ("not yet supported"),
    whether the chip is present on this machine, and node counts are not the plan's business
    (the chip is planned as if emulated, on as many nodes as the layout needs)."""
    plan = resolved(cfg)
    plan.chip.emulate = True
    world = layout(plan).world_size
    plan.launch.nnodes = max(int(plan.launch.nnodes), -(-world // max(1, int(plan.chip.devices_per_node))))
    return [e for e in validate(plan) if NOT_YET not in e]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_microbatches(parallel: DictConfig, trainer: DictConfig, dp: int, pp: int) -> int:
    """The configured pipeline microbatches when they fit this layout; else the fewest that
    fill the pipeline and keep microbatches no larger than trainer.micro_batch."""
    if pp == 1:
        return int(parallel.microbatches)
    per_replica = int(trainer.global_batch) // dp
    step = pp if parallel.schedule == "interleaved_1f1b" else 1

    def ok(mb: int) -> bool:
        return mb >= pp and per_replica % mb == 0 and mb % step == 0

    if ok(int(parallel.microbatches)):
        return int(parallel.microbatches)
    need = max(pp, -(-per_replica // int(trainer.micro_batch)))
    return next((d for d in _divisors(per_replica) if d >= need and ok(d)), int(parallel.microbatches))


def layouts(devices: int, model: DictConfig, chip: DictConfig, max_pp: int = 16) -> List[Tuple[int, int, int]]:
    """Every (dp, tp, pp) of ``devices``: tp a power of two dividing the heads, key/value heads
    and d_ff, within one node; pp dividing the layers, up to ``max_pp``."""
    m = ModelShape.of(model)
    out = []
    tp = 1
    while tp <= min(devices, int(chip.devices_per_node)):
        if m.heads % tp == 0 and m.kv_heads % tp == 0 and m.d_ff % tp == 0:
            for pp in range(1, min(max_pp, m.layers) + 1):
                if m.layers % pp == 0 and devices % (tp * pp) == 0:
                    out.append((devices // (tp * pp), tp, pp))
        tp *= 2
    return out


def layout_config(cfg: DictConfig, devices: int, dp: int, tp: int, pp: int) -> DictConfig:
    """``cfg`` with this layout on ``devices`` devices."""
    out = copy.deepcopy(cfg)
    out.parallel.dp, out.parallel.tp, out.parallel.pp = dp, tp, pp
    out.parallel.microbatches = default_microbatches(cfg.parallel, cfg.trainer, dp, pp)
    if tp == 1:
        out.parallel.sequence_parallel = False
    out.launch.world_size = devices
    out.launch.nnodes = -(-devices // max(1, int(cfg.chip.devices_per_node)))
    return out


def plan_devices(cfg: DictConfig, devices: int) -> Tuple[List[LayoutPlan], Dict[str, List[str]]]:
    """Plans of every valid layout of ``devices`` devices, fastest first, and the layouts
    skipped with their broken rules. Operator coverage (hence attn_impl) is the same for all."""
    cfg = resolved(cfg)
    cov = op_coverage(cfg.model, int(cfg.trainer.seq_len), cfg.precision.compute_dtype, cfg.chip)
    base = with_model_overrides(cfg, cov.model_overrides)
    plans, skipped = [], {}
    for dp, tp, pp in layouts(devices, base.model, base.chip):
        one = layout_config(base, devices, dp, tp, pp)
        errors = planning_errors(one)
        if errors:
            skipped[f"dp{dp}tp{tp}pp{pp}"] = errors
            continue
        plans.append(plan_layout(one))
    plans.sort(key=lambda p: p.step.step_time_s)
    return plans, skipped


def preflight(cfg: DictConfig) -> Dict[str, Any]:
    """The report a trial is launched on (JSON-serialisable, saved as ``preflight.json``):
    ``feasible`` and one line per reason it is not, the ``model_overrides`` the trainer must run
    with (the mapped decompositions), the memory plan, operator coverage and step-time estimate.
    Expects a config that passed validate(); the chip is detected if it is not set."""
    cfg = resolved(cfg)
    cov = op_coverage(cfg.model, int(cfg.trainer.seq_len), cfg.precision.compute_dtype, cfg.chip)
    planned = with_model_overrides(cfg, cov.model_overrides)
    lp = plan_layout(planned)
    mem = lp.memory
    reasons = []
    if not mem.fits:
        reasons.append(f"memory: {mem.total / GiB:.1f} GB per rank exceeds {cfg.chip.name}'s "
                       f"{float(cfg.chip.memory_gb):g} GB x {float(cfg.planner.headroom):g} headroom "
                       f"(params {mem.params / GiB:.1f}, grads {mem.grads / GiB:.1f}, optimizer "
                       f"{mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f}, buffers and "
                       f"reserve {(mem.buffers + mem.overhead) / GiB:.1f})")
    if cov.unresolved:
        reasons.append(f"operators without support or mapping on {cfg.chip.name}: {', '.join(cov.unresolved)}")
    return {
        "feasible": not reasons,
        "reasons": reasons,
        "model_overrides": dict(cov.model_overrides),
        "chip": str(cfg.chip.name),
        "layout": asdict(lp.shape),
        "memory_gb": mem.gb(),
        "memory": mem.detail(),
        "fits": mem.fits,
        "planned_mem_gb": mem.total / GiB,
        "ops": cov.to_dict(),
        "step": asdict(lp.step),
        "planner": OmegaConf.to_container(cfg.planner, resolve=True),
    }


# ---------------------------------------------------------------------------------------------
# calibration against measured trials


@dataclass
class MeasuredTrial:
    run_id: str
    cfg: DictConfig
    step_time_s: float
    peak_mem_gb: Optional[float] = None


@dataclass
class Calibration:
    compute_efficiency: float
    comm_efficiency: float
    collective_latency_us: float
    n_fitted: int  # factors fitted (the rest kept as configured)
    n_runs: int
    median_abs_rel_error: float
    spearman_rho: Optional[float]
    runs: List[Dict[str, Any]] = field(default_factory=list)


def _parse_param(text: str) -> Any:
    if text in ("None", "null"):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def config_from_params(params: Dict[str, str], metrics: Optional[Dict[str, float]] = None) -> DictConfig:
    """The trial's config rebuilt from its MLflow params (the flattened resolved config, see
    tracking.flatten) onto the schema; its layout from the run's dp/tp/pp metrics."""
    from orchestrator.config import Config

    tree: Dict[str, Any] = {}
    sections = set(Config.__dataclass_fields__)
    for key, text in params.items():
        parts = key.split(".")
        if parts[0] not in sections or len(parts) < 2:
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_param(text)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), tree)
    metrics = metrics or {}
    if all(k in metrics for k in ("dp", "tp", "pp")):
        cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = (int(metrics[k]) for k in ("dp", "tp", "pp"))
        cfg.launch.world_size = int(metrics["dp"] * metrics["tp"] * metrics["pp"])
    return cfg


def measured_trials(uri: str, experiment: str, chip: Optional[str] = None) -> List[MeasuredTrial]:
    """Finished, not emulated trials (of ``chip``) with a measured ``step_time_median_s``."""
    from orchestrator import tracking

    c = tracking.client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    out = []
    for run in c.search_runs([exp.experiment_id], filter_string="tags.`trial.status` = 'finished'",
                             max_results=5000):
        tags, metrics = run.data.tags, run.data.metrics
        if tags.get("emulated") == "true" or (chip and tags.get("chip") != chip):
            continue
        if "step_time_median_s" not in metrics:
            continue
        try:
            cfg = config_from_params(run.data.params, metrics)
        except Exception:  # noqa: BLE001 - a run from an older schema: not usable for fitting
            continue
        out.append(MeasuredTrial(run.info.run_id, cfg, float(metrics["step_time_median_s"]),
                                 metrics.get("peak_mem_gb")))
    return out


def _ranks(xs: Sequence[float]) -> List[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman_rho(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (ties get their average rank); None below two points."""
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / den if den > 0 else None


def trial_parts(cfg: DictConfig) -> StepParts:
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg))
    return step_parts(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner)


def calibrate(trials: Sequence[MeasuredTrial], planner: DictConfig) -> Calibration:
    """Fit the compute efficiency, the link efficiency and the per-collective latency to measured
    step times (least squares on log(predicted / measured) over a log-spaced grid, refined five
    times), and report the fitted model's median absolute relative error and Spearman's rho on
    the same trials. What the trials cannot tell keeps its configured value: without any
    communicating run, only the compute efficiency is fitted. With as many trials as fitted
    factors the error is near zero by construction; judge it on more."""
    import numpy as np

    ec0, en0, lat0 = (float(planner.compute_efficiency), float(planner.comm_efficiency),
                      float(planner.collective_latency_us) * 1e-6)
    if not trials:
        return Calibration(ec0, en0, lat0 * 1e6, 0, 0, float("nan"), None)
    parts = [trial_parts(t.cfg) for t in trials]
    y = np.array([t.step_time_s for t in trials])
    col = {k: np.array([getattr(p, k) for p in parts], dtype=float)[:, None, None, None]
           for k in ("compute_s", "backward_s", "bubble", "tp_comm_s", "pp_comm_s", "dp_comm_s", "tp_calls",
                     "pp_calls", "dp_calls", "overlap")}
    fit_comm = bool((col["tp_calls"] + col["pp_calls"] + col["dp_calls"]).sum() > 0)

    def predict(ec, en, lat):
        compute = col["compute_s"] / ec / (1.0 - col["bubble"])
        tp = col["tp_comm_s"] / en + col["tp_calls"] * lat
        pp = col["pp_comm_s"] / en + col["pp_calls"] * lat
        dp = col["dp_comm_s"] / en + col["dp_calls"] * lat
        exposed = dp - np.minimum(col["overlap"] * dp, col["backward_s"] / ec)
        return compute + tp + pp + exposed

    ranges = [(1e-4, 10.0, 81), (1e-4, 10.0, 25), (1e-7, 1e-1, 25)] if fit_comm else [(1e-4, 10.0, 161)]
    best = (ec0, en0, lat0)
    for _ in range(6):
        axes = [np.geomspace(lo, hi, n) for lo, hi, n in ranges]
        ec = axes[0][:, None, None]
        en = axes[1][None, :, None] if fit_comm else np.array(en0)
        lat = axes[2][None, None, :] if fit_comm else np.array(lat0)
        loss = (np.log(predict(ec, en, lat) / y[:, None, None, None]) ** 2).sum(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        best = (float(axes[0][i]), float(axes[1][j]) if fit_comm else en0, float(axes[2][k]) if fit_comm else lat0)
        ranges = [(v / (hi / lo) ** (1 / (n - 1)), v * (hi / lo) ** (1 / (n - 1)), n)
                  for v, (lo, hi, n) in zip(best, ranges)]
    ec_b, en_b, lat_b = best
    predicted = [combine(p, ec_b, en_b, lat_b).step_time_s for p in parts]
    errors = [float(abs(p - m) / m) for p, m in zip(predicted, y)]
    runs = [{"run_id": t.run_id, "measured_s": float(m), "predicted_s": p} for t, m, p in zip(trials, y, predicted)]
    return Calibration(ec_b, en_b, lat_b * 1e6, 3 if fit_comm else 1, len(trials), statistics.median(errors),
                       spearman_rho(predicted, [float(m) for m in y]), runs)
