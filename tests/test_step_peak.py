"""The planner's memory against the peak of everything a training step allocates, not only what
autograd saves: parameters, gradients, saved activations and the transients on top of them (the
loss's fp32 gradients over the vocabulary above all, ``loss_transient_bytes``).

A CUDA device's allocator reports its peak (``torch.cuda.max_memory_allocated``); the CPU's does
not, so each case runs the trainer's own ``RankModel.forward_backward`` (two accumulated
micro-batches, so the second one's backward runs with the gradients allocated, as the plan counts
them) under ``torch.profiler`` with ``profile_memory=True`` and replays its allocation events in
time order: the running sum's maximum is the step's peak above the bytes live before it, which
are the parameters (the gradients are None before the step). The vocabulary is 4096 on a
128-wide model, so the loss's terms are about half of the peak: a plan without them is far off.
``tests/test_rank_activations.py`` holds the saved part alone to the byte; this holds the sum.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from orchestrator import trial
from orchestrator.layout import layout
from orchestrator.planner.memory import memory_plan
from orchestrator.planner.shapes import ModelShape, ParallelShape
from tests.conftest import composed, on_ranks

BASE = [
    "+chip=cpu",
    "trainer=smoke",
    "trainer.global_batch=8",
    "trainer.micro_batch=4",
    "trainer.seq_len=64",
    "model.vocab_size=4096",
    "data=synthetic",
    "tracking.enabled=false",
]
BF16 = ["precision.param_dtype=fp32", "precision.compute_dtype=bf16"]
CASES: Dict[str, Tuple[int, List[str]]] = {
    "llama-fp32": (1, ["model=llama_tiny"]),
    "gpt-bf16": (1, ["model=gpt_tiny", *BF16]),
    "tp2-llama-bf16": (2, ["model=llama_tiny", "parallel=tp2", *BF16]),
    # the head and loss over 4 sequence chunks: one chunk's logits at a time
    "llama-fp32-chunks": (1, ["model=llama_tiny", "model.loss_chunks=4"]),
    "tp2-llama-bf16-chunks": (2, ["model=llama_tiny", "parallel=tp2", *BF16, "model.loss_chunks=4"]),
    # each data-parallel mode's own buffers: the TP replicas' gradient buckets, FSDP2's gathered
    # parameters (a block and the prefetched next, or every unit for zero1) and the whole
    # gradients it accumulates over the two micro-batches
    **{
        f"dp2tp2-{mode}": (
            4,
            ["model=llama_tiny", "parallel=dp2tp2", "trainer.global_batch=16", f"parallel.dp_shard={mode}"],
        )
        for mode in ("ddp", "zero1", "fsdp")
    },
    **{
        f"dp2pp2-{mode}": (
            4,
            [
                "model=gpt_tiny",
                "parallel=dp2pp2",
                "trainer.global_batch=16",
                "parallel.microbatches=2",
                f"parallel.dp_shard={mode}",
            ],
        )
        for mode in ("zero1", "fsdp")  # DDP's own buckets are made before the step: not seen here
    },
}
TOLERANCE = 0.03  # one block's backward transients at a time are not planned: under the loss's here
# FSDP2's gathers and reduce-scatters run asynchronously on gloo's own threads, and the buffers a
# collective holds (gloo's staging copy of an all-gather above all, which NCCL and HCCL do not
# make) are freed when it finishes: so a rank's peak varies between runs by up to one root unit's
# gather. The same dp2tp2 fsdp step peaked at 14.7-18.7 MiB over 16 rank-runs, 14.7 in 11 of them.
# Each such case repeats its step REPEATS times; the plan is held to the step's own need, each
# rank's least peak, within FSDP_TOLERANCE, and every peak seen to within ASYNC_BOUND above it.
FSDP_TOLERANCE = 0.10
ASYNC_BOUND = 0.30
REPEATS = 3


def live_peak(fn) -> int:
    """The maximum, over ``fn``'s run, of the bytes it allocated and has not yet freed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _measure(model, spec, rank: int) -> dict:
    """The step's peak on this rank: the parameters live before it plus what it allocates."""
    from trainers.memory import model_state_bytes

    seq, vocab = spec.trainer.seq_len, spec.model.vocab_size
    per_replica = spec.trainer.global_batch // model.p.dp
    # a replica's micro-batches; a pipeline cuts its one batch into parallel.microbatches itself
    b = per_replica if model.schedule is not None else spec.trainer.micro_batch
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, vocab, (b, seq), generator=g), torch.randint(0, vocab, (b, seq), generator=g))
        for _ in range(per_replica // b)
    ]
    before = model_state_bytes(model.modules, [])
    assert before["grads"] == 0
    peaks = []
    for _ in range(REPEATS if spec.parallel.dp_shard in ("zero1", "fsdp") else 1):
        peaks.append(before["params"] + live_peak(lambda: model.forward_backward(batches)))
        for module in model.modules:
            module.zero_grad(set_to_none=True)
    return dict(peaks=peaks)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    planned, by_world = {}, {}
    for name, (world, over) in CASES.items():
        cfg = trial.prepare(composed([*BASE, *over]))
        assert layout(cfg).world_size == world, name
        m = ModelShape.of(cfg.model)
        s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
        plan = memory_plan(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner)
        planned[name] = plan.params + plan.grads + plan.activations + plan.dp_buffers
        by_world.setdefault(world, []).append((name, trial.build_spec(cfg)))
    GlobalHydra.instance().clear()
    got: Dict[str, List[int]] = {}
    for world, specs in by_world.items():
        ranks = on_ranks(_measure, world, specs, str(tmp_path_factory.mktemp(f"peak{world}")))
        for name, _ in specs:
            got[name] = [r[name]["peaks"] for r in ranks]
    return planned, got


def test_live_peak_sees_the_loss_transients():
    """The measuring tool itself: a cross-entropy over T x V fp32 logits peaks at three T x V
    buffers (the saved log-softmax and, in its backward, the gradients in and out of it)."""
    T, V = 256, 4096
    h = torch.randn(T, 32, requires_grad=True)
    w = torch.randn(V, 32, requires_grad=True)
    y = torch.randint(0, V, (T,))

    def step():
        torch.nn.functional.cross_entropy(h @ w.t(), y).backward()

    assert live_peak(step) == pytest.approx(3 * 4 * T * V, rel=0.02)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_planned_step_memory_is_the_measured_peak(measured, case):
    """The plan is the most loaded rank's (a pipeline's last stage, with the loss): held to the
    largest peak the ranks measure."""
    planned, got = measured
    rows = [f"{case}: planned {planned[case] / 2**20:.2f} MiB"]
    for r, peaks in enumerate(got[case]):
        seen = ", ".join(f"{p / 2**20:.2f}" for p in peaks)
        rows.append(f"  rank {r}: measured {seen} MiB, ratio {planned[case] / min(peaks):.3f}")
    table = "\n".join(rows)
    print("\n" + table)
    tolerance = FSDP_TOLERANCE if "fsdp" in case or "zero1" in case else TOLERANCE
    assert planned[case] == pytest.approx(max(min(peaks) for peaks in got[case]), rel=tolerance), table
    assert max(max(peaks) for peaks in got[case]) <= planned[case] * (1 + ASYNC_BOUND), table
