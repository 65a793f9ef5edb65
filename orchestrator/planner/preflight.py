"""One layout planned as composed, and the preflight report a trial is launched on: memory fit
(:mod:`.memory`), operator coverage (:mod:`.operators`) and the step-time estimate (:mod:`.step_time`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

from omegaconf import DictConfig, OmegaConf

from orchestrator.layout import layout
from orchestrator.planner.memory import MemoryPlan, memory_plan, model_state_bytes
from orchestrator.planner.operators import op_coverage
from orchestrator.planner.shapes import GiB, ModelShape, ParallelShape
from orchestrator.planner.step_time import StepEstimate, step_time
from orchestrator.validate import validate

NOT_YET = "not yet supported"  # trainer-capability lines of validate(): a plan may go beyond them


@dataclass
class LayoutPlan:
    shape: ParallelShape
    memory: MemoryPlan
    step: StepEstimate

    def contract(self) -> Dict[str, Any]:
        """One object of ``python -m orchestrator.plan --json`` (DESIGN.md public contract)."""
        return {
            "dp": self.shape.dp,
            "tp": self.shape.tp,
            "pp": self.shape.pp,
            "microbatches": self.shape.microbatches,
            "schedule": self.shape.schedule,
            "memory_gb": self.memory.gb(),
            "fits": self.memory.fits,
            "bubble_fraction": self.step.bubble_fraction,
            "comm_share": self.step.comm_share,
            "step_time_s": self.step.step_time_s,
            "mfu": self.step.mfu,
        }


def with_model_overrides(cfg: DictConfig, overrides: Dict[str, Any]) -> DictConfig:
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        out.model[key] = value
    return out


def plan_layout(cfg: DictConfig) -> LayoutPlan:
    """Memory and step time of ``cfg`` as composed (apply the coverage's model overrides first)."""
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
    return LayoutPlan(
        s,
        memory_plan(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner),
        step_time(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner),
    )


def state_bytes_per_rank(cfg: DictConfig) -> List[Dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state every rank of ``cfg``'s layout holds,
    in rank order: what the trainer's summary reports as ``model_state_bytes``."""
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
    return model_state_bytes(m, s, cfg.precision, cfg.planner)


def resolved(cfg: DictConfig) -> DictConfig:
    """A copy with the chip filled in (detected when no ``+chip=NAME`` was given)."""
    from orchestrator.filled import fill

    cfg = copy.deepcopy(cfg)
    why = fill(cfg)
    if why:
        raise ValueError(why)
    return cfg


def planning_errors(cfg: DictConfig) -> List[str]:
    """validate() of ``cfg`` as a plan: what the trainer cannot run yet ("not yet supported"),
    whether the chip is present on this machine, and node counts are not the plan's business
    (the chip is planned as if emulated, on as many nodes as the layout needs)."""
    plan = resolved(cfg)
    plan.chip.emulate = True
    world = layout(plan).world_size
    plan.launch.nnodes = max(int(plan.launch.nnodes), -(-world // max(1, int(plan.chip.devices_per_node))))
    return [e for e in validate(plan) if NOT_YET not in e]


def preflight(cfg: DictConfig, filled: bool = False) -> Dict[str, Any]:
    """The report a trial is launched on (JSON-serialisable, saved as ``preflight.json``):
    ``feasible`` and one line per reason it is not, the ``model_overrides`` the trainer must run
    with (the mapped decompositions), the memory plan, operator coverage and step-time estimate.
    Expects a config that passed validate(); the chip is detected if it is not set. ``filled``:
    ``cfg`` is filled already (a resolved trial's, ``orchestrator/filled.py``) and only read."""
    cfg = cfg if filled else resolved(cfg)
    cov = op_coverage(cfg.model, int(cfg.trainer.seq_len), cfg.precision.compute_dtype, cfg.chip)
    planned = with_model_overrides(cfg, cov.model_overrides) if cov.model_overrides else cfg
    lp = plan_layout(planned)
    mem = lp.memory
    reasons = []
    if not mem.fits:
        reasons.append(
            f"memory: {mem.total / GiB:.1f} GB per rank exceeds {cfg.chip.name}'s "
            f"{float(cfg.chip.memory_gb):g} GB x {float(cfg.planner.headroom):g} headroom "
            f"(params {mem.params / GiB:.1f}, grads {mem.grads / GiB:.1f}, optimizer "
            f"{mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f}, buffers and "
            f"reserve {(mem.buffers + mem.overhead) / GiB:.1f})"
        )
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
