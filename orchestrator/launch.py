"""Start a trial's worker processes on this node with torch's elastic launcher.

This is the API behind ``torchrun``: it sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR for
every worker, watches them, and restarts the whole worker group up to ``max_failures`` times.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from typing import Any, Dict, Optional

from orchestrator import statuses

# What a forkserver imports before it forks workers: torch and the trainer, then what a rank
# imports as it builds (DTensor for tensor and sequence parallelism, FSDP2, pipelining, DCP
# checkpoints, with the torch._dynamo and sympy they pull in) and rank 0's reporter (MLflow's
# client on its sqlalchemy store). A worker that forks with these loaded imports about 20 modules
# instead of about 1200: on the 2-core CPU machine a dp2 gpt_tiny trial after the first in a
# driver costs 1.57 CPU-seconds instead of 3.84 (bench/worker_start.py). torch_npu needs no name here:
# where it is installed, `import torch` loads it (its `torch.backends` entry point,
# `torch_npu:_autoload`, torch_npu's setup.py), and its import starts no NPU runtime (that is
# `torch_npu.npu._lazy_init`, at the first device call, which each worker makes itself: forking
# before it is safe, as for CUDA). A name here that no longer imports is skipped by the server
# without a word, so tests/test_cache.py imports each.
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "trainers.loop",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint.state_dict",
    "orchestrator.mlflow_reporter",
    "mlflow.store.tracking.sqlalchemy_store",
)


class TrialFailed(RuntimeError):
    """A worker group failed beyond its restarts; ``status`` classifies why."""

    def __init__(self, status: str, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def classify(message: str) -> str:
    """Map a worker's failure message to a trial status."""
    low = message.lower()
    if "out of memory" in low or "outofmemoryerror" in low:
        return statuses.OOM
    if "nonfiniteerror" in low or "non-finite" in low:
        return statuses.NONFINITE
    if "timed out" in low or "timeout" in low:
        return statuses.TIMEOUT
    if "notimplementederror" in low or "not yet supported" in low or "not implemented" in low:
        return statuses.UNSUPPORTED_OP
    return statuses.CRASH


def error_line(text: str) -> str:
    """The last non-blank line of ``text``: an error's own message, under its traceback. A C++
    error raised through Python (gloo's "Timed out waiting 5000ms for recv operation") ends with
    pybind11's "At:" and the Python frames it passed; those are left out."""
    text = re.split(r"\n\s*At:\s*\n", str(text))[0]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def error_summary(err: BaseException) -> str:
    """An exception in one line: its type and its own message's last line (:func:`error_line`)."""
    return f"{type(err).__name__}: {error_line(str(err))}"


# where a traceback chains a cause to the exception raised from it (``raise ... from err``)
CHAINED = "The above exception was the direct cause of the following exception"
# torch.distributed.pipelining's stage re-raises what failed inside it under this line
PIPELINE_WRAPPER = re.compile(r"\[Stage \d+\] failed to run (forward|backward)")


def wrapped_cause(message: str, stack: str) -> str:
    """A pipeline stage's wrapper says little (torch's pipelining: "[Stage 0] failed to run
    forward: args: ... kwargs: {}"); the error it was raised from, first in the traceback
    ``stack``, says why: its line, or "" where ``message`` is no such wrapper."""
    if PIPELINE_WRAPPER.search(message) and CHAINED in stack:
        return error_line(stack.split(CHAINED)[0])
    return ""


def _rank_line(failure: Any) -> str:
    message, cause = failure.message, ""
    if isinstance(message, dict):  # the elastic error file: {"message": ..., "extraInfo": ...}
        stack = str((message.get("extraInfo") or {}).get("py_callstack") or "")
        message = message.get("message", "")
        cause = wrapped_cause(str(message), stack)
    message = str(message or "")
    if failure.signal_name() and failure.signal_name() != "<N/A>" and (not message or "Signal" in message):
        return f"killed by {failure.signal_name()}"
    return cause or error_line(message) or f"exit code {failure.exitcode}"


def _failure_reason(err: Exception) -> str:
    """One line: the lowest failed rank's, except that a rank whose collective timed out comes
    before the others (a hung rank ended by the launcher says only "killed by SIGTERM")."""
    failures = getattr(err, "failures", None)
    if not failures:
        return f"{type(err).__name__}: {err}"
    lines = {rank: _rank_line(failure) for rank, failure in failures.items()}
    rank = min(lines, key=lambda r: (classify(lines[r]) != statuses.TIMEOUT, r))
    return f"rank {rank}: {lines[rank]}"


def start_workers_early(launch: Dict[str, Any]) -> str:
    """Start what the trial's workers fork from, now, so that it imports while the driver still
    validates, plans and creates the MLflow run; returns the start method.

    With ``launch.start_method=forkserver`` (the default) the server imports torch and the trainer
    once per driver process, and every worker of every later trial forks from it instead of
    importing them again (seconds per trial). ``ensure_running`` only spawns it: its imports go
    on in its own process, beside the driver's work, and the first fork waits for them. It never
    touches a device, so a forked worker initialises CUDA or the NPU runtime as a fresh one.
    Calling it again (the launch itself does) finds the server running."""
    method = launch["start_method"]
    if method == "forkserver":
        import multiprocessing
        from multiprocessing import forkserver

        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        forkserver.ensure_running()
    return method


def rendezvous_store(launch: Dict[str, Any]) -> Any:
    """The trial's rendezvous store, its server bound here before any worker starts, on
    ``launch.master_port`` (0: a port the kernel gives in the same bind, so no other launch can
    take it between the choice and the bind). Held for the whole launch: torch's elastic agent,
    in this process, asks for a multi-tenant server on the same port and is handed this one
    (``TCPServer::start`` keeps them by port). Picking a free port first and binding it later left
    a window in which a second trial on the node took the same port: its agent, failing to bind,
    joined the first trial's store as a client (``c10d_rendezvous_backend._create_tcp_store`` tries
    that next), and the two trials' workers shared rendezvous keys (``/worker/attempt_0``): a gloo
    rank connected to another trial's peer, which hung or corrupted the heap.

    torch's per-process table of servers keeps a dead server's entry under its port until someone
    asks for that port, and a server started on port 0 is not entered where one is (``emplace``):
    when the kernel hands out the port of an earlier trial of this process, the agent would find
    the dead entry and try to bind the port itself (EADDRINUSE, seen in CI). So the store is
    checked as the agent will ask for it (:func:`_agent_finds`), and where that fails it is bound
    again on its own port, which the check's lookup has cleared."""
    host, asked = launch["master_addr"], int(launch["master_port"] or 0)
    port = asked
    for _ in range(RENDEZVOUS_BINDS):
        try:
            store = _store(host, port)
        except (RuntimeError, ValueError) as err:  # DistNetworkError is a RuntimeError
            if asked:
                raise TrialFailed(
                    statuses.CRASH,
                    f"launch.master_port={asked}: cannot bind the rendezvous store on {host} "
                    f"({error_line(str(err))}); another job holds it, leave launch.master_port at 0 to take a free one",
                ) from None
            port = 0  # taken between a release and a bind below: another port
            continue
        if _agent_finds(host, store):
            return store
        port = store.port
        del store  # not in torch's table: bound again on the same port, which the check cleared
    raise TrialFailed(
        statuses.CRASH, f"launch: no rendezvous store the elastic agent finds in {RENDEZVOUS_BINDS} binds"
    )


RENDEZVOUS_BINDS = 5


def _store(host: str, port: int) -> Any:
    import datetime

    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=120)
    return TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timeout)


def _agent_finds(host: str, store: Any) -> bool:
    """Whether a multi-tenant master store on ``store``'s port, as torch's c10d rendezvous makes
    one, is handed this store's server (False: it tried to bind the port anew and failed)."""
    try:
        _store(host, store.port)
    except (RuntimeError, ValueError):
        return False
    return True


def launch_config(world_size: int, launch: Dict[str, Any], start_method: str, port: int) -> Any:
    """torch's elastic ``LaunchConfig`` for one node of ``world_size`` workers: the rendezvous at
    ``launch.master_addr``:``port`` (the store :func:`rendezvous_store` holds, which this node
    hosts: ``is_host``, so an agent that cannot serve it fails instead of joining whatever store
    listens there), restarted up to ``launch.max_failures`` times."""
    from torch.distributed.launcher.api import LaunchConfig

    host = launch["master_addr"]
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"trial-{uuid.uuid4().hex[:8]}",
        role="trainer",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host}:{port}",
        rdzv_configs={"timeout": 120, "is_host": True},
        max_restarts=int(launch["max_failures"]),
        monitor_interval=0.2,
        start_method=start_method,
    )


def launch_local(spec: Dict[str, Any], reporter: Any, world_size: int, launch: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``trainers.loop.worker_entry`` in ``world_size`` local processes; rank 0's summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from trainers.loop import worker_entry

    store = rendezvous_store(launch)  # held until the workers are done
    config = launch_config(world_size, launch, start_workers_early(launch), store.port)
    try:
        # the driver's environment now: a forkserver's workers would otherwise see the server's,
        # as it was when the driver's first trial started it
        results: Optional[Dict[int, Any]] = elastic_launch(config, worker_entry)(spec, reporter, dict(os.environ))
    except ChildFailedError as err:
        reason = _failure_reason(err)
        raise TrialFailed(classify(reason), reason) from None
    finally:
        del store
    return (results or {}).get(0) or {}


def trial_nodes(world_size: int, devices_per_node: int, nnodes: int) -> int:
    """Nodes a trial spans: ``launch.nnodes``, or more when its processes outnumber the devices
    of ``launch.nnodes`` nodes (``parallel=tp8pp4`` on 8-device nodes spans 4)."""
    return max(int(nnodes), -(-int(world_size) // max(1, int(devices_per_node))))
