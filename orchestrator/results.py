"""Trials read back from MLflow: objectives, points (repeats of one config), divergence, the
command that reproduces a run. Shared by ``orchestrator.best``, ``orchestrator.report`` and the
OVAT sweeper (``sweeps.ovat``).

A *point* is one config (one ``trial.config_hash``) and the finished runs measuring it; its value
is the median of their objective, its spread ``(max - min) / median`` over the repeats.
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from orchestrator import statuses, tags, tracking

DIRECTIONS = ("minimize", "maximize")
# objectives that are a trial's median step time, or its inverse: a run measured with
# trainer.measure=adaptive carries the median's own 95% interval (step_time_ci_rel) for them
STEP_TIME_OBJECTIVES = ("step_time_median_s", "tokens_per_s_median")
# two independent medians, each with relative standard error s, differ by more than DIFF_Z x s
# by chance 5% of the time
DIFF_Z = statistics.NormalDist().inv_cdf(0.975) * math.sqrt(2)


def search(uri: str, experiment: str, filter_string: str = "", trials_only: bool = True) -> List[Any]:
    """Runs of an experiment (newest first); only trial runs (not sweep parents) by default."""
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs, token = [], None
    while True:
        page = c.search_runs(
            [exp.experiment_id],
            filter_string=filter_string,
            max_results=5000,
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            break
    if trials_only:
        runs = [r for r in runs if tags.TRIAL_STATUS in r.data.tags]
    return runs


def tag_filter(wanted: Mapping[str, Optional[str]]) -> str:
    """An MLflow filter string matching every given tag (None values are left out)."""
    parts = []
    for key, value in wanted.items():
        if value is None:
            continue
        escaped = str(value).replace("'", "\\'")
        parts.append(f"tags.`{key}` = '{escaped}'")
    return " and ".join(parts)


def status(run: Any) -> str:
    return run.data.tags.get(tags.TRIAL_STATUS, statuses.RUNNING)


def value(run: Any, objective: str) -> Optional[float]:
    v = run.data.metrics.get(objective)
    return float(v) if v is not None else None


def loss_history(uri: str, run_id: str) -> List[float]:
    """The run's per-step training loss, in step order."""
    history = tracking.client(uri).get_metric_history(run_id, "loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def diverged(losses: List[float], final_loss: Optional[float] = None) -> Optional[str]:
    """Why a finished run counts as diverged (its loss is not finite or rose), or None."""
    final = final_loss if final_loss is not None else (losses[-1] if losses else None)
    if final is None:
        return "no loss logged"
    if not math.isfinite(final):
        return f"final loss {final}"
    first = losses[0] if losses else None
    if first is not None and math.isfinite(first) and final > first:
        return f"loss rose from {first:.4g} to {final:.4g}"
    return None


def better(a: float, b: float, direction: str) -> bool:
    return a < b if direction == "minimize" else a > b


def speedup(reference: Optional[float], v: Optional[float], direction: str) -> Optional[float]:
    """S = T_reference / T for a time (minimize); v / v_reference for a rate (maximize)."""
    if reference is None or v is None or reference <= 0 or v <= 0:
        return None
    return reference / v if direction == "minimize" else v / reference


def spread(values: List[float]) -> float:
    """Run-to-run noise of repeats: (max - min) / median; 0 for a single run."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / abs(med) if med else 0.0


@dataclass
class Point:
    """One config and what is known of it: its finished runs (the repeats) or why it did not run."""

    config_hash: Optional[str]
    overrides: List[str] = field(default_factory=list)
    status: str = statuses.PENDING  # pending | finished | a failed status (infeasible, crash, ...)
    reason: str = ""
    run_ids: List[str] = field(default_factory=list)
    values: List[float] = field(default_factory=list)
    final_losses: List[float] = field(default_factory=list)
    val_losses: List[float] = field(default_factory=list)  # held-out loss of the repeats that evaluated
    losses: Dict[str, List[float]] = field(default_factory=dict)  # run id -> per-step loss
    diverged: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)  # what distinguishes it in a study: KEY -> value
    predicted_step_s: Optional[float] = None  # the planner's step time for it (orchestrator.planner)
    repeats: Optional[int] = None  # runs it needs where not the study's (a search's best, confirmed)
    ci_rel: List[float] = field(default_factory=list)  # each run's step_time_ci_rel, where recorded
    se_rel: List[float] = field(default_factory=list)  # each run's step_time_se_rel, where recorded

    @property
    def value(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None

    @property
    def final_loss(self) -> Optional[float]:
        return statistics.median(self.final_losses) if self.final_losses else None

    @property
    def val_loss(self) -> Optional[float]:
        return statistics.median(self.val_losses) if self.val_losses else None

    @property
    def spread(self) -> float:
        """Its noise, relative: the spread of its repeats (at least ``1.96 x sqrt(2) x
        step_time_se_rel / sqrt(k)`` for k repeats that recorded it); for one run of a step-time objective,
        the relative difference two such medians show at 95% by chance, ``1.96 x sqrt(2) x
        step_time_se_rel`` (the median's standard error from the steps' median absolute
        deviation, every run of 6 or more timed steps: one slow step does not inflate it); for a
        run from before that metric, its median's 95% interval's whole width (2 x
        step_time_ci_rel); else 0."""
        if len(self.values) < 2 and self.se_rel:
            return DIFF_Z * max(self.se_rel)
        if len(self.values) < 2 and self.ci_rel:
            return 2.0 * max(self.ci_rel)
        # several repeats: their spread, and no less than what their steps' noise allows for the
        # median of k runs (two repeats that happen to agree do not make the noise zero)
        within = DIFF_Z * max(self.se_rel) / math.sqrt(len(self.se_rel)) if self.se_rel else 0.0
        return max(spread(self.values), within)

    def fill(self, uri: str, runs: Iterable[Any], objective: str, with_losses: bool = True) -> "Point":
        """Take these finished runs as the point's repeats."""
        self.run_ids, self.values, self.final_losses, self.val_losses, self.losses = [], [], [], [], {}
        self.diverged, self.ci_rel, self.se_rel = None, [], []
        for run in runs:
            v = value(run, objective)
            if v is None:
                continue
            rid = run.info.run_id
            self.run_ids.append(rid)
            self.values.append(v)
            ci = run.data.metrics.get("step_time_ci_rel")
            if objective in STEP_TIME_OBJECTIVES and ci is not None and math.isfinite(ci):
                self.ci_rel.append(float(ci))
            se = run.data.metrics.get("step_time_se_rel")
            if objective in STEP_TIME_OBJECTIVES and se is not None and math.isfinite(se):
                self.se_rel.append(float(se))
            final = run.data.metrics.get("final_loss")
            losses = loss_history(uri, rid) if with_losses else []
            self.losses[rid] = losses
            if final is None and losses:
                final = losses[-1]
            if final is not None:
                self.final_losses.append(float(final))
            val = run.data.metrics.get("val_loss")
            if val is not None:
                self.val_losses.append(float(val))
            why = diverged(losses, final)
            if why and not self.diverged:
                self.diverged = why
        if self.values:
            self.status, self.reason = statuses.FINISHED, ""
        return self


def artifact_text(uri: str, run_id: str, path: str) -> str:
    """One small text artifact of a run (raises when the run has none by that name)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory() as tmp:
        return Path(tracking.client(uri).download_artifacts(run_id, path, tmp)).read_text()


def quality_gate(point: "Point", baseline: "Point", loss_band: float) -> Optional[str]:
    """Why a point can never be a win, however fast (it did not finish, its loss diverged, or its
    median loss is outside ``loss_band`` of the baseline's); None when it passes. The loss is the
    held-out ``val_loss`` when both have one (``trainer.eval_every``), else the final training loss."""
    if point.status != statuses.FINISHED:
        return f"{point.status}: {point.reason}" if point.reason else point.status
    if point.diverged:
        return f"rejected by the quality gate: diverged ({point.diverged})"
    if point.val_loss is not None and baseline.val_loss is not None:
        base, loss = baseline.val_loss, point.val_loss
        if abs(loss - base) > loss_band * abs(base):
            return f"rejected by the quality gate: val loss {loss:.4g} outside {base:.4g} +/- {loss_band:.0%}"
        return None
    common = losses_at_common_step(point, baseline)
    if common is not None:  # trials that ran different numbers of steps (trainer.measure=adaptive)
        loss, base, steps = common
        what = f"loss at step {steps}"
    else:
        base, loss, what = baseline.final_loss, point.final_loss, "final loss"
    if base is not None and loss is not None and abs(loss - base) > loss_band * abs(base):
        return f"rejected by the quality gate: {what} {loss:.4g} outside {base:.4g} +/- {loss_band:.0%}"
    return None


def losses_at_common_step(point: "Point", baseline: "Point") -> Optional[Tuple[float, float, int]]:
    """(point's, baseline's median training loss, steps) at the last step every repeat of both
    ran, when their repeats ran different numbers of steps; None when all ran the same (the
    final losses compare) or a history is missing."""
    histories = [*point.losses.values(), *baseline.losses.values()]
    if not point.losses or not baseline.losses or not all(histories):
        return None
    lengths = {len(h) for h in histories}
    if len(lengths) == 1:
        return None
    n = min(lengths)

    def at(p: "Point") -> float:
        return statistics.median(h[n - 1] for h in p.losses.values())

    return at(point), at(baseline), n


def run_seconds(runs: Iterable[Any]) -> float:
    """Trial-seconds: the summed wall time of these runs (ended ones)."""
    return sum((r.info.end_time - r.info.start_time) / 1000.0 for r in runs if r.info.end_time and r.info.start_time)


def overrides_of(uri: str, run: Any) -> List[str]:
    """The overrides a run was launched with (its ``overrides.txt``; the run name as a fallback)."""
    try:
        return [line for line in artifact_text(uri, run.info.run_id, "overrides.txt").splitlines() if line.strip()]
    except Exception:  # noqa: BLE001 - an older run or an artifact store we cannot read
        name = run.data.tags.get(tags.RUN_NAME, "")
        return [] if name in ("", "default") else shlex.split(name)


def command(overrides: Iterable[str]) -> str:
    """The shell command that runs these overrides as one trial. A sweep preset (``+sweep=``)
    sets multirun itself, so the command says ``hydra.mode=RUN`` beside it."""
    overrides = list(overrides)
    if any(o.lstrip("+~").startswith("sweep=") for o in overrides) and not any(
        o.startswith("hydra.mode=") for o in overrides
    ):
        overrides.append("hydra.mode=RUN")
    return tracking.command(overrides)


def fmt(v: Optional[float], digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"
