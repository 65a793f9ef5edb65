"""Typed schemas of every config group, registered in Hydra's ConfigStore.

YAML files under ``conf/`` hold values only; the dataclasses give every key its type, so a typo
(``parallel.tpp=2``) or a wrong type (``trainer.steps=ten``) is rejected by Hydra while it
composes. Each section is declared once, by the component that reads it: the trainer's sections
(model, parallel, precision, comm, data, trainer) in ``trainers/config.py``, handed to the workers
as they are; the control plane's (chip, tracking, launch, planner) here. Cross-field rules live in
:mod:`orchestrator.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from trainers.config import CommConfig, DataConfig, ModelConfig, ParallelConfig, PrecisionConfig, TrainerConfig


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
    # false for a generic preset (a device no preset names): MFU is recorded as unknown, and
    # peak_tflops are placeholders for the planner's step time only
    peak_known: bool = True
    # planner-only (assumptions of its step time, never of a run): link bandwidth per device,
    # GB/s, one direction, inside a node and across nodes (orchestrator/planner/step_time.py)
    intra_node_gbps: float = 0.0
    inter_node_gbps: float = 0.0
    # planner-only: the fixed cost of one collective or send, us (the alpha of the alpha-beta
    # model), as this chip's communication library and links give it; planner.collective_latency_us
    # overrides it (what --calibrate writes). Accelerators: NCCL's tuning model puts a collective's
    # base latency at 6.6-8.4 us and nccl-tests measured an 8-byte all-reduce at 10-34 us on 2-8
    # A100s (NVIDIA/nccl#1334, nccl-tests#123); 30 us leaves room for the framework's call
    collective_latency_us: float = 30.0
    # planner-only: the memory's nominal bandwidth, GB/s (the datasheet's HBM figure): the
    # non-matmul operators' traffic takes bytes / (this x planner.memory_efficiency)
    # (orchestrator/planner/traffic.py); 0: not modelled (the CPU preset: a core's elementwise
    # work is in its fitted compute efficiency)
    hbm_gbps: float = 0.0
    # planner-only: how fast a CPU host's cores move FSDP's bytes, GB/s of the parameters a rank
    # gathers and the gradients it reduce-scatters (gloo's sends and receives, FSDP's copies into
    # and out of its buffers: work, on a host whose cores are the devices; bench/fsdp_host.py
    # measures it); 0: the device moves them, not the host (an accelerator)
    host_copy_gbps: float = 0.0
    dtypes: List[str] = field(default_factory=lambda: ["fp32"])
    unsupported_ops: List[str] = field(default_factory=list)
    # the operators the chip's framework registers, conf/op_tables/NAME.json (written by
    # `python -m orchestrator.npu_ops` from a torch_npu release's own sources); None: every operator
    # the model calls counts as native unless unsupported_ops names it
    op_table: Optional[str] = None
    decompositions: Dict[str, str] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    # HCCL_EXEC_TIMEOUT's unit on this part: 0 any whole second (Atlas A2/A3), 68 on the
    # Atlas training series (910A), which rounds the value down to a multiple of 68 s
    exec_timeout_step_s: int = 0
    # rehearse this chip's plan on CPU processes with gloo; the trial is tagged emulated
    emulate: bool = False
    # how the chip got here: "preset" (+chip=NAME) or "detected"
    source: str = "preset"


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db (cwd)
    # not "default": MLflow's own experiment is "Default" (id 0), and the UI would list both
    experiment: str = "orchestrator"
    artifact_location: Optional[str] = None  # default: ./mlartifacts next to the sqlite file
    enabled: bool = True
    # a multirun does not launch a point whose config hash already has a finished run in the
    # experiment (a re-run sweep launches only the missing points); false measures every point again
    skip_finished: bool = True


@dataclass
class RayLaunchConfig:
    """Where trials go when they go to Ray (``hydra/launcher=ray_trials`` or its alias ``ray``, a
    trial larger than one node, or a cluster address): not part of a trial's config hash. Under
    that launcher, ``hydra.launcher.address`` and ``hydra.launcher.init.*`` win over these keys
    (see :func:`orchestrator.ray_sweep.launch_jobs`)."""

    address: Optional[str] = None  # join this cluster (default $RAY_ADDRESS); none: start a local one
    num_cpus: Optional[int] = None  # CPUs of a local cluster; default: all of this machine's
    dashboard: bool = True  # the local cluster's dashboard (and state API), on 127.0.0.1 only
    # reserve whole nodes for each trial (all of a node's chip resource), so no other trial's
    # processes share a node with it: for sweeps whose step times are compared
    exclusive: bool = False
    # in a sweep under the Ray launcher: a trial runs in the worker processes of an earlier trial
    # of the same shape (world size, devices per worker, placement, environment) once that one
    # ended well, its process group and model built anew (orchestrator.ray_pool); false: every
    # trial starts its own Ray Train worker group
    reuse_workers: bool = True


@dataclass
class LaunchConfig:
    world_size: int = -1  # -1: dp * tp * pp
    nnodes: int = 1  # nodes a trial spans (at least); more than one runs on a Ray cluster
    max_failures: int = 0  # worker-group restarts before the trial is failed
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    start_method: str = "forkserver"  # forkserver (workers fork from a server that imported torch) | spawn | fork
    # variables exported on the driver that reach a trial's workers on every node (a Ray worker
    # inherits its raylet's environment, not the driver's); names ending _VISIBLE_DEVICES never
    env_prefixes: List[str] = field(
        default_factory=lambda: [
            "NCCL_",
            "HCCL_",
            "GLOO_",
            "ASCEND_",
            "TORCH_NCCL_",
            "TORCH_DISTRIBUTED_",
            "MLFLOW_",
            "AWS_",
            "HF_",
        ]
    )
    ray: RayLaunchConfig = field(default_factory=RayLaunchConfig)


@dataclass
class PlannerConfig:
    """Assumptions of the planner (orchestrator/planner/), never of a run; not part of a trial's config hash."""

    headroom: float = 0.9  # plan to fill at most this fraction of chip.memory_gb
    # runtime reserve per device, GiB: CANN/CUDA context, HCCL/NCCL workspaces, caching-allocator
    # slack (an estimate, not a measurement) ...
    runtime_overhead_gb: float = 1.5
    overhead_fraction: float = 0.05  # ... plus this fraction of states + activations (fragmentation)
    # achieved fraction of peak by the matmuls (model FLOPs; the other operators are the memory
    # term below) and of nominal link bandwidth; `python -m orchestrator.plan --calibrate` fits them
    # to finished trials in MLflow. 0.66: one H200 training llama_1b (device-bound, 98.6% busy)
    # took 0.531-0.535 s a step eager and 0.384 s compiled (docs/benchmarks.md): with the memory
    # term both are planned within 2% at 0.66 (alone, the two steps asked 0.44 and 0.61); the link
    # efficiency is a guess
    compute_efficiency: float = 0.66
    comm_efficiency: float = 0.7
    # achieved fraction of chip.hbm_gbps by the elementwise and reduction kernels (norms,
    # activations, softmax, casts): an assumption; streaming kernels reach 80-90% of an HBM
    # GPU's nominal bandwidth
    memory_efficiency: float = 0.8
    # fixed cost of one collective or send (alpha-beta model), us; None: the chip's
    # (chip.collective_latency_us); a number (what --calibrate fits) overrides it
    collective_latency_us: Optional[float] = None
    # ... plus this per log2(group size) of each collective (a tree's depth; a send is one hop):
    # NCCL's tuning model puts a step at 0.6 us over NVLink, 5 us over the network (tree/ring LL)
    collective_hop_us: float = 5.0
    # host fixed costs (planner/step_time.py), assumptions until --calibrate fits them: dispatch of
    # one layer's forward and backward for one micro-batch, hidden behind an accelerator's kernels
    # when shorter than them, added on a CPU ... Measured: a GPT-2 layer's forward and backward is
    # 140 aten operators in eager mode under autocast (a Llama layer's 260), and gpt2_small on one
    # H200 (12 layers x 2 micro-batches a step, its GPU busy 44-58% of the step: the host sets the
    # pace) took 51.7-71.6 ms a step, 2.2-3.0 ms a layer pass (~15-20 us an operator); the fit on
    # this repo's 2-core CPU puts a gpt_mini layer pass at ~4 ms (docs/planner.md)
    layer_host_us: float = 2500.0
    # ... and, with a pipeline, one stage chunk's forward/backward call, send/recv setup and wait
    # per micro-batch, never hidden
    stage_host_us: float = 100.0
    # ... and, with tensor parallelism, what it adds per layer and micro-batch on top of the dispatch:
    # DTensor's sharding propagation on every sharded op, the redistributions around each linear,
    # each collective's wait for the slowest rank of its group (measured on this repo's 2-core CI
    # host: ~5 ms a gpt_mini layer forward and backward for DTensor on a one-rank mesh alone, ~30 ms
    # with a tp2 group; bench/plan_calibration.py fits it). Hidden behind an accelerator's kernels
    # when shorter than them, like layer_host_us. Eager blocks only: compiled through AOTAutograd
    # (trainer.compile with inductor, aot_eager, torchair) DTensor is traced away, and TP adds
    # a layer only its collectives (bench/compile_host.py)
    tp_layer_host_us: float = 2000.0
    # CPU chip only: the host cores that a node's worker processes share (0: the cores this
    # process may use, trainers/host.py: its affinity and its cgroup's CPU quota). The trainer
    # gives each worker cores // workers threads (at least one), so workers beyond the cores
    # time-share them (planner/step_time.py)
    host_cores: int = 0
    dp_overlap: float = 0.8  # fraction of DP gradient traffic hidden behind backward (comm.overlap)
    # channels an NCCL communicator opens (NCCL picks 2-32 by topology; 16 is typical of NVLink
    # nodes): its buffers scale with them. Measure with bench/comm_memory.py and override
    nccl_channels: int = 16


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
    # the summary metric a job returns to its sweeper as a float (Hydra's convention for Optuna,
    # Nevergrad, Ax), e.g. step_time_median_s; NaN for a trial that failed or could not run.
    # None: a job returns its result (status, run id, summary) as a dict
    optimized_metric: Optional[str] = None


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
