"""The core of the ``hydra/launcher=ray_trials`` launcher (alias ``ray``): every job of a sweep's
batch is submitted to Ray at once, and each runs when what it holds is free.

Each job is one Ray task that runs Hydra's ``run_job`` as the basic launcher would (same job
returns, output dirs, ``hydra.job.chdir``, ``.hydra/`` files), for any Hydra app's task function.
This application's jobs hold nothing themselves: each one's trial goes to Ray
(:mod:`orchestrator.ray_trial`), and the trials tell the sweep when their workers are placed
through a progress board (a named Ray actor): the launcher writes the board's name into each
job's Hydra config (``hydra.launcher.board``, beside ``hydra.job.num``, the job's key on it), and
the task function reads it back with :func:`board_slot`. Another app's job counts as running once
its Ray task starts. The plugin shim in ``hydra_plugins/ray_launcher`` calls :func:`launch_jobs`.

Ray is imported inside the functions: composing or validating a config never imports it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from orchestrator import statuses
from orchestrator.launch import error_summary
from orchestrator.ray_cluster import cluster, cluster_address, launch_env
from orchestrator.ray_trial import BoardSlot
from orchestrator.relay import on_this_node

log = logging.getLogger("orchestrator")


class _Board:
    """The sweep's trials whose workers have been placed: an unfinished trial is queued until
    then, running after (through restarts, and while its end is recorded)."""

    def __init__(self) -> None:
        self._placed: set = set()

    def place(self, key: int) -> None:
        self._placed.add(key)

    def placed(self) -> set:
        return set(self._placed)


# the launcher's class, under each of its names (hydra/launcher=ray_trials, and ray where free)
LAUNCHER = "hydra_plugins.ray_launcher.ray_launcher.RayLauncher"


def is_ray_job(hydra_cfg: Any) -> bool:
    """Whether this launcher started the job of ``hydra_cfg`` (``HydraConfig.get()``), whichever
    name selected it; not Hydra's own ``ray`` launcher where that is installed."""
    return OmegaConf.select(hydra_cfg, "launcher._target_") == LAUNCHER


def board_slot(hydra_cfg: Any) -> Optional[BoardSlot]:
    """This job's slot on its sweep's progress board, from the job's Hydra config
    (``HydraConfig.get()``); None for a job this launcher did not start."""
    board = OmegaConf.select(hydra_cfg, "launcher.board")
    pool = OmegaConf.select(hydra_cfg, "launcher.pool")
    return BoardSlot(str(board), int(hydra_cfg.job.num), str(pool) if pool else None) if board else None


def _run_job(
    hydra_context: Any, task_function: Any, config: DictConfig, singleton_state: Any, cwd: str, board: Any
) -> Any:
    """One sweep job, in a Ray task: Hydra's run_job, as the basic launcher would run it, from the
    driver's working directory where this node has it (the job's slot on the progress board is in
    ``config.hydra.launcher``; ``board``: mark the job running now, for a job whose task reports
    nothing)."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job

    if board is not None:
        board.place.remote(int(config.hydra.job.num))
    if os.path.isdir(cwd):
        os.chdir(cwd)
    Singleton.set_state(singleton_state)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def _pool(launcher: Any, wanted: bool) -> Optional[str]:
    """The name of the multirun's pool of warm worker groups (:mod:`orchestrator.ray_pool`),
    started at its first batch and kept on ``launcher`` for the later ones (an OVAT study's
    batches find the groups of the earlier ones); None when ``wanted`` is false (another app's
    jobs, or ``launch.ray.reuse_workers=false``). The pool's groups end with the driver."""
    if not wanted:
        return None
    name = getattr(launcher, "pool_name", None)
    if name is None:
        import ray

        from orchestrator import ray_pool

        name = f"sweep-pool-{uuid.uuid4().hex[:12]}"
        # the handle held here keeps the actor (a named, non-detached one) alive between batches
        launcher.pool_actor = on_this_node(ray_pool.Pool, name=name, max_concurrency=64)
        # started before the jobs go: a driver that ends while the actor still starts (every job
        # skipped a finished point) aborts it inside Ray's worker teardown ("Fatal Python error")
        ray.get(launcher.pool_actor.stats.remote())
        launcher.pool_name = name
    return name


def _outcome(ret: Any) -> Tuple[str, str]:
    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.FAILED:
        err = ret._return_value
        return statuses.CRASH, error_summary(err)
    value = ret.return_value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # an objective for a sweeper (optimized_metric): +-inf stands for a trial that did not finish
        return (statuses.FINISHED, f"{value:.6g}") if math.isfinite(value) else (statuses.FAILED, "no objective value")
    value = value if isinstance(value, dict) else {}
    return str(value.get("status", statuses.FINISHED)), str(value.get("reason") or value.get("run_id") or "")


class _SweepBar:
    """Trials queued, running, done, failed, on one console line (quiet when not a terminal)."""

    def __init__(self, total: int, enabled: Optional[bool] = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            # a terminal that reports no size (0 x 0) would hide the bar: assume 100 x 20 there
            size = shutil.get_terminal_size((100, 20))
            self._bar = tqdm(
                total=total,
                desc="sweep",
                file=sys.stderr,
                ncols=size.columns,
                nrows=size.lines,
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
            )

    def show(self, queued: int, running: int, done: int, failed: int) -> None:
        if self._bar is not None:
            self._bar.n = done + failed
            self._bar.set_postfix_str(f"queued={queued}, running={running}, done={done}, failed={failed}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def cluster_settings(settings: Mapping[str, Any], config: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Where a sweep runs, as :func:`orchestrator.ray_cluster.cluster` takes it: ``(ray_cfg, init)``
    from the launcher's ``settings`` (``hydra.launcher``) and the task ``config``, whose
    ``launch.ray`` section (this application's; another app has none) fills what they leave unset."""
    app = _section(config, "launch.ray")
    init = _plain(settings.get("init"))
    address = settings.get("address") or init.pop("address", None) or app.get("address")
    ray_cfg = {
        "address": address,  # none: $RAY_ADDRESS, else a local cluster (ray_cluster.cluster_address)
        "num_cpus": init.pop("num_cpus", app.get("num_cpus")),
        "dashboard": init.pop("include_dashboard", app.get("dashboard", True)),
    }
    return ray_cfg, init


def cluster_devices(config: Any, chip: Any) -> Tuple[int, str]:
    """The devices of ``chip``'s Ray resource on the cluster a sweep under this launcher runs on
    (``config``: the sweep's config, with its ``hydra`` section; ``chip``: the resolved chip
    section), and that resource's name. A local cluster is started for it and kept for the
    multirun, as :func:`launch_jobs` keeps it."""
    from orchestrator.ray_cluster import live_totals
    from orchestrator.ray_trial import Placement

    ray_cfg, init = cluster_settings(config.hydra.launcher, config)
    resource = Placement.of(chip, config.launch.ray, 1).resource
    with cluster(ray_cfg, keep=True, init=init):
        return int(sum(int(t) for t in live_totals(resource))), resource


def job_options(settings: Mapping[str, Any], config: Any) -> Dict[str, Any]:
    """The Ray task options of each job from ``hydra.launcher.job_resources``: this application's
    jobs hold no CPU unless told (their trials' workers hold the devices), another app's one."""
    held = _plain(settings.get("job_resources"))
    num_cpus = held.get("num_cpus")
    if num_cpus is None:
        num_cpus = 0 if _section(config, "launch.ray") else 1
    options = {"num_cpus": num_cpus, "num_gpus": held.get("num_gpus") or 0}
    if held.get("resources"):
        options["resources"] = dict(held["resources"])
    return options


def _section(config: Any, key: str) -> Dict[str, Any]:
    found = OmegaConf.select(config, key) if OmegaConf.is_config(config) else None
    return _plain(found)


def _plain(node: Any) -> Dict[str, Any]:
    if node is None:
        return {}
    return dict(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node)


def launch_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[Any]:
    """Submit every job of the batch to Ray at once; each runs when what it holds is free.
    ``launcher`` is the Hydra launcher (its settings, config, Hydra context and task function).

    Precedence of the settings, key by key (the first that is set wins):

    - the cluster: ``hydra.launcher.address``, ``hydra.launcher.init.address`` (as Hydra's own Ray
      launcher spells it), the task config's ``launch.ray.address``, ``$RAY_ADDRESS``; none of
      them: a new local cluster, which stops when the multirun's process exits;
    - a local cluster's size and dashboard: ``hydra.launcher.init.num_cpus`` /
      ``init.include_dashboard``, the task config's ``launch.ray.num_cpus`` / ``launch.ray.dashboard``,
      all of the machine's CPUs and a dashboard on 127.0.0.1; every other ``hydra.launcher.init.*``
      key goes to ``ray.init`` as it is (a ``runtime_env`` is merged over the one that ships this
      checkout to a joined cluster);
    - what each job's Ray task holds: ``hydra.launcher.job_resources`` (``num_cpus`` null: 0 when
      the task config has a ``launch.ray`` section, this application's, else 1), on the driver's
      node unless ``hydra.launcher.same_node=false``;
    - the jobs' environment: the driver's variables named by the task config's
      ``launch.env_prefixes`` (none for another app), and ``RAY_ADDRESS`` on a joined cluster.
    """
    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log, filter_overrides, setup_globals

    # composition is over: the task function (orchestrator.app.Task) runs in other processes
    # from here on, so tell it here that a later exit 1 is a failure, not a broken command line
    started = getattr(launcher.task_function, "mark_started", None)
    if started is not None:
        started()
    setup_globals()
    config = launcher.config
    settings = getattr(launcher, "settings", None) or {}
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    board_name = f"sweep-board-{uuid.uuid4().hex[:12]}"
    jobs = _job_configs(launcher, job_overrides, initial_job_idx, {"board": board_name})
    ray_cfg, init = cluster_settings(settings, config)
    ours = bool(_section(config, "launch.ray"))
    # the cluster lives as long as the multirun (a sweeper may send several batches)
    with cluster(ray_cfg, keep=True, init=init):
        import ray

        board = on_this_node(_Board, name=board_name)
        pool_name = _pool(launcher, ours and bool(_section(config, "launch.ray").get("reuse_workers", True)))
        _set_launcher_keys(jobs, {"pool": pool_name})
        run = _job_task(settings, config, ray_cfg)
        resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "NPU")}
        sweep_dir = config.hydra.sweep.dir
        log.info("Ray launcher: %d job(s) on a cluster of %s; sweep dir %s", len(jobs), resources, sweep_dir)
        state = Singleton.get_state()
        pending = {}
        for idx, overrides, job_cfg in jobs:
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            ref = run.remote(
                launcher.hydra_context, launcher.task_function, job_cfg, state, os.getcwd(), None if ours else board
            )
            pending[ref] = (idx, overrides, job_cfg)
        results = _collect(pending, board, len(jobs))
    return [results[idx] for idx, _, _ in jobs]


def _set_launcher_keys(jobs: List[Tuple[int, List[str], Any]], keys: Dict[str, str]) -> None:
    from omegaconf import open_dict, read_write

    for _, _, job_cfg in jobs:
        with read_write(job_cfg.hydra.launcher), open_dict(job_cfg.hydra.launcher):
            for key, value in keys.items():
                job_cfg.hydra.launcher[key] = value


def _job_configs(launcher: Any, job_overrides, initial_job_idx: int, keys: Dict[str, str]):
    """``(index, overrides, config)`` of each job of the batch, ``keys`` set in its launcher
    section (the board's name: its key on the board is ``hydra.job.num``)."""
    from omegaconf import open_dict

    jobs = []
    for i, overrides in enumerate(job_overrides):
        idx = initial_job_idx + i
        job_cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = f"{idx}"
            job_cfg.hydra.job.num = idx
        jobs.append((idx, list(overrides), job_cfg))
    _set_launcher_keys(jobs, keys)
    return jobs


def _job_task(settings: Any, config: Any, ray_cfg: Any) -> Any:
    """The Ray task that runs one job. A job is never re-run (it would record twice); this
    application's jobs stay beside the sweep's files and MLflow store, and the driver's exported
    variables (``launch.env_prefixes``) travel with them to their trials."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env = launch_env({}, OmegaConf.select(config, "launch", default=None))
    address = cluster_address(ray_cfg)
    if address:  # a joined cluster: the jobs' trials know they run on one
        env["RAY_ADDRESS"] = str(address)
    options = job_options(settings, config)
    if settings.get("same_node", True):
        here = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
    return ray.remote(_run_job).options(max_retries=0, runtime_env={"env_vars": env} if env else None, **options)


def _collect(pending: Dict[Any, Tuple[int, List[str], Any]], board: Any, n_jobs: int) -> Dict[int, Any]:
    """Each job's return as it ends (a job whose process died: failed, the sweep goes on), the
    progress bar kept; on Ctrl-C the jobs still running are cancelled."""
    import ray
    from hydra.core.utils import JobReturn, JobStatus

    results: Dict[int, Any] = {}
    done = failed = 0
    bar = _SweepBar(n_jobs)
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in ready:
                idx, overrides, job_cfg = pending.pop(ref)
                try:
                    ret = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - the job's process died: the sweep goes on
                    ret = JobReturn(overrides=overrides, cfg=job_cfg, status=JobStatus.FAILED)
                    ret.return_value = err
                results[idx] = ret
                status, detail = _outcome(ret)
                if status == statuses.FINISHED:
                    done += 1
                else:
                    failed += 1
                log.info("#%d %s: %s", idx, status, detail)
            placed = ray.get(board.placed.remote())
            running = sum(idx in placed for idx, _, _ in pending.values())
            bar.show(len(pending) - running, running, done, failed)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        bar.close()
    return results
