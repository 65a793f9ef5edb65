"""Rank 0's reporter (:class:`MlflowReporter`): during a trial it never waits on the store. It
journals every record to a local file, delivers in the background, retries with backoff while the
store is away, and never delivers a step twice; what a worker leaves undelivered, the driver
delivers from the journal (:func:`deliver_journal`)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from orchestrator import mlflow_calls
from orchestrator.mlflow_journal import Journal, journal_head
from orchestrator.mlflow_store import BACKOFF_S, client, first_line, transient
from trainers.reporter import ROW_TIME

log = logging.getLogger("orchestrator")

FINISH_TIMEOUT_S = 60.0  # rank 0 waits this long at the end for the store to take what is queued
LEFTOVER_TIMEOUT_S = 30.0  # the driver's own try with what a worker left undelivered
# a worker's MLflow HTTP client fails fast and leaves retrying to the reporter: by default it
# retries 7 times with backoff and waits 120 s per request (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
# MLFLOW_HTTP_REQUEST_TIMEOUT in mlflow/environment_variables.py, read per request by
# mlflow.utils.rest_utils.http_request); set only in worker processes, and never over a user's
WORKER_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class MlflowReporter:
    """The trainer's reporter on rank 0 (picklable: the client and the delivery thread start in
    the worker). No call waits on the store: each record (a batch of step rows, a table, a tag,
    a file, the summary) is appended to a local journal (``journal``, a JSON-lines file next to the
    trial's output) and queued; a background thread connects (``open``, before the first step)
    and delivers the queue in order, step rows as few ``log_batch`` calls as MLflow's limit allows,
    each metric stamped with the time its step ended.

    While the store is away, delivery is retried with backoff (0.5 s doubling to 5 s) and the
    trial goes on. Nothing is logged twice: step rows at or below the highest step the store holds
    (read again after any failure, and first thing in a worker group restarted from a checkpoint)
    are dropped. ``finish`` waits up to ``finish_timeout_s`` for the queue to drain; what is still
    undelivered then stays in the journal, which a restarted worker group and the driver's end of
    the trial (:func:`deliver_journal`) deliver; a drained journal is deleted."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        total_steps: int,
        progress: Optional[bool] = None,
        journal: Optional[str] = None,
        finish_timeout_s: float = FINISH_TIMEOUT_S,
    ):
        self.uri, self.run_id, self.total_steps = uri, run_id, total_steps
        self.progress = progress
        self.journal = str(journal) if journal else None
        self.finish_timeout_s = finish_timeout_s
        self._owner_pid = os.getpid()  # the driver: a worker's copy sets WORKER_HTTP_ENV
        self._reset()

    _KEEP = ("uri", "run_id", "total_steps", "progress", "journal", "finish_timeout_s", "_owner_pid")

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._bar: Any = None
        self._last: Dict[str, Any] = {}
        self._ops: Deque[Dict[str, Any]] = deque()
        self._seq = 0
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._abandon = threading.Event()
        self._jrnl = Journal(self.journal, self.uri, self.run_id) if self.journal else None
        self._logged_up_to: Optional[int] = None  # highest step in the store; None: not read yet
        self._resync = True  # read it (again) before the next rows: first, and after a failure
        self.failures = 0  # failed delivery attempts in a row
        self.failed_attempts = 0  # in all
        self.rows_delivered = 0

    def __getstate__(self):
        return {k: self.__dict__[k] for k in self._KEEP}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    # -- the trainer's interface (trainers/reporter.py)

    def open(self) -> None:
        """Start the delivery thread: it connects to the store (importing MLflow and opening the
        client take seconds) while the model is built. Takes over what an earlier worker group of
        the trial left undelivered in the journal. Idempotent; any record opens it too."""
        with self._cond:
            if self._thread is not None:
                return
            self._closing = False
            self._abandon = threading.Event()
            self._take_over_journal()
            self._thread = threading.Thread(target=self._deliver_loop, name="mlflow-reporter", daemon=True)
            self._thread.start()

    def on_step(self, step: int, step_time_s: float) -> None:
        if self._thread is None:
            self.open()
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
        now = time.time()
        rows = [{ROW_TIME: now, **r} for r in rows]  # a row without its own time: when it came
        if rows:
            self._last = rows[-1]
            self._put({"op": "rows", "rows": rows})

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        """One JSON artifact per sampled step (not thousands of metric keys)."""
        self._put({"op": "text", "text": json.dumps(rows), "path": f"{name}/step_{step:06d}.json"})

    def log_artifact(self, path: str, folder: str = "") -> None:
        """A file, uploaded now while the store answers (the caller may delete it afterwards, as
        the Ray relay does); else a copy of it joins the queue."""
        if not self.failures and not self._ops:
            try:
                self._mlflow().log_artifact(self.run_id, path, folder or None)
                return
            except Exception as err:  # noqa: BLE001 - queued instead
                log.warning("run %s: artifact %s queued: %s", self.run_id, path, first_line(err))
        self._put({"op": "artifact", "path": self._stage(path), "folder": folder, "staged": True})

    def tag(self, key: str, value: str) -> None:
        """A tag of the trial's run, set from a worker (where rank 0 runs, its restarts)."""
        self._put({"op": "tags", "tags": {key: str(value)}})

    def checkpoint(self, step: int, path: str) -> None:
        """The newest complete checkpoint, by reference (checkpoints of large models do not
        belong in an artifact store)."""
        self._put({"op": "tags", "tags": {"checkpoint.latest": path, "checkpoint.step": str(step)}})

    def finish(self, summary: Dict[str, Any]) -> None:
        """The summary metrics, then wait (``finish_timeout_s`` at most) for the queue to drain."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        values = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
        self._put({"op": "metrics", "values": values, "time": int(time.time() * 1000)})
        self.close(self.finish_timeout_s)

    # -- delivery

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` (default ``finish_timeout_s``) for every queued record to reach
        the store, then stop the thread. True when all did (the journal is deleted); else they stay
        in the journal, and a warning says where."""
        timeout_s = self.finish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ops and self._thread is not None and deadline - time.monotonic() > 0:
                self._cond.wait(deadline - time.monotonic())
            drained, left = not self._ops, len(self._ops)
            self._closing = True
            if not drained:  # under the lock: from here the thread marks nothing delivered (see _done)
                self._abandon.set()
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if not drained:
            log.warning(
                "run %s: %d record(s) not delivered to %s within %.0f s; kept in %s",
                self.run_id,
                left,
                self.uri,
                timeout_s,
                self.journal or "memory (no journal: lost)",
            )
        if thread is not None:
            thread.join(timeout=1.0 if not drained else None)
        with self._cond:
            if self._jrnl is not None:
                self._jrnl.close(delete=drained)
        return drained

    def _mlflow(self):
        with self._client_lock:
            if self._client is None:
                self._client = client(self.uri)
            return self._client

    def _put(self, op: Dict[str, Any]) -> None:
        if self._thread is None:
            self.open()
        with self._cond:
            op["seq"] = self._seq
            self._seq += 1
            self._journal_write(op)
            self._ops.append(op)
            self._cond.notify_all()

    def _deliver_loop(self) -> None:
        if os.getpid() != self._owner_pid:
            for key, value in WORKER_HTTP_ENV.items():
                os.environ.setdefault(key, value)
        self._connect()
        delay = BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._ops and not self._closing:
                    self._cond.wait()
                if not self._ops or self._abandon.is_set():
                    return
                batch = self._head()
            try:
                self._deliver(batch)
            except Exception as err:  # noqa: BLE001 - the store is away: keep, retry later
                if not transient(err):
                    log.warning("run %s: the store refused a record (%s); dropped", self.run_id, first_line(err))
                    self._done(batch)
                    continue
                self.failures += 1
                self.failed_attempts += 1
                self._resync = True
                if self.failures == 1:
                    log.warning(
                        "run %s: the MLflow store %s failed (%s); the trial goes on, records wait in %s",
                        self.run_id,
                        self.uri,
                        first_line(err),
                        self.journal or "memory",
                    )
                if self._abandon.wait(delay):
                    return
                delay = min(2 * delay, BACKOFF_S[1])
                continue
            if self.failures:  # a warning as the failure was: a worker shows only warnings
                log.warning("run %s: the MLflow store is back after %d failed attempt(s)", self.run_id, self.failures)
            self.failures, delay = 0, BACKOFF_S[0]
            self._done(batch)

    def _head(self) -> List[Dict[str, Any]]:
        """The next records to deliver: all step rows at the head of the queue together, else one."""
        if self._ops[0]["op"] != "rows":
            return [self._ops[0]]
        out = []
        for op in self._ops:
            if op["op"] != "rows":
                break
            out.append(op)
        return out

    def _done(self, batch: List[Dict[str, Any]]) -> None:
        """``batch`` delivered: off the queue, marked done in the journal, staged copies deleted.
        Not once ``close`` has given up on the queue: the journal then belongs to whoever takes it
        over next (a restarted group, the driver), which renumbers its records; a late mark of
        this reporter's numbers would drop another record, a deleted copy lose an artifact. At
        worst the batch is delivered twice (rows are kept once per step; tags are overwritten)."""
        with self._cond:
            if self._abandon.is_set():
                return
            for _ in batch:
                self._ops.popleft()
            self._journal_write({"done": [op["seq"] for op in batch]})
            for op in batch:
                if op.get("staged"):
                    Journal.unstage(op["path"])
            self._cond.notify_all()

    def _read_logged_up_to(self, c: Any) -> None:
        """The highest step the store holds (delivery thread only)."""
        stored = max((m.step for m in c.get_metric_history(self.run_id, "loss")), default=-1)
        self._logged_up_to = max(stored, -1 if self._logged_up_to is None else self._logged_up_to)
        self._resync = False

    def _connect(self) -> None:
        """Import MLflow, open the client and read what the store holds, before the first record
        comes (``open`` is called before the model is built): done at the first delivery instead,
        these seconds of the Python interpreter's time land in a timed step of rank 0. A store
        that does not answer now is tried again by the first delivery."""
        try:
            self._read_logged_up_to(self._mlflow())
        except Exception as err:  # noqa: BLE001 - the first delivery retries, with backoff
            self._resync = True
            log.debug("run %s: the store did not answer yet (%s)", self.run_id, first_line(err))

    def _deliver(self, batch: List[Dict[str, Any]]) -> None:
        c = self._mlflow()
        if batch[0]["op"] == "rows":
            self._deliver_rows(c, [r for o in batch for r in o["rows"]])
        else:
            mlflow_calls.deliver_op(c, self.run_id, batch[0])

    def _deliver_rows(self, c: Any, rows: List[Dict[str, Any]]) -> None:
        """Rows in step order, each step once: none at or below the highest step of ``loss`` in the
        store (one ``log_batch`` is one transaction in MLflow's SQL store, so a failed call leaves
        nothing of itself; the store is read again after any failure); then in as few calls as
        MLflow's per-call limit allows, whole rows per call."""
        if self._resync or self._logged_up_to is None:
            self._read_logged_up_to(c)
        top, kept = self._logged_up_to, []
        for r in rows:  # in the order they came: a step re-run after a restart keeps its first value
            if int(r["step"]) > top:
                kept.append(r)
                top = int(r["step"])
        for metrics, n_rows, last in mlflow_calls.row_batches(kept, int(time.time() * 1000)):
            mlflow_calls.log_metrics(c, self.run_id, metrics)  # one row above the limit: split
            self._logged_up_to = last
            self.rows_delivered += n_rows

    # -- the journal (orchestrator/mlflow_journal.py), under the lock

    def _journal_write(self, entry: Dict[str, Any]) -> None:
        """Append one entry: a record, or the sequence numbers delivered."""
        if self._jrnl is None:
            return
        try:
            self._jrnl.write(entry)
        except OSError as err:
            self._lose_journal(err)

    def _lose_journal(self, err: OSError) -> None:
        log.warning("run %s: journal %s unusable (%s); records kept in memory only", self.run_id, self.journal, err)
        self.journal, self._jrnl = None, None

    def _take_over_journal(self) -> None:
        """Queue first what the journal holds undelivered (an earlier process of this trial died
        or gave up), numbered from this reporter's next sequence number."""
        if self._jrnl is None:
            return
        try:
            pending = self._jrnl.take_over(self._seq)
        except OSError as err:
            self._lose_journal(err)
            return
        if pending:
            log.info("run %s: %d undelivered record(s) taken over from %s", self.run_id, len(pending), self.journal)
            self._seq += len(pending)
            self._ops.extendleft(reversed(pending))

    def _stage(self, path: str) -> str:
        """A copy of ``path`` beside the journal until it is delivered (the caller may delete
        ``path``); without a journal, ``path`` itself."""
        if self._jrnl is None:
            return path
        try:
            return self._jrnl.stage(path, self._seq)
        except OSError as err:
            self._lose_journal(err)
            return path


def deliver_journal(path: str, timeout_s: float = LEFTOVER_TIMEOUT_S) -> bool:
    """Deliver what a reporter's journal holds undelivered (its store and run are in its first
    line), waiting up to ``timeout_s``; True when nothing is left (the journal is then deleted)."""
    head = journal_head(path)
    if head is None:
        return True
    reporter = MlflowReporter(head["uri"], head["run_id"], 0, progress=False, journal=path)
    reporter.open()
    return reporter.close(timeout_s)
