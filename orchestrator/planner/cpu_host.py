"""A CPU host shared by a trial's worker processes, as the step-time model sees it
(:mod:`orchestrator.planner.step_time`): each worker gets ``cores // workers`` threads, at least
one (``trainers.rules.worker_threads``, as ``trainers/runtime.py select_device`` gives them), so
the node asks ``u = workers x threads / cores`` cores of each core; a collective's members are
scheduled in turn where they ask more cores than the host has; a collective every worker is in
idles the host while it waits. On an accelerator every figure here is neutral (1, 1, 0)."""

from __future__ import annotations

import functools
from typing import Tuple

from omegaconf import DictConfig

from orchestrator.planner.shapes import ParallelShape
from trainers import rules
from trainers.host import host_cores


@functools.lru_cache(maxsize=1)
def _this_host_cores() -> int:
    """This machine's cores, read once: the search plans thousands of points, and each read of the
    affinity and the cgroup files costs ~80 us."""
    return int(host_cores())


def _host(s: ParallelShape, chip: DictConfig, planner: DictConfig) -> Tuple[int, int, int]:
    """A CPU host's cores, the trial's workers on it and the threads the trainer gives each."""
    cores = int(planner.get("host_cores", 0) or 0) or _this_host_cores()
    workers = min(s.world, max(1, int(chip.devices_per_node)))
    return cores, workers, rules.worker_threads(cores, workers)


def cpu_share(s: ParallelShape, chip: DictConfig, planner: DictConfig) -> float:
    """Cores each core of a CPU host is asked for (``u`` above): a node's workers times the
    threads the trainer gives each, over the host's cores; 1 on an accelerator."""
    if chip.device_type != "cpu":
        return 1.0
    cores, workers, threads = _host(s, chip, planner)
    return workers * threads / cores


def group_wait(group: int, s: ParallelShape, chip: DictConfig, planner: DictConfig) -> float:
    """How many times as long a collective of ``group`` ranks waits on a CPU host: its members
    ask ``group x threads`` cores, and past the host's cores they are scheduled in turn; 1 on an
    accelerator."""
    if chip.device_type != "cpu":
        return 1.0
    cores, _, threads = _host(s, chip, planner)
    return max(1.0, group * threads / cores)


def lockstep(group: int, s: ParallelShape, chip: DictConfig) -> float:
    """1.0 where a collective group of ``group`` ranks (more than one) holds every worker of a
    CPU node: its waits idle the host; else 0.0."""
    if chip.device_type != "cpu" or group < 2:
        return 0.0
    return 1.0 if group >= min(s.world, max(1, int(chip.devices_per_node))) else 0.0
