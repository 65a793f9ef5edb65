"""A profiler window over a few steps: the trace, the top operators, and the split of the window's wall
time into compute, communication and idle (accounted by ``trainers.trace_accounting``; on an Ascend NPU,
read from torch_npu's own ``step_trace_time.csv`` by ``trainers.ascend_profile``).

The analysis runs after the window closes and off the step thread (``Profiler``): a thread exports and
accounts torch.profiler's trace; on an NPU that thread runs torch_npu's offline analyser in a child process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from trainers.ascend_profile import NPU_OUTPUT_DIR, newest_ascend_dir, read_op_statistic, read_step_trace_time
from trainers.trace_accounting import WINDOW_MARK, Breakdown, analyse_spans, spans_from_events

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

    def log_to(self, reporter) -> None:
        """This rank's trace and op table as the run's ``profile/`` artifacts (rank 0's reporter;
        other ranks hold a null one)."""
        table = os.path.join(self.out_dir, "top_ops.txt")
        with open(table, "w") as f:
            f.write(self.result.table)
        for path in (self.result.trace_path, table):
            if path:
                reporter.log_artifact(path, "profile")

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
