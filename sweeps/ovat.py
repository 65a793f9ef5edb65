"""One-variable-at-a-time tuning (``hydra/sweeper=ovat``): measure a baseline, change one
variable at a time, A/B each change with repeats, quantify S = T_baseline / T_optimized, keep
only real wins, and write down what helped and what did not.

The study: ordered variables with candidates (the first candidate of each is the baseline), an
objective logged by every trial (``step_time_median_s`` by default) and its direction, repeats
per point, a minimum speedup, a loss band, passes. Coordinate descent: the baseline, then each
variable's other candidates with every other variable at its current best, in one batch through
the configured launcher; the fastest candidate that passes the quality gate is adopted when its
speedup over the current best is at least ``max(min_speedup, 1 + noise)``, where the noise is the
spread of the baseline's repeats (with ``repeats=1``, the difference two medians show at 95% by
chance from the standard error each trial records, robust to slow steps:
``orchestrator.results.Point.spread``). Further passes run
while the last one adopted something.

With a step-time objective the planner orders each variable's candidates (predicted best first)
and skips one it predicts slower than the incumbent by more than its own error on the points
measured so far (``planner_skip``; :func:`model_error`, :func:`planner_verdict`).

Every point is first checked as a trial would check it (rules, launch limits, the planner's
memory and operator coverage): one that cannot run is recorded in MLflow and never launched.
Measurements come back from MLflow by config hash, so re-running a study reuses the trials that
already finished (``hydra.sweeper.resume``) and launches only the missing repeats.

The sweep's parent run (``orchestrator.sweep_parent``) gets the tuning report: ``tuning_report.md``,
``tuning_report.json`` and PNG plots, also written to the sweep directory.

Here: the descent and its decisions. The study's definition and parsing are
``sweeps/ovat_spec.py``, its points (compose, check, launch, read back) ``sweeps/ovat_runner.py``,
the report's rows ``sweeps/ovat_rows.py``.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from orchestrator import exit_codes, report_render, results, statuses, sweep_parent, tracking
from orchestrator.results import Point
from sweeps.ovat_rows import _planned_row, _row, _skip_row
from sweeps.ovat_runner import Runner, _label
from sweeps.ovat_spec import PREFIX, Study, StudyError, parse_study

log = logging.getLogger("orchestrator")

PREDICTED = {"step_time_median_s": 1, "tokens_per_s_median": -1}


def predicted(point: Point, objective: str) -> Optional[float]:
    """The planner's value of ``objective`` for the point (in its own units: the planner's step
    time can be off by a constant factor on a given machine), or None when it predicts none."""
    power = PREDICTED.get(objective)
    t = point.predicted_step_s
    if power is None or not t or t <= 0:
        return None
    return t**power


def model_error(points: Sequence[Point], objective: str) -> Optional[float]:
    """The planner's own error on the points measured so far, as the largest relative error of a
    predicted ratio between two of them (the constant factor between its step times and the
    machine's drops out): ``max_ij |(pred_i / pred_j) / (meas_i / meas_j) - 1|``. None with fewer
    than two points both predicted and measured."""
    logs = []
    for p in points:
        pred = predicted(p, objective)
        if pred is not None and p.status == statuses.FINISHED and p.value and p.value > 0:
            logs.append(math.log(pred / p.value))
    if len(logs) < 2:
        return None
    return math.exp(max(logs) - min(logs)) - 1.0


def planner_verdict(
    point: Point, incumbent: Point, study: Study, error: Optional[float]
) -> Tuple[Optional[float], Optional[str]]:
    """(the planner's speedup of ``point`` over the incumbent, why it is skipped or None). A point
    is skipped when, even with the planner's measured ``error`` in its favour, it would be slower
    than the incumbent: predicted S * (1 + error) < 1."""
    pc, pi = predicted(point, study.objective), predicted(incumbent, study.objective)
    if pc is None or pi is None:
        return None, None
    s_pred = results.speedup(pi, pc, study.direction)
    if not study.planner_skip or error is None or s_pred is None or s_pred * (1.0 + error) >= 1.0:
        return s_pred, None
    return s_pred, (
        f"skipped, predicted slower: the planner's S={s_pred:.3f} vs the incumbent, and its error on "
        f"the points measured so far is {error:.1%}"
    )


def judge(point: Point, baseline: Point, incumbent: Point, study: Study, threshold: float) -> Tuple[bool, str]:
    """Is this candidate a win over the incumbent? (win, why). The quality gate first: a point
    whose loss diverged or ended outside the band around the baseline's is never a win. The
    speedup over the incumbent must reach ``threshold`` (max of min_speedup and 1 + the baseline's
    noise) and beat the spread of the candidate's and the incumbent's own repeats."""
    why = results.quality_gate(point, baseline, study.loss_band)
    if why:
        return False, why
    s_prev = results.speedup(incumbent.value, point.value, study.direction)
    # the baseline's noise, or the two compared points' own spread when it is larger
    threshold = max(threshold, 1.0 + point.spread, 1.0 + incumbent.spread)
    if s_prev is None or s_prev < threshold:
        return False, f"no win: S={results.fmt(s_prev, 3)} vs the incumbent, below {threshold:.3f}"
    return True, f"win: S={s_prev:.3f} vs the incumbent (threshold {threshold:.3f})"


class _Descent:
    """The state of one coordinate descent: the incumbent assignment and point, the report's rows,
    the skips, and the finalists whose loss curves the report draws."""

    def __init__(self, study: Study, runner: Runner):
        self.study, self.runner = study, runner
        self.keys = list(study.variables)
        self.current = OrderedDict((k, v[0]) for k, v in study.variables.items())
        self.baseline = runner.point(dict(self.current))
        self.inert = {self.keys[0]: runner.no_effect(dict(self.current), self.keys[0])}
        first = self.keys[0]
        others = []
        if not self.inert[first]:
            others = [runner.point({**self.current, first: v}) for v in study.variables[first][1:]]
        runner.measure([self.baseline, *others])  # one batch: the baseline's repeats and the first variable
        self.noise = self.baseline.spread
        self.threshold = max(study.min_speedup, 1.0 + self.noise)
        self.incumbent = self.baseline
        self.finalists: List[Tuple[str, Point]] = [("baseline", self.baseline)]
        self.skipped: List[str] = []
        self.step = 0
        self.predicted_skips = 0
        ok = self.baseline.status == statuses.FINISHED
        first_decision = "baseline" if ok else f"{self.baseline.status}: {self.baseline.reason}"
        b = self.baseline
        self.rows: List[Dict[str, Any]] = [
            _row(0, 0, "(baseline)", _label(self.current), b, b, b, study, first_decision, False)
        ]
        self.outcome = statuses.FINISHED if ok else "baseline_failed"
        if not ok:
            log.error("ovat: the baseline did not finish (%s: %s); nothing to compare against", b.status, b.reason)
        else:
            log.info(
                "ovat: baseline %s = %s over %d repeats, noise %.1f%%, a win needs S >= %.3f",
                study.objective,
                results.fmt(b.value),
                len(b.values),
                100 * self.noise,
                self.threshold,
            )

    def _skip_inert(self, pass_: int, key: str) -> bool:
        """Whether ``key`` is inert on the incumbent (then skipped, with its row)."""
        why = self.inert.pop(key) if key in self.inert else self.runner.no_effect(dict(self.current), key)
        if why:
            self.step += 1
            self.rows.append(_skip_row(self.step, pass_, key, why))
            self.skipped.append(f"{key}: {why}")
            log.info("ovat: [pass %d] %s skipped, no effect on the incumbent: %s", pass_, key, why)
        return bool(why)

    def _planned(self, pass_: int, key: str) -> List[Tuple[Any, Point]]:
        """``key``'s other values in the planner's order (predicted best first), less the ones it
        predicts slower than the incumbent by more than its own error on what was measured so far
        (each recorded as a predicted skip); a candidate measured already is judged on that."""
        study = self.study
        values = [v for v in study.variables[key] if v != self.current[key]]
        cands = [(v, self.runner.point({**self.current, key: v})) for v in values]
        error = model_error(list(self.runner.points.values()), study.objective)
        plans = {
            id(p): planner_verdict(p, self.incumbent, study, error if p.status == statuses.PENDING else None)
            for _, p in cands
        }
        cands.sort(key=lambda vp: -(plans[id(vp[1])][0] or 0.0))
        for v, p in [vp for vp in cands if plans[id(vp[1])][1]]:
            self.step += 1
            why = plans[id(p)][1]
            self.rows.append(_planned_row(self.step, pass_, key, v, p, study, why))
            self.skipped.append(f"{key}={v}: {why}")
            self.predicted_skips += 1
            log.info("ovat: [pass %d] %s=%s %s", pass_, key, v, why)
        return [vp for vp in cands if not plans[id(vp[1])][1]]

    def vary(self, pass_: int, key: str) -> bool:
        """Measure ``key``'s candidates on the incumbent and adopt the fastest win; whether one won."""
        if self._skip_inert(pass_, key):
            return False
        study = self.study
        cands = self._planned(pass_, key)
        self.runner.measure([p for _, p in cands])
        verdicts = [(v, p, *judge(p, self.baseline, self.incumbent, study, self.threshold)) for v, p in cands]
        wins = [(v, p) for v, p, ok, _ in verdicts if ok]
        winner = None
        if wins:
            winner = max(wins, key=lambda vp: results.speedup(self.incumbent.value, vp[1].value, study.direction))
        for v, p, ok, why in verdicts:
            self.step += 1
            adopted = winner is not None and p is winner[1]
            decision = f"adopted ({why})" if adopted else (f"{why}; a faster candidate won" if ok else why)
            self.rows.append(_row(self.step, pass_, key, v, p, self.baseline, self.incumbent, study, decision, adopted))
            log.info(
                "ovat: [pass %d] %s=%s: %s=%s (S=%s vs baseline) -> %s",
                pass_,
                key,
                v,
                study.objective,
                results.fmt(p.value),
                results.fmt(self.rows[-1]["s_base"], 3),
                decision,
            )
        if winner is None:
            return False
        self.current[key] = winner[0]
        self.incumbent = winner[1]
        self.finalists.append((f"{key}={winner[0]}", winner[1]))
        return True

    def report(self) -> Dict[str, Any]:
        """The tuning report's data (see orchestrator.report_render.render)."""
        study, runner, rows, incumbent = self.study, self.runner, self.rows, self.incumbent
        final_overrides = study.overrides(dict(self.current))
        helped = [
            f"{r['variable']}={r['value']}: S={results.fmt(r['s_prev'], 3)} over the incumbent, "
            f"{results.fmt(r['s_base'], 3)} over the baseline"
            for r in rows
            if r["adopted"]
        ]
        did_not = [
            f"{r['variable']}={r['value']}: {r['decision']}"
            for r in rows[1:]
            if not r["adopted"] and r["status"] != "skipped"
        ]
        return {
            "kind": "ovat",
            "study": study.name,
            "sweep": runner.info["id"],
            "experiment": runner.experiment,
            "objective": study.objective,
            "direction": study.direction,
            "repeats": study.repeats,
            "min_speedup": study.min_speedup,
            "loss_band": study.loss_band,
            "noise": self.noise,
            "threshold": self.threshold,
            "outcome": self.outcome,
            "variables": [{"key": k, "values": v} for k, v in study.variables.items()],
            "fixed": study.fixed,
            "rows": rows,
            "final": {
                "assignment": dict(self.current),
                "overrides": final_overrides,
                "command": results.command(final_overrides),
                "objective": incumbent.value,
                "s_total": results.speedup(self.baseline.value, incumbent.value, study.direction),
                "run_ids": list(incumbent.run_ids),
                "config_hash": incumbent.config_hash,
            },
            "helped": helped,
            "did_not_help": did_not,
            "skipped": self.skipped,
            "curves": {label: p.losses.get(p.run_ids[0], []) if p.run_ids else [] for label, p in self.finalists},
            "trials": {
                "launched": runner.launched,
                "reused": runner.reused,
                statuses.PRUNED: runner.pruned,
                "predicted_skips": self.predicted_skips,
            },
            "planner_error": model_error(list(runner.points.values()), study.objective),
        }


def descend(study: Study, runner: Runner) -> Dict[str, Any]:
    """Coordinate descent; returns the tuning report's data (see orchestrator.report_render.render).
    A variable whose candidates would all run the same trial on the incumbent (the layout rules
    say the key is inert there, e.g. DDP buckets without DDP) is skipped with its reason. Passes
    over the variables go on while one adopts a change, at most ``study.passes``."""
    descent = _Descent(study, runner)
    for pass_ in range(1, study.passes + 1):
        if descent.outcome != statuses.FINISHED:
            break
        adopted = [descent.vary(pass_, key) for key in descent.keys]
        if not any(adopted):
            break
    return descent.report()


def _fail_study(errors: List[str], info: Optional[Dict[str, Any]] = None) -> None:
    """Bad input: one line per broken key, exit 2; the sweep's parent run is removed again."""
    if info is not None:
        sweep_parent.discard(info)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    raise SystemExit(exit_codes.BAD_INPUT)


def _check_composes(study: Study, runner: Runner) -> None:
    """Every candidate must compose (known key, existing preset, right type) before anything runs."""
    base = {k: v[0] for k, v in study.variables.items()}
    errors = []
    for key, values in study.variables.items():
        for v in values:
            try:
                runner.compose(study.overrides({**base, key: v}))
            except Exception as err:  # noqa: BLE001 - Hydra's composition errors, reported per key
                msg = " ".join(str(err).split("Config search path")[0].split())
                errors.append(f"{PREFIX}.{study.space}.{key}: candidate {v!r} does not compose: {msg[:300]}")
    if errors:
        _fail_study(errors, runner.info)


def run_study(sweeper: Any, arguments: List[str]) -> List[Any]:
    """The sweeper's ``sweep()``: parse and check the study, descend, write the report."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    config = sweeper.config
    choices = config.hydra.runtime.choices
    name = str(sweeper.spec.get("study") or choices.get("sweep") or "ovat")
    parser = OverridesParser.create(config_loader=sweeper.hydra_context.config_loader)
    spec = {k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v) for k, v in sweeper.spec.items()}
    try:
        study = parse_study(spec, arguments, parser, name)
    except StudyError as err:
        _fail_study(err.errors, sweep_parent.active(sweeper.hydra_context))
    info = sweep_parent.active(sweeper.hydra_context)
    if info is None:
        _fail_study(
            [
                "tracking.enabled=false: the ovat sweeper reads every measurement back from MLflow; "
                "enable tracking (tracking.uri may point at any store)"
            ]
        )
    # the study reuses finished runs by config hash itself and launches repeats of one config on
    # purpose: its jobs must not skip a hash that already finished (tracking.skip_finished)
    sweep_parent.sweeper_resumes(info)
    runner = Runner(sweeper, study, info)
    _check_composes(study, runner)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")
    c = tracking.client(info["uri"])
    c.set_tag(info["parent_run_id"], "ovat.study", study.name)
    log.info(
        "ovat study %s: %s by %s (%s), %d repeat(s), variables %s",
        study.name,
        study.objective,
        study.direction,
        "resuming from MLflow" if study.resume else "fresh",
        study.repeats,
        ", ".join(f"{k}={','.join(v)}" for k, v in study.variables.items()),
    )
    t0 = time.perf_counter()
    data = descend(study, runner)
    data["trials"]["trial_seconds"] = runner.trial_seconds()
    data["trials"]["wall_seconds"] = time.perf_counter() - t0
    files = report_render.render(data, sweep_dir / "tuning_report")
    report_render.attach(info["uri"], info["parent_run_id"], files, data)
    final = data["final"]
    log.info(
        "ovat: %s -> %s=%s (S=%s over the baseline); %d trial(s) launched, %d reused, %d pruned",
        data["outcome"],
        study.objective,
        results.fmt(final["objective"]),
        results.fmt(final["s_total"], 3),
        runner.launched,
        runner.reused,
        runner.pruned,
    )
    log.info("ovat: best config: %s", final["command"])
    log.info("ovat: report %s (and on the sweep's parent run %s)", files[0], info["parent_run_id"])
    return runner.returns
