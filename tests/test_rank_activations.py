"""The planner's activations per rank (``orchestrator.planner.activations.rank_activation_bytes``)
against what autograd holds on each rank of the trainer, layout by layout.

Each case builds the trainer's own ``RankModel`` (stages, TP plan, sequence parallelism, DDP or
FSDP, the pipeline schedule) in spawned gloo processes and runs one optimizer step's forward and
backward (``RankModel.forward_backward``) under saved-tensor hooks that count, at every moment,
the storages autograd still holds for a backward (each storage once; parameters, FSDP's gathered
parameters and buffers left out, they are the model state and the FSDP buffers of the plan).
The peak of that count is the rank's measured activations: under a pipeline it is reached with
the schedule's microbatches in flight, so the planner's in-flight rule (1 for no pipeline, m for
GPipe, ``min(m, p - rank)`` for 1F1B, the interleaved warm-up, ZB-V) is measured here, as are the
TP and sequence-parallel shards of each block, the vocab-parallel head and loss, and autocast's
weight copies (bf16 and fp16 compute over fp32 parameters).

The count holds a detached alias of each saved tensor: holding the tensor itself would, for a saved
output, tie the graph to itself (node -> holder -> output -> node), a cycle that is never freed, and
a graph never run backward (torch 2.13's pipeline stages run one forward to infer shapes on their
first step) would stay counted as if the trainer leaked it. FSDP's gathered parameters are looked up
as they are at each save, not remembered: FSDP frees them after the forward and activations reuse
their addresses.

``tests/test_activation_bytes.py`` measures the single-device terms knob by knob; this file
measures their composition per rank. Full activation checkpointing is measured there (the
checkpoint's own hooks hide what it keeps from outer hooks).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from orchestrator import trial
from orchestrator.layout import layout
from orchestrator.planner.activations import ActBytes, rank_activation_bytes
from orchestrator.planner.shapes import ModelShape, ParallelShape, rank_contents
from tests.conftest import composed, on_ranks

BASE = [
    "+chip=cpu",
    "trainer=smoke",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "trainer.seq_len=32",
    "data=synthetic",
    "tracking.enabled=false",
]
BF16 = ["precision.param_dtype=fp32", "precision.compute_dtype=bf16"]
PP4 = ["parallel.microbatches=4"]
# name: (world size, overrides)
CASES: Dict[str, Tuple[int, List[str]]] = {
    "tp2-gpt": (2, ["model=gpt_tiny", "parallel=tp2"]),
    "tp2-sp-llama": (2, ["model=llama_tiny", "parallel=tp2", "parallel.sequence_parallel=true"]),
    "tp2-llama-bf16": (2, ["model=llama_tiny", "parallel=tp2", *BF16]),
    "dp2-ddp-gpt": (2, ["model=gpt_tiny", "parallel=dp2"]),
    "dp2-ddp-llama-fp16": (
        2,
        ["model=llama_tiny", "parallel=dp2", "precision.compute_dtype=fp16", "precision.loss_scale=dynamic"],
    ),
    "dp2-fsdp-llama": (2, ["model=llama_tiny", "parallel=dp2", "parallel.dp_shard=fsdp"]),
    "dp2-fsdp-bf16-gpt": (2, ["model=gpt_tiny", "parallel=dp2", "parallel.dp_shard=fsdp", *BF16]),
    "pp2-gpipe-gpt": (2, ["model=gpt_tiny", "parallel=pp2", "parallel.schedule=gpipe", *PP4]),
    "pp2-1f1b-llama": (2, ["model=llama_tiny", "parallel=pp2", "parallel.schedule=1f1b", *PP4]),
    "pp2-1f1b-gpt-bf16": (2, ["model=gpt_tiny", "parallel=pp2", "parallel.schedule=1f1b", *PP4, *BF16]),
    "pp2-interleaved-llama": (
        2,
        ["model=llama_tiny", "parallel=pp2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", *PP4],
    ),
    "pp2-zbv-gpt": (2, ["model=gpt_tiny", "parallel=pp2", "parallel.schedule=zbv", *PP4]),
    "tp2pp2-sp-llama": (4, ["model=llama_tiny", "parallel=tp2pp2", "parallel.sequence_parallel=true", *PP4]),
    "dp2tp2-gpt": (4, ["model=gpt_tiny", "parallel=dp2tp2"]),
    "pp4-1f1b-gpt": (4, ["model=gpt_tiny", "parallel=pp4", "parallel.schedule=1f1b", *PP4]),
    # model.loss_chunks: the head and loss over sequence chunks, each checkpointed
    "tp2-sp-llama-bf16-chunks": (
        2,
        ["model=llama_tiny", "parallel=tp2", "parallel.sequence_parallel=true", *BF16, "model.loss_chunks=4"],
    ),
    "pp2-1f1b-gpt-chunks": (
        2,
        ["model=gpt_tiny", "parallel=pp2", "parallel.schedule=1f1b", *PP4, "model.loss_chunks=4"],
    ),
    # trainer.compile: each block compiled with Inductor (the fused count of activations.py; pp2
    # 1F1B llama compiled measured 0.999-1.000 too, docs/planner.md)
    "tp2-sp-llama-bf16-compiled": (
        2,
        ["model=llama_tiny", "parallel=tp2", "parallel.sequence_parallel=true", *BF16, "trainer.compile=true"],
    ),
}


class _Held:
    """What autograd keeps in place of a saved tensor: while it lives, its storage is counted."""

    __slots__ = ("owner", "ptr", "t")

    def __init__(self, owner: "PeakSaved", ptr: int, t: torch.Tensor):
        self.owner, self.ptr, self.t = owner, ptr, t

    def __del__(self):
        self.owner.release(self.ptr)


class PeakSaved:
    """Saved-tensor hooks counting the bytes autograd holds for backward, and their peak."""

    def __init__(self, modules: List[torch.nn.Module]):
        self.modules = modules
        self.held = self._state()
        self.live: Dict[int, List[int]] = {}  # storage address -> [bytes, holders]
        self.now = self.peak = 0

    def _state(self) -> set:
        """The storages of the modules' parameters and buffers as they are now: FSDP swaps its
        gathered parameters in for the forward (and frees them after it, so their addresses are
        reused by activations), so they are looked up again, not remembered."""
        return {_ptr(t) for m in self.modules for t in [*m.parameters(), *m.buffers()] if _ptr(t)}

    def pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or _ptr(t) in self.held or _ptr(t) in self._state():
            return t  # a parameter (a view of one: FSDP's gathered ones included) or a buffer
        ptr, nbytes = _ptr(t), _local(t).untyped_storage().nbytes()
        entry = self.live.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        # detached: a saved output holding its own grad_fn would be a cycle through the graph
        # that nothing frees (a graph never run backward, such as the pipeline's first-step
        # shape inference, would then stay counted)
        return _Held(self, ptr, t.detach())

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``t``'s bytes on this rank: a DTensor's local shard, a wrapper
    subclass's inner tensor (the functional collectives' ``AsyncCollectiveTensor``, whose own
    storage is not a real one)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        t = getattr(t, names[0])
    return t


def _ptr(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


def _measure(model, spec, rank: int, microbatches: int) -> dict:
    """The peak of what autograd holds through one step's forward and backward on this rank."""
    counter = PeakSaved(model.modules)
    b, seq, vocab = spec.trainer.micro_batch, spec.trainer.seq_len, spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    if model.schedule is None:
        batches = [
            (torch.randint(0, vocab, (b, seq), generator=g), torch.randint(0, vocab, (b, seq), generator=g))
            for _ in range(microbatches)
        ]
    else:
        n = b * microbatches
        batches = [(torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, vocab, (n, seq), generator=g))]
    with counter.hooks():
        model.forward_backward(batches)
    return dict(peak=counter.peak, after=counter.now)


def _planned(cfg) -> Tuple[List[float], ParallelShape]:
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
    ab = ActBytes.of(cfg.precision, m, "cpu")
    per_pp = [rank_activation_bytes(m, s, rank_contents(m, s, r), r, ab) for r in range(s.pp)]
    return [per_pp[s.coords(r)[1]] for r in range(s.world)], s


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Every case's planned and measured bytes per rank, one spawn per world size."""
    planned, by_world = {}, {}
    for name, (world, over) in CASES.items():
        cfg = trial.prepare(composed([*BASE, *over]))
        assert layout(cfg).world_size == world, name
        planned[name], s = _planned(cfg)
        by_world.setdefault(world, []).append((name, trial.build_spec(cfg), s.microbatches))
    GlobalHydra.instance().clear()
    got: Dict[str, List[dict]] = {}
    for world, specs in by_world.items():
        ranks = on_ranks(_measure, world, specs, str(tmp_path_factory.mktemp(f"world{world}")))
        for name, _, _ in specs:
            got[name] = [r[name] for r in ranks]
    return planned, got


# within 0.2% on every case but one (a pipeline's bf16 RMSNorm statistics, 1-3 KiB): a slip such as
# query heads for kv heads in a GQA count (4.75%) is far outside. The one: the compiled block, whose
# partition keeps 0.6% less than the planned min-cut. (The chunked loss in bf16 was planned 32 KiB
# over, the head weight's cast, which its chunks make inside their checkpoints: now a transient.)
TOLERANCE = 0.003
LOOSER = {"tp2-sp-llama-bf16-compiled": 0.01}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_planned_activations_per_rank_are_what_autograd_holds(measured, case):
    planned, got = measured
    rows = [f"{case}: rank  planned  measured peak  ratio"]
    for r, (want, row) in enumerate(zip(planned[case], got[case])):
        rows.append(f"  {r}  {want:>10.0f}  {row['peak']:>10}  {row['peak'] / want:.3f}  after {row['after']}")
    table = "\n".join(rows)
    print("\n" + table)
    for want, row in zip(planned[case], got[case]):
        assert row["after"] == 0, table  # the step's backward released everything it saved
        assert want == pytest.approx(row["peak"], rel=LOOSER.get(case, TOLERANCE)), table
