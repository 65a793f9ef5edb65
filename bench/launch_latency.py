"""Wall time from the command to the first training step of a 2-rank trial, by launch path.

    python bench/launch_latency.py [--repeats 3] [--variants torchrun,local,ray,ray-join,cli-local,cli-ray]

Every variant is a fresh process started here (interpreter start, imports and config
composition included, as for a user), on the same trial: gpt_tiny, ``parallel=dp2`` on the CPU
with gloo, ``trainer=smoke``. "First step" is the moment rank 0 has finished step 0:

- torchrun:  ``torchrun --nproc_per_node 2`` of a script that calls ``trainers.loop.worker_entry``
             with the spec ``orchestrator.trial.build_spec`` makes (the bare baseline);
- local:     ``orchestrator.launch.launch_local`` (torch's elastic launcher API) from one process;
- ray:       ``orchestrator.ray_trial.launch_trial``: a local Ray cluster is started, then a
             Ray Train worker group;
- ray-join:  the same, joining a `ray start --head` cluster that is already up (RAY_ADDRESS);
- cli-local, cli-ray: the real command, ``python -m orchestrator ...`` (with ``hydra/launcher=ray``
             for cli-ray), which also runs the preflight and creates the MLflow run.

- ray-sweep, ray-sweep-cold: a Ray sweep of ``--sweep`` such trials one after another
             (``trainer.seed=1..N`` on a local cluster of 2 CPUs, room for one at a time), with
             warm worker groups (``launch.ray.reuse_workers``, the default) and without; its
             figure is a trial's start *within* the sweep: from the previous trial's end (its
             run's end time in MLflow) to its own first step, median over the sweep's trials
             after the first (the first pays for the cluster and the group, as ``cli-ray`` does).

The first four read a timestamp that rank 0's reporter writes at step 0; the cli variants read
the timestamp of the first per-step metric in MLflow (``trainer.log_every=1``: sent right after
step 0). Each figure is the median over ``--repeats`` runs; ray-join runs last, while its cluster
is up, so that an idle cluster does not share the machine with the other variants.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIAL = ["+chip=cpu", "parallel=dp2", "trainer=smoke", "trainer.steps=3", "data.num_workers=0"]
VARIANTS = ("torchrun", "local", "ray", "ray-join", "cli-local", "cli-ray", "ray-sweep", "ray-sweep-cold")


class FirstStep:
    """A reporter (trainers.reporter.Reporter) that writes the wall-clock time of step 0 to a file."""

    def __init__(self, path: str):
        self.path = path

    def on_step(self, step: int, step_time_s: float) -> None:
        if not os.path.exists(self.path):
            Path(self.path).write_text(repr(time.time()))

    def log_steps(self, rows) -> None:
        pass

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def finish(self, summary) -> None:
        pass


def _spec():
    from hydra import compose, initialize_config_dir

    from orchestrator import conf_dir, trial
    from orchestrator.config import register_configs

    register_configs()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[*TRIAL, "tracking.enabled=false"])
    resolved = trial.resolve(cfg)
    return resolved, trial.build_spec(cfg, resolved.layout)


def child(kind: str, stamp: str) -> None:
    """One timed process (``--child``): build the spec, launch it the ``kind`` way."""
    resolved, spec = _spec()
    launch = resolved.launch_section()
    if kind == "torchrun":
        from trainers.loop import worker_entry

        worker_entry(spec, FirstStep(stamp) if os.environ.get("RANK") == "0" else None)
    elif kind == "local":
        from orchestrator.launch import launch_local

        launch_local(spec, FirstStep(stamp), 2, launch)
    else:
        from orchestrator import ray_trial

        launch["ray"]["num_cpus"] = 2
        ray_trial.launch_trial(spec, FirstStep(stamp), 2, launch, placement=resolved.placement)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


def _first_metric_time(db: Path) -> float:
    from mlflow.tracking import MlflowClient

    c = MlflowClient("sqlite:///" + str(db))
    runs = c.search_runs([c.get_experiment_by_name("orchestrator").experiment_id])
    return min(m.timestamp for m in c.get_metric_history(runs[0].info.run_id, "loss")) / 1000.0


def _sweep_gaps(db: Path) -> list:
    """For each trial of the sweep in ``db`` but the first: seconds from the previous trial's
    end to its own first logged step (trials ran one at a time)."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient("sqlite:///" + str(db))
    runs = c.search_runs([c.get_experiment_by_name("orchestrator").experiment_id])
    trials = sorted(
        (
            min(m.timestamp for m in c.get_metric_history(r.info.run_id, "loss")) / 1000.0,
            r.info.end_time / 1000.0,
        )
        for r in runs
        if "trial.status" in r.data.tags
    )
    return [first - prev_end for (_, prev_end), (first, _) in zip(trials, trials[1:])]


def measure_sweep(kind: str, work: Path, trials: int) -> float:
    """The median start of a trial within a Ray sweep of ``trials`` (see the module docstring)."""
    db = work / f"{kind}-{uuid.uuid4().hex[:8]}.db"
    reuse = "false" if kind.endswith("-cold") else "true"
    seeds = ",".join(str(i + 1) for i in range(trials))
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "-m",
        "hydra/launcher=ray",
        "launch.ray.num_cpus=2",
        f"launch.ray.reuse_workers={reuse}",
        *TRIAL,
        f"trainer.seed={seeds}",
        "trainer.log_every=1",
        f"tracking.uri=sqlite:///{db}",
    ]
    proc = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    gaps = _sweep_gaps(db)
    if len(gaps) != trials - 1:
        raise RuntimeError(f"{kind}: {len(gaps) + 1} trials recorded, {trials} launched")
    return statistics.median(gaps)


def measure(kind: str, work: Path, head: str = "") -> float:
    """Seconds from starting the command to rank 0's first step."""
    # a new store each time: MLflow keeps its connection to a store's file for the process's life
    run = uuid.uuid4().hex[:8]
    stamp, db = work / f"{kind}-{run}.stamp", work / f"{kind}-{run}.db"
    py = sys.executable
    env = _env()
    if kind == "torchrun":
        cmd = [
            str(Path(py).with_name("torchrun")),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "bench.launch_latency",
            "--child",
            "torchrun",
            "--stamp",
            str(stamp),
        ]
    elif kind in ("local", "ray", "ray-join"):
        cmd = [py, "-m", "bench.launch_latency", "--child", kind, "--stamp", str(stamp)]
        if kind == "ray-join":
            env.update(RAY_ADDRESS=head, RAY_AUTH_MODE="token")
    else:
        ray = ["hydra/launcher=ray", "launch.ray.num_cpus=2"] if kind == "cli-ray" else []
        cmd = [py, "-m", "orchestrator", *ray, *TRIAL, "trainer.log_every=1", f"tracking.uri=sqlite:///{db}"]
    t0 = time.time()
    # the cli variants' Hydra output folders go to the scratch folder, not into the checkout
    proc = subprocess.run(
        cmd, cwd=work if kind.startswith("cli") else ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    first = _first_metric_time(db) if kind.startswith("cli") else float(stamp.read_text())
    return first - t0


def _start_head(log: Path):
    port = _free_port()
    env = _env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("PYTHONPATH")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("ray")),
                "start",
                "--head",
                "--block",
                "--num-cpus=2",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={_free_port()}",
                f"--dashboard-agent-listen-port={_free_port()}",
                f"--ray-client-server-port={_free_port()}",
                "--disable-usage-stats",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.time() + 180
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(1)
    return proc, f"127.0.0.1:{port}"


def _stop_head(proc, address: str) -> None:
    proc.terminate()  # `ray start --block` stops the cluster's processes on SIGTERM
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    note = Path("/tmp/ray/ray_current_cluster")  # `ray start` notes its cluster; `ray stop` would remove it
    if note.is_file() and note.read_text().strip().endswith(":" + address.rsplit(":", 1)[1]):
        note.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sweep", type=int, default=4, help="trials in each ray-sweep variant's sweep")
    ap.add_argument("--child", choices=("torchrun", "local", "ray", "ray-join"), help=argparse.SUPPRESS)
    ap.add_argument("--stamp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.stamp)
        return
    variants = [v for v in args.variants.split(",") if v]
    times = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        measure("torchrun", work)  # warm the file cache and the corpus; not counted
        if any(v.startswith("cli") for v in variants):
            # and the orchestrator's own cache (orchestrator/cache.py: the operator capture, the
            # empty MLflow store), as every trial after a machine's first finds it
            measure("cli-local", work)
        for _ in range(args.repeats):
            for kind in variants:
                if kind.startswith("ray-sweep"):
                    times[kind].append(measure_sweep(kind, work, args.sweep))
                elif kind != "ray-join":
                    times[kind].append(measure(kind, work))
        if "ray-join" in variants:
            proc, head = _start_head(work / "head.log")
            try:
                for _ in range(args.repeats):
                    times["ray-join"].append(measure("ray-join", work, head))
            finally:
                _stop_head(proc, head)
    print(f"command -> first step of a 2-rank gpt_tiny trial (dp2, gloo, CPU), median of {args.repeats}:")
    base = statistics.median(times["torchrun"]) if times.get("torchrun") else None
    for kind in variants:
        median = statistics.median(times[kind])
        ratio = f"  {median / base:4.2f}x torchrun" if base else ""
        print(f"  {kind:14s} {median:6.1f} s{ratio}   ({', '.join(f'{t:.1f}' for t in times[kind])})")
    if any(k.startswith("ray-sweep") for k in variants):
        print(f"  (ray-sweep*: a trial's start within a sweep of {args.sweep}, from the previous trial's end)")


if __name__ == "__main__":
    main()
