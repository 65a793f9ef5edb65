"""A sweep in MLflow: one parent run per multirun, each trial's run nested under it.

:class:`SweepCallback` is a Hydra callback (``hydra.callbacks.sweep`` in ``conf/config.yaml``),
so both launchers get it. At the start of a multirun it creates the parent run: tag ``sweep``
(the sweep id), the sweep's overrides as params and as ``overrides.txt``. Around each job it tells
the trial which sweep it belongs to (the trial tags its run ``sweep`` and ``mlflow.parentRunId``,
see :func:`child_tags`) and afterwards logs the sweep's progress on the parent: metrics
``trials_done``, ``trials_failed``, ``trials_running``. At the end it closes the parent.

A job may run in another process than the sweep (a Ray task): the callback travels there with
Hydra's context, and the trial reads its sweep from that process's environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from typing import Any, Dict, Iterator, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orchestrator import tracking

log = logging.getLogger("orchestrator")
ENV = "ORCHESTRATOR_SWEEP"  # the job's sweep, as JSON: id, parent run id, tracking uri, experiment


def active(hydra_context: Any) -> Optional[Dict[str, str]]:
    """The running multirun's sweep (id, parent run id, uri, experiment), for its sweeper: what
    the :class:`SweepCallback` among ``hydra_context``'s callbacks (the sweeper's and launcher's
    ``hydra_context``) started; None outside a multirun or with tracking disabled."""
    callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", None) or []
    return next((c.sweep for c in callbacks if isinstance(c, SweepCallback)), None)


def discard(sweep_info: Dict[str, Any]) -> None:
    """Delete a sweep's parent run: its sweeper refused the study before anything ran."""
    sweep_info["discarded"] = True
    tracking.client(sweep_info["uri"]).delete_run(sweep_info["parent_run_id"])


@contextlib.contextmanager
def job_env(sweep: Optional[Dict[str, str]]) -> Iterator[None]:
    """Within this block, runs recorded in this process belong to ``sweep`` (see child_tags)."""
    if sweep is None:
        yield
        return
    old = os.environ.get(ENV)
    os.environ[ENV] = json.dumps(sweep)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def child_tags(tracking_cfg: DictConfig) -> Dict[str, str]:
    """Tags that put a trial's run into the sweep of the job running it; {} outside a sweep.
    The run nests under the parent only in the parent's store and experiment."""
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    sweep = json.loads(raw)
    tags = {"sweep": sweep["id"]}
    if tracking.resolve_uri(tracking_cfg) == sweep["uri"] and tracking_cfg.experiment == sweep["experiment"]:
        tags["mlflow.parentRunId"] = sweep["parent_run_id"]
    return tags


def _param_key(override: str) -> str:
    key = override.split("=", 1)[0].lstrip("+~")
    return "sweep." + re.sub(r"[^\w\-. /]", "_", key)


def start_sweep(config: DictConfig) -> Dict[str, str]:
    """Create the sweep's parent run; returns what its jobs need to know of it."""
    from mlflow.entities import Param

    uri = tracking.resolve_uri(config.tracking)
    experiment = str(config.tracking.experiment)
    exp = tracking.experiment_id(uri, experiment, config.tracking.artifact_location)
    sweep_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    hydra = config.hydra
    overrides = [str(o) for o in hydra.overrides.task]
    choices = hydra.runtime.choices
    tags = {
        "sweep": sweep_id,
        "sweep.status": "running",
        "sweep.launcher": str(choices.get("hydra/launcher", "")),
        "sweep.sweeper": str(choices.get("hydra/sweeper", "")),
        "sweep.dir": str(hydra.sweep.dir),
        "mlflow.runName": f"sweep {' '.join(overrides)}"[:250],
    }
    c = tracking.client(uri)
    run = c.create_run(exp, run_name=tags["mlflow.runName"], tags=tags)
    params = {_param_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    params["sweep.overrides"] = " ".join(overrides)
    c.log_batch(run.info.run_id, params=[Param(k[:250], v[:6000]) for k, v in sorted(params.items())])
    c.log_text(run.info.run_id, "\n".join(overrides) + "\n", "overrides.txt")
    log.info("sweep %s: parent run %s", sweep_id, run.info.run_id)
    return {
        "id": sweep_id,
        "parent_run_id": run.info.run_id,
        "uri": uri,
        "experiment": experiment,
        "experiment_id": exp,
    }


def progress(sweep: Dict[str, str]) -> Dict[str, int]:
    """Trials of the sweep so far, by state, counted from their runs (whichever process ran them)."""
    c = tracking.client(sweep["uri"])
    runs = c.search_runs([sweep["experiment_id"]], filter_string=f"tags.sweep = '{sweep['id']}'", max_results=50000)
    statuses = [r.data.tags.get("trial.status", "running") for r in runs if r.info.run_id != sweep["parent_run_id"]]
    return {
        "trials_done": sum(s == tracking.STATUS_OK for s in statuses),
        "trials_failed": sum(s in tracking.FAILED_STATUSES for s in statuses),
        "trials_running": sum(s == "running" for s in statuses),
    }


def log_progress(sweep: Dict[str, str]) -> Dict[str, int]:
    counts = progress(sweep)
    tracking.log_metrics(
        sweep["uri"], sweep["parent_run_id"], counts, step=counts["trials_done"] + counts["trials_failed"]
    )
    return counts


def end_sweep(sweep: Dict[str, str]) -> None:
    counts = log_progress(sweep)
    c = tracking.client(sweep["uri"])
    c.set_tag(sweep["parent_run_id"], "sweep.status", "finished")
    c.set_terminated(sweep["parent_run_id"], "FINISHED")
    log.info("sweep %s: %d finished, %d failed", sweep["id"], counts["trials_done"], counts["trials_failed"])


class SweepCallback(Callback):
    """The parent run of a multirun and the nesting of its trials (see the module docstring)."""

    def __init__(self) -> None:
        self.sweep: Optional[Dict[str, str]] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.tracking.enabled:
            self.sweep = start_sweep(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is not None:
            os.environ[ENV] = json.dumps(self.sweep)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        os.environ.pop(ENV, None)
        if self.sweep is not None:
            try:
                log_progress(self.sweep)
            except Exception as err:  # noqa: BLE001 - progress is bookkeeping: never fail a trial for it
                log.warning("sweep %s: progress not recorded: %s", self.sweep["id"], err)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is not None and not self.sweep.get("discarded"):
            end_sweep(self.sweep)
