"""A real multi-node Ray cluster on one machine, for the cluster tests: a head node and worker
nodes, each its own raylet started by ``ray start --block`` in its own process group, so a test
can kill one node (raylet and all its workers) as a dead machine would go.

A worker node may be started in its own mount namespace with a tmpfs over given folders (the
driver's working directory): whatever it writes there is invisible to the driver, as on a
cluster whose nodes share no working directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from orchestrator.launch import free_port

RAY = str(Path(sys.executable).with_name("ray"))
_TOKEN = secrets.token_hex(32)


def node_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The nodes' environment: no PYTHONPATH (the code travels to them as the job's working dir),
    this environment's executables first."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri() in this process exports it
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # the head's GCS declares a node dead after this many missed health checks this far apart:
    # 5 x 1 s here against Ray's 5 x 3 s, so a killed node is noticed sooner; a check still
    # waits up to health_check_timeout_ms (10 s) for a busy raylet's answer, so load is no death
    env["RAY_health_check_period_ms"] = "1000"
    # `ray start --head` turns token authentication on; nodes and drivers share this process's
    # token (a fresh machine has no ~/.ray/auth_token, and `ray start` in token mode refuses
    # to start without one)
    env["RAY_AUTH_MODE"] = "token"
    env.setdefault("RAY_AUTH_TOKEN", _TOKEN)
    env.update(extra or {})
    return env


class Cluster:
    """``ray start`` processes on 127.0.0.1: :meth:`head`, then :meth:`add` worker nodes."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: Dict[str, subprocess.Popen] = {}
        self.temps: List[Path] = []  # the worker nodes' Ray temp folders

    def _start(self, name: str, args: List[str], hide: Sequence[Path] = ()) -> None:
        cmd = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats", *args]
        if hide:  # a node of its own: a tmpfs over each hidden folder, seen by this node only
            mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(str(p))}" for p in hide)
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mounts} && exec {shlex.join(cmd)}"]
        log = self.logs / f"{name}.log"
        with open(log, "w") as out:
            self.nodes[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=node_env(), start_new_session=True
            )
        deadline = time.time() + 180
        while "Ray runtime started" not in log.read_text():
            if self.nodes[name].poll() is not None or time.time() > deadline:
                raise RuntimeError(f"node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def head(self, num_cpus: int = 0, resources: Optional[Dict[str, float]] = None) -> "Cluster":
        self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources or {})}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
            ],
        )
        return self

    def add(self, name: str, num_cpus: int, resources: Optional[Dict[str, float]] = None, hide=()) -> None:
        """A worker node, with a Ray temp folder of its own (short: it holds the node's sockets).
        Nodes of one machine would otherwise share ``/tmp/ray``, where each node's runtime-env
        agent deletes and unpacks the job's working_dir anew (``overwrite=True``): a process
        already started in it on another node (the trial's relay actor on the head) is left in a
        deleted folder, where ``os.getcwd()`` fails. Machines of a real cluster share no such
        folder."""
        temp = Path(f"/tmp/rn{self.port}{name}")
        self.temps.append(temp)
        self._start(
            name,
            [
                f"--address={self.address}",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources or {})}",
                f"--temp-dir={temp}",
            ],
            hide,
        )

    def kill(self, name: str) -> None:
        """The node dies: its raylet and every process on it, at once. Ray puts each worker in
        a process group of its own, but all of a node's processes stay in the session that
        ``ray start`` opened: kill that session."""
        proc = self.nodes.pop(name)
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        proc.wait()

    def stop(self) -> None:
        for name in [n for n in self.nodes if n != "head"] + ["head"]:
            proc = self.nodes.pop(name, None)
            if proc is None:
                continue
            _end(proc, timeout=60)
        _forget(self.port)
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)


def _end(proc: subprocess.Popen, timeout: float) -> None:
    """`ray start --block` stops its node's processes on SIGTERM; a SIGKILL to its process group
    after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _forget(port: int) -> None:
    """`ray start` notes its cluster (host:port) for later `ray.init()` calls; `ray stop` would
    remove the note, a SIGTERM does not."""
    note = Path("/tmp/ray/ray_current_cluster")
    if note.is_file() and note.read_text().strip().endswith(f":{port}"):
        note.unlink()


@contextlib.contextmanager
def head_node(folder: Path, env: Dict[str, str], cpus: int, dashboard: bool) -> Iterator[Dict[str, str]]:
    """`ray start --head --block` on 127.0.0.1 with ``cpus`` CPUs (and its dashboard, where a test
    submits jobs), logging into ``folder``; yields its ``address`` (and ``dashboard`` URL). The
    whole cluster stops by its process's SIGTERM on leaving."""
    log = folder / "head.log"
    port, dash = free_port(), free_port()
    args = [RAY, "start", "--head", "--block", f"--num-cpus={cpus}", "--node-ip-address=127.0.0.1", f"--port={port}"]
    args += [f"--include-dashboard={str(dashboard).lower()}", f"--ray-client-server-port={free_port()}"]
    args.append(f"--dashboard-agent-listen-port={free_port()}")  # the node's agent runs either way
    if dashboard:
        args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
    args.append("--disable-usage-stats")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(folder), start_new_session=True
        )
    try:
        deadline = time.time() + 180
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}"}
    finally:
        _end(proc, timeout=90)
        _forget(port)
