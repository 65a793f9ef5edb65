"""Cross-field rules of a composed config, all in one place.

``validate(cfg)`` returns every broken rule at once, one line each, each naming its key
(``parallel.tp=3 does not divide model.n_heads=8``). Per-key types and unknown keys are Hydra's
job (the dataclass schemas); what is here needs more than one key, the chip, or the disk.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List

from omegaconf import DictConfig

from orchestrator import chips
from orchestrator.launch import trial_nodes
from orchestrator.layout import Layout
from orchestrator.validate_env import env_rules
from orchestrator.validate_inputs import data_rules, weights_rules
from orchestrator.validate_layout import layout_rules
from trainers import rules

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
DTYPES = ("fp32", "bf16", "fp16")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")
CHOICES = {
    "parallel.schedule": SCHEDULES,
    "parallel.dp_shard": rules.DP_MODES,
    "precision.param_dtype": DTYPES,
    "precision.compute_dtype": DTYPES,
    "precision.loss_scale": ("none", "dynamic", "static"),
    "comm.compression": COMPRESSIONS,
    "model.norm": ("layernorm", "rmsnorm"),
    "model.mlp": ("gelu", "swiglu"),
    "model.pos_emb": ("learned", "rope"),
    "model.attn_impl": ("fused", "decomposed", "npu_fused"),
    "model.recompute_granularity": ("full", "selective"),
    "model.family": rules.FAMILIES,
    "data.name": ("stdlib", "memmap", "megatron", "synthetic"),
    "trainer.measure": ("fixed", "adaptive"),
    "launch.start_method": ("spawn", "forkserver", "fork"),
    "trainer.fault.inject": ("nan", "overflow", "hang"),
}
POSITIVE = (
    "model.vocab_size",
    "model.rope_theta",
    "model.norm_eps",
    "model.d_model",
    "model.n_layers",
    "model.n_heads",
    "model.d_ff",
    "model.max_seq_len",
    "trainer.steps",
    "trainer.global_batch",
    "trainer.micro_batch",
    "trainer.measure_tolerance",
    "trainer.seq_len",
    "trainer.lr",
    "trainer.log_every",
    "comm.bucket_mb",
    "comm.buffsize_mb",
    "comm.nccl_buffsize_mb",
    "comm.timeout_s",
    "parallel.tp",
    "parallel.pp",
    "parallel.microbatches",
    "parallel.virtual_stages",
    "launch.nnodes",
    "precision.init_scale",
    "precision.growth_interval",
)
NON_NEGATIVE = (
    "trainer.warmup_steps",
    "trainer.lr_warmup_steps",
    "trainer.weight_decay",
    "trainer.grad_clip",
    "trainer.checkpoint_every",
    "trainer.eval_every",
    "launch.max_failures",
    "data.num_workers",
    "launch.master_port",
    "precision.monitor",
    "trainer.fault.straggle_s",
)


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


FP32_OPS = ("softmax", "layer_norm", "rms_norm")  # trainers/precision.py FP32_OPS (that module imports torch)


def _knob_rules(cfg: DictConfig, err) -> None:
    """What the trainer cannot honour of ``precision.param_dtype``/``compute_dtype``/``fp32_ops``,
    ``comm.overlap`` and ``trainer.eval_every``."""
    m, pr, c, t, d = cfg.model, cfg.precision, cfg.comm, cfg.trainer, cfg.data
    sixteen = ("bf16", "fp16")
    if pr.param_dtype in sixteen and pr.compute_dtype != pr.param_dtype:
        # 16-bit parameters compute in their own dtype: fp32 compute would upcast every weight
        # at every use, and bf16 <-> fp16 would round each weight into the other format
        err(
            f"precision.param_dtype={pr.param_dtype} needs precision.compute_dtype={pr.param_dtype} "
            f"(got {pr.compute_dtype}); or set precision.param_dtype=fp32"
        )
    unknown = [op for op in pr.fp32_ops if op not in FP32_OPS]
    if unknown:
        err(f"precision.fp32_ops: unknown {', '.join(map(str, unknown))} (known: {', '.join(FP32_OPS)})")
    if m.attn_impl in ("fused", "npu_fused") and pr.compute_dtype in sixteen and "softmax" not in pr.fp32_ops:
        err(
            f"precision.fp32_ops={list(pr.fp32_ops)} leaves out softmax, but model.attn_impl={m.attn_impl} keeps its "
            f"softmax statistics in fp32 inside the kernel; list softmax or set model.attn_impl=decomposed"
        )
    if m.recompute_layers < -1:
        err(f"model.recompute_layers={m.recompute_layers}: the first N blocks of each stage, or -1 for all")
    if not c.overlap and c.compression != "none" and int(cfg.parallel.tp) == 1:
        err(
            f"comm.overlap=false with comm.compression={c.compression}: compression runs as a DDP communication "
            f"hook during the backward pass; set comm.overlap=true or comm.compression=none"
        )
    if t.eval_every > 0:
        if t.eval_batches < 1:
            err(f"trainer.eval_batches={t.eval_batches}: must be positive when trainer.eval_every>0")
        if d.name != "synthetic" and not d.val_fraction > 0:
            err(
                f"trainer.eval_every={t.eval_every} needs a held-out split: data.val_fraction={d.val_fraction} "
                f"on data={d.name}"
            )
        elif d.name == "memmap" and d.path and Path(d.path).expanduser().is_file():
            held_out = int(Path(d.path).expanduser().stat().st_size // 2 * d.val_fraction)
            if held_out < t.seq_len + 1:
                err(
                    f"data.val_fraction={d.val_fraction} of data.path={d.path} holds {held_out} tokens, fewer than "
                    f"trainer.seq_len+1={t.seq_len + 1}: trainer.eval_every has nothing to evaluate"
                )


def _hang_rules(f: DictConfig, steps: int, world_size: int, err) -> None:
    """``trainer.fault.inject=hang`` turns the rank drill (kill_rank, at_step) into a hang; it
    needs that drill set, no NaN drill beside it, and a peer whose collective can time out."""
    if f.inject != "hang":
        return
    if f.kill_rank < 0 or f.at_step < 0:
        err(
            f"trainer.fault.inject=hang needs trainer.fault.kill_rank and trainer.fault.at_step (the rank that "
            f"hangs and the step), got kill_rank={f.kill_rank} at_step={f.at_step}"
        )
    elif f.at_step >= steps:
        err(f"trainer.fault.at_step={f.at_step} is past trainer.steps={steps}: the hang (inject=hang) never fires")
    if f.nan_at_step >= 0:
        err(
            f"trainer.fault.nan_at_step={f.nan_at_step} with trainer.fault.inject=hang: the NaN drill takes "
            f"inject=nan or overflow; set trainer.fault.nan_at_step=-1 or another inject"
        )
    if world_size < 2:
        err("trainer.fault.inject=hang needs at least 2 processes: a peer's collective is what times out")


def validate(cfg: DictConfig) -> List[str]:
    """Every broken cross-field rule of ``cfg`` (with ``cfg.chip`` resolved), one line each."""
    errors: List[str] = []
    err = errors.append
    _value_rules(cfg, err)
    if any(k.split("=")[0] in DIVISORS for k in errors):
        return errors  # the arithmetic below divides by these
    _model_rules(cfg, err)
    lay = layout_rules(cfg, err)
    if lay is None:
        return errors
    # precision, overlap and evaluation keys: each acts, or is refused here (tests/test_knobs.py)
    _knob_rules(cfg, err)
    _chip_rules(cfg, lay, err)
    env_rules(cfg, err)
    data_rules(cfg, err)
    if not cfg.tracking.experiment:
        err("tracking.experiment: must not be empty")
    ray = cfg.launch.get("ray")
    if ray is not None and ray.num_cpus is not None and int(ray.num_cpus) < 1:
        err(f"launch.ray.num_cpus={ray.num_cpus}: must be positive (or null: all of this machine's CPUs)")
    return errors


# keys the layout rules divide by: when one of them is broken, those rules are not checked
DIVISORS = (
    "parallel.tp",
    "parallel.pp",
    "model.n_heads",
    "model.n_layers",
    "trainer.micro_batch",
    "trainer.global_batch",
    "launch.nnodes",
)


def _value_rules(cfg: DictConfig, err: Callable[[str], None]) -> None:
    """Each key's own range: choices, positive and non-negative numbers, fractions."""
    c, t = cfg.comm, cfg.trainer
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            err(f"{key}={_get(cfg, key)}: must be one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not _get(cfg, key) > 0:
            err(f"{key}={_get(cfg, key)}: must be positive")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            err(f"{key}={_get(cfg, key)}: must not be negative")
    if not 0.0 < c.topk_ratio <= 1.0:
        err(f"comm.topk_ratio={c.topk_ratio}: must be in (0, 1]")
    if not 0.0 <= cfg.data.val_fraction < 0.5:
        err(f"data.val_fraction={cfg.data.val_fraction}: must be in [0, 0.5)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        err(f"trainer.min_lr_ratio={t.min_lr_ratio}: must be in [0, 1]")


ROPE_SCALING_KEYS = {"rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


def _model_rules(cfg: DictConfig, err: Callable[[str], None]) -> None:
    m, t = cfg.model, cfg.trainer
    kv = rules.kv_heads(m.n_heads, m.n_kv_heads)
    sc = dict(m.rope_scaling or {})
    if sc and (sc.get("rope_type") != "llama3" or set(sc) != ROPE_SCALING_KEYS):
        err(
            f"model.rope_scaling={sc}: the trainer builds Llama 3.1's scaling only: rope_type=llama3 with "
            f"{', '.join(sorted(ROPE_SCALING_KEYS - {'rope_type'}))}"
        )
    elif sc and not float(sc["high_freq_factor"]) > float(sc["low_freq_factor"]) > 0:
        err(f"model.rope_scaling: high_freq_factor must exceed low_freq_factor, both positive ({sc})")
    if sc and m.pos_emb != "rope":
        err("model.rope_scaling applies to model.pos_emb=rope")
    if m.d_model % m.n_heads:
        err(f"model.n_heads={m.n_heads} does not divide model.d_model={m.d_model}")
    if kv < 1 or m.n_heads % kv:
        err(f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
    if m.pos_emb == "rope" and (m.d_model // m.n_heads) % 2:
        err(f"model.pos_emb=rope needs an even head dimension; model.d_model/model.n_heads={m.d_model // m.n_heads}")
    if t.seq_len > m.max_seq_len:
        err(f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if m.sliding_window < 0:
        err(f"model.sliding_window={m.sliding_window}: a span of positions, or 0 for none")
    elif 0 < m.sliding_window < t.seq_len:
        err(
            f"model.sliding_window={m.sliding_window} is below trainer.seq_len={t.seq_len}: the trainer builds full "
            f"causal attention, the window's equal only while a sequence fits in it; set trainer.seq_len<="
            f"{m.sliding_window}"
        )
    weights_rules(m, t, err)


def _chip_rules(cfg: DictConfig, lay: Layout, err: Callable[[str], None]) -> None:
    """What the chip supports and holds, the fault drills' ranks and layers."""
    m, t, chip = cfg.model, cfg.trainer, cfg.chip
    for key in ("precision.param_dtype", "precision.compute_dtype"):
        if _get(cfg, key) in DTYPES and _get(cfg, key) not in chip.dtypes:
            err(f"{key}={_get(cfg, key)} is not supported by chip={chip.name} (supports {', '.join(chip.dtypes)})")
    if cfg.comm.compression == "bf16" and "bf16" not in chip.dtypes:
        err(
            f"comm.compression=bf16 casts gradients to bf16, which chip={chip.name} does not support "
            f"(supports {', '.join(chip.dtypes)}); use comm.compression=fp16 or none"
        )
    if chip.get("op_table"):
        from orchestrator.planner.operators import op_tables

        if str(chip.op_table) not in op_tables():
            err(f"chip.op_table={chip.op_table}: no such table in conf/op_tables (shipped: {', '.join(op_tables())})")
    if m.attn_impl == "npu_fused" and chip.device_type != "npu":
        err(
            f"model.attn_impl=npu_fused is torch_npu's kernel for Ascend NPUs, and chip={chip.name} is a "
            f"{chip.device_type} chip; use model.attn_impl=fused or decomposed"
        )
    if t.compile and m.attn_impl == "npu_fused" and float(m.dropout) > 0 and chip.device_type == "npu":
        # TorchAir's converter for npu_fusion_attention raises NotImplementedError for keep_prob
        # != 1; under aot_eager the op's meta kernel gives seed 0, offset 0 and numels 0, which
        # the derivative hands to npu_fusion_attention_grad (op-plugin _meta_registrations.py,
        # derivatives.yaml): the backward regenerates an empty dropout mask, a silently wrong grad
        err(
            f"trainer.compile=true with model.attn_impl=npu_fused and model.dropout={m.dropout}: a compiled "
            "npu_fusion_attention loses its dropout mask between forward and backward (aot_eager traces "
            "seed 0, TorchAir refuses keep_prob<1); set model.dropout=0, trainer.compile=false or "
            "model.attn_impl=decomposed"
        )
    if t.compile and t.compile_backend == "torchair" and chip.device_type != "npu":
        err(f"trainer.compile_backend=torchair compiles for Ascend NPUs only, and chip={chip.name} is not one")
    why = chips.availability_error(chip)
    if why:
        err(why)
    # a trial on one node must fit this node's devices; one larger than a node spans
    # ceil(world / chip.devices_per_node) nodes of a Ray cluster, chip.devices_per_node on each
    nodes = trial_nodes(lay.world_size, int(chip.devices_per_node), int(cfg.launch.nnodes))
    per_node = -(-lay.world_size // nodes)
    visible = chips.visible_devices(chip) if nodes == 1 else None
    cap = visible if visible is not None else int(chip.devices_per_node)
    if not why and per_node > cap:
        err(
            f"parallel: dp*tp*pp={lay.world_size} needs {per_node} devices per node, chip={chip.name} has {cap} "
            f"on each of launch.nnodes={cfg.launch.nnodes}"
        )
    if t.fault.kill_rank >= lay.world_size:
        err(f"trainer.fault.kill_rank={t.fault.kill_rank} is not a rank of a {lay.world_size}-process trial")
    if t.fault.nan_layer >= m.n_layers:
        err(f"trainer.fault.nan_layer={t.fault.nan_layer} is not a layer of model.n_layers={m.n_layers}")
    _hang_rules(t.fault, int(t.steps), lay.world_size, err)


def cluster_errors(cfg: DictConfig, nodes: int) -> List[str]:
    """Rules of a trial on ``nodes`` nodes: the collectives' interface, and where it checkpoints."""
    errors = []
    ifname = cfg.comm.get("socket_ifname")
    if ifname is not None and not re.fullmatch(r"[\w.:-]+(,[\w.:-]+)*", str(ifname)):
        errors.append(
            f"comm.socket_ifname={ifname}: must be an interface name, or several joined by commas (eth0,eth1)"
        )
    return errors + _storage_errors(cfg, nodes)


def _storage_errors(cfg: DictConfig, nodes: int) -> List[str]:
    """Where a trial of ``nodes`` nodes may checkpoint: storage every node reaches. A node-local
    folder (the default ``./checkpoints``, or a path not declared shared) would leave each node
    its own partial checkpoints, and a worker group restarted on other nodes would start over.
    The same holds for a one-node trial that may restart elsewhere on a cluster
    (``launch.max_failures`` with a cluster address)."""
    t = cfg.trainer
    if int(t.checkpoint_every) <= 0:
        return []
    address = cfg.launch.ray.get("address") or os.environ.get("RAY_ADDRESS")
    restarts_elsewhere = bool(address) and int(cfg.launch.max_failures) > 0
    if nodes <= 1 and not restarts_elsewhere:
        return []
    where = f"a trial on {nodes} nodes" if nodes > 1 else "a trial restarted on any node of the cluster"
    fix = "set it to a path every node mounts with trainer.checkpoint_shared=true, or to a URI such as s3://bucket/path"
    directory = t.checkpoint_dir
    if not directory:
        return [f"trainer.checkpoint_dir: unset, {where} would checkpoint into ./checkpoints on each node; {fix}"]
    scheme = str(directory).split("://", 1)[0].lower() if "://" in str(directory) else ""
    if scheme in ("", "file", "local") and not t.checkpoint_shared:
        return [f"trainer.checkpoint_dir={directory}: node-local unless declared shared, for {where}; {fix}"]
    return []
