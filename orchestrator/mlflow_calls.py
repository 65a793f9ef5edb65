"""How a record queued by rank 0's reporter (:mod:`orchestrator.mlflow_reporter`) becomes MLflow
calls: step rows as metrics at their own step and time, in batches within MLflow's per-call limit
(:func:`row_batches`); tags, texts, a run's summary metrics and artifacts (:func:`deliver_op`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, List, Tuple

from trainers.reporter import ROW_TIME

log = logging.getLogger("orchestrator")

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit (mlflow.utils.validation.MAX_METRICS_PER_BATCH)


def log_metrics(c: Any, run_id: str, metrics: List[Any]) -> None:
    """``metrics`` through the client ``c`` in as few ``log_batch`` calls as MLflow's limit allows."""
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        c.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])


def row_metrics(row: Dict[str, Any], fallback_ms: int) -> List[Any]:
    """A step row's metrics at its step, timed when the step ended (``ROW_TIME``, else
    ``fallback_ms``); keys starting with ``_`` and values that are not numbers are not metrics."""
    from mlflow.entities import Metric

    t = row.get(ROW_TIME)
    ts = int(float(t) * 1000) if isinstance(t, (int, float)) else fallback_ms
    step = int(row["step"])
    return [
        Metric(k, float(v), ts, step)
        for k, v in row.items()
        if k != "step" and not k.startswith("_") and isinstance(v, (int, float))
    ]


def row_batches(rows: List[Dict[str, Any]], now_ms: int) -> Iterator[Tuple[List[Any], int, int]]:
    """``rows`` as few ``log_batch`` calls' worth of metrics as the limit allows, whole rows per
    batch: (metrics, rows in it, its last step). A single row over the limit is one batch the
    caller splits."""
    chunk: List[Any] = []
    n_rows, last = 0, -1
    for r in rows:
        metrics = row_metrics(r, now_ms)
        if chunk and len(chunk) + len(metrics) > MAX_METRICS_PER_BATCH:
            yield chunk, n_rows, last
            chunk, n_rows = [], 0
        chunk.extend(metrics)
        n_rows, last = n_rows + 1, int(r["step"])
    if chunk:
        yield chunk, n_rows, last


def deliver_op(c: Any, run_id: str, op: Dict[str, Any]) -> None:
    """One queued record other than step rows, through the client ``c``: tags, a text artifact,
    metrics at step 0 (in batches within the limit), a file artifact (one gone is logged, not
    raised: it cannot come back)."""
    from mlflow.entities import Metric, RunTag

    if op["op"] == "tags":
        c.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()])
    elif op["op"] == "text":
        c.log_text(run_id, op["text"], op["path"])
    elif op["op"] == "metrics":
        log_metrics(c, run_id, [Metric(k, float(v), op["time"], 0) for k, v in op["values"].items()])
    elif op["op"] == "artifact":
        if not os.path.exists(op["path"]):
            log.warning("run %s: artifact %s is gone; not logged", run_id, op["path"])
            return
        c.log_artifact(run_id, op["path"], op["folder"] or None)
