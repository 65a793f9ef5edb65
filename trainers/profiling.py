"""A profiler window over a few steps: the trace, the top operators, and the split of the window's wall
time into compute, communication and idle.

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

On an Ascend NPU torch_npu's profiler has no ``events()``; its own analysis writes
``step_trace_time.csv``, which already holds this split per step, and that file is read instead.

The analysis runs after the window closes and off the step thread (``Profiler``): a thread exports and
accounts torch.profiler's trace; on an NPU that thread runs torch_npu's offline analyser in a child process.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import heapq
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
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


def _top_rows(times: Dict[str, float], calls: Dict[str, int], comm) -> List[Dict[str, Any]]:
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
    wall = (t1 - t0) / 1e6

    def clip(s: float, e: float) -> Tuple[float, float]:
        return (max(s, t0) - t0) / 1e6, (min(e, t1) - t0) / 1e6

    times: Dict[str, float] = defaultdict(float)
    calls: Dict[str, int] = defaultdict(int)
    intervals: List[Interval] = []
    if on_device:
        # kernels, memcpy and memset: each counted once, on its own event; any stream
        for sp in spans:
            if not sp.on_device:
                continue
            s, e = clip(sp.start, sp.end)
            if e <= s:
                continue
            comm = is_comm_kernel(sp.name)
            intervals.append((s, e, "comm" if comm else "compute"))
            times[sp.name] += e - s
            calls[sp.name] += 1
        top = _top_rows(times, calls, is_comm_kernel)
    else:
        # What a dp2 gloo DDP trace holds (torch 2.13, CPU): on the main thread, autograd's AccumulateGrad hook
        # runs `c10d::allreduce_` (tens of us: it only enqueues the bucket); the reduction itself is an async
        # `gloo:all_reduce` range on one of gloo's two `pt_gloo_runloop` threads, from the start of the work to
        # its completion (waiting on the peer included), while backward goes on: that is the overlap. At the
        # end of backward the main thread waits for the last buckets outside any op, so that gap is covered
        # by gloo's ranges only: exposed communication. No `record_param_comms` range is recorded on gloo.
        # Limit of a host view: a blocking wait inside an op's range is that op's self time, so it counts as
        # compute (e.g. DDP's bucket-rebuild broadcasts inside `DistributedDataParallel.forward` of its second
        # iteration), which overstates the overlap of that step.
        host = [sp for sp in spans if not sp.on_device and sp.name != WINDOW_MARK]
        for sp in host:
            if sp.end > t0 and sp.start < t1:
                calls[sp.name] += 1
        for start, end, name in self_time_pieces(host):
            s, e = clip(start, end)
            if e <= s:
                continue
            intervals.append((s, e, "comm" if is_comm(name) else "compute"))
            times[name] += e - s
        top = _top_rows(times, calls, is_comm)
    return breakdown(intervals, wall), top


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


# Ascend NPU: torch_npu's own analysis output (Ascend/pytorch, torch_npu/profiler/analysis/).
# step_trace_time.csv, written by prof_view/_trace_step_time_parser.py (TraceStepTimeParser.title):
#   Device_id, Step, Computing, Communication(Not Overlapped), Overlapped, Communication, Free, Stage, Bubble,
#   Communication(Not Overlapped and Exclude Receive), Preparing
# in microseconds, one row per device and step (Step empty when no schedule marks steps), where
# Overlapped = Communication - Communication(Not Overlapped).
# op_statistic.csv: prof_bean/_op_statistic_bean.py (OpStatisticBean.HEADERS):
#   OP Type, Core Type, Count, Total Time(us), Min Time(us), Avg Time(us), Max Time(us), Ratio(%)
# Both are read by header name, so a column added or moved in another version does not shift the others.
NPU_OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"  # prof_common_func/_constant.py: Constant.OUTPUT_DIR


def _float(value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    return v if v == v else 0.0  # NaN


def _column(header: Sequence[str], *names: str) -> Optional[str]:
    """The header entry equal to one of ``names``, ignoring case and surrounding spaces."""
    norm = {h.strip().lower(): h for h in header if h}
    for n in names:
        if n.lower() in norm:
            return norm[n.lower()]
    return None


def read_step_trace_time(path: str, wall_s: float = 0.0) -> Breakdown:
    """The breakdown summed over the rows (steps) of a ``step_trace_time.csv``. The wall is the host's
    ``wall_s`` or, if longer, the device's own Computing + Communication(Not Overlapped) + Free."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        cols = {
            "compute": _column(header, "Computing"),
            "comm": _column(header, "Communication"),
            "not_overlapped": _column(header, "Communication(Not Overlapped)"),
            "overlapped": _column(header, "Overlapped"),
            "free": _column(header, "Free"),
        }
        if cols["compute"] is None or cols["comm"] is None:
            raise ValueError(f"{path}: no Computing / Communication columns in {header}")
        sums = dict.fromkeys(cols, 0.0)
        for row in reader:
            for key, col in cols.items():
                if col is not None:
                    sums[key] += _float(row.get(col))
    compute, comm = sums["compute"] / 1e6, sums["comm"] / 1e6
    if cols["overlapped"] is not None:
        overlap = sums["overlapped"] / 1e6
    elif cols["not_overlapped"] is not None:
        overlap = comm - sums["not_overlapped"] / 1e6
    else:
        overlap = 0.0
    overlap = min(max(overlap, 0.0), compute, comm)
    device_wall = compute + comm - overlap + sums["free"] / 1e6
    return Breakdown(max(wall_s, device_wall), compute, comm, overlap)


def read_op_statistic(path: str) -> List[Dict[str, Any]]:
    """Ops by total device time from an ``op_statistic.csv`` (rows per OP Type and Core Type, merged)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        name_col = _column(header, "OP Type", "Op Type", "Type", "Name")
        time_col = _column(header, "Total Time(us)", "Total Time")
        count_col = _column(header, "Count")
        if name_col is None or time_col is None:
            raise ValueError(f"{path}: no OP Type / Total Time(us) columns in {header}")
        times: Dict[str, float] = defaultdict(float)
        calls: Dict[str, int] = defaultdict(int)
        for row in reader:
            name = (row.get(name_col) or "").strip()
            times[name] += _float(row.get(time_col)) / 1e6
            calls[name] += int(_float(row.get(count_col))) if count_col else 0
    return _top_rows(times, calls, is_comm)


def newest_ascend_dir(root: str, worker: str) -> Optional[str]:
    """The newest ``<worker>_<pid>_<time>_ascend_pt`` directory under ``root`` (the name torch_npu's
    ``_profiler_path_creator.py: ProfPathCreator.create_prof_dir`` gives each profile)."""
    found = [d for d in glob.glob(os.path.join(root, f"{worker}_*_ascend_pt")) if os.path.isdir(d)]
    return max(found, key=os.path.getmtime) if found else None


# ---------------------------------------------------------------------------------------------------------
# The profiler window


# the keys of ``ProfileResult.metrics()``: the same on every rank, so ranks can gather them whether or not
# their own window produced a result
METRIC_KEYS = (
    "comm_share",
    "compute_share",
    "profile_compute_s",
    "profile_comm_s",
    "profile_overlap_s",
    "profile_idle_s",
    "profile_wall_s",
)


@dataclass
class ProfileResult:
    trace_path: Optional[str] = None
    table: str = ""
    compute_s: float = 0.0  # union of compute intervals
    comm_s: float = 0.0  # union of communication intervals, overlapped with compute or not
    idle_s: float = 0.0
    wall_s: float = 0.0
    overlap_s: float = 0.0  # communication hidden behind compute
    top: List[Dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, b: Breakdown, **kw) -> "ProfileResult":
        return cls(
            compute_s=b.compute_s, comm_s=b.comm_s, idle_s=b.idle_s, wall_s=b.wall_s, overlap_s=b.overlap_s, **kw
        )

    @property
    def breakdown(self) -> Breakdown:
        return Breakdown(self.wall_s, self.compute_s, self.comm_s, self.overlap_s)

    @property
    def comm_share(self) -> float:
        """Exposed communication (not hidden behind compute) as a share of the wall."""
        return self.breakdown.comm_share

    @property
    def compute_share(self) -> float:
        return self.breakdown.compute_share

    def metrics(self) -> Dict[str, float]:
        """The split as summary metrics: the keys are ``METRIC_KEYS``."""
        return {
            "comm_share": self.comm_share,
            "compute_share": self.compute_share,
            "profile_compute_s": self.compute_s,
            "profile_comm_s": self.comm_s,
            "profile_overlap_s": self.overlap_s,
            "profile_idle_s": self.idle_s,
            "profile_wall_s": self.wall_s,
        }


def format_table(b: Breakdown, top: Sequence[Dict[str, Any]], time_label: str, rows: int = 25) -> str:
    lines = [
        f"window {b.wall_s:.6f} s: compute {b.compute_s:.6f} s ({b.compute_share:.1%}), "
        f"communication {b.comm_s:.6f} s of which exposed {b.exposed_comm_s:.6f} s ({b.comm_share:.1%}), "
        f"idle {b.idle_s:.6f} s ({b.idle_share:.1%})",
        "",
        f"{'op':<80} {time_label:>12} {'% wall':>7} {'calls':>7} {'comm':>5}",
    ]
    for r in top[:rows]:
        name = r["op"] if len(r["op"]) <= 80 else r["op"][:77] + "..."
        share = r["self_s"] / b.wall_s if b.wall_s > 0 else 0.0
        lines.append(f"{name:<80} {r['self_s']:>12.6f} {share:>7.1%} {r['calls']:>7d} {'yes' if r['comm'] else '':>5}")
    return "\n".join(lines) + "\n"


# torch_npu's offline analyser, run in a process of its own (see ``Profiler._offline_analyse``); it lowers
# its own priority so that its parsing pool yields the host's cores to the training processes
_NPU_ANALYSE = "import os, sys\nos.nice(10)\nfrom torch_npu.profiler.profiler import analyse\nanalyse(sys.argv[1])\n"
NPU_ANALYSE_TIMEOUT_S = 1800.0


class Profiler:
    """Profiles steps ``start .. start + steps - 1``; ``step(i)`` is called at every step start.

    The step that closes the window only stops the collection; the trace is exported and analysed on a
    thread of its own, so the rank's next collective is not held back by the analysis (on an NPU, torch_npu's
    parsing of a large profile takes long enough to push a peer's wait toward HCCL_EXEC_TIMEOUT). ``result``
    is None until the analysis is done; ``close()`` waits for it.
    """

    def __init__(self, enabled: bool, start: int, steps: int, out_dir: str, device: torch.device, rank: int):
        self.enabled, self.start, self.stop = enabled, start, start + steps
        self.out_dir, self.device, self.rank = out_dir, device, rank
        self._prof = None
        self._mark = None
        self._t0 = 0.0
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ProfileResult] = None

    @property
    def result(self) -> Optional[ProfileResult]:
        """The window's analysis once it is done (set once, by the analysis thread, when complete)."""
        return self._result

    @property
    def _npu_root(self) -> str:
        return os.path.join(self.out_dir, "npu")

    def _profile(self):
        if self.device.type == "npu":
            import torch_npu  # type: ignore[import-not-found]

            npu_prof = torch_npu.profiler
            # Level1, not the default Level0: Level0 collects ACL_PROF_TASK_TIME_L0 | ACL_PROF_ACL_API only,
            # Level1 adds ACL_PROF_HCCL_TRACE (torch_npu/csrc/profiler/profiler_mgr.h), the HCCL data the
            # Communication columns of step_trace_time.csv come from. Level0 does run TraceStepTimeParser
            # (ParserConfig.COMMON_CONFIG, analysis/prof_config/_parser_config.py; only Level_none skips it).
            # No AI Core PMU metrics: they are not used here and cost collection time.
            cfg_kw: Dict[str, Any] = {"profiler_level": npu_prof.ProfilerLevel.Level1}
            if hasattr(npu_prof.AiCMetrics, "AiCoreNone"):
                cfg_kw["aic_metrics"] = npu_prof.AiCMetrics.AiCoreNone
            return npu_prof.profile(
                activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
                record_shapes=False,
                experimental_config=npu_prof._ExperimentalConfig(**cfg_kw),
                on_trace_ready=self._npu_trace_handler(npu_prof),
            )
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=acts, record_shapes=False)

    def _npu_trace_handler(self, npu_prof):
        """Writes ``<dir>/<worker>_<pid>_<time>_ascend_pt`` when the profile stops, without analysing it.

        ``tensorboard_trace_handler(dir_name, worker_name, analyse_flag=True, async_mode=False)`` (torch_npu
        ``profiler/profiler.py``) runs ``prof_if.analyse()`` inside ``prof.__exit__``, on the step thread, when
        ``analyse_flag`` is true; with ``analyse_flag=False`` "the collected data can be analysed offline"
        (Ascend Extension for PyTorch API reference, torch_npu.profiler.tensorboard_trace_handler) by
        ``torch_npu.profiler.profiler.analyse(path)``. ``async_mode=True`` is no way out: its pool is forked
        from this process (``NpuProfiler.analyse`` sets the "fork" start method, process-wide, with
        ``force=True``: analysis/_npu_profiler.py) and is never joined. Releases without ``analyse_flag``
        (``tensorboard_trace_handler(dir_name, worker_name, use_gzip)``, CANN 7.0) analyse in ``__exit__``:
        nothing to do about that here; the analysis thread then finds the CSVs already written."""
        kw = {"worker_name": f"rank{self.rank}"}
        try:
            return npu_prof.tensorboard_trace_handler(self._npu_root, analyse_flag=False, **kw)
        except TypeError:
            return npu_prof.tensorboard_trace_handler(self._npu_root, **kw)

    def _sync(self) -> None:
        # the window's edges are host times; on an accelerator, wait for the work queued before each edge so
        # that the device's own activity falls inside the window it belongs to (torch.npu from torch_npu)
        if self.device.type in ("cuda", "npu"):
            getattr(torch, self.device.type).synchronize()

    def step(self, step: int) -> None:
        if not self.enabled:
            return
        if step == self.start:
            self._sync()
            self._prof = self._profile()
            self._prof.__enter__()
            self._mark = torch.profiler.record_function(WINDOW_MARK)
            self._mark.__enter__()
            self._t0 = time.perf_counter()
        elif step == self.stop and self._prof is not None:
            self._finish()

    def close(self) -> None:
        """At the end of training: closes a window that ran to the last step, and waits for the analysis."""
        if self._prof is not None:
            self._finish()
        if self._thread is not None:
            self._thread.join()

    def _finish(self) -> None:
        """On the step thread: stop collecting (cheap: torch.profiler parses its events lazily, on
        ``events()``; torch_npu writes its raw data), then hand the window to the analysis thread."""
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        mark, self._mark = self._mark, None
        mark.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        self._thread = threading.Thread(
            target=self._analyse, args=(prof, wall), name=f"profile-analysis-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def _analyse(self, prof, wall: float) -> None:
        """Off the step thread: export the trace and account the window; sets ``result`` when done."""
        path = os.path.join(self.out_dir, f"trace_rank{self.rank}.json")
        try:  # an analysis that fails must not end the trial: the window is then reported as all idle
            os.makedirs(self.out_dir, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # an earlier run's trace is not this one's
                os.remove(path)
            if self.device.type == "npu":
                b, top = self._npu_analysis(wall, path)
                time_label = "device_s"
            else:
                with contextlib.suppress(Exception):  # nor must a trace that cannot be written
                    prof.export_chrome_trace(path)
                b, top = analyse_spans(spans_from_events(prof.events()), self.device.type == "cuda", wall)
                time_label = "kernel_s" if self.device.type == "cuda" else "self_cpu_s"
            table = format_table(b, top, time_label)
        except Exception as e:
            b, top, table = Breakdown(wall), [], f"profile analysis failed: {type(e).__name__}: {e}\n"
        self._result = ProfileResult.of(
            b, trace_path=path if os.path.exists(path) else None, table=table, top=list(top[:25])
        )

    def _npu_analysis(self, wall: float, trace_copy: str) -> Tuple[Breakdown, List[Dict[str, Any]]]:
        run_dir = newest_ascend_dir(self._npu_root, f"rank{self.rank}")
        if run_dir is None:
            raise FileNotFoundError(f"no rank{self.rank}_*_ascend_pt under {self._npu_root}")
        out = os.path.join(run_dir, NPU_OUTPUT_DIR)
        step_csv = os.path.join(out, "step_trace_time.csv")
        if not os.path.exists(step_csv):  # not analysed when the profile stopped (analyse_flag=False)
            said = self._offline_analyse(run_dir)
            if not os.path.exists(step_csv):
                raise FileNotFoundError(f"torch_npu's analysis wrote no {step_csv}: {said}")
        b = read_step_trace_time(step_csv, wall)
        top: List[Dict[str, Any]] = []
        with contextlib.suppress(Exception):
            top = read_op_statistic(os.path.join(out, "op_statistic.csv"))
        with contextlib.suppress(Exception):  # trace_view.json, the chrome-format timeline: this rank's trace
            shutil.copyfile(os.path.join(out, "trace_view.json"), trace_copy)
        return b, top

    @staticmethod
    def _offline_analyse(run_dir: str) -> str:
        """torch_npu's offline analysis of one ``*_ascend_pt`` directory, in a child process.

        Not in this process, even on a thread: ``NpuProfiler.analyse`` calls
        ``multiprocessing.set_start_method("fork", force=True)`` and forks its parsing pool from the caller
        (analysis/_npu_profiler.py), which here holds the device and the communicators, and it is pure Python
        that would hold the GIL against the training thread; it also refuses to run in a daemon process.
        ``analyse`` swallows its own errors (``@no_exception_func``), so success is judged by the CSV it writes;
        returns the end of what the child printed, for the message when there is none."""
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _NPU_ANALYSE, run_dir],
                capture_output=True,
                text=True,
                timeout=NPU_ANALYSE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"torch_npu's analysis of {run_dir} ran past {NPU_ANALYSE_TIMEOUT_S:.0f} s") from e
        if proc.returncode != 0:
            raise RuntimeError(f"torch_npu's analysis of {run_dir} exited {proc.returncode}: {proc.stderr[-500:]}")
        return (proc.stdout + proc.stderr).strip()[-500:]
