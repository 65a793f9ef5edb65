"""Every DP/TP/PP layout of N devices, planned and ranked by estimated step time (what
``python -m orchestrator.plan --devices N`` prints)."""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

from omegaconf import DictConfig

from orchestrator.planner.ops import op_coverage
from orchestrator.planner.preflight import LayoutPlan, plan_layout, planning_errors, resolved, with_model_overrides
from orchestrator.planner.shapes import ModelShape


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
