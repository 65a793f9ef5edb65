"""The one schema of every section the trainer reads: plain, torch-free dataclasses.

Each section is declared here once. The control plane registers these very classes in Hydra's
ConfigStore (``orchestrator/config.py``), so YAML presets and command-line overrides are typed
against them; a trial's resolved sections are turned back into these objects
(``OmegaConf.to_object``) and handed to the workers as a :class:`TrialSpec`. Nothing else in the
project re-declares a key or its default.

Keys that only the planner reads live in ``orchestrator/config.py`` (``planner.*``); a key here
either changes what the trainer runs, or the validator (``orchestrator/validate.py``) refuses the
values it cannot honour. ``tests/test_schema.py`` walks every leaf key and holds the code to that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Type, TypeVar, get_type_hints

from trainers import rules

T = TypeVar("T")


def default_cache_dir() -> Path:
    """The project's cache folder (``data.cache_dir`` unset; the control plane's caches too):
    ``$CHIP_ORCHESTRATOR_CACHE``, else ``$XDG_CACHE_HOME/chip-orchestrator``, else
    ``~/.cache/chip-orchestrator``. Everything in it can be made again; deleting it is safe."""
    if os.environ.get("CHIP_ORCHESTRATOR_CACHE"):
        return Path(os.environ["CHIP_ORCHESTRATOR_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chip-orchestrator"


@dataclass
class ModelConfig:
    """A GPT-style decoder (``trainers/model.py``)."""

    name: str = "custom"  # a label for records and reports (the preset's file name)
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = -1  # -1: same as n_heads; fewer: grouped-query attention
    d_ff: int = 512
    max_seq_len: int = 256
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    pos_emb: str = "learned"  # learned | rope
    rope_theta: float = 10000.0  # RoPE's base (Llama 2: 1e4, Llama 3: 5e5)
    # Llama 3.1's RoPE frequency scaling, as its config.json states it: rope_type llama3, factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings; empty: none
    rope_scaling: Dict[str, Any] = field(default_factory=dict)
    norm_eps: float = 1e-5  # the norms' epsilon (Llama: rms_norm_eps)
    # the Hugging Face family the model is (llama | mistral | qwen2: q, k and v with biases | qwen3:
    # per-head q and k norms): how its checkpoints name and shape the tensors and what an exported
    # folder's config.json says
    family: str = "llama"
    # the family's sliding-window attention span (0: none). The trainer builds full causal
    # attention, the same as the window's only while trainer.seq_len <= the window: the validator
    # refuses longer sequences
    sliding_window: int = 0
    tie_embeddings: bool = False  # untied, as every preset but gpt2_small: the head may sit on another pipeline stage
    # fused (scaled_dot_product_attention) | decomposed (matmul + softmax + matmul) | npu_fused
    # (torch_npu.npu_fusion_attention, Ascend A2; what the planner maps fused attention to there)
    attn_impl: str = "fused"
    # RMSNorm and SwiGLU keep only what their backward needs, recomputing the rest
    # (trainers/lean_ops.py); false: autograd's decomposition (what the trainer kept before)
    lean_ops: bool = True
    activation_checkpointing: bool = False
    # what activation checkpointing recomputes: full (each block from its input) | selective (the
    # attention core: RoPE, scores, softmax, dropout and the product with V, as Megatron's
    # --recompute-granularity selective); and in how many blocks of each stage chunk, the first
    # ones (-1: all, as Megatron's --recompute-num-layers with its block method)
    recompute_granularity: str = "full"
    recompute_layers: int = -1
    # the head and the loss over this many slices of the sequence, each made again in the
    # backward (trainers/head_loss.py): no whole micro-batch of logits is kept; 1: at once
    loss_chunks: int = 1
    dropout: float = 0.0  # attention-probability and residual dropout while training
    # a Hugging Face model folder (or its config.json): its architecture fills the keys above
    # (orchestrator/hf_model.py)
    hf_config: Optional[str] = None
    # a folder of Hugging Face safetensors (model.safetensors, or an index and its shards): the
    # model starts from these weights instead of its own initialisation (trainers/hf_weights.py)
    hf_weights: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return rules.kv_heads(self.n_heads, self.n_kv_heads)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qkv_bias(self) -> bool:
        return rules.qkv_bias(self.family)

    @property
    def qk_norm(self) -> bool:
        return rules.qk_norm(self.family)


@dataclass
class ParallelConfig:
    """The (dp, pp, tp) layout and the pipeline schedule (``trainers/parallel.py``)."""

    dp: int = -1  # -1: fill from launch.world_size / (tp * pp)
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # pipeline microbatches per optimizer step (pp > 1 only)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zbv
    virtual_stages: int = 1  # stages per rank of interleaved_1f1b
    # how replicas meet (trainers/rules.py DP_MODES): ddp (whole replicas, gradients all-reduced
    # once a step) | zero1 (distributed optimizer: units gathered once a step, gradients
    # reduce-scattered once, optimizer state on 1/dp) | fsdp (ZeRO-3, regathered per micro-batch)
    dp_shard: str = "ddp"
    sequence_parallel: bool = False


@dataclass
class PrecisionConfig:
    """Parameter and compute dtypes, master weights, loss scaling (``trainers/precision.py``)."""

    name: str = "fp32"  # a label for records and reports (the preset's file name)
    param_dtype: str = "fp32"  # fp32 | bf16 | fp16: the dtype the model's parameters are stored in
    compute_dtype: str = "fp32"  # fp32 | bf16 | fp16: autocast's dtype
    loss_scale: str = "none"  # none | dynamic | static (static: init_scale, never changed)
    init_scale: float = 65536.0
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    master_weights_fp32: bool = True  # 16-bit parameters: the optimizer steps an fp32 copy
    # ops run in fp32 whatever the compute dtype: softmax | layer_norm | rms_norm
    fp32_ops: List[str] = field(default_factory=lambda: ["softmax", "layer_norm", "rms_norm"])
    monitor: int = 0  # per-layer statistics every k steps; 0 = off
    max_consecutive_skips: int = 25  # overflowed steps in a row before the trial ends nonfinite


@dataclass
class CommConfig:
    """Gradient communication (``trainers/comm.py``) and the backend's buffers and timeouts."""

    name: str = "default"  # a label for records and reports (the preset's file name)
    bucket_mb: float = 25.0  # DDP gradient bucket size (MiB)
    buffsize_mb: int = 200  # HCCL_BUFFSIZE (MB per communicator; CANN's default 200)
    nccl_buffsize_mb: float = 4.0  # NCCL_BUFFSIZE (MiB per channel and peer; NCCL's default 4)
    timeout_s: float = 600.0  # collective timeout of every process group
    compression: str = "none"  # none | fp16 | bf16 | powersgd | topk
    topk_ratio: float = 0.1
    powersgd_rank: int = 4
    overlap: bool = True  # gradient reduction overlapped with the backward pass (DDP and FSDP)
    env: Dict[str, str] = field(default_factory=dict)  # extra backend variables, over the chip's
    # the network interface(s) the collectives' sockets use on every node ("eth0", or "eth0,eth1"):
    # GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME as exact names; None: auto
    socket_ifname: Optional[str] = None


@dataclass
class DataConfig:
    """Token data (``trainers/data.py``)."""

    name: str = "stdlib"  # stdlib | memmap | megatron | synthetic
    path: Optional[str] = None  # uint16 token file (data=memmap)
    # data=megatron: Megatron indexed corpora (PREFIX.bin + PREFIX.idx), blended by weights (none:
    # equal); python -m orchestrator.data writes them from text or JSONL
    prefixes: List[str] = field(default_factory=list)
    weights: List[float] = field(default_factory=list)
    cache_dir: Optional[str] = None  # where the stdlib corpus is cached; default: default_cache_dir()
    max_corpus_mb: int = 16
    val_fraction: float = 0.01  # the tail of the corpus held out for trainer.eval_every
    # loader worker processes: 0 reads each window in the rank's own thread. A token window is a
    # slice of a memory-mapped file (microseconds), cheaper than the inter-process hand-off of a
    # worker's batch (shared-memory file descriptors, ~7 ms a step of gpt_tiny on a CPU,
    # bench/trainer_throughput.py); workers pay off only for costly per-sample work
    num_workers: int = 0
    prefetch_factor: int = 4


@dataclass
class FaultConfig:
    """Chaos drills (``trainers/faults.py``). The rank drill (kill_rank, at_step) kills a rank, or
    with ``inject=hang`` hangs it: alive, in no further collective, so a peer's collective times
    out after ``comm.timeout_s`` and the trial ends ``timeout``. The NaN drill (nan_layer,
    nan_at_step) takes inject=nan or overflow; inject=hang is the rank drill's and needs
    kill_rank and at_step set, nan_at_step not (``orchestrator/validate.py``). The straggler drill
    (straggle_s) delays rank 0 in every step."""

    kill_rank: int = -1  # this rank dies (inject=hang: hangs) ...
    at_step: int = -1  # ... at this step (once per trial); -1 = off
    nan_layer: int = -1  # this block's output gets a NaN (inject=nan), or x1e5 through fp16 (overflow)
    nan_at_step: int = -1  # ... at this step
    inject: str = "nan"  # nan | overflow (the NaN drill's kind) | hang (the rank drill hangs instead of dying)
    # a straggler: rank 0 is this many seconds late to every step (a slow host or device), which
    # every rank's step then waits for at its first collective; 0 = off. A planted slowdown no
    # measurement noise can hide, for testing the tuner's decision rules
    straggle_s: float = 0.0


@dataclass
class TrainerConfig:
    """The loop (``trainers/loop.py``): steps, batches, optimizer, schedule, records."""

    steps: int = 50
    global_batch: int = 16  # sequences per optimizer step, all replicas together
    micro_batch: int = 8  # sequences per forward pass on one rank (without a pipeline)
    seq_len: int = 128
    seed: int = 1234
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup_steps: int = 3  # first steps excluded from step-time summaries
    # fixed: run `steps`; adaptive: stop once the median step time's 95% interval is within
    # measure_tolerance of it (relative half-width, trainers/measure.py), `steps` at the latest
    measure: str = "fixed"
    measure_tolerance: float = 0.02
    log_every: int = 10  # rank 0 sends per-step metrics in batches of this many steps
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    # a path or a URI DCP's fsspec writer understands (file://, s3://, ...), read and written by every
    # rank; default ./checkpoints/<MLflow run id> on the launching node, for one-node trials only
    checkpoint_dir: Optional[str] = None
    checkpoint_shared: bool = False  # checkpoint_dir is a path every node mounts (multi-node trials)
    # after the last step, the model in the Hugging Face layout (safetensors, one file per pipeline
    # stage, and the index) in this folder, on the node of each stage's first rank
    export_hf: Optional[str] = None
    eval_every: int = 0  # steps between held-out evaluations (val_loss); 0: none
    eval_batches: int = 2  # global batches of the held-out split per evaluation
    profile: bool = False  # torch.profiler over a window of steps
    profile_start: int = 3
    profile_steps: int = 3
    profile_dir: Optional[str] = None  # default: ./profiles/<MLflow run id>
    compile: bool = False  # torch.compile each block (graph-level fusion)
    # auto: inductor, aot_eager on Ascend; torchair (Ascend's graph compiler, beta, inference-first)
    # only when named; any other torch.compile backend name as it is
    compile_backend: str = "auto"
    # deterministic kernels and collectives (torch.use_deterministic_algorithms, cuBLAS's fixed
    # workspace, HCCL_DETERMINISTIC): for bit-exact reruns; off by default, as it slows timing trials
    deterministic: bool = False
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class RuntimeConfig:
    """What a worker needs of the chip: device, backend, plugin, environment (``trainers/runtime.py``).
    Built by the control plane from the ``chip`` and ``comm`` sections (``orchestrator/chips.py``)."""

    device_type: str = "cpu"  # cpu | cuda | npu
    backend: str = "gloo"  # gloo | nccl | hccl
    torch_plugin: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    peak_flops: float = 0.0  # per device, for the compute dtype; 0 = unknown


@dataclass
class TrialSpec:
    """Everything a worker needs to run one trial: the sections, as resolved by the control plane
    (``parallel`` with its layout filled in), and the chip turned into a runtime."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    comm: CommConfig
    data: DataConfig
    trainer: TrainerConfig
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def from_dict(cls: Type[T], d: Dict[str, Any]) -> T:
    """Build ``cls`` from a plain dict, nested sections included; an unknown key is an error
    (there is one schema: a key the dataclass does not declare is a bug, not something to drop)."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - set(known)
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown keys {sorted(unknown)}")
    kwargs = {}
    for name, value in d.items():
        sub = _dataclass_type(cls, name)
        kwargs[name] = from_dict(sub, value) if sub is not None and isinstance(value, dict) else value
    return cls(**kwargs)


def _dataclass_type(cls: Type[Any], name: str) -> Optional[Type[Any]]:
    hint = get_type_hints(cls)[name]
    return hint if isinstance(hint, type) and is_dataclass(hint) else None
