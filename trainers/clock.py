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
"""

from __future__ import annotations

import time
from typing import List, Tuple

import torch


class StepClock:
    def __init__(self, device: torch.device):
        self.events = device.type in ("cuda", "npu")
        # whether stop()'s figure is the step's time itself (the CPU), known without a wait
        self.host_timed = not self.events
        self._mod = getattr(torch, device.type) if self.events else None
        self._open: Tuple = ()
        self._laps: List[Tuple] = []

    def start(self) -> None:
        """A step begins (call before its first kernel is queued)."""
        self._open = (self._mark(), time.perf_counter())

    def stop(self) -> float:
        """The step's work is queued; returns the host's seconds for it: on the CPU the step's
        time, elsewhere a progress bar's figure (the step's own time comes from :meth:`collect`)."""
        start, host_t0 = self._open
        end = self._mark()
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
