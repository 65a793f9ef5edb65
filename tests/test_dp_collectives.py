"""The planner's data-parallel collectives per step (``dp_calls``) and bytes per rank
(``dp_traffic_bytes``) against what the trainer's ``RankModel`` issues in one optimizer step.

Each case runs one step's forward and backward (``RankModel.forward_backward``, the step after a
first one, when DDP has rebuilt its buckets) in spawned gloo processes and counts, per rank,
FSDP2's all-gathers and reduce-scatters (``torch.distributed.all_gather_single`` and
``reduce_scatter_single``, which ``fsdp/_fully_shard/_fsdp_collectives.py`` calls; wrapped here
to count calls and each call's full tensor) and the bucket all-reduces of DDP and of the TP
replicas (the trainer's own count, ``GradSyncStats``, from its comm hook and
``trainers/replicas.py``). The bytes a rank sends in a ring collective are
``(dp - 1) / dp`` of the full tensor. FSDP with micro-batches is where the planner was wrong: it
counted one gather for the forward and one for the backward per step whatever the micro-batches
(dp4 at two micro-batches: half the gathers the trainer makes).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from orchestrator import planner, trial
from orchestrator.layout import layout
from orchestrator.planner.shapes import ModelShape, ParallelShape
from tests.conftest import composed, on_ranks

BASE = [
    "+chip=cpu",
    "model=gpt_tiny",
    "trainer=smoke",
    "trainer.global_batch=8",
    "trainer.seq_len=32",
    "data=synthetic",
    "tracking.enabled=false",
]
FSDP = ["parallel.dp_shard=fsdp"]
# name: (world size, overrides); micro-batches per rank = 8 / dp / micro_batch
CASES: Dict[str, Tuple[int, List[str]]] = {
    "fsdp-m1": (2, ["parallel=dp2", *FSDP, "trainer.micro_batch=4"]),
    "fsdp-m4": (2, ["parallel=dp2", *FSDP, "trainer.micro_batch=1"]),
    "fsdp-m2-one-unit": (2, ["parallel=dp2", *FSDP, "trainer.micro_batch=2", "comm.overlap=false"]),
    "ddp-one-bucket": (2, ["parallel=dp2", "trainer.micro_batch=2"]),
    "ddp-1mb-buckets": (2, ["parallel=dp2", "trainer.micro_batch=2", "comm.bucket_mb=1"]),
    "zero1-m4": (2, ["parallel=dp2", "parallel.dp_shard=zero1", "trainer.micro_batch=1"]),
    "zero1-m2-one-unit": (
        2,
        ["parallel=dp2", "parallel.dp_shard=zero1", "trainer.micro_batch=2", "comm.overlap=false"],
    ),
    # beside TP, each mode: the TP replicas' buckets (one, and 1 MiB ones), FSDP2 per micro-batch, zero1 once
    "dp2tp2-ddp-m2": (4, ["parallel=dp2tp2", "trainer.micro_batch=2"]),
    "dp2tp2-ddp-m2-1mb-buckets": (4, ["parallel=dp2tp2", "trainer.micro_batch=2", "comm.bucket_mb=1"]),
    "dp2tp2-fsdp-m2": (4, ["parallel=dp2tp2", *FSDP, "trainer.micro_batch=2"]),
    "dp2tp2-zero1-m2": (4, ["parallel=dp2tp2", "parallel.dp_shard=zero1", "trainer.micro_batch=2"]),
    "dp2pp2-fsdp-m4": (4, ["parallel=dp2pp2", *FSDP, "trainer.micro_batch=1", "parallel.microbatches=4"]),
    "dp2pp2-zero1-m4": (
        4,
        ["parallel=dp2pp2", "parallel.dp_shard=zero1", "trainer.micro_batch=1", "parallel.microbatches=4"],
    ),
    "dp2pp2-fsdp-m4-one-unit": (
        4,
        ["parallel=dp2pp2", *FSDP, "trainer.micro_batch=1", "parallel.microbatches=4", "comm.overlap=false"],
    ),
}


def _count(model, spec, rank: int, microbatches: int) -> dict:
    """This rank's DP collectives (calls, full bytes) in the second of two steps."""
    import torch.distributed as dist

    seen = {"calls": 0, "bytes": 0}
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output, input, *args, **kwargs):  # noqa: A002 - torch's names
        seen["calls"] += 1
        seen["bytes"] += output.numel() * output.element_size()
        return gather(output, input, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):  # noqa: A002
        seen["calls"] += 1
        seen["bytes"] += input.numel() * input.element_size()
        return scatter(output, input, *args, **kwargs)

    b, seq, vocab = spec.trainer.micro_batch, spec.trainer.seq_len, spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    rows = b if model.schedule is None else b * microbatches  # a pipeline splits one batch itself
    batches = [
        (torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g))
        for _ in range(microbatches if model.schedule is None else 1)
    ]
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        for _ in range(2):
            seen.update(calls=0, bytes=0)
            model.sync.in_backward = model.sync.after_backward = 0
            model.forward_backward(batches)
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    return dict(seen, ddp_buckets=model.sync.in_backward + model.sync.after_backward)


def _planned(cfg) -> Tuple[List[Tuple[int, float, int]], ParallelShape]:
    """Per rank: the planner's DP collectives, bytes sent, and the rank's pp coordinate; the shape."""
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg))
    per_pp = []
    for r in range(s.pp):
        rc = planner.rank_contents(m, s, r)
        n = planner.rank_params(m, s, rc)
        calls = planner.dp_calls(m, s, n, len(rc.layers), cfg.precision, cfg.comm, cfg.planner)
        per_pp.append((calls, planner.dp_traffic_bytes(m, s, n, cfg.precision, cfg.comm, cfg.planner), r))
    return [per_pp[s.coords(r)[1]] for r in range(s.world)], s


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    planned, by_world, dp = {}, {}, {}
    for name, (world, over) in CASES.items():
        cfg = trial.prepare(composed([*BASE, *over]))
        planned[name], s = _planned(cfg)
        assert s.world == world, name
        dp[name] = (s.dp, s.wrapping)
        by_world.setdefault(world, []).append((name, trial.build_spec(cfg), s.microbatches))
    GlobalHydra.instance().clear()
    got = {}
    for world, specs in by_world.items():
        ranks = on_ranks(_count, world, specs, str(tmp_path_factory.mktemp(f"world{world}")))
        for name, _, _ in specs:
            got[name] = [r[name] for r in ranks]
    return planned, got, dp


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_planned_dp_collectives_are_what_the_trainer_issues(counted, case):
    planned, got, dp = counted
    n, wrapping = dp[case]
    for rank, ((calls, sent, pp_rank), row) in enumerate(zip(planned[case], got[case])):
        where = f"{case} rank {rank} (pp rank {pp_rank}): planned {calls} calls, {sent:.0f} B; counted {row}"
        if wrapping == "ddp":  # DDP's reducer, or the TP replicas' buckets: counted by the trainer
            assert row["calls"] == 0 and row["ddp_buckets"] == calls, where
            continue
        assert row["ddp_buckets"] == 0 and row["calls"] == calls, where
        assert row["bytes"] * (n - 1) / n == pytest.approx(sent, rel=1e-9), where


def test_zero1_gathers_once_a_step_and_fsdp_per_micro_batch(counted):
    """What the modes are for: beside TP with two micro-batches, zero1's units are gathered and
    reduce-scattered once a step; FSDP's (ZeRO-3) are gathered twice and reduce-scattered once
    per micro-batch (calls per unit)."""
    _, got, _ = counted
    zero1, fsdp = got["dp2tp2-zero1-m2"][0]["calls"], got["dp2tp2-fsdp-m2"][0]["calls"]
    units = zero1 // 2
    assert zero1 == units * (1 + 1) and fsdp == units * (2 * 2 + 2), (zero1, fsdp)
