"""The ``auto`` sweeper's settings (``hydra.sweeper.*`` of ``+sweep=auto``), checked: every broken
key is one line of the study's error, before anything is planned or launched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from orchestrator.planner.space import Space
from orchestrator.validate import SCHEDULES
from sweeps.ovat import PREFIX, StudyError
from trainers.rules import DP_MODES


@dataclass
class AutoSpec:
    """The sweeper's settings, checked."""

    batch: int = 0  # trials a batch; 0: as many as launch.nnodes nodes hold at once, at least 2
    min_speedup: float = 1.03
    max_trials: int = 12
    confirm: int = 2
    max_trial_seconds: Optional[float] = None
    max_device_hours: Optional[float] = None
    dry_run: bool = False
    exhaustive: bool = False
    shortlist: int = 10
    space: Space = Space()
    polish: Optional[Dict[str, Any]] = None
    polish_repeats: int = 1


def parse(spec: Dict[str, Any]) -> AutoSpec:
    """The sweeper's config as an AutoSpec; every broken key is one line of the StudyError."""
    errors: List[str] = []
    out = AutoSpec()

    def number(key: str, kind: type, low: float, strict: bool = False) -> Any:
        value = spec.get(key, getattr(out, key))
        try:
            value = kind(value)
        except (TypeError, ValueError):
            errors.append(f"{PREFIX}.{key}={value!r}: must be a number")
            return getattr(out, key)
        if value < low or (strict and value == low):
            errors.append(f"{PREFIX}.{key}={value}: must be {'above' if strict else 'at least'} {low:g}")
        return value

    out.batch = number("batch", int, 0)
    out.min_speedup = number("min_speedup", float, 1.0)
    out.max_trials = number("max_trials", int, 1)
    out.confirm = number("confirm", int, 1)
    out.shortlist = number("shortlist", int, 1)
    if spec.get("max_trial_seconds") is not None:
        out.max_trial_seconds = number("max_trial_seconds", float, 0.0, strict=True)
    if spec.get("max_device_hours") is not None:
        out.max_device_hours = number("max_device_hours", float, 0.0, strict=True)
    out.polish_repeats = number("polish_repeats", int, 0)
    # a key set to null or [] is not polished (Hydra merges a dict override into the preset's)
    out.polish = {k: v for k, v in dict(spec.get("polish") or {}).items() if v not in (None, [])}
    if out.polish_repeats == 0:
        out.polish = {}
    out.dry_run = bool(spec.get("dry_run", False))
    out.exhaustive = bool(spec.get("exhaustive", False))
    space = dict(spec.get("space") or {})  # its keys are the sweeper schema's (AutoSpaceConf)
    schedules = tuple(space.get("schedules") or SCHEDULES)
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad:
        errors.append(f"{PREFIX}.space.schedules: {bad} not among {list(SCHEDULES)}")
    shards = tuple(space.get("dp_shard") or DP_MODES)
    if set(shards) - set(DP_MODES):
        errors.append(f"{PREFIX}.space.dp_shard: {list(shards)}: each must be one of {list(DP_MODES)}")
    granularities = tuple(space.get("recompute_granularity") or ("full", "selective"))
    if set(granularities) - {"full", "selective"}:
        errors.append(f"{PREFIX}.space.recompute_granularity: {list(granularities)}: each must be full or selective")
    shares = space.get("recompute_shares")
    shares = tuple(float(v) for v in (Space().recompute_shares if shares is None else shares))
    if any(not 0.0 < v < 1.0 for v in shares):
        errors.append(f"{PREFIX}.space.recompute_shares: {list(shares)}: each must be above 0 and below 1")
    out.space = Space(
        schedules=schedules,
        activation_checkpointing=tuple(bool(v) for v in (space.get("activation_checkpointing") or (False, True))),
        recompute_granularity=granularities,
        recompute_shares=shares,
        dp_shard=shards,
        sequence_parallel=tuple(bool(v) for v in (space.get("sequence_parallel") or (False, True))),
        max_pp=int(space.get("max_pp") or 0),
        compile=tuple(bool(v) for v in (space.get("compile") or ())),
    )
    if errors:
        raise StudyError(errors)
    return out
