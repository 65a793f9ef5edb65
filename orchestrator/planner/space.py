"""The space the trainer can run on N devices, and a fast path that plans one point of it.

A point (:class:`Candidate`) is a DP/TP/PP layout (:func:`orchestrator.planner.search.layouts`)
with its batch arithmetic and memory knobs: ``trainer.micro_batch`` (without a pipeline, a
divisor of the replica's batch) or ``parallel.microbatches`` (with one, a divisor of it), the
pipeline schedule and its stages per rank, ``model.activation_checkpointing``,
``parallel.dp_shard`` and ``parallel.sequence_parallel``. Values that change nothing the trainer
does are not separate points: ``dp_shard`` is ``fsdp`` with tensor parallelism (DP is always
FSDP2 there, :func:`trainers.rules.dp_wrapping`) and ``ddp`` with one replica; sequence
parallelism only with ``tp > 1``; ``virtual_stages`` is the stages per rank the schedule runs
(1 for GPipe and 1F1B, 2 for ZB-V, for interleaved 1F1B each count from 2 whose stages split the
layers evenly). Which rules a point must keep is the validator's business: points that break
one are planned only as far as being counted under it (the search adds one rule of its own,
:func:`search_errors`: stages split the layers evenly).

The slow path is the one every trial goes through: :func:`candidate_config` writes the point
into a copy of the composed config, ``planning_errors`` validates it and ``plan_layout`` plans
it. The fast path (:class:`FastPlanner`) gives the same lines and the same floats thousands of
times faster: the config is turned once into plain dicts (:class:`Plain`, which the validator and
the planner's formulas read as they read a DictConfig), each point is validated by the very
``validate()`` on a shallow copy of it, and memory and step time are the formulas of
:mod:`.memory` and :mod:`.step_time` composed as ``memory_plan`` and ``step_parts`` compose them,
over per-rank parameter counts computed once per (layout, stages) instead of once per point.
``tests/test_plan_search.py`` holds the two paths equal, line for line and float for float.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from orchestrator.layout import Layout
from orchestrator.planner.activations import (
    ActBytes,
)
from orchestrator.planner.memory import (
    MemoryPlan,
    ModelState,
    communicator_bytes,
    compose_memory_plan,
    dp_buffer_bytes,
    model_state,
    state_bytes,
)
from orchestrator.planner.preflight import NOT_YET
from orchestrator.planner.shapes import GiB, ModelShape, ParallelShape, rank_contents, rank_params
from orchestrator.planner.step_time import HostCosts, StepEstimate, combine, step_parts
from orchestrator.validate import SCHEDULES, validate
from trainers import rules

# ---------------------------------------------------------------------------------------------
# the points


@dataclass(frozen=True)
class Candidate:
    """One point of the space: what the trainer would be launched with."""

    dp: int
    tp: int
    pp: int
    micro_batch: int  # sequences per forward pass (with a pipeline: the replica's batch / microbatches)
    microbatches: int  # pipeline microbatches (pp > 1); 1 without a pipeline
    schedule: str
    virtual_stages: int
    activation_checkpointing: bool
    dp_shard: str
    sequence_parallel: bool

    @property
    def layout(self) -> str:
        return Layout(self.dp, self.tp, self.pp).name

    @property
    def name(self) -> str:
        parts = [self.layout, f"mbs{self.micro_batch}"]
        if self.pp > 1:
            parts.append(f"m{self.microbatches}")
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.schedule == "interleaved_1f1b" else ""))
        parts += ["ckpt"] * self.activation_checkpointing + ["fsdp"] * (self.dp_shard == "fsdp" and self.dp > 1)
        return "+".join(parts) + ("+sp" if self.sequence_parallel else "")

    def values(self, devices: int, devices_per_node: int) -> Dict[str, Any]:
        """The config keys this point sets, ``section.key -> value`` (the same for both paths)."""
        return {
            "parallel.dp": self.dp,
            "parallel.tp": self.tp,
            "parallel.pp": self.pp,
            "parallel.microbatches": self.microbatches,
            "parallel.schedule": self.schedule,
            "parallel.virtual_stages": self.virtual_stages,
            "parallel.dp_shard": self.dp_shard,
            "parallel.sequence_parallel": self.sequence_parallel,
            "trainer.micro_batch": self.micro_batch,
            "model.activation_checkpointing": self.activation_checkpointing,
            "launch.world_size": devices,
            "launch.nnodes": -(-devices // max(1, devices_per_node)),
        }

    def overrides(self, devices: int, devices_per_node: int) -> List[str]:
        """Hydra overrides that launch this point (``python -m orchestrator ...``)."""
        out = []
        for key, value in self.values(devices, devices_per_node).items():
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
        return out


@dataclass(frozen=True)
class Space:
    """Which values each knob takes (the defaults: all the trainer runs). An auto-tuner narrows it."""

    schedules: Tuple[str, ...] = SCHEDULES
    activation_checkpointing: Tuple[bool, ...] = (False, True)
    dp_shard: Tuple[str, ...] = ("ddp", "fsdp")
    sequence_parallel: Tuple[bool, ...] = (False, True)
    max_pp: int = 16


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_choices(schedule: str, pp: int, n_layers: int) -> List[int]:
    """``parallel.virtual_stages`` values of a schedule: the stages per rank it runs
    (:func:`trainers.rules.stages_per_rank`); interleaved 1F1B takes every count from 2 whose
    stages split the layers evenly (as :func:`~orchestrator.planner.search.layouts` takes pp)."""
    if schedule == "interleaved_1f1b":
        return [v for v in range(2, n_layers // pp + 1) if n_layers % (pp * v) == 0] or [2]
    return [rules.stages_per_rank(pp, schedule, 1)]


def candidates(
    dp: int, tp: int, pp: int, global_batch: int, n_layers: int, space: Space = Space()
) -> Iterator[Candidate]:
    """Every point of one layout. The batch values are divisors of the replica's batch (a
    replica's batch that ``dp`` does not divide gets one point, for the validator to refuse)."""
    per_replica = max(1, global_batch // dp)
    if pp == 1:
        batches = [(mb, 1, "1f1b", 1) for mb in _divisors(per_replica)]
    else:
        batches = [
            (per_replica // m, m, sched, v)
            for m in _divisors(per_replica)
            for sched in space.schedules
            for v in stage_choices(sched, pp, n_layers)
        ]
    if global_batch % dp:
        batches = batches[:1]
    if dp > 1 and tp == 1:
        shards = list(space.dp_shard)
    else:  # one replica: no wrapping; with TP the replicas are FSDP2 whatever dp_shard says
        shards = ["fsdp" if dp > 1 else "ddp"]
    sps = list(space.sequence_parallel) if tp > 1 else [False]
    for mb, m, sched, v in batches:
        for ckpt in space.activation_checkpointing:
            for shard in shards:
                for sp in sps:
                    yield Candidate(dp, tp, pp, mb, m, sched, v, ckpt, shard, sp)


def search_errors(c: Candidate, n_layers: int) -> List[str]:
    """The search's own rule: pipeline stages split the layers evenly (the step-time model
    assumes balanced stages, and an uneven split only loads the first ones more)."""
    if c.pp == 1:
        return []
    stages = c.pp * rules.stages_per_rank(c.pp, c.schedule, c.virtual_stages)
    if stages <= n_layers and n_layers % stages:
        return [
            f"search: parallel.pp={c.pp} x {stages // c.pp} stages per rank = {stages} stages do not split "
            f"model.n_layers={n_layers} evenly"
        ]
    return []


_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(?![\w])")


def reason_key(line: str) -> str:
    """An error line with its numbers taken out: the rule it states, for counting points per rule."""
    return _NUMBER.sub("N", line)


# ---------------------------------------------------------------------------------------------
# the slow path: one full config per point


def _assign(cfg: Any, values: Dict[str, Any]) -> None:
    for key, value in values.items():
        section, name = key.split(".")
        setattr(cfg[section], name, value)


def candidate_config(base: DictConfig, devices: int, c: Candidate) -> DictConfig:
    """``base`` (resolved, with the coverage's model overrides) with this point written in."""
    out = copy.deepcopy(base)
    _assign(out, c.values(devices, int(base.chip.devices_per_node)))
    return out


# ---------------------------------------------------------------------------------------------
# the fast path


class Plain(dict):
    """A config section as a plain dict that reads like a DictConfig (``cfg.a.b``, ``cfg["a"]``,
    ``cfg.get``): what the validator and the planner's formulas read, at dict speed."""

    __slots__ = ()

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    @classmethod
    def of(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return cls({k: cls.of(v) for k, v in value.items()})
        if isinstance(value, list):
            return [cls.of(v) for v in value]
        return value


def plain(cfg: DictConfig) -> Plain:
    return Plain.of(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))


@dataclass
class FastPlan:
    """One point planned: its validator/planner lines (empty: valid), and when valid its shape
    and memory; the step time is filled only for what fits (:meth:`FastPlanner.step`)."""

    candidate: Candidate
    errors: List[str]
    shape: Optional[ParallelShape] = None
    model: Optional[ModelShape] = None
    memory: Optional[MemoryPlan] = None
    step: Optional[StepEstimate] = None


class FastPlanner:
    """Validates and plans points of one base config (resolved, the coverage's overrides applied)."""

    def __init__(self, base: DictConfig, devices: int):
        self.devices = devices
        self.cfg = plain(base)
        self.devices_per_node = int(self.cfg.chip.devices_per_node)
        self.cfg.chip.emulate = True  # planned as emulated, as planning_errors plans it
        self.models = {ck: ModelShape.of(dict(self.cfg.model, activation_checkpointing=ck)) for ck in (False, True)}
        pr, cm, ch, pl = self.cfg.precision, self.cfg.comm, self.cfg.chip, self.cfg.planner
        self.pb, self.gb, _ = state_bytes(pr, pl)
        self.act_bytes = {ck: ActBytes.of(pr, mm, str(ch.get("device_type", "cuda"))) for ck, mm in self.models.items()}
        self.comm_bytes = communicator_bytes(ch.dist_backend, cm, pl)
        self.host = HostCosts.of(pl)
        self._contents: Dict[Tuple, Any] = {}
        self._state: Dict[Tuple, ModelState] = {}
        self._params: Dict[Tuple, int] = {}
        self._dp_buf: Dict[Tuple, float] = {}

    # -- validation ---------------------------------------------------------------------------

    def point_config(self, c: Candidate) -> Plain:
        """A shallow copy of the base with the point written in (the sections it sets copied)."""
        out = Plain(self.cfg)
        for section in ("parallel", "trainer", "model", "launch"):
            out[section] = Plain(self.cfg[section])
        _assign(out, c.values(self.devices, self.devices_per_node))
        return out

    def errors(self, cfg: Plain) -> List[str]:
        """``planning_errors`` of the point: the chip emulated (set once in the base), on as many
        nodes as its world needs (set by :meth:`Candidate.values`)."""
        return [e for e in validate(cfg) if NOT_YET not in e]

    # -- memory -------------------------------------------------------------------------------

    def _rank(self, m: ModelShape, s: ParallelShape, rank: int):
        key = (m.layers, s.pp, s.schedule, s.virtual_stages, rank)
        rc = self._contents.get(key)
        if rc is None:
            rc = self._contents[key] = rank_contents(m, s, rank)
        return rc

    def _rank_state(self, m: ModelShape, s: ParallelShape, rank: int) -> ModelState:
        key = (s.tp, s.pp, s.schedule, s.virtual_stages, s.fsdp, s.dp if s.fsdp else 0, rank)
        st = self._state.get(key)
        if st is None:
            st = self._state[key] = model_state(m, s, self.cfg.precision, self.cfg.planner, rank)
        return st

    def _rank_params(self, m: ModelShape, s: ParallelShape, rc, rank: int) -> int:
        key = (s.tp, s.pp, s.schedule, s.virtual_stages, rank)
        n = self._params.get(key)
        if n is None:
            n = self._params[key] = rank_params(m, s, rc)
        return n

    def _dp_buffers(self, m: ModelShape, s: ParallelShape, n: int) -> float:
        key = (s.dp > 1, s.fsdp, s.tp, n)
        b = self._dp_buf.get(key)
        if b is None:
            b = self._dp_buf[key] = dp_buffer_bytes(m, s, self.cfg.comm, self.cfg.planner, n, self.pb, self.gb)
        return b

    def memory(self, m: ModelShape, s: ParallelShape) -> MemoryPlan:
        """:func:`orchestrator.planner.memory.memory_plan`'s composition, over this planner's caches."""
        return compose_memory_plan(
            m,
            s,
            self.act_bytes[m.checkpointing],
            self.cfg.chip,
            self.cfg.planner,
            self.comm_bytes,
            contents=lambda rank: self._rank(m, s, rank),
            state=lambda rank: self._rank_state(m, s, rank),
            dp_buffers=lambda rc, rank: self._dp_buffers(m, s, self._rank_params(m, s, rc, rank)),
        )

    # -- step time ----------------------------------------------------------------------------

    def step(self, m: ModelShape, s: ParallelShape) -> StepEstimate:
        """:func:`orchestrator.planner.step_time.step_time`, with this planner's caches."""
        pl = self.cfg.planner
        parts = step_parts(
            m,
            s,
            self.cfg.precision,
            self.cfg.comm,
            self.cfg.chip,
            pl,
            contents=lambda rank: self._rank(m, s, rank),
            params=lambda rc, rank: self._rank_params(m, s, rc, rank),
            host=self.host,
        )
        return combine(parts, float(pl.compute_efficiency), float(pl.comm_efficiency))

    # -- one point ----------------------------------------------------------------------------

    def plan(self, c: Candidate, with_step: bool = False) -> FastPlan:
        """Rules first (the search's, then the validator's), then memory; the step time only when
        asked (``with_step``) or later through :meth:`step`."""
        lines = search_errors(c, self.models[False].layers)
        if lines:
            return FastPlan(c, lines)
        cfg = self.point_config(c)
        lines = self.errors(cfg)
        if lines:
            return FastPlan(c, lines)
        m = self.models[bool(c.activation_checkpointing)]
        s = ParallelShape.of(cfg.parallel, cfg.trainer, Layout(c.dp, c.tp, c.pp))
        out = FastPlan(c, [], s, m, self.memory(m, s))
        if with_step:
            out.step = self.step(m, s)
        return out


def memory_reason(mem: MemoryPlan, chip: str) -> str:
    """The memory rule, for counting points per rule."""
    return f"memory: the most loaded rank exceeds {chip}'s {mem.chip_memory_gb:g} GB x {mem.headroom:g} headroom"


def memory_line(mem: MemoryPlan, chip: str) -> str:
    """Why a point does not fit, in the words of the preflight report's memory line."""
    return (
        f"memory: {mem.total / GiB:.1f} GB per rank exceeds {chip}'s {mem.chip_memory_gb:g} GB x "
        f"{mem.headroom:g} headroom (params {mem.params / GiB:.1f}, grads {mem.grads / GiB:.1f}, optimizer "
        f"{mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f}, buffers and reserve "
        f"{(mem.buffers + mem.overhead) / GiB:.1f})"
    )


def sample(items: Sequence[Any], k: int) -> List[Any]:
    """``k`` items spread evenly over ``items`` (deterministic)."""
    if len(items) <= k:
        return list(items)
    return [items[i * len(items) // k] for i in range(k)]


__all__ = [
    "Candidate",
    "FastPlan",
    "FastPlanner",
    "Plain",
    "Space",
    "candidate_config",
    "candidates",
    "memory_line",
    "memory_reason",
    "plain",
    "reason_key",
    "sample",
    "search_errors",
    "stage_choices",
]
