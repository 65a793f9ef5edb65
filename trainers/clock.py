"""Step times without a host sync per step.

On the CPU the host does the work, so a step's wall-clock time is its time. On a GPU or an NPU the
host only queues kernels and runs ahead of the device; waiting for the device at every step
(``synchronize``) to read a wall clock stalls the queue, and the device idles while the host
builds the next step. :class:`StepClock` records an event on the device's current stream at each
step's start and end instead (``torch.cuda.Event(enable_timing=True)``; torch_npu has the same
class on ``torch.npu``, its ``npu/streams.py``: ``Event(enable_timing=...)``, ``record``,
``elapsed_time`` in milliseconds) and reads the durations back when the loop reads its other
metrics, every ``trainer.log_every`` steps: one wait for the last event, then host arithmetic.

A step's time is then the device's time between its start and end markers: its kernels and any
gap the device spent waiting for the host within the step, which is what a user of the device
pays. Work between steps (a metric flush, a checkpoint, an evaluation) is outside both markers.

The clock also reads the process's CPU time (``time.process_time``: every thread of the process,
user and system) at both ends of a step: what the host worked for the step, against which the
step's wall time tells how much of it the host spent waiting (on a collective, a pipeline peer, a
device). :func:`host_figures` turns every rank's figure into the trial's.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Sequence, Tuple

import torch

from trainers.host import host_cores


class StepClock:
    def __init__(self, device: torch.device):
        self.events = device.type in ("cuda", "npu")
        # whether stop()'s figure is the step's time itself (the CPU), known without a wait
        self.host_timed = not self.events
        self._mod = getattr(torch, device.type) if self.events else None
        self._open: Tuple = ()
        self._laps: List[Tuple] = []
        self.cpu_s: List[float] = []  # the process's CPU seconds of each step stopped, in order
        self._cpu0 = 0.0

    def start(self) -> None:
        """A step begins (call before its first kernel is queued)."""
        self._open = (self._mark(), time.perf_counter())
        self._cpu0 = time.process_time()

    def stop(self) -> float:
        """The step's work is queued; returns the host's seconds for it: on the CPU the step's
        time, elsewhere a progress bar's figure (the step's own time comes from :meth:`collect`)."""
        start, host_t0 = self._open
        end = self._mark()
        self.cpu_s.append(time.process_time() - self._cpu0)
        host = time.perf_counter() - host_t0 if self.events else end - start
        self._laps.append((start, end, host))
        return host

    def collect(self) -> List[float]:
        """Seconds of each step stopped since the last call, in order. With events this waits for
        the last one (the only wait, once per batch of steps)."""
        laps, self._laps = self._laps, []
        if not laps:
            return []
        if not self.events:
            return [end - start for start, end, _ in laps]
        laps[-1][1].synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end, _ in laps]

    def _mark(self):
        if not self.events:
            return time.perf_counter()
        ev = self._mod.Event(enable_timing=True)
        ev.record()
        return ev


def cores_per_worker() -> float:
    """This worker's share of its host's cores: the host's over the workers on it."""
    return host_cores() / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_figures(cpu_s: Sequence[float], cores: Sequence[float], step_time_s: float) -> Dict[str, float]:
    """The trial's host figures from every rank's median CPU seconds per step (``cpu_s``) and its
    share of its host's cores (``cores``, :func:`cores_per_worker`), in rank order:
    ``host_cpu_s`` the busiest rank's CPU seconds per step (near the step time on an accelerator:
    the host, not the device, sets the pace), ``host_busy`` the share of the hosts' cores the
    ranks kept busy over a step of ``step_time_s`` (on the CPU: below 1, the rest is waiting)."""
    total = sum(cores)
    busy = sum(cpu_s) / (total * step_time_s) if total > 0 and step_time_s > 0 else float("nan")
    return {"host_cpu_s": max(cpu_s), "host_busy": busy}


def median_or_zero(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
