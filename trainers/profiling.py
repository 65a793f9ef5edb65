"""A profiler window over a few steps: the trace, the top operators, and the split of step time
into compute, communication and idle.

torch.profiler records host and device activity (CUDA; on Ascend, torch_npu.profiler with the
same interface). Communication is every collective or point-to-point operator (c10d, gloo,
NCCL, HCCL, pipelining send/recv); compute is the other operators; idle is what is left of the
window's wall time. Operator times are self times, so nested ops are not counted twice.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

_COMM = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|alltoall|barrier|send|recv|"
    r"gloo|nccl|hccl|c10d::",
    re.IGNORECASE,
)


def is_comm(name: str) -> bool:
    return bool(_COMM.search(name))


@dataclass
class ProfileResult:
    trace_path: Optional[str] = None
    table: str = ""
    compute_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    wall_s: float = 0.0
    top: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.wall_s if self.wall_s > 0 else 0.0

    def metrics(self) -> Dict[str, float]:
        return {
            "comm_share": self.comm_share,
            "profile_compute_s": self.compute_s,
            "profile_comm_s": self.comm_s,
            "profile_idle_s": self.idle_s,
            "profile_wall_s": self.wall_s,
        }


class Profiler:
    """Profiles steps ``start .. start + steps - 1``; ``step(i)`` is called at every step start."""

    def __init__(self, enabled: bool, start: int, steps: int, out_dir: str, device: torch.device, rank: int):
        self.enabled, self.start, self.stop = enabled, start, start + steps
        self.out_dir, self.device, self.rank = out_dir, device, rank
        self._prof = None
        self._t0 = 0.0
        self.result: Optional[ProfileResult] = None

    def _activities(self):
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    def _profile(self):
        if self.device.type == "npu":
            import torch_npu  # type: ignore[import-not-found]

            npu_prof = torch_npu.profiler
            return npu_prof.profile(
                activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU], record_shapes=False
            )
        return torch.profiler.profile(activities=self._activities(), record_shapes=False)

    def step(self, step: int) -> None:
        import time

        if not self.enabled:
            return
        if step == self.start:
            self._prof = self._profile()
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif step == self.stop and self._prof is not None:
            self._finish(time.perf_counter() - self._t0)

    def close(self) -> None:
        """At the end of training, if the window ran to the last step."""
        import time

        if self._prof is not None and self.result is None:
            self._finish(time.perf_counter() - self._t0)

    def _finish(self, wall: float) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"trace_rank{self.rank}.json")
        with contextlib.suppress(Exception):  # a trace that cannot be written must not end the trial
            prof.export_chrome_trace(path)
        events = prof.key_averages()
        device_attr = "self_device_time_total" if self.device.type != "cpu" else "self_cpu_time_total"
        comm = compute = 0.0
        top = []
        for e in events:
            t = float(getattr(e, device_attr, 0.0) or 0.0) / 1e6  # microseconds
            if t <= 0:
                continue
            if is_comm(e.key):
                comm += t
            else:
                compute += t
            top.append({"op": e.key, "self_s": t, "calls": int(e.count), "comm": is_comm(e.key)})
        top.sort(key=lambda r: r["self_s"], reverse=True)
        # host-side self times can exceed the wall on a multi-threaded CPU; scale them into it
        busy = compute + comm
        if busy > wall > 0:
            compute, comm = compute * wall / busy, comm * wall / busy
        sort_by = "self_cpu_time_total" if self.device.type == "cpu" else "self_device_time_total"
        self.result = ProfileResult(
            trace_path=path if os.path.exists(path) else None,
            table=events.table(sort_by=sort_by, row_limit=25),
            compute_s=compute,
            comm_s=comm,
            idle_s=max(0.0, wall - compute - comm),
            wall_s=wall,
            top=top[:25],
        )
