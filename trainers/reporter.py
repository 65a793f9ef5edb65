"""The one interface through which a worker's metrics leave the trainer.

The trainer never imports MLflow, Ray or Hydra: the control plane hands it an object with these
methods (picklable, so it crosses into spawned worker processes), and rank 0 calls them.

A step row is a dict of metrics with its ``step``; keys that start with ``_`` are not metrics:
``_time`` (:data:`ROW_TIME`) is the wall-clock time the step ended (seconds since the epoch), the
time its metrics are recorded at however late they are delivered.
"""

from __future__ import annotations

from typing import Any, Dict, List, Protocol

ROW_TIME = "_time"


class Reporter(Protocol):
    def open(self) -> None:
        """Optional: called once on rank 0 before the model is built, so that a reporter can
        connect to its store meanwhile (the loop calls it where present)."""

    def on_step(self, step: int, step_time_s: float) -> None:
        """Called every step, cheaply (a progress bar); no metric is stored here."""

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        """A batch of per-step metric rows, each with its ``step``."""

    def checkpoint(self, step: int, path: str) -> None:
        """A complete checkpoint of ``step`` steps now sits at ``path``."""

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        """A table of rows for one step (per-layer statistics), kept as one artifact."""

    def log_artifact(self, path: str, folder: str = "") -> None:
        """A file the trial produced (a profiler trace)."""

    def finish(self, summary: Dict[str, Any]) -> None:
        """Summary metrics of the trial, once, after the last step."""


class NullReporter:
    def open(self) -> None:
        pass

    def on_step(self, step: int, step_time_s: float) -> None:
        pass

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        pass

    def log_artifact(self, path: str, folder: str = "") -> None:
        pass

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        pass

    def finish(self, summary: Dict[str, Any]) -> None:
        pass
