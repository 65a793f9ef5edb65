"""The planner's search over the whole space the trainer can run (orchestrator/planner/search.py,
space.py): each layout with its batch arithmetic and memory knobs, excluded points counted by the
rule they break, and a fast path that gives what the slow path (each point's full config through
planning_errors and plan_layout) gives, line for line and float for float."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import defaultdict

import pytest

from orchestrator import planner
from orchestrator.planner import search
from orchestrator.planner.fast_plan import FastPlanner
from orchestrator.planner.space import (
    LEAN_CHUNKS,
    Space,
    candidate_config,
    chunked_twin_line,
    compile_choices,
    loss_chunk_choices,
    memory_reason,
    reason_key,
    recompute_counts,
    sample,
)
from tests.conftest import ROOT, cli_env

LLAMA7_8 = (["+chip=ascend910b", "model=llama2_7b", "parallel.microbatches=16"], 8)
LLAMA70_1024 = (["+chip=ascend910b", "model=llama2_70b", "trainer.global_batch=1024", "trainer.seq_len=4096"], 1024)
# bf16 on NCCL over two nodes, no overlap: the other branches of the memory and step formulas
LLAMA13_H100 = (
    ["+chip=h100", "model=llama2_13b", "precision=bf16", "comm.overlap=false", "trainer.global_batch=64"],
    16,
)
NEW_KEYS = {"micro_batch", "virtual_stages", "activation_checkpointing", "dp_shard", "sequence_parallel"}


def test_the_7b_on_8_devices_offers_tensor_parallel_8(compose_cfg):
    """parallel.microbatches=16 composed: the search picks the batch split per layout, so the
    layouts without a pipeline (tp8 among them) are planned with microbatches=1."""
    ov, n = LLAMA7_8
    res = search.plan_space(compose_cfg(ov), n)
    tp8 = [p for p in res.plans if (p.candidate.dp, p.candidate.tp, p.candidate.pp) == (1, 8, 1)]
    # parallel.microbatches=1; the replica's 16 sequences as micro-batches accumulated
    assert tp8 and all(p.fits and p.candidate.microbatches == 1 for p in tp8)
    assert all(p.shape.microbatches * p.shape.micro_batch == 16 for p in tp8)
    assert {p.candidate.micro_batch for p in tp8} == {1, 2, 4, 8, 16}  # every divisor of the batch of 16
    assert res.layouts["dp8tp1pp1"].fit > 0  # micro-batch 1 or 2, not the composed 8
    assert res.plans == sorted(res.plans, key=lambda p: p.step.step_time_s)
    assert res.count == sum(s.candidates for s in res.layouts.values()) == res.fit + res.n_excluded


def test_the_70b_on_1024_devices_has_feasible_points(compose_cfg):
    """Before the knobs were searched, none of its 17 layouts fit (micro-batch 8, no
    checkpointing); with them, every layout has points that fit."""
    ov, n = LLAMA70_1024
    res = search.plan_space(compose_cfg(ov), n)
    assert res.count > 1000
    assert res.fit > 0
    assert all(s.fit > 0 for s in res.layouts.values()), {k: s.fit for k, s in res.layouts.items()}
    for p in res.plans:
        assert p.fits and p.memory.total / planner.GiB <= 64 * 0.9
    usable = memory_reason(res.plans[0].memory, "ascend910b")
    assert res.excluded[usable].count > 0  # what does not fit is counted, not dropped
    print(f"\n70B on 1024: {res.count} points, {res.fit} fit, {res.seconds:.2f} s")


def _stratified(points, per=2):
    """A few points of every kind: pipeline or not, schedule, checkpointing, sharding, SP."""
    groups = defaultdict(list)
    for c in points:
        ckpt = (c.activation_checkpointing, c.recompute_granularity, c.recompute_layers >= 0)
        groups[(c.pp > 1, c.tp > 1, c.schedule, ckpt, c.dp_shard, c.sequence_parallel, c.compile)].append(c)
    return [c for key in sorted(groups, key=str) for c in sample(groups[key], per)]


@pytest.mark.parametrize("case", [LLAMA7_8, LLAMA70_1024, LLAMA13_H100], ids=["7b-8", "70b-1024", "13b-h100-16"])
def test_the_fast_path_equals_the_slow_path(compose_cfg, case):
    """On points of every kind, the fast path's validator lines, shapes, memory plan and step
    estimate are exactly those of the point's full config through planning_errors and
    plan_layout (dataclass equality: every float to the bit)."""
    ov, n = case
    base, _ = search.base_config(compose_cfg(ov))
    fast = FastPlanner(base, n)
    pts = _stratified(list(search.points(base, n)))
    planned = 0
    for c in pts:
        full = candidate_config(base, n, c)
        assert fast.errors(fast.point_config(c)) == planner.planning_errors(full), c.name
        got = fast.plan(c, with_step=True)
        if got.errors:
            continue
        want = planner.plan_layout(full)
        assert got.model == planner.ModelShape.of(full.model), c.name
        assert got.shape == want.shape, c.name
        assert got.memory == want.memory, c.name
        assert got.step == want.step, c.name
        planned += 1
    assert planned >= 10 and len(pts) >= 20


def test_partial_recompute_points_sit_between_none_and_all(compose_cfg):
    """Full recompute of the first N blocks of each stage chunk: N a quarter, a half, three
    quarters of the chunk, rounded up, where that is some but not all. On one point of the 70B
    (tp8 pp8, 10 blocks a stage), more recomputed blocks plan less memory and a longer step, from
    no recompute to all of it: the search trades the two, never offering a partial point
    predicted faster than the same point without recompute."""
    assert recompute_counts(10, (0.25, 0.5, 0.75)) == [-1, 3, 5, 8]
    assert recompute_counts(2, (0.25, 0.5, 0.75)) == [-1, 1] and recompute_counts(1, (0.5,)) == [-1]
    ov, n = LLAMA70_1024
    base, _ = search.base_config(compose_cfg(ov))
    fast = FastPlanner(base, n)
    space = Space(
        schedules=("1f1b",),
        recompute_granularity=("full",),
        dp_shard=("zero1",),
        layouts=((16, 8, 8),),
        loss_chunks=(1,),
    )
    pts = [c for c in search.points(base, n, space) if c.microbatches == 64 and c.sequence_parallel]
    assert [c.recompute_layers for c in pts if c.activation_checkpointing] == [-1, 3, 5, 8]
    order = sorted(pts, key=lambda c: (c.activation_checkpointing, c.recompute_layers % 11))  # none, 3, 5, 8, all
    plans = [fast.plan(c, with_step=True) for c in order]
    assert not any(p.errors for p in plans)
    mem = [p.memory.activations for p in plans]
    step = [p.step.step_time_s for p in plans]
    assert mem == sorted(mem, reverse=True) and len(set(mem)) == 5
    assert step == sorted(step) and len(set(step)) == 5


def test_the_search_chunks_the_loss_only_where_the_whole_loss_does_not_fit(compose_cfg):
    """model.loss_chunks is a knob of the search on an accelerator (1 and LEAN_CHUNKS): each
    chunked point plans no more activations (fewer where the last stage is the most loaded rank)
    and a longer step than its unchunked twin, so it is
    planned only where that twin does not fit, and counted out under the search's own line where
    it does. On one 70B layout of 1024 910Bs some points fit only chunked."""
    assert loss_chunk_choices(Space(), "npu", 1) == [1, LEAN_CHUNKS]
    assert loss_chunk_choices(Space(), "cuda", 4) == [4]
    assert loss_chunk_choices(Space(), "cpu", 1) == [1]
    assert loss_chunk_choices(Space(loss_chunks=(1, 8)), "cpu", 1) == [1, 8]
    ov, n = LLAMA70_1024
    base, _ = search.base_config(compose_cfg(ov))
    fast = FastPlanner(base, n)
    space = Space(layouts=((32, 4, 8),), schedules=("gpipe", "1f1b"))
    pts = list(search.points(base, n, space))
    chunked = [c for c in pts if c.loss_chunks > 1]
    assert len(chunked) * 2 == len(pts) and {c.loss_chunks for c in chunked} == {LEAN_CHUNKS}
    twins = lighter = 0
    for c in chunked[::7]:
        lean, whole = fast.plan(c, with_step=True), fast.plan(dataclasses.replace(c, loss_chunks=1), with_step=True)
        if lean.errors or whole.errors:
            # the search gives a refused point's chunked twin the same lines without validating it
            assert lean.errors == whole.errors, c.name
            continue
        # less, or as much where the most loaded rank is not the last stage (1F1B's first)
        assert lean.memory.activations <= whole.memory.activations, c.name
        assert lean.step.step_time_s > whole.step.step_time_s, c.name
        twins += 1
        lighter += lean.memory.activations < whole.memory.activations
    assert twins >= 10 and lighter >= 5
    res = search.plan_space(compose_cfg(ov), n, space)
    fit = {p.candidate for p in res.plans}
    only_chunked = [c for c in fit if c.loss_chunks > 1]
    assert only_chunked and not any(dataclasses.replace(c, loss_chunks=1) in fit for c in only_chunked)
    left_out = [c for c in chunked if dataclasses.replace(c, loss_chunks=1) in fit]
    assert res.excluded[search.reason_key(chunked_twin_line(chunked[0]))].count == len(left_out) > 0


def test_the_search_compiles_where_the_backend_fuses_on_an_accelerator(compose_cfg):
    """trainer.compile is a knob of the search on a GPU (Inductor fuses: the planner credits the
    fused memory traffic, so a compiled point plans a shorter step than its eager twin); on the
    910B (aot_eager, nothing fused) and on the CPU (short trials, long compiles) the composed value
    stays, unless the space names values."""
    assert compile_choices(Space(), "cuda", "auto", False) == [False, True]
    assert compile_choices(Space(), "npu", "auto", False) == [False]
    assert compile_choices(Space(), "npu", "torchair", True) == [False, True]
    assert compile_choices(Space(), "cpu", "auto", True) == [True]
    assert compile_choices(Space(compile=(True,)), "cpu", "auto", False) == [True]
    ov, n = LLAMA13_H100
    res = search.plan_space(compose_cfg(ov), n, Space(layouts=((4, 4, 1),), sequence_parallel=(True,)))
    by_point = {}
    for p in res.plans:
        by_point.setdefault(p.candidate.name.replace("+compiled", ""), {})[p.candidate.compile] = p
    pairs = [v for v in by_point.values() if len(v) == 2]
    assert len(pairs) >= 4
    assert all(v[True].step.step_time_s < v[False].step.step_time_s for v in pairs)
    ascend = search.plan_space(compose_cfg(["+chip=ascend910b", "model=llama2_7b"]), 8, Space(layouts=((8, 1, 1),)))
    assert ascend.plans and not any(p.candidate.compile for p in ascend.plans)


def test_excluded_points_come_with_their_rules(compose_cfg):
    """Every excluded point is counted under the rule it breaks; the examples are the
    validator's own lines for their point, and the memory ones do not fit by plan_layout."""
    ov, n = LLAMA7_8
    cfg = compose_cfg(ov)
    res = search.plan_space(cfg, n)
    base, _ = search.base_config(cfg)
    never_fills = "parallel.microbatches=N is below parallel.pp=N: the pipeline never fills"
    assert res.excluded[never_fills].count > 0
    assert sum(ex.count for ex in res.excluded.values()) >= res.n_excluded > 0
    for key, ex in res.excluded.items():
        assert 0 < len(ex.examples) <= ex.count
        for c, line in ex.examples:
            full = candidate_config(base, n, c)
            if key.startswith("memory: "):
                assert not planner.plan_layout(full).memory.fits and line.startswith("memory: ")
            elif not key.startswith("search: "):
                assert line in planner.planning_errors(full), (c.name, line)
            assert reason_key(line) == key or key.startswith("memory: ")
    for name, summary in res.layouts.items():  # a layout's misses are counted under its reasons too
        assert sum(summary.reasons.values()) >= summary.candidates - summary.fit, name


def test_cli_json_keeps_the_contract_and_adds_the_knobs(compose_cfg):
    """plan --devices N --json: the layout contract per entry, n_params and the pipeline rank
    reported, and the point's knobs; --top 0 gives every point that fits, tp8 among them."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.plan", *LLAMA7_8[0], "--devices", "8", "--json", "--top", "0"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    n_params = planner.ModelShape.of(compose_cfg(LLAMA7_8[0]).model).n_params
    assert "searched " in proc.stderr and " fit, " in proc.stderr
    for row in rows:
        assert NEW_KEYS | {"n_params", "pipeline_rank", "dp", "tp", "pp", "microbatches", "memory_gb"} <= set(row)
        assert row["fits"] and row["dp"] * row["tp"] * row["pp"] == 8
        assert row["n_params"] == n_params and 0 <= row["pipeline_rank"] < row["pp"]
    assert any(r["tp"] == 8 for r in rows)
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)
