"""The profile is analysed after its window closes, off the step thread (trainers/profiling.py).

A planted analyser that waits on an event stands in for a slow analysis: the step that closes the window
returns while it waits, ``result`` stays None, and ``close()`` returns only once it is done. Ordering is
proved with events and threads; the only timeouts are there so that a broken implementation fails instead
of hanging. On an NPU, a stand-in ``torch_npu`` package (importable here and by child processes) records
how the profile is handed over and analyses it in whichever process calls its ``analyse``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import trainers.profiling as profiling
from trainers.profiling import Profiler

HANG = 60.0  # how long a planted analyser waits to be let go, at most


def test_the_closing_step_returns_while_the_analysis_runs_and_close_waits_for_it(tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    order, analysed_on = [], []
    real = profiling.analyse_spans

    def slow(spans, on_device, wall_s=None):
        analysed_on.append(threading.get_ident())
        started.set()
        release.wait(HANG)
        order.append("analysis done")
        return real(spans, on_device, wall_s)

    monkeypatch.setattr(profiling, "analyse_spans", slow)
    # every step() on this thread, as the training loop calls it: kineto stops on the thread that started it
    prof = Profiler(True, 0, 1, str(tmp_path), torch.device("cpu"), rank=0)
    try:
        prof.step(0)
        torch.ones(64, 64) @ torch.ones(64, 64)
        prof.step(1)
        # step() returned and the analysis is not done: only this thread lets it go (a step() that ran the
        # analysis itself would have returned after "analysis done", HANG seconds later)
        assert order == [], "step() waited for the analysis"
        assert started.wait(HANG)  # the analysis is under way, on another thread, held by the planted analyser
        assert analysed_on and analysed_on[0] != threading.get_ident()
        assert prof.result is None  # not ready until it is done
        for step in range(2, 6):  # training goes on meanwhile
            prof.step(step)
            torch.ones(64, 64) @ torch.ones(64, 64)
        assert order == [] and prof.result is None

        def closing():
            prof.close()
            order.append("close returned")

        closer = threading.Thread(target=closing, daemon=True)
        closer.start()
        closer.join(1.0)  # a close() that does not wait is done by now; one that waits cannot be
        assert "close returned" not in order
    finally:
        release.set()
    closer.join(HANG)
    assert order == ["analysis done", "close returned"]
    r = prof.result
    assert r is not None and r.wall_s > 0 and r.compute_s > 0
    assert r.trace_path == str(tmp_path / "trace_rank0.json") and os.path.exists(r.trace_path)
    assert "aten::mm" in r.table


def test_the_cuda_cpu_path_parses_events_off_the_step_thread(tmp_path, monkeypatch):
    """torch.profiler parses its events lazily, on ``events()``; that and the export happen on the analysis
    thread, the step thread only stops the collection."""
    step_thread = threading.get_ident()
    seen = {}
    real_events = torch.profiler.profile.events
    real_export = torch.profiler.profile.export_chrome_trace

    def events(self):
        seen["events"] = threading.get_ident()
        return real_events(self)

    def export(self, path):
        seen["export"] = threading.get_ident()
        return real_export(self, path)

    monkeypatch.setattr(torch.profiler.profile, "events", events)
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    prof = Profiler(True, 0, 1, str(tmp_path), torch.device("cpu"), rank=0)
    prof.step(0)
    torch.ones(8, 8) @ torch.ones(8, 8)
    prof.step(1)
    prof.close()
    assert set(seen) == {"events", "export"} and step_thread not in seen.values()
    assert prof.result.wall_s > 0


# --- Ascend NPU: torch_npu's analysis, in a child process --------------------------------------------

FAKE_PROFILER = '''
"""Stands in for torch_npu.profiler: a profile that writes its raw data directory when it stops and, like
torch_npu's tensorboard_trace_handler, analyses it there when analyse_flag is true."""
import os
import time

HANDLERS = []


class ProfilerLevel:
    Level1 = "Level1"


class AiCMetrics:
    AiCoreNone = "AiCoreNone"


class ProfilerActivity:
    CPU, NPU = "CPU", "NPU"


class _ExperimentalConfig:
    def __init__(self, **kw):
        self.kw = kw


def tensorboard_trace_handler(dir_name=None, worker_name=None, analyse_flag=True, async_mode=False):
    def handler(prof):
        if analyse_flag:
            from torch_npu.profiler.profiler import analyse
            analyse(prof.run_dir)

    handler.dir_name, handler.worker_name, handler.analyse_flag = dir_name, worker_name, analyse_flag
    HANDLERS.append(handler)
    return handler


class profile:
    def __init__(self, activities=None, record_shapes=False, experimental_config=None, on_trace_ready=None):
        self.on_trace_ready = on_trace_ready

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        h = self.on_trace_ready
        self.run_dir = os.path.join(h.dir_name, "%s_%d_%d_ascend_pt" % (h.worker_name, os.getpid(), time.time_ns()))
        os.makedirs(self.run_dir)  # the raw data; ASCEND_PROFILER_OUTPUT is the analysis's
        h(self)
'''

FAKE_ANALYSE = '''
"""Stands in for torch_npu.profiler.profiler.analyse: waits for FAKE_NPU_RELEASE, then writes
step_trace_time.csv (in torch_npu's header) and the pid of the process that analysed."""
import csv, os, time


def analyse(profiler_path, max_process_number=None, export_type=None):
    open(os.environ["FAKE_NPU_STARTED"], "w").close()
    deadline = time.time() + 60
    while not os.path.exists(os.environ["FAKE_NPU_RELEASE"]) and time.time() < deadline:
        time.sleep(0.01)
    out = os.path.join(profiler_path, "ASCEND_PROFILER_OUTPUT")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "step_trace_time.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Device_id", "Step", "Computing", "Communication(Not Overlapped)", "Overlapped",
                    "Communication", "Free", "Stage", "Bubble",
                    "Communication(Not Overlapped and Exclude Receive)", "Preparing"])
        w.writerow([0, "", 6000.0, 1000.0, 1000.0, 2000.0, 3000.0, 0, 0, 1000.0, 0])
    with open(os.path.join(profiler_path, "analysed_by"), "w") as f:
        f.write(str(os.getpid()))
'''


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    root = tmp_path / "site"
    pkg = root / "torch_npu" / "profiler"
    pkg.mkdir(parents=True)
    (root / "torch_npu" / "__init__.py").write_text("from . import profiler  # noqa: F401\n")
    (pkg / "__init__.py").write_text(FAKE_PROFILER)
    (pkg / "profiler.py").write_text(FAKE_ANALYSE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    flags = SimpleNamespace(started=tmp_path / "started", release=tmp_path / "release")
    monkeypatch.setenv("FAKE_NPU_STARTED", str(flags.started))
    monkeypatch.setenv("FAKE_NPU_RELEASE", str(flags.release))
    monkeypatch.setattr(torch, "npu", SimpleNamespace(synchronize=lambda: None), raising=False)
    yield flags
    flags.release.touch()  # a broken implementation's analysis is let go
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]


def test_npu_analysis_runs_in_a_child_process_after_the_window(tmp_path, fake_torch_npu):
    out = tmp_path / "profiles"
    prof = Profiler(True, 0, 1, str(out), device=SimpleNamespace(type="npu"), rank=0)
    prof.step(0)
    prof.step(1)
    (handler,) = sys.modules["torch_npu.profiler"].HANDLERS
    assert handler.analyse_flag is False and handler.worker_name == "rank0"  # not analysed in __exit__
    # step() returned before the analysis wrote anything (only this test lets it go) ...
    (run_dir,) = (out / "npu").glob("rank0_*_ascend_pt")
    assert not (run_dir / "analysed_by").exists() and prof.result is None
    deadline = time.monotonic() + HANG
    while not fake_torch_npu.started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake_torch_npu.started.exists()  # ... and it is under way, held by the stand-in analyser

    fake_torch_npu.release.touch()
    prof.close()
    r = prof.result
    assert r.table.startswith("window") and r.compute_s == pytest.approx(0.006)
    assert r.comm_s == pytest.approx(0.002) and r.overlap_s == pytest.approx(0.001)
    analysed_by = int((run_dir / "analysed_by").read_text())
    assert analysed_by != os.getpid()  # torch_npu's analyse ran in a child, not in the training process


def test_an_npu_analysis_that_writes_nothing_is_reported_not_raised(tmp_path, fake_torch_npu, monkeypatch):
    fake_torch_npu.release.touch()
    monkeypatch.setattr(profiling, "_NPU_ANALYSE", "print('Profiling data parsing failed, error: no msprof')")
    prof = Profiler(True, 0, 1, str(tmp_path), device=SimpleNamespace(type="npu"), rank=0)
    prof.step(0)
    prof.step(1)
    prof.close()
    assert prof.result.table.startswith("profile analysis failed: FileNotFoundError")
    assert "no msprof" in prof.result.table and prof.result.idle_s == prof.result.wall_s
