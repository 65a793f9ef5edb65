"""The order FSDP2 issues its collectives in, read from a profiler trace of the trainer's own
``RankModel`` on real gloo ranks: what the planner's overlap windows rest on
(``orchestrator/planner/dp_comm.py dp_windows``; docs/planner.md, "Data-parallel modes").

- Backward: entering a block's backward (``pre_backward``), FSDP2 issues the next block's
  all-gather (``backward_prefetch``) before this block's gradients are computed, and each block's
  reduce-scatter is issued before the next block's backward starts: both run behind backward
  compute. Only the root's reduce-scatter (embedding, final norm, head) has nothing after it.
- Forward: no explicit prefetch. Each block's all-gather is issued in its own ``pre_forward``,
  after the previous block's forward was issued: on a GPU or NPU it overlaps that block's kernels
  only because the host runs ahead of the device (the planner credits the forward window on that
  ground, which a host-bound step does not meet).
- ``zero1`` (the units kept gathered across micro-batches): the blocks are gathered in the first
  micro-batch's forward only, and reduce in the last micro-batch's backward only.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from orchestrator import trial
from tests.conftest import composed, on_ranks
from tests.test_dp_collectives import BASE as COUNTED_BASE  # gpt_tiny, 8 sequences of 32 a step

pytestmark = pytest.mark.distributed

BASE = [*COUNTED_BASE, "trainer.micro_batch=2", "parallel=dp2"]  # two micro-batches a replica
MODES = ("fsdp", "zero1")
BLOCKS = 4  # gpt_tiny's layers


def _trace(model, spec, rank: int) -> List[Tuple[str, float]]:
    """The FSDP record-function events of one step (after a first one), by start time."""
    from torch.profiler import ProfilerActivity, profile

    b, seq, vocab = spec.trainer.micro_batch, spec.trainer.seq_len, spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    n = spec.trainer.global_batch // model.p.dp // b
    batches = [
        (torch.randint(0, vocab, (b, seq), generator=g), torch.randint(0, vocab, (b, seq), generator=g))
        for _ in range(n)
    ]
    model.forward_backward(batches)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward_backward(batches)
    events = [(e.name, e.time_range.start) for e in prof.events() if e.name.startswith("FSDP::")]
    return sorted(events, key=lambda e: e[1])


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Dict[str, List[List[str]]]:
    specs = [(mode, trial.build_spec(trial.prepare(composed([*BASE, f"parallel.dp_shard={mode}"])))) for mode in MODES]
    GlobalHydra.instance().clear()
    ranks = on_ranks(_trace, 2, specs, str(tmp_path_factory.mktemp("fsdp_order")))
    return {mode: [[name for name, _ in r[mode]] for r in ranks] for mode in MODES}


def _at(names: List[str], event: str, after: int = 0) -> int:
    """Where ``event`` first comes at or after ``after``."""
    return names.index(event, after)


def _last_backward(names: List[str]) -> int:
    """Where the step's last backward starts: the last block's last ``pre_backward``."""
    return max(i for i, n in enumerate(names) if n == f"FSDP::pre_backward (layers.{BLOCKS - 1})")


@pytest.mark.parametrize("mode", MODES)
def test_each_backward_gathers_the_next_block_and_reduces_behind_the_next_ones_compute(traces, mode):
    for names in traces[mode]:
        start = _last_backward(names)
        for i in range(BLOCKS - 1, 0, -1):
            enter = _at(names, f"FSDP::pre_backward (layers.{i})", start)
            done = _at(names, f"FSDP::post_backward_accumulate (layers.{i})", enter)
            if mode == "fsdp":  # zero1 keeps every block gathered: nothing to prefetch
                prefetch = _at(names, f"FSDP::backward_prefetch for layers.{i - 1}", enter)
                assert prefetch < done, (mode, i, names[enter : done + 1])
            reduce = _at(names, f"FSDP::post_backward_reduce (layers.{i})", done)
            assert reduce < _at(names, f"FSDP::pre_backward (layers.{i - 1})", enter), (mode, i)
        # the root's reduce-scatter comes after every block's backward: nothing left to hide it
        first_block_reduce = _at(names, "FSDP::post_backward_reduce (layers.0)", start)
        assert _at(names, "FSDP::post_backward_reduce", first_block_reduce) > first_block_reduce


def test_the_forward_gathers_each_block_in_its_own_pre_forward(traces):
    for names in traces["fsdp"]:
        for i in range(1, BLOCKS):
            previous_done = _at(names, f"FSDP::post_forward (layers.{i - 1})")
            gather = _at(names, f"FSDP::all_gather (layers.{i})")
            assert previous_done < gather, (i, "an explicit forward prefetch: docs/planner.md's forward window")
            assert names[gather - 1] == f"FSDP::pre_forward (layers.{i})"


def test_zero1_gathers_in_the_first_micro_batch_and_reduces_in_the_last(traces):
    for names in traces["zero1"]:
        for i in range(BLOCKS):
            assert names.count(f"FSDP::all_gather (layers.{i})") == 1
            assert names.count(f"FSDP::post_backward_reduce (layers.{i})") == 1
            gather = names.index(f"FSDP::all_gather (layers.{i})")
            forwards = [k for k, n in enumerate(names) if n == f"FSDP::pre_forward (layers.{i})"]
            assert len(forwards) == 2 and forwards[0] < gather < forwards[1]
            assert names.index(f"FSDP::post_backward_reduce (layers.{i})") > _last_backward(names)
