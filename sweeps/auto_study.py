"""The ``auto`` Hydra sweeper's study (``+sweep=auto``): from a model and a number of devices to
the measured best layout, with nothing listed by hand.

1. **Plan**: every point the trainer can run on ``launch.world_size`` devices
   (``orchestrator.planner.plan_space``: layouts x batch split x schedule and virtual stages x
   activation checkpointing x DP sharding x sequence parallelism), pruned by the rules and the
   memory fit, ranked by predicted step time. Logged: points, fits, excluded counts per reason,
   the shortlist. ``hydra.sweeper.dry_run=true`` stops here, launching nothing.
2. **Measure**: the candidates in the planner's order, ``batch`` at a time through the
   configured launcher (each a timing trial, tracked in MLflow like any other), the ranking
   corrected by what was measured after each batch, until no unmeasured candidate credited with
   the planner's measured error can win, or the budget is spent (``sweeps/auto.py``: the rules,
   tested on planted timings). A trial that runs out of memory prunes what needs more and
   corrects the planner's memory by what it needed.
3. **Polish**: one variable at a time from the winner over ``hydra.sweeper.polish`` (buckets,
   buffers, compression, precision) with the OVAT engine (``sweeps/auto_polish.py``). The budgets
   bound stage 2; stage 3 adds at most one trial per value listed beyond the winner's own, per
   repeat (the dry run prints the count).

Without ``launch.world_size``, under the Ray launcher, the search spans the Ray cluster's devices
of the chip's resource; with it, a cluster that cannot hold that many is refused before anything
runs.

Every candidate's fate is in the report (``auto_report.md`` / ``.json`` in the sweep directory and
on the sweep's parent run): measured (predicted and measured side by side), failed, pruned by a
failure, or not measured (its prediction out of reach), with the planner's mean error and
Kendall's tau on the measured points, trials and trial-seconds against the budget, and the
command that reproduces the best. Re-running reuses finished trials from MLflow by config hash.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf, open_dict

from orchestrator import auto_report, results, statuses, sweep_parent, tags, tracking
from orchestrator.filled import fill
from orchestrator.planner.search import base_config
from orchestrator.planner.space import candidate_config
from sweeps import auto_polish as polish
from sweeps.auto import Entry, Search, ratio_refit, summary
from sweeps.auto_spec import AutoSpec, parse
from sweeps.ovat import Runner, Study, _fail_study

log = logging.getLogger("orchestrator")


def _plain(cfg: DictConfig) -> DictConfig:
    with open_dict(cfg):
        if "hydra" in cfg:
            del cfg["hydra"]
    return cfg


def _entry_row(e: Entry, chosen: Optional[Entry], stop: str) -> Dict[str, Any]:
    left = "not measured: budget spent" if stop.startswith("budget") else "not measured: predicted out of reach"
    fate = {statuses.FINISHED: "measured", statuses.PRUNED: "pruned by a failure", statuses.PENDING: left}.get(
        e.status, f"failed: {e.status}"
    )
    return {
        "candidate": e.name,
        "fate": fate,
        "predicted_s": e.predicted_s,
        "corrected_s": e.corrected_s,
        "measured_s": e.measured_s,
        "runs": e.runs,
        "samples": e.samples,
        "trial_s": e.trial_s,
        "reason": e.reason,
        "best": e is chosen,
    }


def _prepare(
    sweeper: Any, arguments: List[str]
) -> Tuple[AutoSpec, DictConfig, int, _Planned, int, Optional[Dict[str, Any]]]:
    """The study's spec, the composed config, the devices, the plan, the batch and the sweep, or
    one error line and exit 2 (nothing launched) when any of them cannot be had."""
    from sweeps.ovat import StudyError

    spec = {k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v) for k, v in sweeper.spec.items()}
    info = sweep_parent.active(sweeper.hydra_context)
    try:
        auto = parse(spec)
    except StudyError as err:
        _fail_study(err.errors, info)

    def compose(overrides: List[str]) -> DictConfig:
        return _plain(sweeper.hydra_context.config_loader.load_sweep_config(sweeper.config, overrides))

    cfg = compose(list(arguments))
    why = fill(cfg)
    if why:
        _fail_study([why], info)
    devices = _devices(sweeper, cfg, auto, info)
    plan = _plan(cfg, devices, auto, info)
    # a batch: the trials the nodes hold at once (the Ray launcher runs them side by side, the
    # basic one in turn), at least two so each refit has something new
    dpn = int(cfg.chip.devices_per_node)
    batch = auto.batch or max(2, max(1, int(cfg.launch.nnodes)) * dpn // devices)
    bad = polish.check(compose, list(arguments), auto.polish)
    if bad:
        _fail_study(bad, info)
    return auto, cfg, devices, plan, batch, info


def run_auto(sweeper: Any, arguments: List[str]) -> List[Any]:
    """The ``auto`` sweeper's ``sweep()``: plan, then (unless a dry run) measure and polish."""
    auto, cfg, devices, plan, batch, info = _prepare(sweeper, arguments)
    if auto.dry_run:
        _print_dry_run(plan, cfg, auto, batch)
        if info is not None:
            sweep_parent.discard(info)
        return []
    if info is None:
        _fail_study(["tracking.enabled=false: the auto sweeper reads every measurement back from MLflow"])
    sweep_parent.sweeper_resumes(info)
    t1 = time.perf_counter()
    search, stop, points, runner = _measure(sweeper, arguments, cfg, devices, auto, batch, plan, info)
    best = search.best()
    best_point = points.get(id(best)) if best else None
    sweep_dir = Path(str(sweeper.config.hydra.sweep.dir))
    polished = None
    if best_point is not None:
        polished = polish.run(sweeper, info, list(best_point.overrides), auto.polish, auto.polish_repeats,
                              auto.min_speedup, sweep_dir)  # fmt: skip
    final = polished["final"]["overrides"] if polished else (best_point.overrides if best_point else None)
    data = {
        "model": str(cfg.model.name),
        "chip": str(cfg.chip.name),
        "devices": devices,
        "points": plan.res.count,
        "fit": plan.res.fit,
        "plan_seconds": plan.seconds,
        "excluded": plan.excluded,
        "budget": {k: getattr(auto, k) for k in ("max_trials", "max_trial_seconds", "max_device_hours")},
        "stop": stop,
        "log": search.log,
        "summary": summary(search),
        "candidates": [_entry_row(e, best, stop) for e in search.entries],
        "command": results.command(final) if final else None,
        "final_overrides": final,
        "polish": polish.summary(polished, "" if best_point else "no candidate finished"),
        "wall_seconds": time.perf_counter() - t1,
    }
    _report(data, sweep_dir, info)
    log.info("auto: %s; best %s (%s)", stop, best.name if best else "-", data["command"] or "nothing finished")
    return runner.returns


@dataclass
class _Planned:
    res: Any  # orchestrator.planner.search's result
    seconds: float
    excluded: Dict[str, int]  # points per reason, most first


def _plan(cfg: DictConfig, devices: int, auto: AutoSpec, info: Any) -> _Planned:
    """Stage 1: every point of ``devices``, logged; a model no point fits is refused."""
    from orchestrator.planner import plan_space

    t0 = time.perf_counter()
    res = plan_space(cfg, devices, auto.space)
    plan = _Planned(res, time.perf_counter() - t0, {})
    plan.excluded = {why: ex.count for why, ex in sorted(res.excluded.items(), key=lambda kv: -kv[1].count)}
    log.info(
        "auto: %d points on %d x %s, %d fit, planned in %.2f s; excluded: %s",
        res.count,
        devices,
        cfg.chip.name,
        res.fit,
        plan.seconds,
        "; ".join(f"{n} {why}" for why, n in plan.excluded.items()) or "none",
    )
    if not res.plans:
        near = res.closest[0] if res.closest else None
        extra = f" (closest: {near.candidate.name} at {near.memory.total / 2**30:.1f} GiB)" if near else ""
        _fail_study([f"model={cfg.model.name}: no point of {devices} devices fits or runs{extra}"], info)
    for i, p in enumerate(res.plans[: auto.shortlist]):
        log.info("auto: shortlist %d. %s predicted %.4g s", i + 1, p.candidate.name, p.step.step_time_s)
    return plan


def _print_dry_run(plan: _Planned, cfg: DictConfig, auto: AutoSpec, batch: int) -> None:
    res = plan.res
    n = min(auto.max_trials, res.fit)
    guess = sum(p.step.step_time_s for p in res.plans[:n]) * float(cfg.trainer.steps)
    print(f"auto (dry run): {res.count} points, {res.fit} fit, planned in {plan.seconds:.2f} s")
    for why, count in plan.excluded.items():
        print(f"  excluded {count:>6}  {why}")
    for i, p in enumerate(res.plans[: auto.shortlist]):
        print(f"  {i + 1:>3}. {p.candidate.name:<48} predicted {p.step.step_time_s:.4g} s")
    print(
        f"measure: at most {n} trials in batches of {batch}, about {guess:.0f} s of training steps "
        f"({cfg.trainer.steps} steps each at the predicted step times, launches not counted)"
    )
    if auto.polish:
        most = sum(len(v) for v in auto.polish.values()) * auto.polish_repeats
        print(f"polish from the winner, one at a time, at most {most} trials: "
              + ", ".join(f"{k}={v}" for k, v in auto.polish.items()))  # fmt: skip


def _measure(sweeper, arguments, cfg, devices, auto, batch, plan, info):
    """Stage 2: the search over the planned points, each measured through the launcher; returns
    (the search, why it stopped, its points by entry, the runner)."""
    res, dpn = plan.res, int(cfg.chip.devices_per_node)
    keys = list(res.plans[0].candidate.values(devices, dpn))
    study = Study(name="auto", variables=OrderedDict((k, []) for k in keys), fixed=list(arguments), repeats=1)
    runner = Runner(sweeper, study, info)

    def assignment(candidate) -> "OrderedDict[str, str]":
        return OrderedDict((k, _value(v)) for k, v in candidate.values(devices, dpn).items())

    top = runner.point(assignment(res.plans[0].candidate))
    if top.status not in (statuses.PENDING, statuses.FINISHED):
        _fail_study([f"launch.world_size={devices}: the planner's best point cannot launch here: {top.reason}"], info)
    base, _ = base_config(cfg)
    configs = {p.candidate: candidate_config(base, devices, p.candidate) for p in res.plans}
    search = Search.of(
        [(p.candidate, p.step.step_time_s) for p in res.plans],
        planned_gb=[p.memory.total / 2**30 for p in res.plans],
        memory_gb=float(cfg.chip.memory_gb),
        devices=devices,
        max_device_hours=auto.max_device_hours or 0.0,
        refit=calibrated_refit(configs, base.planner),
        batch=batch,
        threshold=auto.min_speedup,
        max_trials=auto.max_trials,
        max_trial_seconds=auto.max_trial_seconds or 0.0,
        exhaustive=auto.exhaustive,
        confirm=auto.confirm,
    )
    points: Dict[int, Any] = {}

    def measure(entries: List[Entry]) -> None:
        pts = [runner.point(assignment(e.candidate)) for e in entries]
        for e, p in zip(entries, pts):
            if e.status == statuses.FINISHED:  # the best, confirmed: one run more than it has
                p.repeats = e.runs + 1
        runner.measure(pts)
        for e, p in zip(entries, pts):
            points[id(e)] = p
            seconds = max(0.0, _seconds(info["uri"], p.run_ids) - e.trial_s)  # this batch's run(s)
            if p.status == statuses.FINISHED and p.value is not None:
                search.record(e, p.value, trial_s=seconds, samples=p.values)
            else:
                failed = p.status if p.status != statuses.PENDING else statuses.CRASH
                search.record(e, None, status=failed, reason=p.reason, trial_s=seconds)
            log.info("auto: %s: %s", e.name, f"{p.value:.4g} s" if p.value else f"{p.status}: {p.reason[:200]}")

    stop = search.run(measure)
    return search, stop, points, runner


def _devices(sweeper: Any, cfg: DictConfig, auto: AutoSpec, info: Any) -> int:
    """The devices to search over: ``launch.world_size``, else the Ray cluster's (under the Ray
    launcher); a world size the cluster cannot hold is refused (a dry run plans any size)."""
    from orchestrator import ray_sweep

    devices = int(cfg.launch.world_size)
    on_ray = ray_sweep.is_ray_job(sweeper.config.hydra)
    if devices <= 0 and not on_ray:
        _fail_study(
            ["launch.world_size: give the number of devices to search over (launch.world_size=N), or search "
             "a Ray cluster's devices with hydra/launcher=ray"], info)  # fmt: skip
    if not on_ray or (auto.dry_run and devices > 0):
        return devices
    try:
        have, resource = ray_sweep.cluster_devices(sweeper.config, cfg.chip)
    except ConnectionError as err:
        _fail_study([f"launch.ray.address: {err}"], info)
    if devices <= 0:
        if have <= 0:
            _fail_study([f"launch.world_size: the Ray cluster has no {resource} resource to search over"], info)
        log.info("auto: launch.world_size from the Ray cluster: %d %s", have, resource)
        return have
    if have < devices:
        _fail_study([f"launch.world_size={devices}: the Ray cluster has {have} {resource}"], info)
    return devices


def calibrated_refit(configs: Dict[Any, DictConfig], planner_cfg: DictConfig, min_error: float = 0.05):
    """A refit for :class:`sweeps.auto.Search`: the planner's factors fitted to the measured
    points (``orchestrator.planner.calibrate``, the host terms where the points tell them), so
    the correction can differ by layout, not only scale; its error the largest ``|log(measured /
    predicted)|`` of each measured point predicted by a fit to the others. With fewer than two
    points, the ratio refit's scale and an unknown error."""
    from orchestrator import planner

    def refit(measured):
        if len(measured) < 2:
            return ratio_refit(measured, min_error)
        trials = [planner.MeasuredTrial(str(i), configs[e.candidate], e.measured_s) for i, e in enumerate(measured)]
        cal = planner.calibrate(trials, planner_cfg, fit_host=True)
        loo = []
        for i, t in enumerate(trials):
            rest = planner.calibrate(trials[:i] + trials[i + 1 :], planner_cfg, fit_host=True)
            loo.append(abs(math.log(t.step_time_s / planner.predict(rest, t.cfg))))
        return (lambda e: planner.predict(cal, configs[e.candidate])), max(max(loo), min_error)

    return refit


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _seconds(uri: str, run_ids: List[str]) -> float:
    c = tracking.client(uri)
    total = 0.0
    for rid in run_ids:
        try:
            r = c.get_run(rid)
        except Exception:  # noqa: BLE001 - a run the store no longer has
            continue
        if r.info.end_time and r.info.start_time:
            total += (r.info.end_time - r.info.start_time) / 1000.0
    return total


def _report(data: Dict[str, Any], out_dir: Path, info: Dict[str, str]) -> None:
    files = auto_report.render(data, out_dir)
    md = files[0]
    c = tracking.client(info["uri"])
    rid = info["parent_run_id"]
    for f in files:
        c.log_artifact(rid, str(f))
    c.set_tag(rid, tags.AUTO_STOP, data["stop"][:5000])
    if data["final_overrides"]:
        c.set_tag(rid, tags.TUNING_FINAL_OVERRIDES, " ".join(data["final_overrides"])[:5000])
        c.set_tag(rid, tags.TUNING_COMMAND, (data["command"] or "")[:5000])
    s = data["summary"]
    metrics = {
        "auto_trials": s["trials"],
        "auto_trial_seconds": s["trial_seconds"],
        "best_objective": s["best_s"],
        "planner_mean_abs_error": s["planner_mean_abs_error"],
        "planner_kendall_tau": s["planner_kendall_tau"],
    }
    tracking.log_metrics(
        info["uri"], rid, {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    )
    log.info("auto: report %s (and on the sweep's parent run %s)", md, rid)


__all__ = ["AutoSpec", "parse", "run_auto"]
