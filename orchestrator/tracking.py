"""MLflow: one run per trial, its resolved config, per-step metrics in batches, status tags.

The tracking URI is ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite file in the
working directory (``sqlite:///mlruns.db``) whose experiments keep their artifacts in
``./mlartifacts`` beside it. MLflow is imported lazily: composing or validating a config never
touches it, so a rejected config leaves no run behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

# sections that define what a trial computes; tracking and launch details do not change it
HASHED_SECTIONS = ("chip", "parallel", "precision", "comm", "model", "data", "trainer")
STATUS_OK = "finished"
STATUS_KILLED = "killed"  # the driver was interrupted (Ctrl-C, SIGTERM) while the trial ran
FAILED_STATUSES = ("infeasible", "oom", "nonfinite", "timeout", "crash", "node_lost", "unsupported_op", STATUS_KILLED)
# MLflow's own run status for a trial status: KILLED for an interrupt, FAILED for any other failure
RUN_STATUS = {STATUS_OK: "FINISHED", STATUS_KILLED: "KILLED"}


def resolve_uri(tracking: DictConfig | Dict[str, Any]) -> str:
    uri = tracking.get("uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    return "sqlite:///" + str(Path("mlruns.db").resolve())


def default_artifact_location(uri: str) -> Optional[str]:
    """``mlartifacts/`` next to a sqlite file; servers and file stores choose their own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").resolve().as_uri()
    return None


def config_hash(cfg: DictConfig) -> str:
    body = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in HASHED_SECTIONS if cfg.get(k) is not None}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(uri: str, name: str, artifact_location: Optional[str] = None) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name, artifact_location=artifact_location or default_artifact_location(uri))
    except Exception:  # another process created it first
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def start_run(cfg: DictConfig, overrides: Iterable[str], tags: Dict[str, str]) -> tuple[str, str]:
    """Create the trial's run with params, tags and config artifacts; return (uri, run_id)."""
    from mlflow.entities import Param

    uri = resolve_uri(cfg.tracking)
    exp = experiment_id(uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
    c = client(uri)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    chash = config_hash(cfg)
    overrides = list(overrides)
    name = " ".join(overrides) or "default"
    all_tags = {"trial.status": "running", "trial.config_hash": chash, "mlflow.runName": name[:250], **tags}
    run = c.create_run(exp, run_name=name[:250], tags=all_tags)
    rid = run.info.run_id
    params = flatten(resolved)
    params["config_hash"] = chash
    items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(rid, params=items[i : i + 100])
    c.log_text(rid, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
    c.log_text(rid, "\n".join(overrides) + "\n", "overrides.txt")
    return uri, rid


def log_metrics(uri: str, run_id: str, values: Dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
    if metrics:
        client(uri).log_batch(run_id, metrics=metrics)


def end_run(uri: str, run_id: str, status: str, reason: str = "") -> None:
    c = client(uri)
    c.set_tag(run_id, "trial.status", status)
    if reason:
        c.set_tag(run_id, "trial.reason", reason[:5000])
    c.set_terminated(run_id, RUN_STATUS.get(status, "FAILED"))


class MlflowReporter:
    """The trainer's reporter on rank 0: per-step rows go to MLflow in batches (one
    ``log_batch`` call per flush, not one call per metric), and a progress bar runs when
    stderr is a terminal. Picklable: the client is created inside the worker."""

    def __init__(self, uri: str, run_id: str, total_steps: int, progress: Optional[bool] = None):
        self.uri, self.run_id, self.total_steps = uri, run_id, total_steps
        self.progress = progress
        self._client = None
        self._bar = None
        self._last: Dict[str, Any] = {}
        self._logged_up_to: Optional[int] = None  # highest step already in MLflow (a resume)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_client"], state["_bar"], state["_logged_up_to"] = None, None, None
        return state

    def _mlflow(self):
        if self._client is None:
            self._client = client(self.uri)
        return self._client

    def on_step(self, step: int, step_time_s: float) -> None:
        show = sys.stderr.isatty() if self.progress is None else self.progress
        if not show:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, unit="step", dynamic_ncols=True, file=sys.stderr)
        self._bar.update(1)
        post = {"step_s": f"{step_time_s:.3f}"}
        if "loss" in self._last:
            post["loss"] = f"{self._last['loss']:.4f}"
        self._bar.set_postfix(post, refresh=False)

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        if self._logged_up_to is None:
            # a worker group restarted from a checkpoint recomputes steps that were already
            # logged before the crash: keep exactly one value per step
            history = self._mlflow().get_metric_history(self.run_id, "loss")
            self._logged_up_to = max((m.step for m in history), default=-1)
        rows = [r for r in rows if int(r["step"]) > self._logged_up_to]
        now = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now, int(r["step"]))
            for r in rows
            for k, v in r.items()
            if k != "step" and v is not None
        ]
        for i in range(0, len(metrics), 1000):  # MLflow's per-call limit
            self._mlflow().log_batch(self.run_id, metrics=metrics[i : i + 1000])
        if rows:
            self._last = rows[-1]
            self._logged_up_to = int(rows[-1]["step"])

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        """One JSON artifact per sampled step (not thousands of metric keys)."""
        self._mlflow().log_text(self.run_id, json.dumps(rows), f"{name}/step_{step:06d}.json")

    def log_artifact(self, path: str, folder: str = "") -> None:
        self._mlflow().log_artifact(self.run_id, path, folder or None)

    def tag(self, key: str, value: str) -> None:
        """A tag of the trial's run, set from a worker (where rank 0 runs, its restarts)."""
        self._mlflow().set_tag(self.run_id, key, value)

    def checkpoint(self, step: int, path: str) -> None:
        """The newest complete checkpoint, by reference (checkpoints of large models do not
        belong in an artifact store)."""
        self._mlflow().set_tag(self.run_id, "checkpoint.latest", path)
        self._mlflow().set_tag(self.run_id, "checkpoint.step", str(step))

    def finish(self, summary: Dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        log_metrics(self.uri, self.run_id, {k: v for k, v in summary.items() if isinstance(v, (int, float))})
