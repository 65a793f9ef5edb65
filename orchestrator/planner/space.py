"""The space the trainer can run on N devices: its points and the rules the search adds.

A point (:class:`Candidate`) is a DP/TP/PP layout (:func:`orchestrator.planner.search.layouts`)
with its batch arithmetic and memory knobs: ``trainer.micro_batch`` (without a pipeline, a
divisor of the replica's batch) or ``parallel.microbatches`` (with one, a divisor of it), the
pipeline schedule and its stages per rank, ``model.activation_checkpointing`` with its
``model.recompute_granularity`` (full, or selective: the attention core) and, with full, its
``model.recompute_layers`` (all blocks, or the first N of each stage chunk: N a quarter, a half,
three quarters of the chunk's blocks, :func:`recompute_counts`; Megatron's
``--recompute-method block --recompute-num-layers N``),
``parallel.dp_shard`` (each data-parallel mode, :data:`trainers.rules.DP_MODES`),
``parallel.sequence_parallel``, ``trainer.compile`` (where it helps, :func:`compile_choices`) and
``model.loss_chunks`` (the head and loss over sequence chunks on an accelerator,
:func:`loss_chunk_choices`).
Values that change nothing the trainer does are not separate points: ``dp_shard`` is ``ddp``
with one replica; sequence parallelism only with ``tp > 1``; ``virtual_stages`` is the stages per rank the schedule runs
(1 for GPipe and 1F1B, 2 for ZB-V, for interleaved 1F1B each count from 2 whose stages split the
layers evenly). Which rules a point must keep is the validator's business: points that break
one are planned only as far as being counted under it (the search adds one rule of its own,
:func:`search_errors`: stages split the layers evenly).

The slow path is the one every trial goes through: :func:`candidate_config` writes the point
into a copy of the composed config, ``planning_errors`` validates it and ``plan_layout`` plans
it. The fast path (:mod:`.fast_plan`) gives the same lines and the same floats thousands of
times faster; ``tests/test_plan_search.py`` holds the two paths equal.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from omegaconf import DictConfig

from orchestrator.layout import Layout
from orchestrator.planner.memory import MemoryPlan
from orchestrator.planner.shapes import GiB
from orchestrator.validate import SCHEDULES
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
    recompute_granularity: str = "full"  # what checkpointing recomputes (read only with it on)
    recompute_layers: int = -1  # the first N blocks of each stage chunk recompute; -1: all of them
    compile: bool = False  # trainer.compile: each block through torch.compile
    loss_chunks: int = 1  # model.loss_chunks: the head and loss over this many sequence chunks

    @property
    def layout(self) -> str:
        return Layout(self.dp, self.tp, self.pp).name

    @property
    def name(self) -> str:
        parts = [self.layout, f"mbs{self.micro_batch}"]
        if self.pp > 1:
            parts.append(f"m{self.microbatches}")
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.schedule == "interleaved_1f1b" else ""))
        if self.activation_checkpointing:
            parts.append("sel" if self.recompute_granularity == "selective" else "ckpt")
            parts[-1] += str(self.recompute_layers) * (self.recompute_layers >= 0)
        parts += [self.dp_shard] * (self.dp_shard != "ddp" and self.dp > 1)
        parts += [f"chunks{self.loss_chunks}"] * (self.loss_chunks > 1)
        return "+".join(parts) + ("+sp" if self.sequence_parallel else "") + ("+compiled" if self.compile else "")

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
            "trainer.compile": self.compile,
            "model.activation_checkpointing": self.activation_checkpointing,
            "model.recompute_granularity": self.recompute_granularity,
            "model.recompute_layers": self.recompute_layers,
            "model.loss_chunks": self.loss_chunks,
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
    recompute_granularity: Tuple[str, ...] = ("full", "selective")  # with checkpointing on
    # with full recompute, the shares of each stage chunk's blocks that recompute besides all of
    # them (each rounded up to whole blocks, kept where it is some but not all: recompute_counts)
    recompute_shares: Tuple[float, ...] = (0.25, 0.5, 0.75)
    dp_shard: Tuple[str, ...] = rules.DP_MODES
    sequence_parallel: Tuple[bool, ...] = (False, True)
    max_pp: int = 0  # 0: every pipeline depth that divides the layers
    compile: Tuple[bool, ...] = ()  # trainer.compile values; empty: compile_choices' rule
    loss_chunks: Tuple[int, ...] = ()  # model.loss_chunks values; empty: loss_chunk_choices' rule
    layouts: Tuple[Tuple[int, int, int], ...] = ()  # (dp, tp, pp) to plan; empty: every one


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_choices(schedule: str, pp: int, n_layers: int) -> List[int]:
    """``parallel.virtual_stages`` values of a schedule: the stages per rank it runs
    (:func:`trainers.rules.stages_per_rank`); interleaved 1F1B takes every count from 2 whose
    stages split the layers evenly (as :func:`~orchestrator.planner.search.layouts` takes pp)."""
    if schedule == "interleaved_1f1b":
        return [v for v in range(2, n_layers // pp + 1) if n_layers % (pp * v) == 0] or [2]
    return [rules.stages_per_rank(pp, schedule, 1)]


def compile_choices(space: Space, device_type: str, backend: str, composed: bool) -> List[bool]:
    """``trainer.compile`` values of the search: ``space.compile`` where given; else both where
    the backend fuses (``trainers.rules.FUSING_BACKENDS``: Inductor on a GPU, TorchAir when named)
    on an accelerator, and the composed value elsewhere: the 910B's auto backend, ``aot_eager``,
    runs the graph's operators one by one (nothing the planner can credit), and on the CPU, where
    CI and laptops run short trials, Inductor's compile time outweighs the steps it saves."""
    if space.compile:
        return list(space.compile)
    if device_type != "cpu" and rules.compile_backend_name(device_type, backend) in rules.FUSING_BACKENDS:
        return [False, True]
    return [composed]


LEAN_CHUNKS = 16  # the chunked loss's count where the search adds one (docs/planner.md, "Lean ends")


def loss_chunk_choices(space: Space, device_type: str, composed: int) -> List[int]:
    """``model.loss_chunks`` values of the search: ``space.loss_chunks`` where given; on an
    accelerator the composed value and, where that is 1, :data:`LEAN_CHUNKS` too (the ends then
    keep about Megatron's bytes, ``bench/megatron_activations.py``, for one more head forward);
    on the CPU the composed value alone, as :func:`compile_choices` keeps it there."""
    if space.loss_chunks:
        return list(space.loss_chunks)
    if device_type != "cpu" and composed == 1:
        return [1, LEAN_CHUNKS]
    return [composed]


def recompute_counts(chunk_blocks: int, shares: Sequence[float]) -> List[int]:
    """``model.recompute_layers`` values of full recompute on stage chunks of ``chunk_blocks``
    blocks: -1 (all), then each share of the chunk rounded up to whole blocks, where that is some
    blocks but not all (a chunk of one block has only -1)."""
    counts = sorted({math.ceil(round(chunk_blocks * share, 6)) for share in shares})
    return [-1] + [n for n in counts if 0 < n < chunk_blocks]


def candidates(
    dp: int,
    tp: int,
    pp: int,
    global_batch: int,
    n_layers: int,
    space: Space = Space(),
    compiles: Sequence[bool] = (False,),
    chunks: Sequence[int] = (1,),
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
    shards = list(space.dp_shard) if dp > 1 else ["ddp"]  # one replica: no wrapping
    sps = list(space.sequence_parallel) if tp > 1 else [False]
    off = [(False, "full", -1)] * (False in space.activation_checkpointing)
    grains = list(space.recompute_granularity) if True in space.activation_checkpointing else []
    for mb, m, sched, v in batches:
        chunk = max(1, n_layers // (pp * rules.stages_per_rank(pp, sched, v)))
        counts = {"full": recompute_counts(chunk, space.recompute_shares), "selective": [-1]}
        recomputes = off + [(True, g, n) for g in grains for n in counts[g]]
        for ckpt, granularity, count in recomputes:
            for shard in shards:
                for sp in sps:
                    for compiled in compiles:
                        for n in chunks:
                            yield Candidate(
                                dp, tp, pp, mb, m, sched, v, ckpt, shard, sp, granularity, count, compiled, n
                            )


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


def chunked_twin_line(c: Candidate) -> str:
    """Why the search leaves out a chunked point whose ``model.loss_chunks=1`` twin fits: it is the
    same point with one more head forward (``shapes.head_recompute_flops``), never faster."""
    return (
        f"search: model.loss_chunks={c.loss_chunks} where the same point fits unchunked: only one more "
        "head forward per micro-batch"
    )


_NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(?![\w])")


def reason_key(line: str) -> str:
    """An error line with its numbers taken out: the rule it states, for counting points per rule."""
    return _NUMBER.sub("N", line)


# ---------------------------------------------------------------------------------------------
# the slow path: one full config per point


def assign(cfg: Any, values: Dict[str, Any]) -> None:
    """Write ``section.key`` values into ``cfg`` (a DictConfig or a :class:`~.fast_plan.Plain`)."""
    for key, value in values.items():
        section, name = key.split(".")
        setattr(cfg[section], name, value)


def candidate_config(base: DictConfig, devices: int, c: Candidate) -> DictConfig:
    """``base`` (resolved, with the coverage's model overrides) with this point written in."""
    out = copy.deepcopy(base)
    assign(out, c.values(devices, int(base.chip.devices_per_node)))
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
    "Space",
    "assign",
    "candidate_config",
    "candidates",
    "memory_line",
    "memory_reason",
    "reason_key",
    "sample",
    "search_errors",
    "stage_choices",
]
