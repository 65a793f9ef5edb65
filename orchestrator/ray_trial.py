"""A trial on a Ray cluster: where its workers go, a Ray Train worker group, why it failed.

A trial goes to Ray when the sweep's launcher is ``ray``, when it spans more than one node, or
when a cluster address is set (``launch.ray.address`` or ``RAY_ADDRESS``); a single trial on one
node keeps the local elastic launcher (:mod:`orchestrator.launch`).

On Ray a trial is one ``TorchTrainer``: ``world_size`` workers in one placement group, so they
are placed all together or not at all, each holding whole devices of the chip's Ray resource
(``NPU``, ``GPU``, ``CPU``); a trial waits in Ray's queue until its devices are free. Ray Train
sets up the process group (gloo on CPU and for emulated chips, nccl on CUDA, hccl on Ascend, with
``comm.timeout_s``) and restarts the worker group up to ``launch.max_failures`` times. Each worker
runs ``trainers.loop.worker_entry``; rank 0 sends per-step metrics to MLflow in batches through
the trial's reporter, never through Ray.

In a sweep under the Ray launcher, with ``launch.ray.reuse_workers`` (the default), the workers
are instead a warm group from the sweep's pool (:mod:`orchestrator.ray_pool`): the processes of an
earlier trial of the same shape, each trial building its own process group and model in them. The
restarts, the failure reasons and the lost-node names are the same on both.

The sweep side of Ray (the ``hydra/launcher=ray`` core, which submits every trial of a sweep at
once) is :mod:`orchestrator.ray_sweep`. Ray is imported inside the functions: composing or
validating a config never imports it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from orchestrator import ray_pool, ray_rank, relay, statuses, tags
from orchestrator.launch import TrialFailed, classify
from orchestrator.ray_cluster import cluster, launch_env, live_totals
from orchestrator.ray_failures import attempt_failed, failure_reason, lost_nodes

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class Placement:
    """How a trial's workers ask Ray for devices."""

    resource: str  # the Ray resource each worker holds whole units of: NPU | GPU | CPU
    nodes: int  # nodes the trial spans
    exclusive: bool  # whole nodes: each worker holds its share of all of a node's `resource`

    @classmethod
    def of(cls, chip: Any, ray_cfg: Any, nodes: int) -> "Placement":
        """From the ``chip`` and ``launch.ray`` sections, for a trial spanning ``nodes`` nodes."""
        resource = "CPU" if chip.emulate or chip.device_type == "cpu" else str(chip.ray_resource)
        return cls(resource, int(nodes), bool(ray_cfg.exclusive))

    def units(self, world_size: int, node_totals: Sequence[float]) -> int:
        """Whole units of ``resource`` per worker, checked against the cluster's nodes; raises
        TrialFailed(infeasible) for a trial that could never be placed (it would wait forever)."""
        per_node = -(-world_size // self.nodes)
        totals = sorted(int(t) for t in node_totals if t >= 1)
        if not totals:
            raise TrialFailed(statuses.INFEASIBLE, f"the Ray cluster has no {self.resource} resource")
        units = 1
        if self.exclusive:
            # all of a node's devices, split over the trial's workers on it; what is left over is
            # less than any exclusive trial's share of a node, so no other such trial fits in it
            capable = [t for t in totals if t >= per_node]
            units = capable[0] // per_node if capable else 1
        if self.nodes == 1 and totals[-1] < world_size * units:
            raise TrialFailed(
                statuses.INFEASIBLE,
                f"needs {world_size} x {units} {self.resource} on one node; the largest "
                f"node of the Ray cluster has {totals[-1]}",
            )
        if sum(t // units for t in totals) < world_size:
            raise TrialFailed(
                statuses.INFEASIBLE,
                f"needs {world_size} x {units} {self.resource}; the Ray cluster has "
                f"{sum(totals)} on {len(totals)} node(s)",
            )
        return units


@dataclass(frozen=True)
class BoardSlot:
    """A sweep job's place on its sweep's progress board (``orchestrator.ray_sweep``): the board,
    a named Ray actor, and the job's key on it. Rank 0 marks the key once the trial's workers are
    placed, so the sweep can tell a running trial from a queued one."""

    board: str
    key: int
    pool: Optional[str] = None  # the multirun's pool of warm worker groups (orchestrator.ray_pool)


class _Roster:
    """Where each rank of each attempt of a trial runs (Ray node id and address); the driver
    reads it to name the node a failed attempt lost."""

    def __init__(self) -> None:
        self._nodes: Dict[int, Dict[int, Tuple[str, str]]] = {}

    def place(self, attempt: int, rank: int, node_id: str, ip: str) -> None:
        self._nodes.setdefault(attempt, {})[rank] = (node_id, ip)

    def nodes(self, attempt: int) -> Dict[int, Tuple[str, str]]:
        return dict(self._nodes.get(attempt, {}))


def _train_worker(config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """One Ray Train worker: the process group is already up (Ray Train's TorchConfig)."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    node_id = ray.get_runtime_context().get_node_id()
    ranks = {
        "rank": ctx.get_world_rank(),
        "world_size": ctx.get_world_size(),
        "local_rank": ctx.get_local_rank(),
        "local_world_size": ctx.get_local_world_size(),
        "node_rank": ctx.get_node_rank(),
        "node_id": node_id,
        "ip": next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?"),
    }
    return ray_rank.rank_entry(config, ranks)


def _tag_nodes(reporter: Any, placed: Dict[int, Tuple[str, str]]) -> None:
    """Tag the trial's run with the nodes its last worker group ran on (``trial.nodes``)."""
    if reporter is not None and placed:
        nodes = sorted({f"{ip} ({node[:12]})" for node, ip in placed.values()})
        reporter.tag(tags.TRIAL_NODES, ", ".join(nodes))


def launch_trial(
    spec: Dict[str, Any],
    reporter: Any,
    world_size: int,
    launch: Dict[str, Any],
    *,
    placement: Placement,
    slot: Optional[BoardSlot] = None,
) -> Dict[str, Any]:
    """Run ``trainers.loop.worker_entry`` in ``world_size`` workers on Ray; rank 0's summary.
    The same signature as :func:`orchestrator.launch.launch_local`, plus where the workers go and,
    for a job of a Ray sweep, its ``slot``: its place on the sweep's progress board and, with
    ``launch.ray.reuse_workers``, the sweep's pool of warm worker groups
    (:mod:`orchestrator.ray_pool`). Else the workers are a Ray Train worker group of its own.

    A failed worker group is restarted up to ``launch.max_failures`` times, on whatever nodes Ray
    gives it, resuming from the newest complete checkpoint; a restart is attempted only when the
    nodes still alive can hold the whole group (else it would wait for capacity forever). A
    failure that lost a node ends ``node_lost``, naming it."""
    ray_cfg = launch["ray"]
    max_failures = int(launch["max_failures"])
    with cluster(ray_cfg):
        import ray

        rt = spec.runtime
        pool = slot.pool if slot is not None and ray_cfg["reuse_workers"] else None
        run = _Attempts(
            spec=spec,
            reporter=reporter,
            workers_reporter=relay.for_workers(reporter),
            world_size=world_size,
            placement=placement,
            env=launch_env(rt.env, launch),
            board=ray.get_actor(slot.board) if slot is not None else None,
            key=slot.key if slot is not None else -1,
            pool=pool,
            roster=None if pool else relay.on_this_node(_Roster),
            name=f"trial-{getattr(reporter, 'run_id', None) or uuid.uuid4().hex[:12]}",
        )
        for attempt in range(max_failures + 1):
            try:
                summary, placed = run.attempt(attempt, max_failures)
                _tag_nodes(reporter, placed)
                return summary
            except Exception as err:
                if not attempt_failed(err):
                    raise
                failed = err
            # outside the handler: a TrialFailed raised from here carries no attempt's error as its context
            run.fail_or_restart(failed, attempt, max_failures)
        raise AssertionError("unreachable")


@dataclass
class _Attempts:
    """What every attempt of one trial on Ray shares: its workers' spec, environment and reporter,
    where they go, and either the sweep's pool of warm groups or a roster of its own group's nodes."""

    spec: Any
    reporter: Any
    workers_reporter: Any  # the reporter itself, or a relay to it when a node cannot reach the store
    world_size: int
    placement: Placement
    env: Dict[str, str]
    board: Any
    key: int
    pool: Any
    roster: Any
    name: str

    def fail_or_restart(self, err: BaseException, attempt: int, max_failures: int) -> None:
        """After attempt ``attempt`` failed with ``err``: raise TrialFailed (its status and reason;
        ``node_lost`` naming the lost nodes) when it was the last one or the nodes still alive
        cannot hold the group; else return, and the group is started again."""
        import ray

        reason = failure_reason(err)
        status = classify(reason)
        placed = err.placed if self.pool else ray.get(self.roster.nodes.remote(attempt))
        _tag_nodes(self.reporter, placed)
        lost = lost_nodes(placed)
        if lost:
            status, reason = statuses.NODE_LOST, f"lost node {', '.join(lost)}: {reason}"
        if attempt == max_failures:
            raise TrialFailed(status, reason)
        try:
            self.placement.units(self.world_size, live_totals(self.placement.resource))
        except TrialFailed as no_room:
            raise TrialFailed(status, f"{reason}; not restarted: {no_room.reason}") from None
        log.warning("trial attempt %d ended %s (%s): restarting", attempt, status, reason)

    def attempt(self, attempt: int, max_failures: int) -> Tuple[Dict[str, Any], Dict[int, Tuple[str, str]]]:
        """One attempt: rank 0's summary and where each rank ran."""
        import ray

        placement, rt = self.placement, self.spec.runtime
        units = placement.units(self.world_size, live_totals(placement.resource))
        strategy = "STRICT_PACK" if placement.nodes == 1 else "PACK"
        config = {
            "spec": self.spec,
            "reporter": self.workers_reporter,
            "cwd": os.getcwd(),
            "board": self.board,
            "key": self.key,
            "attempt": attempt,
            "roster": self.roster,
        }
        log.info(
            "trial on Ray: %d worker(s) x {%s: %d}%s%s%s",
            self.world_size,
            placement.resource,
            units,
            ", whole nodes" if placement.exclusive else "",
            ", warm group pool" if self.pool else "",
            f", restart {attempt} of {max_failures}" if attempt else "",
        )
        if self.pool:
            timeout_s = float(math.ceil(float(rt.timeout_s)))
            env = _group_env(self.spec, self.env)
            summary, placed, group = ray_pool.run_trial(
                self.pool, config, self.world_size, placement.resource, units, strategy, env, timeout_s
            )
            if self.reporter is not None:
                self.reporter.tag(tags.TRIAL_WORKER_GROUP, f"{group['group']} (trial {group['reused'] + 1})")
            return summary, placed
        name = f"{self.name}-{attempt}"
        summary = _fit(config, self.world_size, placement, units, strategy, rt, self.env, name)
        return summary, ray.get(self.roster.nodes.remote(attempt))


def _group_env(spec: Any, env: Dict[str, str]) -> Dict[str, str]:
    """The environment a warm group's workers start with: the trial's, plus the determinism
    variables when ``trainer.deterministic`` (the trainer sets them in its process and never unsets
    them: a group that ran a deterministic trial would make every later trial in it deterministic
    too, so such trials get groups of their own)."""
    if not spec.trainer.deterministic:
        return env
    from trainers import rules

    return {**rules.determinism_env(spec.runtime.device_type), **env}


def _fit(
    config: Dict[str, Any],
    world_size: int,
    placement: Placement,
    units: int,
    strategy: str,
    rt: Any,
    env: Dict[str, str],
    name: str,
) -> Dict[str, Any]:
    """One attempt as a Ray Train TorchTrainer of its own (restarts are the caller's: it checks
    the capacity left and names lost nodes); rank 0's summary."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    trainer = _trainer_class()(
        _train_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=world_size,
            use_gpu=placement.resource == "GPU",
            resources_per_worker={placement.resource: units},
            # one node: all on it (as the local launcher would); more: fill nodes in turn
            placement_strategy=strategy,
        ),
        torch_config=TorchConfig(backend=rt.backend, timeout_s=int(math.ceil(float(rt.timeout_s)))),
        run_config=RunConfig(
            name=name,
            # every restart is the caller's, preemptions included (Ray Train's own default
            # retries a preempted node's group without end, outside the caller's count, its
            # capacity check and the attempt number the fault drills read)
            failure_config=FailureConfig(max_failures=0, max_preemption_failures=0),
            worker_runtime_env={"env_vars": env} if env else None,
            callbacks=_accelerator_callbacks(placement.resource),
        ),
    )
    return trainer.fit().return_value or {}


def _trainer_class():
    """Ray Train's TorchTrainer without its placement-group cleaner. The cleaner is a detached
    actor that asks the State API whether the trial's controller still lives, and it finds the
    State API through RAY_ADDRESS or the last `ray start` on this machine, not through the cluster
    it runs in: beside another cluster (or a stale one's address file) it holds every trial 12 s
    after its last step, or takes a live controller for dead and removes its placement group.
    Without it a trial's placement group goes with its worker group, or at the latest with the
    process that launched the trial."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [
                cb for cb in super()._create_default_callbacks() if type(cb).__name__ != "PlacementGroupCleanerCallback"
            ]

    return Trainer


def _accelerator_callbacks(resource: str) -> Optional[list]:
    """Ray Train shares CUDA_VISIBLE_DEVICES among a node's workers (so LOCAL_RANK indexes the
    device, as under torchrun) but not ASCEND_RT_VISIBLE_DEVICES; do the same for NPUs."""
    if resource != "NPU":
        return None
    from ray.train.v2._internal.callbacks.accelerators import _share_accelerator_ids
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    class ShareNpus(WorkerGroupCallback):
        def before_init_train_context(self, workers):
            _share_accelerator_ids(workers, "NPU", "ASCEND_RT_VISIBLE_DEVICES")
            return {}

    return [ShareNpus()]


def trial_launcher(placement: Placement, slot: Optional[BoardSlot] = None):
    """The Ray launch path of a trial placed so, with the signature of ``launch_local``."""
    return functools.partial(launch_trial, placement=placement, slot=slot)
