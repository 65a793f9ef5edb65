"""Shared fixtures: Hydra compose with a clean global state, a private MLflow store per test,
and a helper that runs the real CLI in a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

# The suite runs three workers, Ray clusters and trials of several processes on two cores: far
# more threads than cores. OpenMP's threads (libgomp in torch's CPU build) spin between parallel
# regions by default, burning the cores the other processes wait for; passive ones sleep. Three
# gpt_tiny trainings at once on two cores: 17.7-20.7 s passive against 48.7-57.1 s spinning (a
# lone training, which has the cores to itself, steps ~25% faster spinning: not the suite's case).
# Read by libgomp when torch loads: set before any import of torch, in this process and so in
# every process it starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from orchestrator import conf_dir, results
from orchestrator.config import register_configs
from trainers.reporter import NullReporter

ROOT = Path(__file__).resolve().parents[1]

# How the suite's files share pytest-xdist's three workers (`--dist loadfile
# --no-loadscope-reorder` in pyproject's addopts). Each file is a group of its own, so its module
# fixtures (a Ray cluster, an MLflow server, a grid sweep's store) start once, except the files
# that start Ray clusters, which are one group: they run one after another on one worker, so no
# two Ray clusters (each a dozen processes) fight for the two cores, and the two other workers
# take the rest. Groups go out in collection order, sorted here: the Ray group first, then the
# longest files (seconds each took in a clean-clone run under three workers: tracker_outage 164,
# trial 157, parallel 155, best 140, sweep 138, ovat 129, knobs 122, the distributed part of which
# is knobs_distributed now, ...), and the short ones last to fill the end. xdist's own order (most
# tests first) left the long few-test files to the end, where one of them ran on alone for minutes.
RAY_CLUSTERS = ("test_cluster.py", "test_ray.py", "test_launcher.py", "test_hang.py", "test_ray_pool.py")
LONGEST_FIRST = (
    "test_tracker_outage.py",
    "test_trial.py",
    "test_parallel.py",
    "test_best.py",
    "test_sweep.py",
    "test_ovat.py",
    "test_knobs_distributed.py",
    "test_numerics.py",
    "test_checkpoint.py",
    "test_llama_parallel.py",
    "test_device_check.py",
)


def pytest_xdist_make_scheduler(config, log):
    """Whole files to each worker, as ``--dist loadfile``, except that the Ray files are one unit
    (pytest-xdist's ``--dist loadgroup`` cannot say this under pytest 9.2: it marks a group by
    rewriting a test's ``_nodeid``, which pytest no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray_clusters" if Path(path).name in RAY_CLUSTERS else path

    return RayFilesTogether(config, log)


def pytest_collection_modifyitems(session, config, items):
    """The groups' order (a stable sort: a file keeps its tests' order)."""
    rank = {name: i for i, name in enumerate(RAY_CLUSTERS + LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def composed(overrides=()):
    """The config `python -m orchestrator <overrides>` composes (for module-scoped fixtures; tests
    take the ``compose_cfg`` fixture, which also clears Hydra after them)."""
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def single_process(overrides, reporter=None) -> dict:
    """The single-process reference: ``overrides`` composed and prepared as a trial, trained in
    this process with no process group (``trainers.loop.train``); its summary."""
    from orchestrator import trial
    from trainers.loop import train

    try:
        cfg = trial.prepare(composed(overrides))
    finally:
        GlobalHydra.instance().clear()
    return train(trial.build_spec(cfg), reporter)


def _rank_main(rank: int, world: int, port: int, measure, specs: list, extra: tuple, out: str) -> None:
    """One spawned rank of :func:`on_ranks`: a gloo group, each spec's ``RankModel`` measured in
    turn (every rank finishing each before the next), its results saved to ``out/rank{r}.pt``."""
    import datetime

    import torch
    import torch.distributed as dist

    from trainers.assembly import RankModel
    from trainers.precision import LossScaler

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank that waits 15 minutes on a peer is stuck, not slow (these collectives take seconds):
    # fail then, not after gloo's default 30. Not less: a compiled case's peer may still be in
    # Inductor's compile, which took over 5 minutes on a loaded 2-core host (its cache is shared)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=15))
    cpu = torch.device("cpu")
    results = {}
    try:
        for name, spec, *rest in specs:
            model = RankModel(spec, cpu, LossScaler(spec.precision, cpu))
            value = measure(model, spec, rank, *rest, *extra)
            if value is not None:
                results[name] = value
            dist.barrier()
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def held_port():
    """The port spawned gloo ranks meet at, its store server bound here first (port 0: the kernel
    picks it in the bind) and held until they are done. The ranks join it as clients, as torch's
    elastic workers join their agent's store (``TORCHELASTIC_USE_AGENT_STORE``, which torch's
    env:// and tcp:// rendezvous and ``trainers.runtime`` honour; the children inherit it). A port
    picked free and bound later by rank 0 could be taken in between by a trial another test worker
    launches, and the two groups' ranks then met each other (``orchestrator.launch.rendezvous_store``)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    try:
        yield store.port
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del store


def on_ranks(measure, world: int, specs: list, out: str, *extra) -> list:
    """``measure(model, spec, rank, *rest, *extra)`` on the trainer's own ``RankModel`` of each
    ``(name, spec, *rest)`` of ``specs``, in ``world`` spawned gloo processes (``measure`` a
    module-level function); each rank's ``{name: value}`` (values None left out), in rank order."""
    import torch
    import torch.multiprocessing as mp

    with held_port() as port:
        mp.spawn(_rank_main, args=(world, port, measure, specs, extra, out), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture
def compose_cfg():
    """compose_cfg(overrides) -> DictConfig, as `python -m orchestrator <overrides>` composes it."""
    yield composed
    GlobalHydra.instance().clear()


@pytest.fixture
def mlflow_uri(tmp_path):
    return "sqlite:///" + str(tmp_path / "mlruns.db")


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def run_cli(args, cwd, timeout=300, **env) -> subprocess.CompletedProcess:
    """`python -m orchestrator ARGS` in `cwd`, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_in_process(args, cwd, monkeypatch, capfd, **env):
    """`python -m orchestrator ARGS` in this process (Hydra's own entry point, exit code and
    output as the real command gives them), for the many cases where starting an interpreter
    would cost more than the check: returns (exit code, stdout, stderr)."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from orchestrator.app import cli

    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["orchestrator", *args])
    GlobalHydra.instance().clear()
    capfd.readouterr()
    code = 0
    try:
        cli()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None  # a --cfg run leaves a config without an output dir behind
    out, err = capfd.readouterr()
    return code, out, err


def search_runs(uri: str, experiment: str = "orchestrator"):
    """The runs of ``experiment`` at ``uri``; [] while a sqlite store is not there yet. A poll must
    not make the store itself: MLflow's client creates and migrates a missing store's tables in
    place, without a lock, and a sweep starting at that moment migrates the same file too, the two
    losing rows between them (a parent run without its tags, seen in CI). The product seeds its
    store whole (``mlflow_store.seed_sqlite_store``), so once the file exists it is complete."""
    import mlflow

    from orchestrator import mlflow_store

    path = mlflow_store.sqlite_file(uri)
    if path is not None and not path.exists():
        return []
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return mlflow.search_runs([exp.experiment_id], output_format="list")


def metric_history(uri: str, run_id: str, key: str) -> list:
    from mlflow.tracking import MlflowClient

    return sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.step)


def assert_planned_state_bytes(cfg, summary) -> None:
    """Every rank holds, to the byte, the parameters, gradients and optimizer state the planner
    plans for it (``cfg`` as the trial ran it: chip resolved, mapped ops applied). Called by the
    layout tests, so each launched layout checks the planner's model state at no extra launch."""
    from orchestrator import planner

    measured = [{k: int(v) for k, v in r.items()} for r in summary["model_state_bytes"]]
    assert measured == planner.state_bytes_per_rank(cfg)


class Rows(NullReporter):
    """A reporter that keeps the per-step rows ``trainers.loop.train`` logs."""

    def __init__(self):
        self.rows = []

    def log_steps(self, rows):
        self.rows.extend(rows)


class TableRunner:
    """Coordinate descent driven by a table of known objectives (the descent's logic alone; the
    real runner is exercised end to end in tests/test_ovat.py): assignment -> (step time, final loss) or a status."""

    def __init__(self, table, inert=None):
        self.table, self.batches, self.points = table, [], {}
        self.info, self.experiment = {"id": "s"}, "e"
        self.launched = self.reused = self.pruned = 0
        self.inert = inert or {}  # key -> (assignment of the other variables -> reason or None)

    def no_effect(self, current, key):
        rule = self.inert.get(key)
        return rule(current) if rule else None

    def point(self, assignment):
        key = tuple(sorted(assignment.items()))
        if key not in self.points:
            p = results.Point(str(key), overrides=[f"{k}={v}" for k, v in assignment.items()])
            p.labels = dict(assignment)
            self.points[key] = p
        return self.points[key]

    def measure(self, points):
        batch = [p for p in points if p.status == "pending"]
        self.batches.append([p.labels for p in batch])
        for p in batch:
            got = self.table[tuple(sorted(p.labels.items()))]
            if isinstance(got, str):
                p.status, p.reason = got, "planner"
                continue
            t, loss = got
            p.status, p.values, p.final_losses = "finished", [t, t], [loss, loss]
            p.run_ids, p.losses = [p.config_hash], {p.config_hash: [5.0, loss]}
