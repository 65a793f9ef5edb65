"""Tracking from any node: a trial's records reach the sweep's MLflow store wherever rank 0 runs.

On a Ray cluster, rank 0 of a trial may land on any node, and nodes share no working directory.
A tracking URI that only the driver's node can reach (the default ``sqlite:///`` file, a
``file:`` store, any path) is therefore written by the driver's node alone: the trial's
reporter becomes a Ray actor pinned to the node that launched the trial, and rank 0 gets a
:class:`RelayReporter` that hands it each batch of rows, each table and each artifact's bytes.
The actor writes them with the trial's own :class:`orchestrator.mlflow_reporter.MlflowReporter`, so
batching, the one-value-per-step rule after a restart and the checkpoint tags are the same on
every path. A tracking server (``http(s)://``, ``databricks``) is reachable from every node:
rank 0 logs to it directly, as on one node.

Why an actor rather than an ``mlflow server`` started on the head node: it needs no port open
between nodes beyond Ray's own, no server process to start, watch and stop per sweep, and it
keeps sqlite's single writer on the node that owns the file; the per-step traffic is one call
per ``trainer.log_every`` steps.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

# stores every node reaches over the network; anything else is a file on the driver's node
SERVER_SCHEMES = ("http", "https", "databricks")


def needs_relay(uri: str) -> bool:
    """Whether only the driver's node can write to the store at ``uri``."""
    scheme = urlparse(uri).scheme.lower() or uri.split(":", 1)[0].lower()  # "databricks" has no "://"
    return scheme not in SERVER_SCHEMES


class _Relay:
    """The Ray actor on the driver's node: the trial's reporter, fed from rank 0 on any node."""

    def __init__(self, reporter: Any):
        self.reporter = reporter
        self.reporter.progress = False  # an actor has no terminal; the driver shows the sweep

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        self.reporter.log_steps(rows)

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        self.reporter.log_table(step, name, rows)

    def log_file(self, name: str, data: bytes, folder: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(data)
            self.reporter.log_artifact(path, folder)

    def checkpoint(self, step: int, path: str) -> None:
        self.reporter.checkpoint(step, path)

    def tag(self, key: str, value: str) -> None:
        self.reporter.tag(key, value)

    def finish(self, summary: Dict[str, Any]) -> None:
        self.reporter.finish(summary)


class RelayReporter:
    """Rank 0's reporter when the store is on the driver's node: every call goes to the relay
    actor and waits for it, so a record is in the relay's journal and delivery queue when the call
    returns (a checkpoint's tag before the next step); ``finish`` waits for the queue to reach the
    store (see :class:`orchestrator.mlflow_reporter.MlflowReporter`). Picklable (an actor handle)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any) -> None:
        import ray

        ray.get(getattr(self.actor, method).remote(*args))

    def on_step(self, step: int, step_time_s: float) -> None:
        pass

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        self._call("log_steps", rows)

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        self._call("log_table", step, name, rows)

    def log_artifact(self, path: str, folder: str = "") -> None:
        with open(path, "rb") as f:
            self._call("log_file", os.path.basename(path), f.read(), folder)

    def checkpoint(self, step: int, path: str) -> None:
        self._call("checkpoint", step, path)

    def tag(self, key: str, value: str) -> None:
        self._call("tag", key, value)

    def finish(self, summary: Dict[str, Any]) -> None:
        self._call("finish", summary)


def for_workers(reporter: Optional[Any]) -> Optional[Any]:
    """What the trial's workers get as their reporter: ``reporter`` itself when every node can
    reach its store, else a :class:`RelayReporter` to an actor on this node (call inside a
    connected Ray driver or task). None stays None (tracking disabled)."""
    if reporter is None or not needs_relay(reporter.uri):
        return reporter
    return RelayReporter(on_this_node(_Relay, reporter))


def on_this_node(cls: type, *args: Any, **options: Any) -> Any:
    """An actor of ``cls`` on the node of the calling driver or task, holding no resources: the
    trial's bookkeeping lives and dies with the process that launched it, never on a worker node
    that may be lost (call inside a connected Ray driver or task)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(here, soft=False)
    return ray.remote(num_cpus=0, max_restarts=0)(cls).options(scheduling_strategy=strategy, **options).remote(*args)
