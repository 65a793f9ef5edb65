"""The profiler's compute / communication / idle accounting.

Hand-made intervals and spans with known answers; then a real data-parallel trace: two gloo processes
train a small DDP model under ``trainers.profiling.Profiler``, whose gloo all-reduces run on gloo's own
threads while backward goes on, and each rank's exported chrome trace is checked against a reference
computed another way (sampling the trace on a 1 us grid); then torch_npu's CSV output, written here in the
format torch_npu's parsers write it.
"""

from __future__ import annotations

import csv
import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import held_port
from trainers.ascend_profile import read_op_statistic, read_step_trace_time
from trainers.profiling import ProfileResult
from trainers.trace_accounting import (
    WINDOW_MARK,
    Breakdown,
    Span,
    analyse_spans,
    breakdown,
    is_comm_kernel,
    self_time_pieces,
    spans_from_chrome_trace,
    spans_from_events,
)


def _close(b: Breakdown, compute, comm, overlap, idle):
    assert (b.compute_s, b.comm_s, b.overlap_s, b.idle_s) == pytest.approx((compute, comm, overlap, idle), abs=1e-12)


def test_overlap_is_counted_once_and_shares_add_up():
    b = breakdown([(0, 4, "compute"), (2, 6, "comm")], wall=10)
    _close(b, compute=4, comm=4, overlap=2, idle=4)
    assert (b.compute_share, b.comm_share, b.idle_share) == pytest.approx((0.4, 0.2, 0.4))
    # communication entirely hidden behind compute is not exposed
    hidden = breakdown([(0, 8, "compute"), (1, 3, "comm"), (4, 7, "comm")], wall=10)
    _close(hidden, compute=8, comm=5, overlap=5, idle=2)
    assert hidden.comm_share == 0


def test_two_streams_union_per_category():
    # compute kernels on two streams overlap each other; a NCCL kernel on a third overlaps both
    b = breakdown([(0, 3, "compute"), (5, 7, "compute"), (1, 4, "compute"), (2, 6, "comm")], wall=10)
    _close(b, compute=6, comm=4, overlap=3, idle=3)  # compute [0,4]+[5,7]; overlap [2,4]+[5,6]
    assert b.compute_share + b.comm_share + b.idle_share == pytest.approx(1)


def test_intervals_are_clipped_to_the_window():
    b = breakdown([(-3, 1, "compute"), (8, 14, "comm"), (12, 13, "compute"), (-2, -1, "comm")], wall=10)
    _close(b, compute=1, comm=2, overlap=0, idle=7)
    with pytest.raises(ValueError, match="category"):
        breakdown([(0, 1, "memcpy")], wall=1)


def test_nested_ops_on_one_thread_get_their_self_time():
    spans = [
        Span("DistributedDataParallel.forward", 1, 0, 10),
        Span("aten::linear", 1, 1, 5),
        Span("aten::addmm", 1, 1, 4),  # opens with its parent: the inner one
        Span("c10d::allreduce_", 1, 6, 9),
        Span("aten::mm", 2, 2, 8),  # another thread, running meanwhile
    ]
    pieces = sorted(self_time_pieces(spans))
    assert pieces == [
        (0, 1, "DistributedDataParallel.forward"),
        (1, 4, "aten::addmm"),
        (2, 8, "aten::mm"),
        (4, 5, "aten::linear"),
        (5, 6, "DistributedDataParallel.forward"),
        (6, 9, "c10d::allreduce_"),
        (9, 10, "DistributedDataParallel.forward"),
    ]
    b, top = analyse_spans(
        [Span(WINDOW_MARK, 1, 0, 10e6)] + [s._replace(start=s.start * 1e6, end=s.end * 1e6) for s in spans], False
    )
    _close(b, compute=9, comm=3, overlap=2, idle=0)  # compute [0,8]+[9,10] over both threads; comm [6,9]
    assert {r["op"]: r["self_s"] for r in top}["DistributedDataParallel.forward"] == pytest.approx(3)
    assert WINDOW_MARK not in {r["op"] for r in top}  # the window's own range is not an op


def test_async_ranges_that_do_not_nest_share_their_thread():
    # gloo records its collectives as async ranges; two on one thread may overlap without nesting
    pieces = sorted(self_time_pieces([Span("gloo:all_reduce", 7, 0, 5), Span("gloo:all_reduce", 7, 3, 9)]))
    assert pieces == [(0, 3, "gloo:all_reduce"), (3, 9, "gloo:all_reduce")]


def test_cuda_counts_each_kernel_once_not_on_its_launching_op():
    us = 1e6
    spans = [
        Span(WINDOW_MARK, 1, 0, 10 * us),
        Span("aten::mm", 1, 0, 5 * us),  # host: launched the gemm, its key_averages row carries the kernel too
        Span("ampere_sgemm_128x64_nn", ("device", 0, 7), 1 * us, 4 * us, True),
        Span(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            ("device", 0, 20),
            3 * us,
            6 * us,
            True,
        ),
        Span("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", ("device", 0, 20), 9 * us, 12 * us, True),
    ]
    b, top = analyse_spans(spans, on_device=True)
    _close(b, compute=3, comm=4, overlap=1, idle=4)  # the all-gather runs past the window's end: 1 s in it
    assert [r["op"] for r in top if not r["comm"]] == ["ampere_sgemm_128x64_nn"]
    assert sum(r["self_s"] for r in top) == pytest.approx(7)
    assert is_comm_kernel("ncclKernel_AllReduce_RING_LL_Sum_float") and not is_comm_kernel("void at::nccl_like")


def _event(name, kind, start, end, thread=1, device=False, annotation=False):
    """A stand-in for a torch FunctionEvent: the fields spans_from_events reads."""
    import torch

    dt = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        activity_type=kind,
        device_type=dt,
        is_user_annotation=annotation,
        thread=thread,
        device_index=0,
        device_resource_id=7,
        time_range=SimpleNamespace(start=start, end=end),
    )


@pytest.mark.parametrize("with_activity_type", [True, False])
def test_events_from_a_cuda_profile(with_activity_type):
    events = [
        _event(WINDOW_MARK, "user_annotation", 0, 10e6, annotation=True),
        _event(WINDOW_MARK, "gpu_user_annotation", 0, 10e6, device=True, annotation=True),  # not a kernel
        _event("aten::mm", "cpu_op", 1e6, 2e6),
        _event("cudaLaunchKernel", "cuda_runtime", 1.5e6, 1.6e6),
        _event("ampere_sgemm_128x64_nn", "kernel", 2e6, 5e6, device=True),
        _event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 0, 1e6, device=True),
    ]
    if not with_activity_type:  # older torch: no activity_type; cuda_runtime is then a host span, harmless here
        events = [SimpleNamespace(**{**vars(e), "activity_type": None}) for e in events]
    spans = spans_from_events(events)
    assert [sp.name for sp in spans if sp.on_device] == ["ampere_sgemm_128x64_nn", "Memcpy HtoD (Pageable -> Device)"]
    b, top = analyse_spans(spans, on_device=True)
    _close(b, compute=4, comm=0, overlap=0, idle=6)
    assert [r["op"] for r in top] == ["ampere_sgemm_128x64_nn", "Memcpy HtoD (Pageable -> Device)"]


def _grid_reference(spans, window, step=1.0):
    """Compute / comm / overlap by sampling: at each grid point of each thread, the active span that
    started last owns it; categories are OR-ed over threads. Independent of the sweep in profiling.py."""
    from trainers.trace_accounting import is_comm

    t0, t1 = window
    grid = np.arange(t0 + step / 2, t1, step)
    compute = np.zeros(len(grid), bool)
    comm = np.zeros(len(grid), bool)
    tracks = {}
    for sp in spans:
        tracks.setdefault(sp.track, []).append(sp)
    for track in tracks.values():
        owner_start = np.full(len(grid), -np.inf)
        owner_len = np.full(len(grid), np.inf)
        owner_comm = np.zeros(len(grid), bool)
        for sp in track:
            a, z = np.searchsorted(grid, [sp.start, sp.end])
            sel = slice(a, z)
            inner = (sp.start > owner_start[sel]) | (
                (sp.start == owner_start[sel]) & (sp.end - sp.start < owner_len[sel])
            )
            owner_start[sel] = np.where(inner, sp.start, owner_start[sel])
            owner_len[sel] = np.where(inner, sp.end - sp.start, owner_len[sel])
            owner_comm[sel] = np.where(inner, is_comm(sp.name), owner_comm[sel])
        owned = owner_start > -np.inf
        compute |= owned & ~owner_comm
        comm |= owned & owner_comm
    s = step / 1e6
    return compute.sum() * s, comm.sum() * s, (compute & comm).sum() * s


def test_random_spans_match_the_grid_reference():
    rng = random.Random(0)
    names = ["aten::mm", "aten::add", "gloo:all_reduce", "c10d::allreduce_", "autograd::engine::evaluate_function"]
    spans = [Span(WINDOW_MARK, 0, 0.0, 2000.0)]
    for _ in range(300):
        s = rng.randrange(-100, 2100)
        spans.append(Span(rng.choice(names), rng.randrange(3), float(s), float(s + rng.randrange(1, 200))))
    b, _ = analyse_spans(spans, on_device=False)
    ref = _grid_reference([sp for sp in spans if sp.name != WINDOW_MARK], (0.0, 2000.0))
    assert (b.compute_s, b.comm_s, b.overlap_s) == pytest.approx(ref, abs=1e-12)
    assert b.overlap_s > 0 and b.compute_share + b.comm_share <= 1 + 1e-9


# --- a real dp2 gloo trace ------------------------------------------------------------------------------


def _dp2_worker(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainers.profiling import Profiler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    # several small buckets, so reductions of late layers run while earlier layers' backward goes on
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    # the window opens at step 2: DDP rebuilds its buckets (broadcasts
    # from rank 0) in its second forward, outside the window
    prof = Profiler(True, start=2, steps=3, out_dir=out_dir, device=torch.device("cpu"), rank=rank)
    for step in range(6):
        prof.step(step)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    prof.close()
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump({**prof.result.metrics(), "top": prof.result.top, "table": prof.result.table}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp2_trace(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("dp2_profile")
    # rank 0 once aborted right after the profiler stopped (SIGABRT, "terminate called without an
    # active exception": 1 clean-clone run of 4 on 2026-12-06, never in 14 alone or under load);
    # the trace is what is tested here: an aborted run is run once more, a second abort fails.
    # Likely cause, found later: its port, picked free before rank 0 bound it, shared with a trial
    # another test worker launched (the ranks of both met: tests.conftest.held_port now holds it)
    for attempt in (1, 2):
        try:
            with held_port() as port:
                mp.spawn(_dp2_worker, args=(port, str(out)), nprocs=2)
            return out
        except mp.ProcessExitedException as err:
            if attempt == 2 or err.signal_name != "SIGABRT":
                raise


@pytest.mark.distributed
@pytest.mark.parametrize("rank", [0, 1])
def test_dp2_gloo_trace_overlaps_and_shares_stay_in_the_wall(dp2_trace, rank):
    spans = spans_from_chrome_trace(str(dp2_trace / f"trace_rank{rank}.json"))
    (mark,) = [sp for sp in spans if sp.name == WINDOW_MARK]
    b, _ = analyse_spans(spans, on_device=False)
    # gloo runs the all-reduce on its own threads (pt_gloo_runloop), as async "gloo:all_reduce" ranges
    gloo_tracks = {sp.track for sp in spans if sp.name == "gloo:all_reduce"}
    assert gloo_tracks and mark.track not in gloo_tracks
    assert b.comm_s > 0 and b.compute_s > 0 and b.overlap_s > 0
    assert b.compute_share + b.comm_share <= 1 + 1e-9 and b.idle_s >= 0

    host = [sp for sp in spans if not sp.on_device and sp.name != WINDOW_MARK]
    ref = _grid_reference(host, (mark.start, mark.end))
    tol = 0.005 * b.wall_s  # the grid's 1 us resolution over a few thousand span edges
    assert (b.compute_s, b.comm_s, b.overlap_s) == pytest.approx(ref, abs=tol)

    # what the trainer logged in-process, from prof.events() rather than the exported file, agrees
    logged = json.loads((dp2_trace / f"result_rank{rank}.json").read_text())
    assert logged["profile_wall_s"] == pytest.approx(b.wall_s, rel=1e-3)
    for key, mine in [
        ("profile_compute_s", b.compute_s),
        ("profile_comm_s", b.comm_s),
        ("profile_overlap_s", b.overlap_s),
    ]:
        assert logged[key] == pytest.approx(mine, abs=1e-3 * b.wall_s)
    assert logged["comm_share"] + logged["compute_share"] <= 1 + 1e-9
    assert any(r["op"] == "gloo:all_reduce" and r["comm"] for r in logged["top"])
    assert "gloo:all_reduce" in logged["table"] and WINDOW_MARK not in logged["table"]


# --- Ascend NPU: torch_npu's analysis output ------------------------------------------------------------

STEP_TRACE_HEADER = [  # torch_npu profiler/analysis/prof_view/_trace_step_time_parser.py: TraceStepTimeParser.title
    "Device_id",
    "Step",
    "Computing",
    "Communication(Not Overlapped)",
    "Overlapped",
    "Communication",
    "Free",
    "Stage",
    "Bubble",
    "Communication(Not Overlapped and Exclude Receive)",
    "Preparing",
]
OP_STATISTIC_HEADER = [  # profiler/analysis/prof_bean/_op_statistic_bean.py: OpStatisticBean.HEADERS
    "OP Type",
    "Core Type",
    "Count",
    "Total Time(us)",
    "Min Time(us)",
    "Avg Time(us)",
    "Max Time(us)",
    "Ratio(%)",
]


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_npu_step_trace_time(tmp_path):
    # two steps on device 0 (us): computing, comm not overlapped, overlapped, comm, free, ...
    rows = [
        [0, 3, 8000.0, 1500.0, 2500.0, 4000.0, 500.0, 10000.0, 0, 1500.0, 120.0],
        [0, 4, 7000.0, 1000.0, 2000.0, 3000.0, 1000.0, 9000.0, 0, 1000.0, 80.0],
    ]
    _write_csv(tmp_path / "step_trace_time.csv", STEP_TRACE_HEADER, rows)
    b = read_step_trace_time(str(tmp_path / "step_trace_time.csv"), wall_s=0.019)
    _close(b, compute=0.015, comm=0.007, overlap=0.0045, idle=0.019 - 0.015 - 0.0025)
    assert b.comm_share == pytest.approx(0.0025 / 0.019)
    # a host wall shorter than the device's own time: the device's Computing + exposed comm + Free wins
    assert read_step_trace_time(str(tmp_path / "step_trace_time.csv"), wall_s=0.001).wall_s == pytest.approx(0.019)

    # read by header name: columns in another order, no Overlapped column (derived from the other two)
    order = ["Step", "Device_id", "Free", "Communication", "Computing", "Communication(Not Overlapped)"]
    _write_csv(tmp_path / "moved.csv", order, [[None, 0, 500.0, 4000.0, 8000.0, 1500.0]])
    _close(read_step_trace_time(str(tmp_path / "moved.csv")), compute=0.008, comm=0.004, overlap=0.0025, idle=0.0005)


def test_npu_op_statistic(tmp_path):
    rows = [
        ["MatMulV2", "AI_CORE", 40, 5200.0, 100.0, 130.0, 160.0, 52.0],
        ["hcom_allReduce_", "COMMUNICATION", 6, 3000.0, 400.0, 500.0, 600.0, 30.0],
        ["MatMulV2", "MIX_AIC", 4, 800.0, 150.0, 200.0, 250.0, 8.0],
        ["Add", "AI_VECTOR_CORE", 100, 1000.0, 5.0, 10.0, 20.0, 10.0],
    ]
    _write_csv(tmp_path / "op_statistic.csv", OP_STATISTIC_HEADER, rows)
    top = read_op_statistic(str(tmp_path / "op_statistic.csv"))
    assert [(r["op"], r["calls"], r["comm"]) for r in top] == [
        ("MatMulV2", 44, False),
        ("hcom_allReduce_", 6, True),
        ("Add", 100, False),
    ]
    assert top[0]["self_s"] == pytest.approx(0.006)


def test_npu_profiler_reads_the_newest_ascend_dir_of_its_rank(tmp_path):
    from trainers.profiling import Profiler

    # torch.device("npu") exists only once torch_npu is imported; the profiler reads only device.type
    prof = Profiler(True, 0, 1, str(tmp_path), device=SimpleNamespace(type="npu"), rank=1)
    old, new, other = (
        tmp_path / "npu" / "rank1_11_20260101000000000_ascend_pt",
        tmp_path / "npu" / "rank1_12_20260101000100000_ascend_pt",
        tmp_path / "npu" / "rank10_13_20260101000200000_ascend_pt",  # another rank, newer
    )
    for d, computing in [(old, 1.0), (new, 6000.0), (other, 9.0)]:
        (d / "ASCEND_PROFILER_OUTPUT").mkdir(parents=True)
        _write_csv(
            d / "ASCEND_PROFILER_OUTPUT" / "step_trace_time.csv",
            STEP_TRACE_HEADER,
            [[1, "", computing, 1000.0, 1000.0, 2000.0, 3000.0, 0, 0, 1000.0, 0]],
        )
        (d / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").write_text(json.dumps({"traceEvents": [], "d": d.name}))
        os.utime(d, (os.path.getmtime(d) + (2 if d is other else 1 if d is new else 0),) * 2)
    b, top = prof._npu_analysis(0.005, str(tmp_path / "trace_rank1.json"))
    _close(b, compute=0.006, comm=0.002, overlap=0.001, idle=0.003)
    assert top == []  # no op_statistic.csv: no ops, and no failure
    assert json.loads((tmp_path / "trace_rank1.json").read_text())["d"] == new.name
    r = ProfileResult.of(b)
    assert r.metrics()["comm_share"] == pytest.approx(0.001 / 0.01)
    assert r.metrics()["compute_share"] + r.comm_share <= 1


def test_a_failing_analysis_does_not_end_the_trial(tmp_path, monkeypatch):
    import torch

    import trainers.profiling as profiling

    def broken(events):
        raise RuntimeError("no events")

    monkeypatch.setattr(profiling, "spans_from_events", broken)
    prof = profiling.Profiler(True, 0, 1, str(tmp_path), torch.device("cpu"), rank=0)
    prof.step(0)
    torch.ones(8, 8) @ torch.ones(8, 8)
    prof.step(1)
    prof.close()  # the analysis runs off the step thread: close() waits for it
    r = prof.result
    assert r.table.startswith("profile analysis failed: RuntimeError: no events")
    assert r.wall_s > 0 and r.idle_s == r.wall_s and r.metrics()["comm_share"] == 0
    assert r.trace_path == str(tmp_path / "trace_rank0.json")  # the trace is still written
