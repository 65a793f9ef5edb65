"""The points of an OVAT study: each composed and checked as a trial would be (an infeasible one is
recorded and never launched), measured through the configured launcher, and read back from MLflow
by config hash (so a re-run reuses what finished)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, open_dict

from orchestrator import effects, results, statuses, sweep_parent, tags, trial
from orchestrator.filled import fill
from orchestrator.results import Point
from sweeps.ovat_spec import Study

log = logging.getLogger("orchestrator")


class Runner:
    """Points of a study: planned (pruned when infeasible), measured through the launcher, read
    back from MLflow by config hash."""

    def __init__(self, sweeper: Any, study: Study, info: Dict[str, str]):
        self.sweeper, self.study, self.info = sweeper, study, info
        self.uri, self.experiment = info["uri"], info["experiment"]
        self.points: Dict[Tuple[Tuple[str, str], ...], Point] = {}
        self.by_hash: Dict[str, Point] = {}
        self.job_idx = 0
        self.returns: List[Any] = []
        self.launched = self.reused = self.pruned = 0

    def compose(self, overrides: List[str]) -> DictConfig:
        cfg = self.sweeper.hydra_context.config_loader.load_sweep_config(self.sweeper.config, list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def point(self, assignment: Dict[str, str]) -> Point:
        key = tuple(assignment.items())
        if key in self.points:
            return self.points[key]
        overrides = self.study.overrides(assignment)
        cfg = self.compose(overrides)
        plan = trial.check(cfg)
        known = self.by_hash.get(plan["config_hash"])
        if known is not None:  # another spelling of a config already in the study
            self.points[key] = known
            return known
        p = Point(plan["config_hash"], overrides)
        p.labels = dict(assignment)
        p.predicted_step_s = ((plan.get("preflight") or {}).get("step") or {}).get("step_time_s")
        if plan["status"] != "ready":
            # recorded in the sweep, never launched
            p.status, p.reason = plan["status"], "; ".join(plan["reasons"])
            with sweep_parent.job_env(self.info):
                run_id = trial.record_infeasible(cfg, overrides, plan["reasons"], plan["status"], plan["preflight"])
            p.run_ids = [run_id]
            self.pruned += 1
            log.info("ovat: %s pruned (%s): %s", _label(assignment), p.status, p.reason)
        self.points[key] = self.by_hash[p.config_hash] = p
        return p

    def no_effect(self, current: Dict[str, str], key: str) -> Optional[str]:
        """Why every candidate of ``key``, with the other variables at ``current``, would run the
        same trial (the shared layout rules say the key is inert there), or None."""
        cfgs = []
        for v in self.study.variables[key]:
            cfg = self.compose(self.study.overrides({**current, key: v}))
            fill(cfg)  # a folder that does not read fails the trial itself, with its reason
            cfgs.append(cfg)
        return effects.no_effect(cfgs, key)

    def _finished(self, p: Point) -> List[Any]:
        wanted = {tags.CONFIG_HASH: p.config_hash, tags.TRIAL_STATUS: statuses.FINISHED}
        if not self.study.resume:
            wanted[tags.SWEEP] = self.info["id"]
        return results.search(self.uri, self.experiment, results.tag_filter(wanted))

    def _refresh(self, p: Point) -> int:
        """Fill the point from MLflow; returns how many repeats are still missing."""
        runs = self._finished(p)
        usable = [r for r in runs if results.value(r, self.study.objective) is not None]
        p.fill(self.uri, usable[: self._repeats(p)], self.study.objective)
        if runs and not usable:
            p.status, p.reason = statuses.FAILED, f"objective {self.study.objective} is not logged by its runs"
            return 0
        return self._repeats(p) - len(p.run_ids)

    def _repeats(self, p: Point) -> int:
        return p.repeats or self.study.repeats

    def _unfinished(self, p: Point) -> bool:
        return p.status == statuses.PENDING or (p.status == statuses.FINISHED and len(p.run_ids) < self._repeats(p))

    def measure(self, points: Sequence[Point]) -> None:
        """Finish every pending point, and every finished one asked for more runs than it has
        (``Point.repeats``): reuse finished runs, launch the missing repeats in one batch
        (interleaved, so drift spreads over all candidates), read the results back."""
        todo = [p for p in OrderedDict((id(p), p) for p in points).values() if self._unfinished(p)]
        need: Dict[int, int] = {}
        for p in todo:
            missing = self._refresh(p)
            self.reused += len(p.run_ids)
            if missing > 0:
                need[id(p)] = missing
            elif p.status == statuses.FINISHED:
                log.info(
                    "ovat: %s already measured in MLflow (%d runs), not run again", _label(p.labels), len(p.run_ids)
                )
        batch: List[List[str]] = []
        owners: List[Point] = []
        for r in range(max((self._repeats(p) for p in todo), default=0)):
            for p in todo:
                if need.get(id(p), 0) > r:
                    batch.append(list(p.overrides))
                    owners.append(p)
        if not batch:
            return
        log.info("ovat: launching %d trial(s)", len(batch))
        rets = self.sweeper.launcher.launch(batch, initial_job_idx=self.job_idx)
        self.job_idx += len(batch)
        self.launched += len(batch)
        self.returns.append(rets)
        errors = {id(p): err for p, err in ((p, _job_error(ret)) for p, ret in zip(owners, rets)) if err}
        for p in todo:
            if id(p) in need and self._refresh(p) > 0:
                self._fail(p, errors.get(id(p)))

    def _fail(self, p: Point, job_error: Optional[str]) -> None:
        runs = results.search(
            self.uri,
            self.experiment,
            results.tag_filter({tags.CONFIG_HASH: p.config_hash, tags.SWEEP: self.info["id"]}),
        )
        failed = [r for r in runs if results.status(r) != statuses.FINISHED]
        if failed:
            p.status = results.status(failed[0])
            p.reason = failed[0].data.tags.get(tags.TRIAL_REASON, "")
        else:
            p.status, p.reason = statuses.CRASH, job_error or "no finished run came back"
        if p.run_ids:
            p.reason = f"{len(p.run_ids)} of {self._repeats(p)} repeats finished; {p.reason}"
        p.run_ids = [r.info.run_id for r in failed] or p.run_ids

    def trial_seconds(self) -> float:
        return results.run_seconds(
            results.search(self.uri, self.experiment, results.tag_filter({tags.SWEEP: self.info["id"]}))
        )


def _job_error(ret: Any) -> Optional[str]:
    from hydra.core.utils import JobStatus

    if getattr(ret, "status", None) == JobStatus.FAILED:
        err = getattr(ret, "_return_value", None)
        return f"the job failed: {type(err).__name__}: {err}".splitlines()[0]
    return None


def _label(assignment: Dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in assignment.items())
