"""The layout rules the trainer builds by and the planner plans by, in one place (torch-free).

Which data-parallel wrapping a layout gets, how a replica's batch is cut into micro-batches, how
the model is split into pipeline stages and which stages a rank holds, and the pipeline bubble:
``trainers/parallel.py`` and ``trainers/assembly.py`` build exactly this, ``orchestrator/planner``
and ``orchestrator/validate.py`` reason about exactly this. A change here changes both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Layout:
    """The process mesh, dp x tp x pp."""

    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp) < 1:
            raise ValueError(f"a layout's sizes are at least 1, got dp={self.dp} tp={self.tp} pp={self.pp}")

    @classmethod
    def filled(cls, dp: int, tp: int, pp: int, world_size: int) -> "Layout":
        """``dp <= 0`` filled from ``world_size``: the replicas that fit beside tp x pp (at least 1)."""
        tp, pp = max(1, tp), max(1, pp)
        return cls(dp if dp > 0 else max(1, world_size // (tp * pp)), tp, pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        """``dp2tp2pp1``: how runs, reports and the planner name a layout."""
        return f"dp{self.dp}tp{self.tp}pp{self.pp}"


def kv_heads(n_heads: int, n_kv_heads: int | None) -> int:
    """The key/value heads of attention: ``model.n_kv_heads``, or ``n_heads`` when it is unset
    (-1, 0 or None); fewer than ``n_heads`` is grouped-query attention."""
    return int(n_heads) if n_kv_heads in (-1, 0, None) else int(n_kv_heads)


# model.family's values: the Hugging Face families the trainer builds (trainers/hf_layout.py),
# each with its config.json's architecture and model_type
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
FAMILIES = tuple(ARCHITECTURES)
# config.json fields a family's config class carries that the trainer builds one way only: read
# and refused otherwise (orchestrator/hf_model.py), written so on export (trainers/hf_layout.py).
# transformers' LlamaConfig has attention_bias and mlp_bias, Qwen3Config attention_bias; Mistral's
# and Qwen2's layers are fixed (Qwen2's q, k, v biases always built: qkv_bias below)
FIXED_FIELDS: Dict[str, Dict[str, bool]] = {
    "llama": {"attention_bias": False, "mlp_bias": False},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"attention_bias": False},
}
# the config.json field that turns a family's attention window on: Mistral's sliding_window
# itself (null: none); Qwen2's and Qwen3's configs carry a sliding_window value either way, in
# force only where use_sliding_window is set (or a layer's type is sliding_attention)
WINDOW_SWITCH = {"mistral": "sliding_window", "qwen2": "use_sliding_window", "qwen3": "use_sliding_window"}


def qkv_bias(family: str) -> bool:
    """Whether attention's q, k and v projections carry biases: Qwen2's do (its modeling code
    builds them unconditionally); Llama's and Mistral's do not."""
    return family == "qwen2"


def qk_norm(family: str) -> bool:
    """Whether each query and key head is RMS-normalised over its own dimensions before RoPE:
    Qwen3's are (``q_norm``, ``k_norm``, one weight of ``head_dim`` each, shared by the heads)."""
    return family == "qwen3"


# parallel.dp_shard's values: how replicas meet (trainers/assembly.py builds each one)
# ddp: whole replicas, gradients all-reduced once a step (DDP's reducer without TP, a bucketed
#   all-reduce of the DTensor gradients over the DP group with it);
# zero1: the distributed optimizer: FSDP2 units kept gathered for the whole step (one all-gather
#   of the parameters, one reduce-scatter of the gradients a step), fp32 masters and optimizer
#   state on a 1/dp shard, as Megatron's --use-distributed-optimizer moves them;
# fsdp: ZeRO-3, FSDP2 units resharded after each forward and backward (gathered again for every
#   micro-batch), the least memory.
DP_MODES = ("ddp", "zero1", "fsdp")


def dp_wrapping(dp: int, tp: int, dp_shard: str) -> str:
    """``none`` (one replica), else ``parallel.dp_shard`` itself (:data:`DP_MODES`), with or
    without tensor parallelism. ``tp`` does not decide it: DDP's reducer does not take DTensor
    parameters, so under TP ``ddp`` is the trainer's own bucketed all-reduce of the gradients'
    local shards (``trainers/replicas.py``)."""
    if dp <= 1:
        return "none"
    if dp_shard not in DP_MODES:
        raise ValueError(f"parallel.dp_shard={dp_shard!r} is not one of {DP_MODES}")
    return dp_shard


def sharded(wrapping: str) -> bool:
    """Whether a wrapping shards parameters, gradients and optimizer state over the replicas
    between steps (FSDP2's ``fully_shard``: ``zero1`` and ``fsdp``)."""
    return wrapping in ("zero1", "fsdp")


def zero3(wrapping: str, pp: int, schedule: str) -> bool:
    """Whether FSDP reduce-scatters every micro-batch's gradients into their shards (``fsdp``),
    rather than holding them whole until the step's last backward. Not under ZB-V, whose weight
    gradients come in a pass after the input gradients' backward: the stage keeps torch's own
    reduction once a step there (``trainers/pipeline_stage.py``)."""
    return wrapping == "fsdp" and not (pp > 1 and schedule == "zbv")


def fsdp_gathers(wrapping: str, pp: int, microbatches: int, overlap: bool, schedule: str = "1f1b") -> int:
    """All-gathers of each FSDP unit per step, as torch 2.13's FSDP2 issues them under the
    trainer (``tests/test_dp_collectives.py`` counts them). ``zero1``: once, the units stay
    gathered for the step. ``fsdp``: a block unit (``comm.overlap``,
    ``reshard_after_forward=True``) is gathered for each micro-batch's forward and again for its
    backward, 2 m; the one root unit without overlap once per micro-batch, m. Under ZB-V torch's
    stage keeps the units gathered after every backward but the last
    (``set_reshard_after_backward(False)``, ``pipelining/stage.py``): m + 1 for block units, one
    for the root."""
    if wrapping == "zero1":
        return 1
    if pp > 1 and not zero3(wrapping, pp, schedule):
        return microbatches + 1 if overlap else 1
    return 2 * microbatches if overlap else microbatches


def fsdp_reduces(wrapping: str, pp: int, microbatches: int, schedule: str = "1f1b") -> int:
    """Reduce-scatters of each FSDP unit per step: every micro-batch's under ZeRO-3
    (:func:`zero3`), else once, after the last backward."""
    return microbatches if zero3(wrapping, pp, schedule) else 1


def stages_per_rank(pp: int, schedule: str, virtual_stages: int) -> int:
    """Model chunks one pipeline rank holds: 1 for GPipe and 1F1B, ``virtual_stages`` for
    interleaved 1F1B, a V of 2 for ZB-V."""
    if pp <= 1:
        return 1
    if schedule == "zbv":
        return 2
    return virtual_stages if schedule == "interleaved_1f1b" else 1


def stage_ids(pp: int, schedule: str, virtual_stages: int, pp_rank: int) -> List[int]:
    """Global stage indices held by ``pp_rank``: one for GPipe/1F1B; every pp-th for interleaved
    1F1B; a V (stage r and 2p-1-r, so rank 0 holds both ends of the model) for ZB-V."""
    if pp <= 1:
        return [0]
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(pp, schedule, virtual_stages))]


@functools.lru_cache(maxsize=4096)
def layer_split(n_layers: int, n_stages: int) -> Tuple[range, ...]:
    """Contiguous blocks per stage, the remainder going to the earliest stages (cached: the
    planner's search asks it for every point and rank)."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds: its stage indices, its layers, and the model's two ends."""

    stages: List[int]
    layers: List[int]
    embedding: bool  # the first stage: token (and position) embeddings
    head: bool  # the last stage: final norm and output head


def rank_stages(n_layers: int, pp: int, schedule: str, virtual_stages: int, pp_rank: int) -> RankStages:
    n_stages = pp * stages_per_rank(pp, schedule, virtual_stages)
    mine = stage_ids(pp, schedule, virtual_stages, pp_rank)
    split = layer_split(n_layers, n_stages)
    layers = [i for s in mine for i in split[s]]
    return RankStages(mine, layers, 0 in mine, n_stages - 1 in mine)


def bubble_fraction(pp: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p-1)/(p-1+m) for GPipe and 1F1B (Narayanan et al. 2021);
    interleaving v stages per rank divides the bubble by v: (p-1)/(p-1+v m). ZB-V schedules the
    weight-gradient work into the bubble; it is counted as the interleaved form with v=2, an upper
    bound (the zero-bubble paper reaches ~0 only when F, B and W times balance)."""
    if pp <= 1:
        return 0.0
    v = stages_per_rank(pp, schedule, virtual_stages)
    return (pp - 1) / (pp - 1 + v * microbatches)


def worker_threads(cores: float, workers: int) -> int:
    """The intra-op threads the trainer gives each of a CPU node's ``workers`` processes: the
    node's whole ``cores`` split among them, at least one each (``runtime.select_device``; the
    planner's CPU host counts the same, ``orchestrator/planner/cpu_host.py``)."""
    return max(1, int(cores) // max(1, workers))


@dataclass(frozen=True)
class BatchSplit:
    """How one replica's share of the global batch runs: ``count`` forward passes of ``size``
    sequences per optimizer step (gradient accumulation without a pipeline; the pipeline's own
    microbatches with one)."""

    per_replica: int
    size: int
    count: int


def batch_split(global_batch: int, dp: int, pp: int, micro_batch: int, microbatches: int) -> BatchSplit:
    """Without a pipeline: micro-batches of ``trainer.micro_batch`` accumulated. With one: the
    schedule cuts the replica's batch into ``parallel.microbatches`` (``trainer.micro_batch``
    does not apply)."""
    per_replica = max(1, global_batch // max(1, dp))
    if pp > 1:
        count = max(1, microbatches)
        return BatchSplit(per_replica, max(1, per_replica // count), count)
    size = max(1, min(micro_batch, per_replica))
    return BatchSplit(per_replica, size, max(1, per_replica // size))


def exec_margin_s(timeout_s: float) -> float:
    """How much sooner than the process group's watchdog (``comm.timeout_s``) the backend's own
    execution timeout (``HCCL_EXEC_TIMEOUT``) fires: time for HCCL to write its diagnosis (which
    rank, which operator) before torch aborts the communicator. Used by the control plane that
    sets the variable and by the worker that checks it."""
    return max(5.0, 0.1 * float(timeout_s))


def collective_timeout_s(timeout_s: float, backend: str, exec_timeout_s: float | None) -> float:
    """The process group's timeout: ``timeout_s``, raised where the backend's own execution
    timeout (an exported ``HCCL_EXEC_TIMEOUT``, say) would otherwise fire after it, so the
    collective timeout is never shorter than the backend's. 0 means HCCL never times out."""
    if backend == "hccl" and exec_timeout_s:
        return max(float(timeout_s), float(exec_timeout_s) + exec_margin_s(exec_timeout_s))
    return float(timeout_s)


# How long ranks may take to join the process group, at least: on a loaded node or a Ray cluster
# the ranks start seconds apart (imports, placement), and a short collective timeout
# (comm.timeout_s) applied to the join would fail a healthy trial before its first step.
JOIN_TIMEOUT_FLOOR_S = 300.0


def join_timeout_s(collective_s: float, backend: str) -> float:
    """The process group's timeout while its ranks connect: on gloo and nccl the collective
    timeout, at least :data:`JOIN_TIMEOUT_FLOOR_S`; the collective timeout is set once every rank
    has joined (as torchtitan separates its init and train timeouts; torch's ``_set_pg_timeout``
    knows gloo and nccl only). HCCL connects within its own ``HCCL_CONNECT_TIMEOUT`` (at least
    120 s, see ``orchestrator/chips.py``): its group keeps the collective timeout throughout."""
    if backend not in ("gloo", "nccl"):
        return float(collective_s)
    return max(float(collective_s), JOIN_TIMEOUT_FLOOR_S)


def backend_env(env: Dict[str, str], device_type: str, deterministic: bool) -> Dict[str, str]:
    """The backend variables a worker applies: ``env`` (the chip's and comm's, as
    ``orchestrator.chips.runtime`` composes them) and, with ``trainer.deterministic``, the
    device's :func:`determinism_env` where ``env`` does not set them (``trainers.runtime`` applies
    ``env`` first, and an applied value stays)."""
    return {**(determinism_env(device_type) if deterministic else {}), **env}


def determinism_env(device_type: str) -> Dict[str, str]:
    """What a device's libraries need, beside ``torch.use_deterministic_algorithms``, to be
    deterministic; set before the first kernel and the first communicator. cuBLAS: a fixed
    workspace (torch docs, "Reproducibility" and ``use_deterministic_algorithms``: CUDA >= 10.2
    needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` or ``:16:8``). HCCL: its reductions run in a fixed
    order only with ``HCCL_DETERMINISTIC=true`` (CANN environment variable reference)."""
    if device_type == "cuda":
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    if device_type == "npu":
        return {"HCCL_DETERMINISTIC": "true"}
    return {}


def compile_backend_name(device_type: str, requested: str = "auto") -> str:
    """The ``torch.compile`` backend a trial's blocks get (``trainers/runtime.py compile_backend``
    builds it): ``auto`` is Inductor, and ``aot_eager`` on an Ascend NPU; any other name as given."""
    if requested != "auto":
        return requested
    return "aot_eager" if device_type == "npu" else "inductor"


# Backends that trace through AOTAutograd, which turns DTensor into plain local tensors and
# functional collectives: DTensor's per-operator work (sharding propagation, redistributions) is
# paid once, at trace time (bench/compile_host.py, Inductor and aot_eager: TP's added host cost a
# layer falls to its collectives' own). TorchAir's backend is built on aot_module_simplified too,
# so it is counted as one; not measured (no NPU here).
AOT_BACKENDS = ("inductor", "aot_eager", "torchair")
# Backends whose backward is AOTAutograd's min-cut partition over Inductor's decompositions, which
# saves the matmuls' inputs and outputs and recomputes the elementwise work between them: what a
# compiled block keeps for its backward (the planner's fused count, measured in
# tests/test_activation_bytes.py).
MIN_CUT_BACKENDS = ("inductor",)
# aot_eager partitions by min-cut as well but without Inductor's decompositions, so some operators
# keep what they keep eagerly (the decomposed softmax's output, LayerNorm's fp32 input under
# autocast): on the 17 knob cases it saves the fused count exactly for Llama-shaped blocks with the
# fused kernel and up to 14% more than it otherwise. Not modelled: aot_eager (the NPU's auto) and
# TorchAir (unmeasured) blocks get the eager count, 0.92-1.45 of what aot_eager keeps (1.29 for
# Llama-shaped blocks with the fused kernel).
# Backends that fuse each elementwise chain into one kernel (the planner's fused memory traffic);
# aot_eager runs the captured graph's operators one by one, as eager mode does.
FUSING_BACKENDS = ("inductor", "torchair")


def npu_rope(a2: bool, batch: int, heads: int, head_dim: int) -> bool:
    """Whether torch_npu's ``npu_rotary_mul`` runs the trainer's interleaved RoPE on q or k of
    (batch, heads, s, head_dim): its interleave mode goes through ``aclnnRotaryPositionEmbedding``,
    which op-plugin calls on the 910B1 and later only (``a2``; older parts take the half mode), for
    BNSD input with B x N < 1000 and an even head_dim below 896 (op-plugin
    ``docs/context/torch_npu-npu_rotary_mul.md``, ``RotaryMulKernelNpuOpApi.cpp``)."""
    return a2 and batch * heads < 1000 and head_dim < 896 and head_dim % 2 == 0
