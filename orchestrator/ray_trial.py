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

import contextlib
import functools
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from orchestrator import ray_pool, ray_rank, relay
from orchestrator.launch import TrialFailed, classify, error_summary

log = logging.getLogger("orchestrator")


def cluster_address(ray_cfg: Any) -> Optional[str]:
    """``launch.ray.address``, else ``$RAY_ADDRESS``, else None (a local cluster is started)."""
    address = (ray_cfg.get("address") if ray_cfg is not None else None) or os.environ.get("RAY_ADDRESS")
    return str(address) if address else None


def goes_to_ray(nodes: int, ray_cfg: Any) -> bool:
    """A trial larger than one node, or any trial when a cluster address is set."""
    return nodes > 1 or cluster_address(ray_cfg) is not None


def launch_errors(chip: Any, launch: Any, world_size: int, nodes: int) -> List[str]:
    """Rules of where a trial of ``world_size`` processes on ``nodes`` nodes can run (the planner
    plans any node count; a launch cannot). ``chip`` and ``launch`` are those config sections."""
    if nodes == 1 or cluster_address(launch.ray) is not None:
        return []
    fix = "a multi-node trial runs on a Ray cluster: set launch.ray.address (or RAY_ADDRESS) to one"
    if int(launch.nnodes) > 1:
        return [f"launch.nnodes={launch.nnodes}: {fix}"]
    return [
        f"parallel: dp*tp*pp={world_size} needs {nodes} nodes of chip={chip.name} "
        f"(chip.devices_per_node={chip.devices_per_node}); {fix}"
    ]


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
            raise TrialFailed("infeasible", f"the Ray cluster has no {self.resource} resource")
        units = 1
        if self.exclusive:
            # all of a node's devices, split over the trial's workers on it; what is left over is
            # less than any exclusive trial's share of a node, so no other such trial fits in it
            capable = [t for t in totals if t >= per_node]
            units = capable[0] // per_node if capable else 1
        if self.nodes == 1 and totals[-1] < world_size * units:
            raise TrialFailed(
                "infeasible",
                f"needs {world_size} x {units} {self.resource} on one node; the largest "
                f"node of the Ray cluster has {totals[-1]}",
            )
        if sum(t // units for t in totals) < world_size:
            raise TrialFailed(
                "infeasible",
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


@contextlib.contextmanager
def cluster(ray_cfg: Any, keep: bool = False, init: Optional[Dict[str, Any]] = None) -> Iterator[None]:
    """Connect to the cluster at :func:`cluster_address`, or start a local one (dashboard on
    127.0.0.1 only); a cluster started here stops on leaving, unless ``keep`` (then it stops when
    this process exits). ``init``: more ``ray.init`` keyword arguments, which win over these (a
    ``runtime_env`` is merged over the code's). Inside a Ray task or actor this is a no-op."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = cluster_address(ray_cfg)
    extra = dict(init or {})
    if address:
        runtime_env = {**(_code_runtime_env() or {}), **(extra.pop("runtime_env", None) or {})}
        try:
            ray.init(address=address, **{"log_to_driver": True, "runtime_env": runtime_env or None, **extra})
        except ConnectionError as err:
            raise ConnectionError(
                f"{err} (a cluster started by `ray start` expects a token: export "
                f"RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token)"
            ) from None
    else:
        # "local": a new cluster, even where `ray start` left one running on this machine
        local = {
            "num_cpus": ray_cfg.get("num_cpus"),
            "log_to_driver": True,
            "include_dashboard": bool(ray_cfg.get("dashboard", True)),
            "dashboard_host": "127.0.0.1",
        }
        ray.init(address="local", **{**local, **extra})
    try:
        yield
    finally:
        if not address and not keep:
            ray.shutdown()


def _code_runtime_env() -> Optional[Dict[str, Any]]:
    """What a joined cluster's workers need to import this code: nothing when it is an installed
    package (install it on every node) or inside a submitted job (the job's runtime env rules);
    a source checkout travels as the job's working_dir (Ray uploads it, less what .gitignore lists)."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        return None
    root = Path(__file__).resolve().parents[1]
    return {"working_dir": str(root)} if (root / "pyproject.toml").is_file() else None


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
    return f"rank {rank}: {error_summary(failure)}"


# variables whose value belongs to one host (HCCL_IF_IP: that host's own address) or to one
# rendezvous (NCCL_COMM_ID): never copied from the driver to the workers
NODE_OWN = ("HCCL_IF_IP", "NCCL_COMM_ID")


def worker_env(runtime_env: Dict[str, Any], prefixes: Sequence[str]) -> Dict[str, str]:
    """The environment a trial's workers get on every node (a Ray worker inherits its raylet's
    environment, not the driver's): the backend variables of the chip and ``comm`` sections,
    where a value the user exported on the driver wins (as ``trainers.runtime.apply_env`` lets it
    win on one node), and every driver variable whose name starts with one of ``prefixes``
    (``launch.env_prefixes``). Device visibility is Ray's to set per worker, never copied."""
    env = {k: os.environ.get(k, str(v)) for k, v in runtime_env.items()}
    env.update({k: v for k, v in os.environ.items() if k.startswith(tuple(prefixes))})
    return {k: v for k, v in env.items() if not k.endswith("_VISIBLE_DEVICES") and k not in NODE_OWN}


def live_totals(resource: str) -> List[float]:
    """Each live node's total of ``resource``, as :meth:`Placement.units` takes them."""
    import ray

    return [float(n["Resources"].get(resource, 0.0)) for n in ray.nodes() if n.get("Alive")]


def _tag_nodes(reporter: Any, placed: Dict[int, Tuple[str, str]]) -> None:
    """Tag the trial's run with the nodes its last worker group ran on (``trial.nodes``)."""
    if reporter is not None and placed:
        nodes = sorted({f"{ip} ({node[:12]})" for node, ip in placed.values()})
        reporter.tag("trial.nodes", ", ".join(nodes))


def _pong() -> bool:
    return True


def _lost_nodes(placed: Dict[int, Tuple[str, str]], wait_s: float = 30.0) -> List[str]:
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
    ray_cfg = launch.get("ray") or {}
    max_failures = int(launch.get("max_failures", 0))
    with cluster(ray_cfg):
        import ray

        rt = spec.runtime
        env = worker_env(rt.env, launch.get("env_prefixes") or ())
        board, key = (ray.get_actor(slot.board), slot.key) if slot is not None else (None, -1)
        pool = slot.pool if slot is not None and ray_cfg.get("reuse_workers", True) else None
        roster = None if pool else relay.on_this_node(_Roster)
        workers_reporter = relay.for_workers(reporter)
        name = f"trial-{getattr(reporter, 'run_id', None) or uuid.uuid4().hex[:12]}"
        strategy = "STRICT_PACK" if placement.nodes == 1 else "PACK"
        timeout_s = float(math.ceil(float(rt.timeout_s)))
        for attempt in range(max_failures + 1):
            units = placement.units(world_size, live_totals(placement.resource))
            config = {
                "spec": spec,
                "reporter": workers_reporter,
                "cwd": os.getcwd(),
                "board": board,
                "key": key,
                "attempt": attempt,
                "roster": roster,
            }
            log.info(
                "trial on Ray: %d worker(s) x {%s: %d}%s%s%s",
                world_size,
                placement.resource,
                units,
                ", whole nodes" if placement.exclusive else "",
                ", warm group pool" if pool else "",
                f", restart {attempt} of {max_failures}" if attempt else "",
            )
            try:
                if pool:
                    summary, placed, group = ray_pool.run_trial(
                        pool, config, world_size, placement.resource, units, strategy, _group_env(spec, env), timeout_s
                    )
                    if reporter is not None:
                        reporter.tag("trial.worker_group", f"{group['group']} (trial {group['reused'] + 1})")
                else:
                    summary = _fit(config, world_size, placement, units, strategy, rt, env, f"{name}-{attempt}")
                    placed = ray.get(roster.nodes.remote(attempt))
                _tag_nodes(reporter, placed)
                return summary
            except Exception as err:
                if not _attempt_failed(err):
                    raise
                reason = failure_reason(err)
                status = classify(reason)
                placed = err.placed if pool else ray.get(roster.nodes.remote(attempt))
            _tag_nodes(reporter, placed)
            lost = _lost_nodes(placed)
            if lost:
                status, reason = "node_lost", f"lost node {', '.join(lost)}: {reason}"
            if attempt == max_failures:
                raise TrialFailed(status, reason)
            try:
                placement.units(world_size, live_totals(placement.resource))
            except TrialFailed as no_room:
                raise TrialFailed(status, f"{reason}; not restarted: {no_room.reason}") from None
            log.warning("trial attempt %d ended %s (%s): restarting", attempt, status, reason)
        raise AssertionError("unreachable")


def _group_env(spec: Any, env: Dict[str, str]) -> Dict[str, str]:
    """The environment a warm group's workers start with: the trial's, plus the determinism
    variables when ``trainer.deterministic`` (the trainer sets them in its process and never unsets
    them: a group that ran a deterministic trial would make every later trial in it deterministic
    too, so such trials get groups of their own)."""
    if not spec.trainer.deterministic:
        return env
    from trainers import rules

    return {**rules.determinism_env(spec.runtime.device_type), **env}


def _attempt_failed(err: BaseException) -> bool:
    """Whether ``err`` is an attempt's worker group failing (Ray Train's or a warm group's)."""
    from ray.train import TrainingFailedError

    return isinstance(err, (TrainingFailedError, ray_pool.GroupFailed))


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
