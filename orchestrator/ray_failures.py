"""Why a trial on Ray failed, in one line: the rank whose process died first (and why Ray says
it died), else the first error that is not a peer's collateral connection error; and which of
the trial's nodes are gone."""

from __future__ import annotations

import re
import time
from typing import Dict, List, Tuple

from orchestrator import ray_pool
from orchestrator.launch import error_line, error_summary, wrapped_cause

_ACTOR_DEATHS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")
_COLLATERAL = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def _death(failure: Exception) -> str:
    """Why a worker process vanished, in one line that classify() reads right."""
    if type(failure).__name__ == "OutOfMemoryError":  # ray.exceptions: Ray's memory monitor killed it
        return "OutOfMemoryError: killed by Ray's memory monitor (the node ran low on memory)"
    found = re.search(r"Worker exit type: (\S+) Worker exit detail: ([^.]*\.)", str(failure))
    if found:
        return f"worker process died ({found.group(1)}: {found.group(2)})"
    return f"worker process died ({type(failure).__name__})"


def _summary(failure: Exception) -> str:
    """A rank's error in one line. Ray Train hands a rank's exception back wrapped with its
    traceback as text (``UserExceptionWithTraceback``, whose ``str`` is ``traceback.format_exc``),
    so the line is read from that text: the error a pipeline stage's wrapper was raised from
    where there is one, else the traceback's own last line ("RuntimeError: ...")."""
    text = str(failure)
    if type(failure).__name__ == "UserExceptionWithTraceback":
        return wrapped_cause(text, text) or error_line(text)
    return error_summary(failure)


def failure_reason(err: Exception) -> str:
    """One line for a trial that failed on Ray: the rank whose process died first, else the
    first error that is not the peers' collateral connection errors."""
    failures: Dict[int, Exception] = getattr(err, "worker_failures", None) or {}
    if not failures:
        inner = getattr(err, "controller_failure", None) or err
        return error_summary(inner)
    for rank, failure in sorted(failures.items()):
        if hasattr(failure, "health_check_failure"):  # Ray Train's worker group
            return f"rank {rank}: {_death(failure.health_check_failure)}"
        if type(failure).__name__ in _ACTOR_DEATHS:  # a warm group's rank (orchestrator.ray_pool)
            return f"rank {rank}: {_death(failure)}"
    ranked = sorted(failures.items(), key=lambda kv: (any(c in str(kv[1]).lower() for c in _COLLATERAL), kv[0]))
    rank, failure = ranked[0]
    return f"rank {rank}: {_summary(failure)}"


def _pong() -> bool:
    return True


def lost_nodes(placed: Dict[int, Tuple[str, str]], wait_s: float = 30.0) -> List[str]:
    """The nodes among ``placed`` (rank -> (node id, ip)) that are gone, as "ip (node id)". Each
    node gets a no-resource task pinned to it: a node that runs it is alive. Ray declares a node
    whose raylet vanished dead after a few missed health checks (GCS ``health_check_period_ms``
    x ``health_check_failure_threshold``, seconds), later than its workers' deaths reach the
    trial: wait up to ``wait_s`` for one answer or the other."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ours = {node: ip for node, ip in placed.values()}
    ping = ray.remote(num_cpus=0, max_retries=0)(_pong)
    pings = {
        node: ping.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in ours
    }
    answered: set = set()
    deadline = time.monotonic() + wait_s
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        dead = {node for node in ours if node not in alive}
        waiting = [ref for node, ref in pings.items() if node not in dead and node not in answered]
        if waiting:
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=1.0)
            for node, ref in pings.items():
                if ref in ready:
                    try:
                        ray.get(ref)
                        answered.add(node)
                    except Exception:  # noqa: BLE001 - the node went while the ping ran: counted dead below
                        pass
        if dead | answered >= set(ours) or time.monotonic() > deadline:
            # only the pings still queued (a dead node's), and not by force: force-cancelling a
            # ping whose reply was already on its way crashed this process inside Ray's core
            # worker ("Check failed: it != submissible_tasks_.end()", Ray 2.60), which ended a
            # Ray sweep's job right after its trial had failed and been recorded
            for node, ref in pings.items():
                if node not in answered:
                    ray.cancel(ref)
            return sorted(f"{ours[node]} ({node[:12]})" for node in dead)


def attempt_failed(err: BaseException) -> bool:
    """Whether ``err`` is an attempt's worker group failing (Ray Train's or a warm group's)."""
    from ray.train import TrainingFailedError

    return isinstance(err, (TrainingFailedError, ray_pool.GroupFailed))
