"""A profiled window's wall time split into compute, communication and idle, from a trace's spans
(``trainers.profiling`` runs the window; ``trainers.ascend_profile`` reads torch_npu's own split).

Accounting works on busy intervals, not on summed operator times, because those double count:

- on CUDA, torch links every kernel to the aten op that launched it (by correlation id), so the op's row
  and the kernel's row of ``key_averages()`` both carry the kernel's device time ("by design",
  pytorch/pytorch#60783). Only the device's own kernel / memcpy / memset events are used here.
- compute and communication overlap: NCCL kernels run on their own stream, and gloo runs its collectives
  on its own threads while backward goes on. Overlapping time is counted once.

So ``compute_s`` is the length of the union of compute intervals, ``comm_s`` that of communication
intervals, ``overlap_s`` their intersection, and idle the rest of the window. The shares of the wall,
``compute_share + comm_share + idle_share == 1``, count communication only where it is exposed (not hidden
behind compute), as Ascend's "Communication(Not Overlapped)" does.

On the host (CPU/gloo) ops nest: an aten op inside a module's record_function inside autograd's
evaluate_function. Each instant of a thread goes to the innermost op active then (its self time), which is
compute or communication by its name (``is_comm``); then categories are unioned across threads.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

# A record_function range around the whole window: it gives the window's start and end in the trace's own
# clock (host ops and, via kineto's clock alignment, device kernels), so clipping needs no clock mapping.
WINDOW_MARK = "profile_window"

_COMM = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|alltoall|barrier|send|recv|"
    r"gloo|nccl|hccl|hcom|c10d::|record_param_comms",
    re.IGNORECASE,
)
# NCCL's device kernels: ncclKernel_* (NCCL < 2.19) and ncclDevKernel_* (newer)
_NCCL_KERNEL = re.compile(r"^nccl(Dev)?Kernel_")


def is_comm(name: str) -> bool:
    """Whether a host op / framework op name is a collective or point-to-point operation."""
    return bool(_COMM.search(name))


def is_comm_kernel(name: str) -> bool:
    """Whether a CUDA kernel is a NCCL communication kernel."""
    return bool(_NCCL_KERNEL.match(name))


# ---------------------------------------------------------------------------------------------------------
# The accounting core: no torch


Interval = Tuple[float, float, str]  # (start, end, "compute" | "comm")
CATEGORIES = ("compute", "comm")


def _merged(pairs: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for s, e in sorted(pairs):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _length(merged: Sequence[Tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def _intersection(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class Breakdown:
    """A window's wall time split; ``compute_s`` and ``comm_s`` each count their overlap."""

    wall_s: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    overlap_s: float = 0.0

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_s - self.overlap_s

    @property
    def idle_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s - self.exposed_comm_s)

    def _share(self, t: float) -> float:
        return t / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def compute_share(self) -> float:
        return self._share(self.compute_s)

    @property
    def comm_share(self) -> float:
        return self._share(self.exposed_comm_s)

    @property
    def idle_share(self) -> float:
        return self._share(self.idle_s)


def breakdown(intervals: Iterable[Interval], wall: float) -> Breakdown:
    """Compute / communication / overlap of busy ``intervals`` in the window ``[0, wall]``; intervals are
    clipped to the window, and may overlap one another (streams, threads, nesting)."""
    pairs: Dict[str, List[Tuple[float, float]]] = {c: [] for c in CATEGORIES}
    for start, end, category in intervals:
        if category not in pairs:
            raise ValueError(f"unknown interval category {category!r}; expected one of {CATEGORIES}")
        pairs[category].append((max(0.0, start), min(wall, end)))
    compute, comm = _merged(pairs["compute"]), _merged(pairs["comm"])
    return Breakdown(wall, _length(compute), _length(comm), _intersection(compute, comm))


class Span(NamedTuple):
    """One traced event. ``track``: the host thread or device stream it ran on."""

    name: str
    track: Hashable
    start: float
    end: float
    on_device: bool = False


def self_time_pieces(spans: Iterable[Span]) -> List[Tuple[float, float, str]]:
    """Per track, each instant goes to the innermost span active then: the one that started last (on a tie,
    the one that ends first, a child opening with its parent). For properly nested ops these are their self
    times; spans that do not nest (async ranges on a thread) still get each instant exactly once.
    Returns ``(start, end, name)`` pieces, disjoint within a track."""
    by_track: Dict[Hashable, List[Span]] = defaultdict(list)
    for sp in spans:
        if sp.end > sp.start:
            by_track[sp.track].append(sp)
    pieces: List[Tuple[float, float, str]] = []
    for track in by_track.values():
        track.sort(key=lambda sp: (sp.start, -sp.end))
        bounds = sorted({t for sp in track for t in (sp.start, sp.end)})
        active: List[Tuple[float, float, int]] = []  # heap of (-start, end, -index): innermost on top
        k, last = 0, None  # last: [start, end, index] of the piece being extended
        for lo, hi in zip(bounds, bounds[1:]):
            while k < len(track) and track[k].start <= lo:
                heapq.heappush(active, (-track[k].start, track[k].end, -k))
                k += 1
            while active and active[0][1] <= lo:  # every end is a bound, so none ends inside (lo, hi)
                heapq.heappop(active)
            if not active:
                continue
            idx = -active[0][2]
            if last is not None and last[2] == idx and last[1] == lo:
                last[1] = hi
            else:
                if last is not None:
                    pieces.append((last[0], last[1], track[last[2]].name))
                last = [lo, hi, idx]
        if last is not None:
            pieces.append((last[0], last[1], track[last[2]].name))
    return pieces


def top_rows(times: Dict[str, float], calls: Dict[str, int], comm) -> List[Dict[str, Any]]:
    rows = [{"op": n, "self_s": t, "calls": calls.get(n, 0), "comm": comm(n)} for n, t in times.items() if t > 0]
    rows.sort(key=lambda r: r["self_s"], reverse=True)
    return rows


def analyse_spans(
    spans: Sequence[Span], on_device: bool, wall_s: Optional[float] = None
) -> Tuple[Breakdown, List[Dict[str, Any]]]:
    """The breakdown and the ops by time of one rank's trace.

    ``spans`` are in microseconds of one clock. The window is the ``WINDOW_MARK`` host span; without one, it
    starts at the first host span and lasts ``wall_s`` (or runs to the last span). ``on_device``: account the
    device's kernels (CUDA); otherwise the host's ops (CPU/gloo). Times come back in seconds.
    """
    marks = [sp for sp in spans if sp.name == WINDOW_MARK and not sp.on_device]
    if marks:
        t0, t1 = marks[0].start, marks[0].end
    else:
        host = [sp for sp in spans if not sp.on_device] or list(spans)
        if not host:
            return Breakdown(wall_s or 0.0), []
        t0 = min(sp.start for sp in host)
        t1 = t0 + wall_s * 1e6 if wall_s else max(sp.end for sp in spans)
    times: Dict[str, float] = defaultdict(float)
    calls: Dict[str, int] = defaultdict(int)
    account = _device_ops if on_device else _host_ops
    intervals = account(spans, t0, t1, times, calls)
    return breakdown(intervals, (t1 - t0) / 1e6), top_rows(times, calls, is_comm_kernel if on_device else is_comm)


def _clip(s: float, e: float, t0: float, t1: float) -> Tuple[float, float]:
    """A span of microseconds as seconds into the window [t0, t1], cut to it."""
    return (max(s, t0) - t0) / 1e6, (min(e, t1) - t0) / 1e6


def _device_ops(
    spans: Sequence[Span], t0: float, t1: float, times: Dict[str, float], calls: Dict[str, int]
) -> List[Interval]:
    """The device's kernels, memcpy and memset in the window, each counted once, on its own
    event, any stream: their intervals, with ``times`` and ``calls`` added to per name."""
    intervals: List[Interval] = []
    for sp in spans:
        if not sp.on_device:
            continue
        s, e = _clip(sp.start, sp.end, t0, t1)
        if e <= s:
            continue
        intervals.append((s, e, "comm" if is_comm_kernel(sp.name) else "compute"))
        times[sp.name] += e - s
        calls[sp.name] += 1
    return intervals


def _host_ops(
    spans: Sequence[Span], t0: float, t1: float, times: Dict[str, float], calls: Dict[str, int]
) -> List[Interval]:
    """The host's ops in the window by self time: their intervals, with ``times`` and ``calls``
    added to per name.

    What a dp2 gloo DDP trace holds (torch 2.13, CPU): on the main thread, autograd's AccumulateGrad hook
    runs `c10d::allreduce_` (tens of us: it only enqueues the bucket); the reduction itself is an async
    `gloo:all_reduce` range on one of gloo's two `pt_gloo_runloop` threads, from the start of the work to
    its completion (waiting on the peer included), while backward goes on: that is the overlap. At the
    end of backward the main thread waits for the last buckets outside any op, so that gap is covered
    by gloo's ranges only: exposed communication. No `record_param_comms` range is recorded on gloo.
    Limit of a host view: a blocking wait inside an op's range is that op's self time, so it counts as
    compute (e.g. DDP's bucket-rebuild broadcasts inside `DistributedDataParallel.forward` of its second
    iteration), which overstates the overlap of that step.
    """
    host = [sp for sp in spans if not sp.on_device and sp.name != WINDOW_MARK]
    for sp in host:
        if sp.end > t0 and sp.start < t1:
            calls[sp.name] += 1
    intervals: List[Interval] = []
    for start, end, name in self_time_pieces(host):
        s, e = _clip(start, end, t0, t1)
        if e <= s:
            continue
        intervals.append((s, e, "comm" if is_comm(name) else "compute"))
        times[name] += e - s
    return intervals


# ---------------------------------------------------------------------------------------------------------
# Where the spans come from


_HOST_CATS = {"cpu_op", "user_annotation"}
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def spans_from_events(events: Iterable[Any]) -> List[Span]:
    """Spans from torch.profiler's ``prof.events()`` (FunctionEvents, microseconds from the trace start).

    A FunctionEvent's ``activity_type`` is kineto's activity name, the chrome trace's ``cat``: host ops and
    record_function ranges (``cpu_op``, ``user_annotation``) and device work (``kernel``, ``gpu_memcpy``,
    ``gpu_memset``) are kept; ``gpu_user_annotation`` (a record_function range copied onto the device
    timeline, spanning whole regions), ``cuda_runtime`` and ``python_function`` are not. Without an
    ``activity_type`` (older torch), device work is ``device_type != CPU`` less the user annotations. A CPU
    event's ``thread`` is its host thread (async ranges such as gloo's keep the thread they started on)."""
    cpu = torch.autograd.DeviceType.CPU
    out = []
    for e in events:
        kind = getattr(e, "activity_type", None)
        if kind:
            if kind not in _HOST_CATS | _DEVICE_CATS:
                continue
            on_device = kind in _DEVICE_CATS
        else:
            on_device = e.device_type != cpu
            if on_device and getattr(e, "is_user_annotation", False):
                continue
        track = ("device", e.device_index, getattr(e, "device_resource_id", 0)) if on_device else e.thread
        out.append(Span(e.name, track, float(e.time_range.start), float(e.time_range.end), on_device))
    return out


def spans_from_chrome_trace(trace: Any) -> List[Span]:
    """Spans from an exported chrome trace (a path, or the loaded JSON): complete events (``ph == "X"``) of
    host categories ``cpu_op`` / ``user_annotation`` and device categories ``kernel`` / ``gpu_memcpy`` /
    ``gpu_memset`` (kineto's names; ``gpu_user_annotation`` is left out, as in ``spans_from_events``)."""
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in _HOST_CATS | _DEVICE_CATS:
            continue
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        out.append(Span(ev.get("name", ""), (ev.get("pid"), ev.get("tid")), ts, ts + dur, ev["cat"] in _DEVICE_CATS))
    return out
