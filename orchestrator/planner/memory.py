"""Memory per rank (GiB, 2**30 bytes, as device memory and ``peak_mem_gb`` are counted).

- parameters, gradients and Adam states from the bytes per parameter of the precision: FP32
  training keeps 4 (params) + 4 (grads) + 8 (two FP32 moments); 16-bit parameters with FP32
  master weights keep 2 + 2 + 12 (master + moments), the 16 bytes/param of the ZeRO paper
  (Rajbhandari et al. 2020, sec. 3.1), the trainer's gradients being in the parameters' dtype
  (Megatron's fp32 main grads make it 18, ``theoretical_memory_usage.py``); 16-bit parameters
  without master weights keep 2 + 2 + 4 (16-bit moments). The element counts are exact per rank
  (:func:`model_state`, the tensors of :mod:`orchestrator.planner.shapes`): tensor parallelism
  shards the layer matrices and the vocabulary; pipeline parallelism gives each rank its
  stages' layers (the embedding on the first, the head on the last; ZB-V's V shape puts both on
  rank 0); FSDP shards all three over ``dp``. ``tests/test_state_bytes.py`` holds these to the
  bytes the trainer really holds (``model_state_bytes`` of its summary), rank by rank.
- activations and the loss's own peak: :mod:`orchestrator.planner.activations`.
- buffers: HCCL allocates ``2 x HCCL_BUFFSIZE`` per communicator (CANN environment variable
  reference, HCCL_BUFFSIZE: "每个通信域占用 2*HCCL_BUFFSIZE 大小的内存"), NCCL per channel and
  ring neighbour its three protocols' buffers (:func:`communicator_bytes`, ~294 MiB with 16
  channels: an estimate, ``planner.nccl_channels``, calibrated by ``bench/comm_memory.py``);
  communicators are the world, dp, tp groups and the pipeline neighbours a rank talks to (on
  HCCL the pipeline group's too, and each neighbour's point-to-point communicator holds
  ``2 x P2P_HCCL_BUFFSIZE``, 20 MB by default: :func:`communicators`). Data parallelism
  (:func:`dp_buffer_bytes`): DDP keeps a flat copy of every gradient in its buckets unless
  ``gradient_as_bucket_view`` (torch docs), as do the TP replicas' buckets; FSDP gathers one
  block's parameters while prefetching the next, ``zero1`` keeps every unit gathered for the
  step, and both hold whole gradients while micro-batches accumulate. Without overlap (``comm.overlap=false``) there
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
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from orchestrator.planner.activations import (
    ActBytes,
    loss_transient_bytes,
    rank_activation_bytes,
)
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
from trainers import rules


def state_bytes(precision: DictConfig, planner: DictConfig) -> Tuple[int, int, int]:
    """Bytes per parameter of (parameters, gradients, Adam states)."""
    p = BYTES[precision.param_dtype]
    g = p  # gradients in the parameters' dtype, as the trainer keeps them (no fp32 main grads)
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


def communicators(s: ParallelShape, rank: int, backend: str = "nccl") -> Tuple[int, int]:
    """(group communicators, point-to-point ones) one rank holds: the world, dp and tp groups,
    and for a pipeline a point-to-point communicator with each neighbour (ZB-V's V also joins
    rank 0 and rank p-1). On HCCL the pipeline group has a communicator of its own as well:
    ``batch_isend_irecv`` runs as a collective on the group's communicator (torch_npu
    ``ProcessGroupHCCL::batch_isend_irecv``), plain ``isend``/``irecv`` on a communicator per pair
    of ``P2P_HCCL_BUFFSIZE`` (``ProcessGroupHCCL::pointToPoint``, ``getKeySendRecv``;
    v7.3.0-pytorch2.7.1); torch's pipeline schedules take the first for mixed batches and, since
    they split homogeneous ones, the second for the rest, so both are counted."""
    n = 1 if s.world > 1 else 0
    n += 1 if 1 < s.dp < s.world else 0
    n += 1 if 1 < s.tp < s.world else 0
    p2p = 0
    if s.pp > 1:
        p2p = (rank > 0) + (rank < s.pp - 1) + (s.schedule == "zbv")
        n += 1 if backend == "hccl" and s.pp < s.world else 0
    return n, p2p


# NCCL's per-connection buffers beside NCCL_BUFFSIZE's Simple-protocol FIFO: LL128 (120 x 640
# threads x 8 steps x 8 B = 4.6875 MiB) and LL (8 lines x 512 threads x 8 steps x 16 B = 0.5 MiB),
# NCCL's DEFAULT_LL128_BUFFSIZE and DEFAULT_LL_BUFFSIZE (src/include/device.h)
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
NCCL_LL_BYTES = 8 * 512 * 8 * 16


# P2P_HCCL_BUFFSIZE's default, MB (torch_npu OptionsManager::GetP2PBufferSize: 20 unless set)
P2P_HCCL_BUFFSIZE_MB = 20


def communicator_sizes(backend: str, comm: DictConfig, planner: DictConfig) -> Tuple[float, float]:
    """Device memory of one group communicator (:func:`communicator_bytes`) and of one
    point-to-point communicator: on HCCL ``2 x P2P_HCCL_BUFFSIZE`` (``comm.env`` may set it),
    elsewhere a communicator like any other (the pair :func:`communicators` counts)."""
    group = communicator_bytes(backend, comm, planner)
    if backend == "hccl":
        env = comm.get("env") or {}
        return group, 2 * float(env.get("P2P_HCCL_BUFFSIZE", P2P_HCCL_BUFFSIZE_MB)) * MiB
    return group, group


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
        simple = float(comm.nccl_buffsize_mb) * MiB
        return int(planner.nccl_channels) * 2 * (simple + NCCL_LL128_BYTES + NCCL_LL_BYTES)
    return 0.0


def dp_buffer_bytes(
    m: ModelShape, s: ParallelShape, comm: DictConfig, planner: DictConfig, n: int, pb: int, gb: int, rc: Any
) -> float:
    """Data-parallel buffers of pipeline rank contents ``rc`` holding ``n`` parameters before FSDP
    sharding."""
    if s.dp <= 1:
        return 0.0
    if s.fsdp:
        block = block_params(m, s)
        # unsharded gradients: accumulated whole across the micro-batches (FSDP2 keeps them until
        # the last backward's reduce-scatter, set_requires_gradient_sync(False); a pipeline's stage
        # does so for every backward), and the one root unit's all at once; else a block's at a time
        zero3 = rules.zero3(s.wrapping, s.pp, s.schedule)  # reduced into shards every micro-batch
        whole_grads = not comm.overlap or (not zero3 and (s.microbatches > 1 or s.pp > 1))
        # whole gradients stand in for the sharded ones the state counts (those exist only after
        # the last reduce-scatter, when the whole ones are freed)
        grads = n - sum(local_numel(t, s) for t in rank_tensors(m, rc)) if whole_grads else block
        root = n - len(rc.layers) * block  # the stage root's unit: embeddings, final norm, head
        if s.wrapping == "zero1" or not comm.overlap:
            # every unit gathered for the step (or the one root unit), and the largest landing:
            # FSDP2 gathers a unit into one flat buffer and copies it out into the parameters
            gathered = n + (max(block, root) if comm.overlap else n)
        elif s.pp > 1:
            # the stage's forward reshards every unit, the root too, before the loss's backward
            # peak: the prefetched block, landing (measured on dp2pp2's last stage)
            gathered = 2 * block
        else:
            # the root gathered for its backward beside the block and the prefetched next
            # (measured on dp2tp2: 0.96-1.07 of the step's peak)
            gathered = 2 * block + root
        return float(gathered * pb + grads * gb)
    # DDP's buckets copy every gradient (the trainer does not set gradient_as_bucket_view); without
    # the wrapper (comm.overlap=false) every bucket's flat copy is in flight at once after the backward
    return float(n * gb)


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


def compose_memory_plan(
    m: ModelShape,
    s: ParallelShape,
    ab: ActBytes,
    chip: Any,
    planner: Any,
    comm_bytes: Tuple[float, float],
    contents: Callable[[int], Any],
    state: Callable[[int], ModelState],
    dp_buffers: Callable[[Any, int], float],
) -> MemoryPlan:
    """The plan of the most loaded pipeline rank, from per-rank callables: ``contents(rank)``
    (:func:`rank_contents`), ``state(rank)`` (:func:`model_state`), ``dp_buffers(rc, rank)``
    (:func:`dp_buffer_bytes`). :func:`memory_plan` passes the plain functions, the search's fast
    path (``orchestrator/planner/space.py``) its caches of the same."""
    reserve, fraction = float(planner.runtime_overhead_gb) * GiB, float(planner.overhead_fraction)
    best: Optional[MemoryPlan] = None
    for rank in range(s.pp):
        rc = contents(rank)
        st = state(rank)
        act = rank_activation_bytes(m, s, rc, rank, ab)
        if rc.head:  # the loss's own peak sits on top of what the rank saves
            act += loss_transient_bytes(m, s.seq_len, s.micro_batch, s.tp, ab, pipelined=s.pp > 1)
        dp_buf = dp_buffers(rc, rank)
        if s.wrapping == "ddp" and s.tp > 1:
            # the TP replicas' buckets are made during the last backward, as it frees the
            # activations: they add only what exceeds them (measured: tests/test_step_peak.py)
            dp_buf = max(0.0, dp_buf - act)
        n_comm, n_p2p = communicators(s, rank, str(chip.dist_backend))
        plan = MemoryPlan(
            params=float(st.params),
            grads=float(st.grads),
            optimizer=float(st.optimizer),
            activations=act,
            comm_buffers=n_comm * comm_bytes[0] + n_p2p * comm_bytes[1],
            dp_buffers=dp_buf,
            overhead=reserve + fraction * (st.total + act),
            rank=rank,
            communicators=n_comm + n_p2p,
            chip_memory_gb=float(chip.memory_gb),
            headroom=float(planner.headroom),
        )
        if best is None or plan.total > best.total:
            best = plan
    assert best is not None
    return best


def memory_plan(
    m: ModelShape, s: ParallelShape, precision: DictConfig, comm: DictConfig, chip: DictConfig, planner: DictConfig
) -> MemoryPlan:
    """Memory of every pipeline rank; the plan is that of the rank with the largest total (of
    each pipeline rank, its TP and DP rank 0, which hold the most)."""
    pb, gb, _ = state_bytes(precision, planner)
    return compose_memory_plan(
        m,
        s,
        ActBytes.on(precision, m, chip),
        chip,
        planner,
        communicator_sizes(chip.dist_backend, comm, planner),
        contents=lambda rank: rank_contents(m, s, rank),
        state=lambda rank: model_state(m, s, precision, planner, rank),
        dp_buffers=lambda rc, rank: dp_buffer_bytes(m, s, comm, planner, rank_params(m, s, rc), pb, gb, rc),
    )
