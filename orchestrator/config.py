"""Typed schemas of every config group, registered in Hydra's ConfigStore.

YAML files under ``conf/`` hold values only; the dataclasses here give every key its type, so a
typo (``parallel.tpp=2``) or a wrong type (``trainer.steps=ten``) is rejected by Hydra while it
composes.  Cross-field rules live in :mod:`orchestrator.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ChipConfig:
    name: str = MISSING
    vendor: str = MISSING
    device_type: str = MISSING  # npu | cuda | mlu | cpu
    dist_backend: str = MISSING  # hccl | nccl | cncl | gloo
    torch_plugin: Optional[str] = None  # module that must import for the device (torch_npu)
    ray_resource: str = "CPU"  # NPU | GPU | CPU
    devices_per_node: int = 1
    memory_gb: float = MISSING
    # dense peak per dtype, TFLOPS; keys fp32 | bf16 | fp16 (| tf32 | fp8)
    peak_tflops: Dict[str, float] = field(default_factory=dict)
    intra_node_gbps: float = 0.0  # per device, GB/s, one direction
    inter_node_gbps: float = 0.0  # per device, GB/s, one direction
    dtypes: List[str] = field(default_factory=lambda: ["fp32"])
    unsupported_ops: List[str] = field(default_factory=list)
    decompositions: Dict[str, str] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    # rehearse this chip's plan on CPU processes with gloo; the trial is tagged emulated
    emulate: bool = False
    # how the chip got here: "preset" (+chip=NAME) or "detected"
    source: str = "preset"


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: fill from launch.world_size / (tp * pp)
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # pipeline microbatches per optimizer step (pp > 1)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zbv
    virtual_stages: int = 1
    dp_shard: str = "ddp"  # ddp | fsdp
    sequence_parallel: bool = False


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"
    loss_scale: str = "none"  # none | dynamic | static
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    master_weights_fp32: bool = True
    fp32_ops: List[str] = field(default_factory=lambda: ["softmax", "layer_norm", "rms_norm"])
    monitor: int = 0  # per-layer statistics every k steps; 0 = off
    max_consecutive_skips: int = 25  # overflowed steps in a row before the trial ends nonfinite


@dataclass
class CommConfig:
    name: str = "default"
    bucket_mb: float = 25.0  # DDP gradient bucket size
    buffsize_mb: int = 200  # HCCL_BUFFSIZE (MB per communicator; CANN's default 200)
    nccl_buffsize_mb: float = 4.0  # NCCL_BUFFSIZE (MiB per channel and peer; NCCL's default 4)
    timeout_s: float = 600.0  # process-group collective timeout
    compression: str = "none"  # none | fp16 | bf16 | powersgd | topk
    topk_ratio: float = 0.1
    powersgd_rank: int = 4
    overlap: bool = True
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class ModelConfig:
    name: str = MISSING
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = -1  # -1: same as n_heads
    d_ff: int = 512
    max_seq_len: int = 256
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    pos_emb: str = "learned"  # learned | rope
    tie_embeddings: bool = True
    attn_impl: str = "fused"  # fused (scaled_dot_product_attention) | decomposed
    activation_checkpointing: bool = False
    dropout: float = 0.0


@dataclass
class DataConfig:
    name: str = "stdlib"  # stdlib | memmap | synthetic
    path: Optional[str] = None  # uint16 token file (data=memmap)
    cache_dir: Optional[str] = None  # where the stdlib corpus is cached; default ~/.cache
    max_corpus_mb: int = 16
    val_fraction: float = 0.01
    num_workers: int = 1
    prefetch_factor: int = 4


@dataclass
class FaultConfig:
    kill_rank: int = -1  # chaos drill: this rank dies ...
    at_step: int = -1  # ... at this step (once per trial); -1 = off
    nan_layer: int = -1  # chaos: this block's output gets a NaN (inject=nan), or x1e5 through fp16 (overflow)
    nan_at_step: int = -1  # ... at this step
    inject: str = "nan"  # nan | overflow


@dataclass
class TrainerConfig:
    steps: int = 50
    global_batch: int = 16  # sequences per optimizer step, all replicas together
    micro_batch: int = 8  # sequences per forward pass on one rank
    seq_len: int = 128
    seed: int = 1234
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup_steps: int = 3  # first steps excluded from step-time summaries
    log_every: int = 10  # rank 0 sends per-step metrics in batches of this many steps
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    checkpoint_dir: Optional[str] = None  # default: ./checkpoints/<MLflow run id>; shared by all ranks
    eval_every: int = 0
    profile: bool = False  # torch.profiler over a window of steps
    profile_start: int = 3
    profile_steps: int = 3
    profile_dir: Optional[str] = None  # default: ./profiles/<MLflow run id>
    compile: bool = False  # torch.compile each block (graph-level fusion)
    compile_backend: str = "auto"  # auto: torchair's NPU backend on Ascend, inductor elsewhere
    deterministic: bool = True
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db (cwd)
    experiment: str = "default"
    artifact_location: Optional[str] = None  # default: ./mlartifacts next to the sqlite file
    enabled: bool = True


@dataclass
class RayLaunchConfig:
    """Where trials go when they go to Ray (``hydra/launcher=ray``, a trial larger than one node,
    or a cluster address): not part of a trial's config hash."""
    address: Optional[str] = None  # join this cluster (default $RAY_ADDRESS); none: start a local one
    num_cpus: Optional[int] = None  # CPUs of a local cluster; default: all of this machine's
    dashboard: bool = True  # the local cluster's dashboard (and state API), on 127.0.0.1 only
    # reserve whole nodes for each trial (all of a node's chip resource), so no other trial's
    # processes share a node with it: for sweeps whose step times are compared
    exclusive: bool = False


@dataclass
class LaunchConfig:
    world_size: int = -1  # -1: dp * tp * pp
    nnodes: int = 1  # nodes a trial spans (at least); more than one runs on a Ray cluster
    max_failures: int = 0  # worker-group restarts before the trial is failed
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    start_method: str = "spawn"
    ray: RayLaunchConfig = field(default_factory=RayLaunchConfig)


@dataclass
class PlannerConfig:
    """Assumptions of the planner (orchestrator/planner.py); not part of a trial's config hash."""
    headroom: float = 0.9  # plan to fill at most this fraction of chip.memory_gb
    # runtime reserve per device, GiB: CANN/CUDA context, HCCL/NCCL workspaces, caching-allocator
    # slack (an estimate, not a measurement) ...
    runtime_overhead_gb: float = 1.5
    overhead_fraction: float = 0.05  # ... plus this fraction of states + activations (fragmentation)
    # achieved fraction of peak (model FLOPs) and of nominal link bandwidth; uncalibrated guesses
    # until `python -m orchestrator.plan --calibrate` fits them to finished trials in MLflow
    compute_efficiency: float = 0.5
    comm_efficiency: float = 0.7
    collective_latency_us: float = 30.0  # fixed cost of one collective or send (alpha-beta model)
    dp_overlap: float = 0.8  # fraction of DP gradient traffic hidden behind backward (comm.overlap)
    grad_accum_fp32: bool = False  # fp32 gradient buffers for 16-bit params (Megatron's main_grad)
    ddp_bucket_view: bool = False  # DDP gradient_as_bucket_view; False: buckets copy every gradient


@dataclass
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # not in the defaults list: `+chip=NAME` selects a preset; without it chip.name stays
    # missing and the local accelerator is detected (keys set with chip.KEY=... still apply)
    chip: ChipConfig = field(default_factory=ChipConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)


GROUPS: Dict[str, Any] = {
    "chip": ChipConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "comm": CommConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
    "tracking": TrackingConfig,
}


def register_configs() -> None:
    """Store the root schema; ``config.yaml`` lists it first, so every group merged onto it is
    checked against its dataclass (unknown keys and wrong types fail while composing)."""
    ConfigStore.instance().store(name="schema", node=Config)
