"""The core of the ``hydra/launcher=ray`` launcher: every job of a sweep's batch is submitted to
Ray at once, and each runs when its trial's devices are free.

Each job is one Ray task on the sweep's node that runs Hydra's ``run_job`` as the basic launcher
would; its trial goes to Ray (:mod:`orchestrator.ray_trial`). The jobs' trials tell the sweep when
their workers are placed through a progress board (a named Ray actor): the launcher writes the
board's name into each job's Hydra config (``hydra.launcher.board``, beside ``hydra.job.num``,
the job's key on it), and the task function reads it back with :func:`board_slot`. The plugin
shim in ``hydra_plugins/ray_launcher`` calls :func:`launch_jobs`.

Ray is imported inside the functions: composing or validating a config never imports it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from orchestrator.launch import error_summary
from orchestrator.ray_trial import BoardSlot, cluster, cluster_address, worker_env
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


def board_slot(hydra_cfg: Any) -> Optional[BoardSlot]:
    """This job's slot on its sweep's progress board, from the job's Hydra config
    (``HydraConfig.get()``); None for a job this launcher did not start."""
    board = OmegaConf.select(hydra_cfg, "launcher.board")
    return BoardSlot(str(board), int(hydra_cfg.job.num)) if board else None


def _run_job(hydra_context: Any, task_function: Any, config: DictConfig, singleton_state: Any, cwd: str) -> Any:
    """One sweep job, in a Ray task on the sweep's node: Hydra's run_job, as the basic launcher
    would run it (the job's slot on the progress board is in ``config.hydra.launcher``)."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job

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


def _outcome(ret: Any) -> Tuple[str, str]:
    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.FAILED:
        err = ret._return_value
        return "crash", error_summary(err)
    value = ret.return_value if isinstance(ret.return_value, dict) else {}
    return str(value.get("status", "finished")), str(value.get("reason") or value.get("run_id") or "")


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
            self._bar.set_postfix({"queued": queued, "running": running, "done": done, "failed": failed})

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def launch_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[Any]:
    """Submit every job of the batch to Ray at once; each runs when its trial's devices are free.
    ``launcher`` is the Hydra launcher (its config, Hydra context and task function)."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
    from omegaconf import open_dict, read_write

    # composition is over: the task function (orchestrator.app.Task) runs in other processes
    # from here on, so tell it here that a later exit 1 is a failure, not a broken command line
    started = getattr(launcher.task_function, "mark_started", None)
    if started is not None:
        started()
    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    board_name = f"sweep-board-{uuid.uuid4().hex[:12]}"
    jobs = []
    for i, overrides in enumerate(job_overrides):
        idx = initial_job_idx + i
        job_cfg = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = f"{idx}"
            job_cfg.hydra.job.num = idx
        with read_write(job_cfg.hydra.launcher), open_dict(job_cfg.hydra.launcher):
            job_cfg.hydra.launcher.board = board_name  # this job's key on it is hydra.job.num
        jobs.append((idx, list(overrides), job_cfg))

    # the cluster lives as long as the multirun (a sweeper may send several batches)
    with cluster(config.launch.ray, keep=True):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        board = on_this_node(_Board, name=board_name)
        # the jobs' own processes hold no devices (their trials' workers do) and stay on this node,
        # beside the sweep's files and MLflow store; a job is never re-run (it would record twice)
        # the driver's exported variables (launch.env_prefixes) travel with the jobs to their trials
        env = worker_env({}, list(config.launch.env_prefixes))
        if cluster_address(config.launch.ray):  # a joined cluster: its trials know they run on one
            env["RAY_ADDRESS"] = str(cluster_address(config.launch.ray))
        run = ray.remote(_run_job).options(
            num_cpus=0,
            max_retries=0,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        )
        resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "NPU")}
        log.info(
            "Ray launcher: %d trial(s) on a cluster of %s; sweep dir %s", len(jobs), resources, config.hydra.sweep.dir
        )
        state = Singleton.get_state()
        pending = {}
        for idx, overrides, job_cfg in jobs:
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            ref = run.remote(launcher.hydra_context, launcher.task_function, job_cfg, state, os.getcwd())
            pending[ref] = (idx, overrides, job_cfg)
        results: Dict[int, Any] = {}
        counts = {"done": 0, "failed": 0}
        bar = _SweepBar(len(jobs))
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
                    counts["done" if status == "finished" else "failed"] += 1
                    log.info("#%d %s: %s", idx, status, detail)
                placed = ray.get(board.placed.remote())
                running = sum(idx in placed for idx, _, _ in pending.values())
                bar.show(len(pending) - running, running, counts["done"], counts["failed"])
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            bar.close()
    return [results[idx] for idx, _, _ in jobs]
