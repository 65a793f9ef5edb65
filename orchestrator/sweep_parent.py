"""A sweep in MLflow: one parent run per multirun, each trial's run nested under it.

:class:`SweepCallback` is a Hydra callback (``hydra.callbacks.sweep`` in ``conf/config.yaml``),
so both launchers get it. At the start of a multirun it creates the parent run: tag ``sweep``
(the sweep id), the sweep's overrides as params and as ``overrides.txt``, a description with the
command that runs the sweep again (at its end, the counts of its trials). A store that cannot be
used stops the multirun before anything runs (one line naming ``tracking.uri``). Around each job it tells
the trial which sweep it belongs to (the trial tags its run ``sweep`` and ``mlflow.parentRunId``,
see :func:`child_tags`) and afterwards logs the sweep's progress on the parent: metrics
``trials_done``, ``trials_failed``, ``trials_running``, ``trials_reused``. At the end it closes
the parent.

The parent always ends. Hydra calls no callback when a sweep raises, so the callback also closes
it when the driver's process exits without ``on_multirun_end`` (an ``atexit`` hook it holds while
the sweep runs): KILLED with ``sweep.status=killed`` after an interrupt (Ctrl-C, or a SIGTERM,
which the callback turns into one unless something else handles SIGTERM: a local Ray cluster
stops itself on it and exits 1, which reads as a crash), FAILED with ``sweep.status=failed`` and
``sweep.reason`` otherwise; trials of the sweep still RUNNING then (a Ray job cancelled under its
trial) end killed or crash.

A re-run sweep skips the points already finished: a job whose config hash has a finished run in
its experiment is not launched (:func:`finished_run`, ``tracking.skip_finished``); the parent
records the run it reused (tag ``sweep.reused.<job number>``). A sweeper that resumes by itself
and launches one config several times on purpose (``hydra/sweeper=ovat``'s repeats) turns this
off for its jobs with :func:`sweeper_resumes`.

A job may run in another process than the sweep (a Ray task): the callback travels there with
Hydra's context, and the trial reads its sweep from that process's environment.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from typing import Any, Dict, Iterator, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from orchestrator import exit_codes, mlflow_store, mlflow_ui, statuses, tags, tracking

log = logging.getLogger("orchestrator")
ENV = "ORCHESTRATOR_SWEEP"  # the job's sweep, as JSON: id, parent run id, tracking uri, experiment


def active(hydra_context: Any) -> Optional[Dict[str, str]]:
    """The running multirun's sweep (id, parent run id, uri, experiment), for its sweeper: what
    the :class:`SweepCallback` among ``hydra_context``'s callbacks (the sweeper's and launcher's
    ``hydra_context``) started; None outside a multirun or with tracking disabled."""
    callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", None) or []
    return next((c.sweep for c in callbacks if isinstance(c, SweepCallback)), None)


def sweeper_resumes(sweep_info: Dict[str, Any]) -> None:
    """The sweeper of ``sweep_info`` reuses finished runs itself and may launch one config several
    times on purpose (repeats): its jobs launch what they are given, never skipping a finished hash.
    Call it before the first launch (the Ray launcher ships the sweep to its jobs then)."""
    sweep_info["skip_finished"] = False


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


def current() -> Optional[Dict[str, Any]]:
    """The sweep of the job running in this process (see :func:`job_env`); None outside a sweep."""
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def child_tags(tracking_cfg: DictConfig) -> Dict[str, str]:
    """Tags that put a trial's run into the sweep of the job running it; {} outside a sweep.
    The run nests under the parent only in the parent's store and experiment."""
    sweep = current()
    if sweep is None:
        return {}
    out = {tags.SWEEP: sweep["id"]}
    if tracking.resolve_uri(tracking_cfg) == sweep["uri"] and tracking_cfg.experiment == sweep["experiment"]:
        out[tags.PARENT_RUN] = sweep["parent_run_id"]
    return out


def skips_finished(tracking_cfg: DictConfig) -> bool:
    """Does the job running in this process skip a point already finished? In a sweep, with
    tracking on, ``tracking.skip_finished`` and a sweeper that does not resume by itself."""
    sweep = current()
    return (
        sweep is not None
        and bool(sweep.get("skip_finished", True))
        and bool(tracking_cfg.enabled)
        and bool(tracking_cfg.skip_finished)
    )


def finished_run(tracking_cfg: DictConfig, config_hash: str) -> Optional[Any]:
    """The newest run of the job's experiment that finished ``config_hash`` (MLflow status
    FINISHED, ``trial.status=finished``), or None."""
    uri = tracking.resolve_uri(tracking_cfg)
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(str(tracking_cfg.experiment))
    if exp is None:
        return None
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string=(
            f"tags.`{tags.CONFIG_HASH}` = '{config_hash}' and tags.`{tags.TRIAL_STATUS}` = '{statuses.FINISHED}' "
            "and attributes.status = 'FINISHED'"
        ),
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0] if runs else None


def record_reused(job_num: int, run_id: str) -> None:
    """Note on the sweep's parent run that job ``job_num`` reused the finished run ``run_id``
    (one tag per job: jobs running at once never overwrite each other's)."""
    sweep = current()
    if sweep is not None:
        tracking.client(sweep["uri"]).set_tag(sweep["parent_run_id"], f"{tags.REUSED}{job_num}", run_id)


def _param_key(override: str) -> str:
    key = override.split("=", 1)[0].lstrip("+~")
    return "sweep." + re.sub(r"[^\w\-. /]", "_", key)


def start_sweep(config: DictConfig) -> Dict[str, str]:
    """Create the sweep's parent run; returns what its jobs need to know of it."""
    from mlflow.entities import Param

    uri = mlflow_store.check_store(config.tracking)
    experiment = str(config.tracking.experiment)
    exp = tracking.experiment_id(uri, experiment, config.tracking.artifact_location)
    sweep_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    hydra = config.hydra
    overrides = [str(o) for o in hydra.overrides.task]
    choices = hydra.runtime.choices
    name = f"sweep {' '.join(overrides)}"[:250]
    run_tags = {
        tags.SWEEP: sweep_id,
        tags.SWEEP_STATUS: statuses.RUNNING,
        tags.SWEEP_LAUNCHER: str(choices.get("hydra/launcher", "")),
        tags.SWEEP_SWEEPER: str(choices.get("hydra/sweeper", "")),
        tags.SWEEP_DIR: str(hydra.sweep.dir),
        tags.RUN_NAME: name,
        tags.NOTE: tracking.run_note(overrides, f"sweep {sweep_id}", multirun=True)[: tracking.MAX_TAG_VALUE],
        **tracking.source_tags(),
    }
    c = tracking.client(uri)
    run = c.create_run(exp, run_name=name, tags=run_tags)
    params = {_param_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    params[tags.SWEEP_OVERRIDES] = " ".join(overrides)
    c.log_batch(run.info.run_id, params=[Param(k[:250], v[:6000]) for k, v in sorted(params.items())])
    c.log_text(run.info.run_id, "\n".join(overrides) + "\n", "overrides.txt")
    log.info("sweep %s: parent run %s", sweep_id, run.info.run_id)
    return {
        "id": sweep_id,
        "parent_run_id": run.info.run_id,
        "uri": uri,
        "experiment": experiment,
        "experiment_id": exp,
        "skip_finished": True,  # its jobs may skip finished points (see sweeper_resumes)
    }


def _trial_runs(sweep: Dict[str, Any]) -> list:
    c = tracking.client(sweep["uri"])
    runs = c.search_runs(
        [sweep["experiment_id"]], filter_string=f"tags.`{tags.SWEEP}` = '{sweep['id']}'", max_results=50000
    )
    return [r for r in runs if r.info.run_id != sweep["parent_run_id"]]


def progress(sweep: Dict[str, Any]) -> Dict[str, int]:
    """Trials of the sweep so far, by state, counted from their runs (whichever process ran them),
    and the points its jobs did not launch because they had finished before (``trials_reused``)."""
    told = [r.data.tags.get(tags.TRIAL_STATUS, statuses.RUNNING) for r in _trial_runs(sweep)]
    parent_tags = tracking.client(sweep["uri"]).get_run(sweep["parent_run_id"]).data.tags
    return {
        "trials_done": sum(s == statuses.FINISHED for s in told),
        "trials_failed": sum(s in statuses.TRIAL_FAILED for s in told),
        "trials_running": sum(s == statuses.RUNNING for s in told),
        "trials_reused": sum(k.startswith(tags.REUSED) for k in parent_tags),
    }


def log_progress(sweep: Dict[str, Any]) -> Dict[str, int]:
    counts = progress(sweep)
    step = counts["trials_done"] + counts["trials_failed"] + counts["trials_reused"]
    tracking.log_metrics(sweep["uri"], sweep["parent_run_id"], counts, step=step)
    return counts


def end_sweep(sweep: Dict[str, Any], status: str = statuses.FINISHED, reason: str = "") -> None:
    """Close the parent run: ``status`` finished, failed (the driver crashed: ``reason``) or killed
    (interrupted). A sweep that did not finish first ends its trials still RUNNING (their job was
    cancelled or died with the driver): killed after an interrupt, else crash."""
    c = tracking.client(sweep["uri"])
    if status != statuses.FINISHED:
        trial_status = statuses.KILLED if status == statuses.KILLED else statuses.CRASH
        ended = (statuses.FINISHED, *statuses.TRIAL_FAILED)
        for r in _trial_runs(sweep):
            if r.info.status != "RUNNING":
                continue
            told = r.data.tags.get(tags.TRIAL_STATUS)
            if told in ended:
                # its end was cut between its tags and its run status (tracking.end_run writes
                # both; an interrupt can land between): what it ended as stands, its status follows
                c.set_terminated(r.info.run_id, statuses.run_status(told))
            else:
                tracking.end_run(sweep["uri"], r.info.run_id, trial_status, f"the sweep's driver ended: {reason}")
    counts = log_progress(sweep)
    reused = f", {counts['trials_reused']} reused (finished before)" if counts["trials_reused"] else ""
    line = f"sweep {sweep['id']}: {counts['trials_done']} finished, {counts['trials_failed']} failed{reused}"
    parent = sweep["parent_run_id"]

    def _end() -> None:
        from mlflow.entities import RunTag

        note = c.get_run(parent).data.tags.get(tags.NOTE, "")
        result = f"**{status}**: {line.split(': ', 1)[1]}" + (f"\n\n{reason}" if reason else "")
        ended = {tags.SWEEP_STATUS: status, tags.NOTE: tracking.with_result(note, result)}
        if reason:
            ended[tags.SWEEP_REASON] = reason[:5000]
        c.log_batch(parent, tags=[RunTag(k, v) for k, v in ended.items()])
        c.set_terminated(parent, statuses.run_status(status))

    mlflow_store.retrying(_end, f"sweep {sweep['id']}: its end")
    if status == statuses.FINISHED:
        log.info(line)
    else:
        log.warning("%s; %s: %s", line, status, reason)
    mlflow_ui.show_ui(sweep["uri"], parent, sweep["experiment_id"])


def _last_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}".rstrip(": ")


class SweepCallback(Callback):
    """The parent run of a multirun and the nesting of its trials (see the module docstring)."""

    def __init__(self) -> None:
        self.sweep: Optional[Dict[str, Any]] = None
        self.pid: Optional[int] = None  # the driver's process, where the parent is closed
        self.job_error: Optional[str] = None  # the last job that raised (Hydra's basic sweeper re-raises it)
        self.terminated: Optional[str] = None  # the signal that stopped the driver, if one did
        self._sigterm: Any = None  # the driver's SIGTERM handler before the sweep

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.tracking.enabled:
            try:
                self.sweep = start_sweep(config)
            except mlflow_store.StoreUnreachable as err:
                # Hydra turns a callback's exception into a warning and launches the jobs anyway:
                # stop as a broken config stops (one error line, exit code 2, nothing launched)
                print(f"error: {err}", file=sys.stderr)
                raise SystemExit(exit_codes.BAD_INPUT) from None
            self.pid = os.getpid()
            atexit.register(self._driver_exits)
            if threading.current_thread() is threading.main_thread():
                # a SIGTERM ends the driver as Ctrl-C does (with the default handler, no exit
                # hook would run); a local Ray cluster installs its own later
                if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                    self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = signal.Signals(signum).name
        raise KeyboardInterrupt(self.terminated)

    def _restore_signals(self) -> None:
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def abandon(self, err: Optional[BaseException]) -> None:
        """Close the parent run of a sweep that ends without ``on_multirun_end``: KILLED when
        ``err`` (what ended the driver, None when unknown) is an interrupt, FAILED otherwise."""
        self._restore_signals()
        if self.sweep is None or self.sweep.get("discarded") or self.sweep.get("ended"):
            return
        self.sweep["ended"] = True
        if isinstance(err, KeyboardInterrupt) or self.terminated:
            status, reason = statuses.KILLED, f"interrupted ({self.terminated or 'KeyboardInterrupt'})"
        else:
            status = statuses.FAILED
            reason = _last_line(err) if err is not None else (self.job_error or "the driver exited")
        end_sweep(self.sweep, status, reason)

    def _driver_exits(self) -> None:
        # an exit hook: an uncaught exception is sys.last_value by now (Hydra reports the others
        # and exits 1, which reads as a crash)
        if os.getpid() != self.pid:
            return
        try:
            self.abandon(getattr(sys, "last_value", None))
        except Exception as err:  # noqa: BLE001 - the process is exiting: say so, do not mask its error
            log.warning("sweep %s: parent run not closed: %s", (self.sweep or {}).get("id"), err)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep is not None:
            os.environ[ENV] = json.dumps(self.sweep)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        os.environ.pop(ENV, None)
        if getattr(job_return, "status", None) == JobStatus.FAILED:
            self.job_error = _last_line(job_return._return_value)
        if self.sweep is not None:
            try:
                log_progress(self.sweep)
            except Exception as err:  # noqa: BLE001 - progress is bookkeeping: never fail a trial for it
                log.warning("sweep %s: progress not recorded: %s", self.sweep["id"], err)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._restore_signals()
        if self.sweep is not None and not self.sweep.get("discarded") and not self.sweep.get("ended"):
            end_sweep(self.sweep)
            self.sweep["ended"] = True
        atexit.unregister(self._driver_exits)
