"""Which config keys act on a given trial, and which are inert there.

A key that exists in the schema may still do nothing in one layout: DDP buckets
(``comm.bucket_mb``) do not exist with one replica or under FSDP, ``HCCL_BUFFSIZE`` is read by HCCL
only, ``trainer.micro_batch`` is replaced by the pipeline's own microbatches. Measuring such a key
measures noise. :func:`inert` answers for one key and one config, from the same layout rules the
trainer builds by (``trainers/rules.py``); :func:`effective_view` is the part of a config that
changes what runs, and :func:`no_effect` tells whether the candidates of a tuning variable differ
in it at all (the OVAT sweeper skips a variable that does not, with the reason).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from orchestrator.layout import Layout, layout
from trainers import rules

# sections whose keys decide what a trial computes (tracking and the planner's assumptions do not)
SECTIONS = ("chip", "parallel", "precision", "comm", "model", "data", "trainer", "launch")
# labels: recorded as tags and shown in reports; the run is the same whatever they say
LABELS = ("model.name", "precision.name", "comm.name", "chip.name", "chip.vendor", "chip.source")
# where a trial runs, not what it computes
PLACEMENT = (
    "launch.master_addr",
    "launch.master_port",
    "launch.start_method",
    "launch.max_failures",
    "launch.ray",
    "launch.world_size",
    "launch.nnodes",
)

Rule = Callable[[DictConfig, Layout], Optional[str]]


def _wrapping(cfg: DictConfig, lay: Layout) -> str:
    return rules.dp_wrapping(lay.dp, lay.tp, str(cfg.parallel.dp_shard))


def _backend(cfg: DictConfig) -> str:
    return "gloo" if cfg.chip.emulate else str(cfg.chip.dist_backend)


def _unless(cond: Callable[[DictConfig, Layout], bool], why: str) -> Rule:
    return lambda cfg, lay: None if cond(cfg, lay) else why


RULES: Dict[str, Rule] = {
    "comm.bucket_mb": _unless(
        lambda c, lay: _wrapping(c, lay) == "ddp",
        "gradient buckets exist only with whole replicas (parallel.dp>1, parallel.dp_shard=ddp)",
    ),
    "comm.compression": _unless(
        lambda c, lay: _wrapping(c, lay) == "ddp",
        "gradient compression acts on the all-reduce between whole replicas (parallel.dp>1, dp_shard=ddp)",
    ),
    "comm.topk_ratio": _unless(
        lambda c, lay: _wrapping(c, lay) == "ddp" and lay.tp == 1 and c.comm.compression == "topk",
        "read by comm.compression=topk only",
    ),
    "comm.powersgd_rank": _unless(
        lambda c, lay: _wrapping(c, lay) == "ddp" and lay.tp == 1 and c.comm.compression == "powersgd",
        "read by comm.compression=powersgd only",
    ),
    "comm.overlap": _unless(lambda c, lay: lay.dp > 1, "with one replica there is no gradient reduction to overlap"),
    "comm.buffsize_mb": _unless(
        lambda c, lay: _backend(c) == "hccl" and lay.world_size > 1,
        "HCCL_BUFFSIZE is read by HCCL only (a multi-rank trial on an Ascend chip)",
    ),
    "comm.nccl_buffsize_mb": _unless(
        lambda c, lay: _backend(c) == "nccl" and lay.world_size > 1,
        "NCCL_BUFFSIZE is read by NCCL only (a multi-rank trial on a CUDA chip)",
    ),
    "comm.timeout_s": _unless(lambda c, lay: lay.world_size > 1, "one process: no collective to time out"),
    "parallel.microbatches": _unless(lambda c, lay: lay.pp > 1, "pipeline microbatches need parallel.pp>1"),
    "parallel.schedule": _unless(lambda c, lay: lay.pp > 1, "a pipeline schedule needs parallel.pp>1"),
    "parallel.virtual_stages": _unless(
        lambda c, lay: lay.pp > 1 and c.parallel.schedule == "interleaved_1f1b",
        "read by parallel.schedule=interleaved_1f1b only",
    ),
    "parallel.dp_shard": _unless(lambda c, lay: lay.dp > 1, "with one replica there is no data parallelism"),
    "parallel.sequence_parallel": _unless(lambda c, lay: lay.tp > 1, "sequence parallelism needs parallel.tp>1"),
    "model.lean_ops": _unless(
        lambda c, lay: c.model.norm == "rmsnorm" or c.model.mlp == "swiglu",
        "acts on RMSNorm and SwiGLU only (model.norm=rmsnorm or model.mlp=swiglu)",
    ),
    **{
        f"model.{k}": _unless(
            lambda c, lay: bool(c.model.activation_checkpointing), "read by model.activation_checkpointing=true only"
        )
        for k in ("recompute_granularity", "recompute_layers")
    },
    "trainer.micro_batch": _unless(
        lambda c, lay: lay.pp == 1, "with a pipeline, parallel.microbatches cuts the batch instead"
    ),
    "precision.init_scale": _unless(lambda c, lay: c.precision.loss_scale != "none", "precision.loss_scale=none"),
    "precision.max_consecutive_skips": _unless(
        lambda c, lay: c.precision.loss_scale != "none", "steps are skipped only under loss scaling"
    ),
    **{
        f"precision.{k}": _unless(
            lambda c, lay: c.precision.loss_scale == "dynamic", "read by precision.loss_scale=dynamic only"
        )
        for k in ("growth_interval", "growth_factor", "backoff_factor", "hysteresis")
    },
    "precision.fp32_ops": _unless(
        lambda c, lay: c.precision.compute_dtype != "fp32",
        "everything already runs in fp32 (precision.compute_dtype=fp32)",
    ),
    "precision.master_weights_fp32": _unless(
        lambda c, lay: c.precision.param_dtype != "fp32", "parameters are fp32 already (precision.param_dtype=fp32)"
    ),
    **{
        f"trainer.{k}": _unless(lambda c, lay: bool(c.trainer.profile), "read by trainer.profile=true only")
        for k in ("profile_start", "profile_steps", "profile_dir")
    },
    "trainer.compile_backend": _unless(lambda c, lay: bool(c.trainer.compile), "read by trainer.compile=true only"),
    "trainer.checkpoint_dir": _unless(lambda c, lay: c.trainer.checkpoint_every > 0, "trainer.checkpoint_every=0"),
    "trainer.eval_batches": _unless(lambda c, lay: c.trainer.eval_every > 0, "trainer.eval_every=0"),
    "data.path": _unless(lambda c, lay: c.data.name == "memmap", "read by data=memmap only"),
    "data.cache_dir": _unless(lambda c, lay: c.data.name == "stdlib", "read by data=stdlib only"),
    "data.max_corpus_mb": _unless(lambda c, lay: c.data.name == "stdlib", "read by data=stdlib only"),
    "data.prefetch_factor": _unless(lambda c, lay: c.data.num_workers > 0, "data.num_workers=0"),
}


def inert(cfg: DictConfig, key: str, lay: Optional[Layout] = None) -> Optional[str]:
    """Why ``key`` has no effect on the trial ``cfg`` (chip resolved), or None where it acts."""
    if key in LABELS:
        return "a label: recorded, it does not change what runs"
    if any(key == p or key.startswith(p + ".") for p in PLACEMENT):
        return "where the trial runs, not what it computes"
    rule = RULES.get(key) or next((r for k, r in RULES.items() if key.startswith(k + ".")), None)
    return rule(cfg, lay or layout(cfg)) if rule else None


def _leaves(node: Any, prefix: str) -> Dict[str, Any]:
    if isinstance(node, dict) and node and prefix.count(".") < 2 and not prefix.endswith("env"):
        out: Dict[str, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def effective_view(cfg: DictConfig) -> Dict[str, Any]:
    """The leaves of ``cfg`` that change what its trial computes: labels, placement and keys
    inert in this layout left out; the layout itself as resolved (``parallel.dp=-1`` filled)."""
    lay = layout(cfg)
    tree = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in SECTIONS if cfg.get(k) is not None}
    tree["parallel"].update(dp=lay.dp, tp=lay.tp, pp=lay.pp)
    return {k: v for k, v in _leaves(tree, "").items() if inert(cfg, k, lay) is None}


def no_effect(cfgs: Sequence[DictConfig], key: str) -> Optional[str]:
    """Why the candidate configs of variable ``key`` (each chip-resolved) would all run the same
    trial, or None where at least two of them differ in what they compute."""
    views = [effective_view(c) for c in cfgs]
    if all(v == views[0] for v in views[1:]):
        reasons = sorted({why for c in cfgs if (why := inert(c, key)) is not None})
        return "; ".join(reasons) or "the candidates compose to the same effective config"
    return None


def differing(cfgs: Sequence[DictConfig]) -> List[str]:
    """Keys whose effective values differ between the configs (for logs and reports)."""
    views = [effective_view(c) for c in cfgs]
    keys = set().union(*views)
    return sorted(k for k in keys if len({repr(v.get(k)) for v in views}) > 1)
