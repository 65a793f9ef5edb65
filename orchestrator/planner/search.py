"""Every point the trainer can run on N devices, planned and ranked by estimated step time (what
``python -m orchestrator.plan --devices N`` prints): each DP/TP/PP layout (:func:`layouts`) with
its batch arithmetic and memory knobs (:mod:`.space`), excluded points counted by the rule they
break. :func:`plan_space` is the Python API (an auto-tuner's); :func:`plan_devices` its plans as
:class:`LayoutPlan`."""

from __future__ import annotations

import copy
import dataclasses
import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import DictConfig

from orchestrator.planner.fast_plan import FastPlan, FastPlanner
from orchestrator.planner.memory import MemoryPlan
from orchestrator.planner.operators import OpCoverage, op_coverage
from orchestrator.planner.preflight import LayoutPlan, resolved, with_model_overrides
from orchestrator.planner.shapes import ModelShape, ParallelShape
from orchestrator.planner.space import (
    Candidate,
    Space,
    candidates,
    chunked_twin_line,
    compile_choices,
    loss_chunk_choices,
    memory_line,
    memory_reason,
    reason_key,
)
from orchestrator.planner.step_time import StepEstimate
from orchestrator.validate_layout import chunkable_positions


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


def layouts(devices: int, model: DictConfig, chip: DictConfig, max_pp: int = 0) -> List[Tuple[int, int, int]]:
    """Every (dp, tp, pp) of ``devices``: tp a power of two dividing the heads, key/value heads
    and d_ff, within one node; pp dividing the layers, up to ``max_pp`` (0: the layers)."""
    m = ModelShape.of(model)
    out = []
    tp = 1
    while tp <= min(devices, int(chip.devices_per_node)):
        if m.heads % tp == 0 and m.kv_heads % tp == 0 and m.d_ff % tp == 0:
            for pp in range(1, (min(max_pp, m.layers) if max_pp > 0 else m.layers) + 1):
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


# ---------------------------------------------------------------------------------------------
# the whole space: every layout with its batch arithmetic and memory knobs


def contract(plan: LayoutPlan, n_params: int) -> Dict[str, Any]:
    """One object of ``plan --json``: the layout contract (DESIGN.md), the model's parameter
    count and the pipeline rank whose memory is reported (the most loaded one)."""
    out = plan.contract()
    out.setdefault("n_params", n_params)
    out.setdefault("pipeline_rank", plan.memory.rank)
    return out


@dataclass
class SpacePlan:
    """One planned point of the space: the point, its shape, memory and step-time estimate."""

    candidate: Candidate
    shape: ParallelShape
    memory: MemoryPlan
    step: StepEstimate
    n_params: int

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def layout_plan(self) -> LayoutPlan:
        return LayoutPlan(self.shape, self.memory, self.step)

    def contract(self) -> Dict[str, Any]:
        """One object of ``plan --devices N --json``: the layout's (:func:`contract`) and the
        knobs of the point."""
        c = self.candidate
        out = contract(self.layout_plan(), self.n_params)
        out.update(
            micro_batch=self.shape.micro_batch,
            virtual_stages=self.shape.virtual_stages,
            activation_checkpointing=c.activation_checkpointing,
            recompute_granularity=c.recompute_granularity,
            recompute_layers=c.recompute_layers,
            compile=c.compile,
            loss_chunks=c.loss_chunks,
            dp_shard=c.dp_shard,
            sequence_parallel=self.shape.sequence_parallel,
        )
        return out


@dataclass
class Excluded:
    """The points one rule excluded: how many, and a few of them with the rule's own line."""

    count: int = 0
    examples: List[Tuple[Candidate, str]] = field(default_factory=list)  # (point, line)


@dataclass
class LayoutSummary:
    """One DP/TP/PP layout of the space: its points, how many fit, the fastest that does, and
    the rules its other points broke (reason -> points)."""

    candidates: int = 0
    fit: int = 0
    best: Optional[SpacePlan] = None
    reasons: Dict[str, int] = field(default_factory=dict)


@dataclass
class SpaceResult:
    """What :func:`plan_space` found. ``plans``: every point that fits, fastest first;
    ``closest``: the points nearest to fitting (least memory first, step time included) when few
    or none fit; ``excluded``: reason (the rule's line, numbers taken out) -> points and examples,
    a point that breaks several rules counted under each; ``count``: points in the space."""

    devices: int
    plans: List[SpacePlan]
    closest: List[SpacePlan]
    excluded: Dict[str, Excluded]
    layouts: Dict[str, LayoutSummary]
    count: int
    seconds: float

    @property
    def fit(self) -> int:
        return len(self.plans)

    @property
    def n_excluded(self) -> int:
        return self.count - self.fit


EXAMPLES = 3


def _rank_key(p: SpacePlan) -> Tuple:
    c = p.candidate
    return (p.step.step_time_s, p.memory.total, c.dp, c.tp, c.pp, c.micro_batch, c.schedule, c.virtual_stages,
            c.activation_checkpointing, c.recompute_granularity, c.recompute_layers, c.dp_shard,
            c.sequence_parallel, c.compile, c.loss_chunks)  # fmt: skip


def base_config(cfg: DictConfig, coverage: Optional[OpCoverage] = None) -> Tuple[DictConfig, OpCoverage]:
    """The config every point starts from: the chip resolved, the coverage's model overrides
    (the mapped decompositions, hence ``attn_impl``) applied; coverage is the same for all."""
    cfg = resolved(cfg)
    cov = coverage or op_coverage(cfg.model, int(cfg.trainer.seq_len), cfg.precision.compute_dtype, cfg.chip)
    return with_model_overrides(cfg, cov.model_overrides), cov


def points(base: DictConfig, devices: int, space: Space = Space()) -> Iterator[Candidate]:
    """Every point of the space, layout by layout (:func:`layouts`, :func:`space.candidates`;
    ``space.layouts``, where given, the ones of them to plan)."""
    t = base.trainer
    device = str(base.chip.device_type)
    compiles = compile_choices(space, device, str(t.compile_backend), bool(t.compile))
    chunks = loss_chunk_choices(space, device, int(base.model.loss_chunks))
    for dp, tp, pp in layouts(devices, base.model, base.chip, space.max_pp):
        if space.layouts and (dp, tp, pp) not in space.layouts:
            continue
        yield from candidates(dp, tp, pp, int(t.global_batch), int(base.model.n_layers), space, compiles, chunks)


def _exclude(
    excluded: Dict[str, Excluded],
    summary: LayoutSummary,
    p: FastPlan,
    lines: List[str],
    reason: Optional[str] = None,
) -> None:
    """Count ``p`` out for each of ``lines`` (under ``reason``, else the line's own reason), in
    the search's tally and its layout's, keeping a few examples of each reason."""
    for line in lines:
        key = reason or reason_key(line)
        ex = excluded.setdefault(key, Excluded())
        ex.count += 1
        summary.reasons[key] = summary.reasons.get(key, 0) + 1
        if len(ex.examples) < EXAMPLES:
            ex.examples.append((p.candidate, line))


def plan_space(
    cfg: DictConfig,
    devices: int,
    space: Space = Space(),
    coverage: Optional[OpCoverage] = None,
    keep_closest: int = 10,
) -> SpaceResult:
    """Every point the trainer can run on ``devices`` devices, planned: each layout of
    :func:`layouts` with every batch split and memory knob of :func:`space.candidates`, pruned
    by the rules (the search's even stages, then ``validate()``'s lines, as ``planning_errors``
    gives them), then by memory; the step time is estimated for what fits (and the few closest
    to fitting). The same lines and floats as planning each point's full config
    (:func:`space.candidate_config`, ``planning_errors``, ``plan_layout``), by the fast path."""
    t0 = time.perf_counter()
    base, _ = base_config(cfg, coverage)
    fast = FastPlanner(base, devices)
    n_params = fast.whole.n_params
    chip = str(base.chip.name)
    plans: List[SpacePlan] = []
    near: List[Tuple[float, int, FastPlan]] = []  # max-heap by memory (negated) of the closest misses
    excluded: Dict[str, Excluded] = {}
    by_layout: Dict[str, LayoutSummary] = {}
    count = 0
    unchunked_fits = set()  # points with model.loss_chunks=1 that fit: their chunked twins are slower
    # the rules an unchunked point broke, which its chunked twin breaks alike while its chunk count
    # keeps the one rule that reads it (chunkable_positions)
    unchunked_errors: Dict[Candidate, List[str]] = {}
    seq_len = int(base.trainer.seq_len)

    for c in points(base, devices, space):
        count += 1
        summary = by_layout.setdefault(c.layout, LayoutSummary())
        summary.candidates += 1
        if c.loss_chunks > 1:
            twin = dataclasses.replace(c, loss_chunks=1)
            if twin in unchunked_fits:
                _exclude(excluded, summary, FastPlan(c, []), [chunked_twin_line(c)])
                continue
            lines = unchunked_errors.get(twin)
            if lines and c.loss_chunks <= chunkable_positions(seq_len, c.tp, c.sequence_parallel):
                _exclude(excluded, summary, FastPlan(c, lines), lines)
                continue
        p = fast.plan(c)
        if p.errors:
            if c.loss_chunks == 1:
                unchunked_errors[c] = p.errors
            _exclude(excluded, summary, p, p.errors)
            continue
        assert p.memory is not None and p.model is not None and p.shape is not None
        if not p.memory.fits:
            _exclude(excluded, summary, p, [memory_line(p.memory, chip)], memory_reason(p.memory, chip))
            item = (-p.memory.total, count, p)  # the heap's root: the largest memory kept
            if len(near) < keep_closest:
                heapq.heappush(near, item)
            elif item > near[0]:
                heapq.heapreplace(near, item)
            continue
        sp = SpacePlan(c, p.shape, p.memory, fast.step(p.model, p.shape), n_params)
        plans.append(sp)
        if c.loss_chunks == 1:
            unchunked_fits.add(c)
        summary.fit += 1
        if summary.best is None or _rank_key(sp) < _rank_key(summary.best):
            summary.best = sp
    plans.sort(key=_rank_key)
    closest = []
    for _, _, p in sorted(near, key=lambda it: (-it[0], it[1])):
        assert p.shape is not None and p.memory is not None and p.model is not None
        closest.append(SpacePlan(p.candidate, p.shape, p.memory, fast.step(p.model, p.shape), n_params))
    return SpaceResult(devices, plans, closest, excluded, by_layout, count, time.perf_counter() - t0)


def plan_devices(cfg: DictConfig, devices: int) -> Tuple[List[LayoutPlan], Dict[str, List[str]]]:
    """The plans of every point of ``devices`` devices that fits, fastest first
    (:func:`plan_space`), and a few excluded points with their broken rules."""
    res = plan_space(cfg, devices)
    skipped: Dict[str, List[str]] = {}
    for ex in res.excluded.values():
        for c, line in ex.examples:
            skipped.setdefault(c.name, []).append(line)
    return [p.layout_plan() for p in res.plans], skipped
