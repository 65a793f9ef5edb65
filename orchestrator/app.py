"""The Hydra application: compose the config, hand it to :mod:`orchestrator.trial`.

Exit codes: 0 finished; 1 the trial failed (its status and reason are in MLflow); 2 the config is
broken (one line per broken rule, nothing launched, nothing recorded). Ctrl-C stops the process
as an interrupt does; the trial's run and a sweep's parent run end KILLED.

In a multirun a job whose point already finished (same config hash, ``tracking.skip_finished``)
launches nothing: its result is the finished run's (see :func:`finished_before`).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Dict, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from orchestrator import conf_dir, exit_codes, ray_sweep, statuses, sweep_parent, trial
from orchestrator.config import register_configs

log = logging.getLogger("orchestrator")


def _report(result: dict) -> None:
    s = result.get("summary") or {}
    if result["status"] == statuses.FINISHED:
        log.info(
            "finished run %s: final_loss=%.4f step_time_median_s=%.4f tokens_per_s=%.0f peak_mem_gb=%.2f",
            result["run_id"],
            s.get("final_loss", float("nan")),
            s.get("step_time_median_s", float("nan")),
            s.get("tokens_per_s_median", float("nan")),
            s.get("peak_mem_gb", float("nan")),
        )
    else:
        log.error("run %s ended %s: %s", result["run_id"], result["status"], result.get("reason", ""))


def finished_before(resolved: trial.ResolvedTrial, job_num: int) -> Optional[Dict[str, Any]]:
    """A sweep job's point that already finished: the result of the newest run with its config
    hash (``reused: True``), recorded on the sweep's parent run; None when the job must run (not
    in a sweep, ``tracking.skip_finished=false``, a sweeper that resumes by itself, no such run)."""
    cfg = resolved.cfg
    if not sweep_parent.skips_finished(cfg.tracking):
        return None
    # the hash its run will carry: the chip resolved and the planner's mappings applied
    plan = resolved.outcome()
    if plan["status"] != "ready":
        return None
    run = sweep_parent.finished_run(cfg.tracking, plan["config_hash"])
    if run is None:
        return None
    run_id = run.info.run_id
    sweep_parent.record_reused(job_num, run_id)
    log.info("#%d already finished in run %s: skipped", job_num, run_id)
    return {
        "status": statuses.FINISHED,
        "run_id": run_id,
        "reused": True,
        "config_hash": plan["config_hash"],
        "summary": dict(run.data.metrics),
    }


def maximizes(sweeper: Any) -> bool:
    """Whether the sweeper in ``hydra.sweeper`` maximizes its objective: Optuna's ``direction``
    (``maximize``, or a list of one), Nevergrad's ``optim.maximize``, Ax's
    ``ax_config.experiment.minimize``; any other sweeper is taken to minimize."""
    if sweeper is None:
        return False
    direction = OmegaConf.select(sweeper, "direction")
    if direction is not None:
        first = direction[0] if OmegaConf.is_list(direction) or isinstance(direction, list) else direction
        return str(getattr(first, "name", first)).lower() == "maximize"
    if OmegaConf.select(sweeper, "optim.maximize") is not None:
        return bool(OmegaConf.select(sweeper, "optim.maximize"))
    if OmegaConf.select(sweeper, "ax_config.experiment.minimize") is not None:
        return not bool(OmegaConf.select(sweeper, "ax_config.experiment.minimize"))
    return False


def objective(cfg: DictConfig, result: Dict[str, Any], sweeper: Any = None) -> Any:
    """What the job returns to its sweeper: ``result`` itself, or with ``optimized_metric`` set,
    that summary metric as a float. A trial that did not finish (failed, infeasible, pruned by
    the planner) or lacks the metric returns the worst value of the sweeper's direction (+inf
    when it minimizes, -inf when it maximizes): a completed trial no sweeper can read as a good
    one. Not NaN: Optuna's Hydra sweeper (1.2, 1.3) crashes on a NaN return instead of failing
    the trial (it tells the study FAIL with the values still set)."""
    name = cfg.get("optimized_metric")
    if not name:
        return result
    summary = result.get("summary") or {}
    value = summary.get(name)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if result["status"] == statuses.FINISHED and not number:
        numeric = sorted(k for k, v in summary.items() if isinstance(v, (int, float)))
        log.error("optimized_metric=%s: the trial logged no such metric (it logs %s)", name, ", ".join(numeric))
    if result["status"] != statuses.FINISHED or not number:
        return -math.inf if maximizes(sweeper) else math.inf
    return float(value)


def main(cfg: DictConfig, hc: DictConfig):
    """One job: the trial of ``cfg``, with the job's Hydra config ``hc`` (overrides, mode, launcher)."""
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    # under hydra/launcher=ray every trial goes to Ray; otherwise the trial's size decides
    launcher = "ray" if ray_sweep.is_ray_job(hc) else None  # hydra/launcher=ray_trials (or its alias ray)
    try:
        resolved = trial.resolve(cfg, launcher)  # once for the job: fill, validate, and below the preflight
        reused = finished_before(resolved, int(hc.job.num)) if multirun else None
        if reused is not None:
            return objective(cfg, reused, hc.sweeper)
        result = trial.run_resolved(resolved, overrides, slot=ray_sweep.board_slot(hc))
    except trial.ConfigError as err:
        for line in err.errors:
            print(f"error: {line}", file=sys.stderr)
        if not multirun:
            sys.exit(exit_codes.BAD_INPUT)
        # in a sweep, a point that cannot run is recorded as infeasible and the sweep goes on
        infeasible = {"status": statuses.INFEASIBLE, "run_id": trial.record_infeasible(cfg, overrides, err.errors)}
        return objective(cfg, infeasible, hc.sweeper)
    _report(result)
    if result["status"] != statuses.FINISHED and not multirun:
        sys.exit(exit_codes.FAILED)
    return objective(cfg, result, hc.sweeper)


class Task:
    """The Hydra task function: :func:`main` for each job. It knows whether a job has started, so
    that :func:`cli` can tell Hydra's own exit 1 (the command line does not compose) from a
    trial's; the Ray launcher runs the jobs in other processes, and calls :meth:`mark_started`
    here once composition is over."""

    def __init__(self) -> None:
        self.started = False

    def mark_started(self) -> None:
        self.started = True

    def __call__(self, cfg: DictConfig):
        self.started = True
        return main(cfg, HydraConfig.get())


def cli() -> None:
    register_configs()
    task = Task()
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(task)()
    except SystemExit as exc:
        # Hydra exits 1 when it cannot compose (unknown key, wrong type, missing preset):
        # that is bad input, before any trial started
        if exc.code == 1 and not task.started:
            raise SystemExit(exit_codes.BAD_INPUT) from None
        raise
