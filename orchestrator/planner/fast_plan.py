"""The fast path that plans one point of the space (:mod:`.space`): the same lines and the same
floats as the slow path (``candidate_config``, ``planning_errors``, ``plan_layout``) thousands of
times faster. The config becomes plain dicts once (:class:`Plain`), each point is validated by the
very ``validate()`` on a shallow copy, and memory and step time compose the formulas of
:mod:`.memory` and :mod:`.step_time` over per-rank figures cached per (layout, stages).
``tests/test_plan_search.py`` holds the two paths equal, line for line and float for float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from orchestrator.layout import Layout
from orchestrator.planner.activations import ActBytes
from orchestrator.planner.memory import (
    MemoryPlan,
    ModelState,
    communicator_sizes,
    compose_memory_plan,
    dp_buffer_bytes,
    model_state,
    state_bytes,
)
from orchestrator.planner.preflight import NOT_YET
from orchestrator.planner.shapes import ModelShape, ParallelShape, rank_contents, rank_params
from orchestrator.planner.space import Candidate, assign, search_errors
from orchestrator.planner.step_time import HostCosts, StepEstimate, combine, step_parts
from orchestrator.validate import validate


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


def _memo(cache: Dict[Tuple, Any], key: Tuple, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` the first time."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
    return value


class FastPlanner:
    """Validates and plans points of one base config (resolved, the coverage's overrides applied)."""

    def __init__(self, base: DictConfig, devices: int):
        self.devices = devices
        self.cfg = plain(base)
        self.devices_per_node = int(self.cfg.chip.devices_per_node)
        self.cfg.chip.emulate = True  # planned as emulated, as planning_errors plans it
        # one model shape for each recompute setting a point can set (checkpointing, granularity,
        # blocks of a stage chunk that recompute), made as points ask for them
        self.models: Dict[Tuple[bool, str, int, int], ModelShape] = {}
        self.whole = self.model(False, "full", -1, int(self.cfg.model.loss_chunks))
        pr, cm, ch, pl = self.cfg.precision, self.cfg.comm, self.cfg.chip, self.cfg.planner
        self.pb, self.gb, _ = state_bytes(pr, pl)
        self.act_bytes = {
            (ck, g): ActBytes.on(pr, self.model(ck, g, -1, 1), ch)
            for ck in (False, True)
            for g in ("full", "selective")
        }
        self.comm_bytes = communicator_sizes(ch.dist_backend, cm, pl)
        self.host = HostCosts.of(pl)
        self._contents: Dict[Tuple, Any] = {}
        self._state: Dict[Tuple, ModelState] = {}
        self._params: Dict[Tuple, int] = {}
        self._dp_buf: Dict[Tuple, float] = {}

    def model(self, checkpointing: bool, granularity: str, recompute_layers: int, loss_chunks: int) -> ModelShape:
        """The model shape of one recompute setting and loss chunk count."""
        key = (checkpointing, granularity, recompute_layers, loss_chunks)
        knobs = dict(
            activation_checkpointing=checkpointing,
            recompute_granularity=granularity,
            recompute_layers=recompute_layers,
            loss_chunks=loss_chunks,
        )
        return _memo(self.models, key, lambda: ModelShape.of(dict(self.cfg.model, **knobs)))

    # -- validation ---------------------------------------------------------------------------

    def point_config(self, c: Candidate) -> Plain:
        """A shallow copy of the base with the point written in (the sections it sets copied)."""
        out = Plain(self.cfg)
        for section in ("parallel", "trainer", "model", "launch"):
            out[section] = Plain(self.cfg[section])
        assign(out, c.values(self.devices, self.devices_per_node))
        return out

    def errors(self, cfg: Plain) -> List[str]:
        """``planning_errors`` of the point: the chip emulated (set once in the base), on as many
        nodes as its world needs (set by :meth:`Candidate.values`)."""
        return [e for e in validate(cfg) if NOT_YET not in e]

    # -- memory -------------------------------------------------------------------------------

    def _rank(self, m: ModelShape, s: ParallelShape, rank: int):
        key = (m.layers, s.pp, s.schedule, s.virtual_stages, rank)
        return _memo(self._contents, key, lambda: rank_contents(m, s, rank))

    def _rank_state(self, m: ModelShape, s: ParallelShape, rank: int) -> ModelState:
        key = (s.tp, s.pp, s.schedule, s.virtual_stages, s.fsdp, s.dp if s.fsdp else 0, rank)
        return _memo(self._state, key, lambda: model_state(m, s, self.cfg.precision, self.cfg.planner, rank))

    def _rank_params(self, m: ModelShape, s: ParallelShape, rc, rank: int) -> int:
        key = (s.tp, s.pp, s.schedule, s.virtual_stages, rank)
        return _memo(self._params, key, lambda: rank_params(m, s, rc))

    def _dp_buffers(self, m: ModelShape, s: ParallelShape, n: int, rc) -> float:
        key = (s.wrapping, s.dp > 1, s.tp, s.pp, s.microbatches > 1, n, len(rc.layers))
        pl, cm = self.cfg.planner, self.cfg.comm
        return _memo(self._dp_buf, key, lambda: dp_buffer_bytes(m, s, cm, pl, n, self.pb, self.gb, rc))

    def memory(self, m: ModelShape, s: ParallelShape) -> MemoryPlan:
        """:func:`orchestrator.planner.memory.memory_plan`'s composition, over this planner's caches."""
        return compose_memory_plan(
            m,
            s,
            self.act_bytes[(m.checkpointing, "selective" if m.selective else "full")],
            self.cfg.chip,
            self.cfg.planner,
            self.comm_bytes,
            contents=lambda rank: self._rank(m, s, rank),
            state=lambda rank: self._rank_state(m, s, rank),
            dp_buffers=lambda rc, rank: self._dp_buffers(m, s, self._rank_params(m, s, rc, rank), rc),
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
        lines = search_errors(c, self.whole.layers)
        if lines:
            return FastPlan(c, lines)
        cfg = self.point_config(c)
        lines = self.errors(cfg)
        if lines:
            return FastPlan(c, lines)
        m = self.model(bool(c.activation_checkpointing), c.recompute_granularity, c.recompute_layers, c.loss_chunks)
        s = ParallelShape.of(cfg.parallel, cfg.trainer, Layout(c.dp, c.tp, c.pp), str(cfg.chip.device_type))
        out = FastPlan(c, [], s, m, self.memory(m, s))
        if with_step:
            out.step = self.step(m, s)
        return out
