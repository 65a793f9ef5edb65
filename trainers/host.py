"""The CPU cores this process may use: the fewest of what the kernel reports, what the process's
affinity mask allows (``taskset``, a batch scheduler's binding) and what its control group's CPU
quota grants (a container's or a Kubernetes pod's CPU limit: cgroup v2 ``cpu.max``, cgroup v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``). ``os.cpu_count()`` alone counts the machine's
cores, so a worker in a 2-core pod on a 64-core host would start 64 threads and time-share 2."""

from __future__ import annotations

import os
from pathlib import Path


def _quota(root: Path) -> float:
    """Cores the control group's CPU quota grants, or infinity where none is set."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().partition(" ")
        if quota.strip() != "max" and period.strip():
            return int(quota) / int(period)
        return float("inf")
    v1 = root / "cpu" / "cpu.cfs_quota_us"
    if v1.is_file():
        quota = int(v1.read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else float("inf")
    return float("inf")


def host_cores(cgroup_root: str = "/sys/fs/cgroup") -> float:
    """The cores this process may keep busy (at least one; a fraction where the quota gives one)."""
    cores = float(os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    try:
        cores = min(cores, _quota(Path(cgroup_root)))
    except (OSError, ValueError):
        pass  # an unreadable or unexpected control file: the other two figures stand
    return max(1.0, cores)
