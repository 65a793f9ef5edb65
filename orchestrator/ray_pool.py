"""Warm worker groups in a Ray sweep: trials of one shape run one after another in the same
worker processes, as Ray Tune's actor reuse runs them.

Starting a trial's workers is most of what a short trial costs on Ray: new processes, each
importing torch and the trainer, then Ray Train's controller and its rendezvous. A multirun of
the Ray launcher keeps a *pool* (a threaded Ray actor on the driver's node, for the whole
multirun, so an OVAT study's later batches find the groups of its earlier ones). A trial asks it
for a group of its *shape*: world size, the Ray resource and units each worker holds, the
placement strategy, and the environment its workers start with (NCCL and HCCL read some variables
once per process, so a group never changes its environment: a trial that sweeps one gets groups
of its own). It gets an idle group of that shape when there is one, else a new one.

Each trial still builds everything that is its own: the process group, on a fresh rendezvous
store whose port rank 0 binds itself (no probe-then-bind race), the device mesh, the model, the
optimizer, the data loader. What stays is the interpreter, torch's import and the devices. A trial
that ends well gives its group back; one that fails discards it (a rank may be dead, hung, or
holding a broken communicator), and a restart gets a new group. An idle group holds its placement
group's resources: a trial waiting for resources evicts the idle groups of other shapes.

The pool owns its groups' actors: they end with it, and it ends with the multirun's driver.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("orchestrator")

# the Ray resource of a chip -> the variable its devices are made visible by (Ray sets it per
# actor to the actor's own devices; a node's ranks share the union, so LOCAL_RANK indexes it, as
# under torchrun and as Ray Train does for GPUs)
VISIBLE = {"GPU": "CUDA_VISIBLE_DEVICES", "NPU": "ASCEND_RT_VISIBLE_DEVICES"}
WAIT_S = 2.0  # a placement group not ready yet: evict idle groups and look again this often
GRACE_S = 5.0  # after a rank fails, how long its peers get to fail in turn (for the reason)
IDLE_TRIES = 3  # idle groups found dead (a node lost while they waited) before a trial fails


def shape_key(world_size: int, resource: str, units: int, strategy: str, env: Dict[str, str]) -> str:
    """The shape a group serves: trials with the same key may share it."""
    return json.dumps([world_size, resource, units, strategy, sorted(env.items())])


class Rank:
    """One worker process of a warm group (a Ray actor in one bundle of the group's placement
    group). It runs trials one at a time; nothing of a trial but the imports outlives it."""

    def __init__(self) -> None:
        self._store: Any = None
        self._visible: Optional[str] = None

    def where(self, resource: str) -> Tuple[str, str, List[str], int]:
        """(node id, node address, the devices of ``resource`` Ray gave it, pid)."""
        import ray

        ctx = ray.get_runtime_context()
        ids = [str(i) for i in ctx.get_accelerator_ids().get(resource, [])]
        return ctx.get_node_id(), ray.util.get_node_ip_address(), ids, os.getpid()

    def open_store(self, host: str, world_size: int, timeout_s: float) -> int:
        """Rank 0: a rendezvous store for the next trial, on a port the OS picks; returns it."""
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(
            host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return int(self._store.port)

    def run(self, config: Dict[str, Any], ranks: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """One trial on this rank: ``ranks`` holds its RANK, LOCAL_RANK, ..., where the store is,
        and the node's shared device visibility."""
        import datetime

        import torch.distributed as dist

        from orchestrator.ray_rank import rank_entry

        visible = ranks.get("visible")
        if visible is not None and self._visible is None:  # before the first trial touches the device
            os.environ[VISIBLE[ranks["resource"]]] = visible
            self._visible = visible
        rank = int(ranks["rank"])
        store = self._store
        if rank != 0:
            timeout = datetime.timedelta(seconds=float(ranks["timeout_s"]))
            store = dist.TCPStore(ranks["master"], int(ranks["port"]), int(ranks["world_size"]), False, timeout=timeout)
        self._store = None
        # the trainer tears down the process group and releases the device's memory after the trial
        return rank_entry(config, ranks, store=store)


class Group:
    """A placement group and one :class:`Rank` actor per bundle, ranks in bundle order."""

    def __init__(self, key: str, pg: Any, actors: List[Any]):
        self.id = uuid.uuid4().hex[:12]
        self.key, self.pg, self.actors = key, pg, actors
        self.trials = 0  # trials it has run (0: a new group)


class Pool:
    """The multirun's groups (a Ray actor; calls run on its threads): idle ones by shape, and
    every group it made until one is discarded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: Dict[str, List[Group]] = {}
        self._groups: Dict[str, Group] = {}
        self._pending: List[Any] = []  # placement groups still waiting for resources
        self.created = 0

    def acquire(self, key: str, bundle: Dict[str, float], count: int, strategy: str, env: Dict[str, str]) -> Group:
        """An idle group of shape ``key``, else a new one (waits until Ray can place it,
        evicting idle groups of other shapes meanwhile)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
        pg = placement_group([dict(bundle)] * count, strategy=strategy)
        with self._lock:
            self._pending.append(pg)
        placed = pg.ready()
        try:
            while not ray.wait([placed], timeout=WAIT_S)[0]:
                # a group of this shape came back while this one waited (it may hold the very
                # resources this one waits for): take it instead
                with self._lock:
                    idle = self._idle.get(key)
                    group = idle.pop() if idle else None
                if group is not None:
                    remove_placement_group(pg)
                    return group
                self.evict(keep=key)
        finally:
            with self._lock:
                self._pending = [p for p in self._pending if p.id != pg.id]
        options = {
            "num_cpus": bundle.get("CPU", 0),
            "num_gpus": bundle.get("GPU", 0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
            "runtime_env": {"env_vars": env} if env else None,
            "max_restarts": 0,
        }
        rank_actor = ray.remote(Rank)
        actors = [
            rank_actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i), **options).remote()
            for i in range(count)
        ]
        group = Group(key, pg, actors)
        with self._lock:
            self._groups[group.id] = group
            self.created += 1
        return group

    def release(self, group: Group) -> None:
        """A group whose trial ended well: idle, for the next trial of its shape."""
        group.trials += 1
        with self._lock:
            if group.id in self._groups:
                self._idle.setdefault(group.key, []).append(group)

    def discard(self, group_id: str) -> None:
        """A group whose trial failed: its processes and its placement group go."""
        with self._lock:  # a group in use: acquire took it out of the idle ones
            group = self._groups.pop(group_id, None)
        if group is not None:
            _destroy(group)

    def evict(self, keep: Optional[str] = None) -> int:
        """Discard the idle groups of every shape but ``keep``; how many went."""
        with self._lock:
            gone = [g for key, groups in self._idle.items() if key != keep for g in groups]
            self._idle = {key: groups for key, groups in self._idle.items() if key == keep}
            for g in gone:
                self._groups.pop(g.id, None)
        for g in gone:
            _destroy(g)
        return len(gone)

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"created": self.created, "alive": len(self._groups), "idle": sum(map(len, self._idle.values()))}

    def close(self) -> None:
        """Every group and every pending placement group goes (the multirun is over)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            groups, pending = list(self._groups.values()), list(self._pending)
            self._groups, self._idle, self._pending = {}, {}, []
        for g in groups:
            _destroy(g)
        for pg in pending:
            remove_placement_group(pg)


def _destroy(group: Group) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in group.actors:
        ray.kill(actor, no_restart=True)
    try:
        remove_placement_group(group.pg)
    except Exception as err:  # noqa: BLE001 - already gone with its node
        log.debug("placement group of group %s: %s", group.id, err)


class GroupFailed(Exception):
    """A rank of a warm group failed: ``failures`` rank -> its exception, ``placed`` rank ->
    (node id, address)."""

    def __init__(self, failures: Dict[int, BaseException], placed: Dict[int, Tuple[str, str]]):
        super().__init__(f"{len(failures)} rank(s) failed")
        self.worker_failures, self.placed = failures, placed


def ranks_by_node(where: Sequence[Tuple[str, str, List[str], int]]) -> List[Dict[str, Any]]:
    """Each actor's RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK from where Ray put it
    (``where``: per actor, in bundle order, (node id, address, device ids, pid)): a node's actors
    take consecutive ranks, nodes in the order their first bundle comes, as Ray Train numbers them;
    each actor's devices are the node's union, its LOCAL_RANK indexing its own."""
    nodes: List[str] = []
    for node, *_ in where:
        if node not in nodes:
            nodes.append(node)
    order = sorted(range(len(where)), key=lambda i: (nodes.index(where[i][0]), i))
    out: List[Dict[str, Any]] = [{} for _ in where]
    for rank, i in enumerate(order):
        node = where[i][0]
        peers = [j for j in order if where[j][0] == node]
        devices = sorted({d for j in peers for d in where[j][2]}, key=lambda d: (len(d), d))
        own = where[i][2]
        out[i] = {
            "rank": rank,
            "local_rank": devices.index(own[0]) if own else peers.index(i),
            "local_world_size": len(peers),
            "node_rank": nodes.index(node),
            "node_id": node,
            "ip": where[i][1],
            "visible": ",".join(devices) if devices else None,
        }
    return out


def live_group(
    pool: Any, world_size: int, resource: str, units: int, strategy: str, env: Dict[str, str]
) -> Tuple[Group, List[Tuple[str, str, List[str], int]]]:
    """A group of this shape from ``pool`` whose workers all answer, and where each is. An idle
    group that lost a worker while it waited (its node went) is discarded and another taken,
    without charging the trial a failure; a new group that fails to start raises GroupFailed."""
    import ray

    key = shape_key(world_size, resource, units, strategy, env)
    for tries in range(IDLE_TRIES):
        group = ray.get(pool.acquire.remote(key, {resource: units}, world_size, strategy, env))
        try:
            return group, ray.get([a.where.remote(resource) for a in group.actors])
        except Exception as err:  # noqa: BLE001 - a worker died: its node went, or it never started
            ray.get(pool.discard.remote(group.id))
            if group.trials == 0 or tries == IDLE_TRIES - 1:  # a new group: the trial's own failure
                raise GroupFailed({0: err}, {}) from None
            log.info("warm group %s lost a worker while idle (%s): another group", group.id, type(err).__name__)
    raise AssertionError("unreachable")


def run_trial(
    pool_name: str,
    config: Dict[str, Any],
    world_size: int,
    resource: str,
    units: int,
    strategy: str,
    env: Dict[str, str],
    timeout_s: float,
) -> Tuple[Dict[str, Any], Dict[int, Tuple[str, str]], Dict[str, Any]]:
    """One attempt of a trial on a warm group from the pool named ``pool_name``: (rank 0's
    summary, rank -> (node id, address), what the group was: its id and the trials it ran before).
    Raises :class:`GroupFailed` (the group discarded) when a rank fails."""
    import ray

    pool = ray.get_actor(pool_name)
    group, where = live_group(pool, world_size, resource, units, strategy, env)
    ranks = ranks_by_node(where)
    placed = {r["rank"]: (r["node_id"], r["ip"]) for r in ranks}
    first = next(i for i, r in enumerate(ranks) if r["rank"] == 0)
    common = {"world_size": world_size, "resource": resource, "timeout_s": timeout_s, "master": ranks[first]["ip"]}
    info = {"group": group.id, "reused": group.trials}
    try:
        common["port"] = ray.get(group.actors[first].open_store.remote(ranks[first]["ip"], world_size, timeout_s))
        refs = {group.actors[i].run.remote(config, {**ranks[i], **common}): ranks[i]["rank"] for i in range(world_size)}
    except Exception as err:  # noqa: BLE001
        ray.get(pool.discard.remote(group.id))
        raise GroupFailed({0: err}, placed) from None
    summary, failures = _gather(refs)
    if failures:
        ray.get(pool.discard.remote(group.id))
        raise GroupFailed(failures, placed)
    ray.get(pool.release.remote(group))
    return summary or {}, placed, info


def _gather(refs: Dict[Any, int]) -> Tuple[Optional[Dict[str, Any]], Dict[int, BaseException]]:
    """Wait for every rank; on the first failure, give the others ``GRACE_S`` to fail in turn
    (the rank that failed first is not always the one to name), then stop waiting."""
    import ray

    pending, failures, summary = list(refs), {}, None
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            break
        ref = ready[0]
        try:
            value = ray.get(ref)
            if refs[ref] == 0:
                summary = value
        except Exception as err:  # noqa: BLE001 - a rank's error or its process's death
            cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
            failures[refs[ref]] = cause if isinstance(cause, BaseException) else err
            if deadline is None:
                deadline = time.monotonic() + GRACE_S
    return summary, failures
