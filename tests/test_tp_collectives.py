"""The planner's tensor-parallel collectives per layer (``orchestrator/planner/mesh_comm.py``)
against what the trainer's TP blocks issue (``trainers/parallel.py apply_tp``), counted in two
gloo processes.

A dispatch mode counts every c10d collective of one forward and backward of the trainer's model
(``build_stages``, tp=2) and the bytes each rank sends in it (a ring all-reduce ``2 (t-1)/t`` of the
tensor, an all-gather ``(t-1)/t`` of its output, a reduce-scatter ``(t-1)/t`` of its input), with 1
and 3 layers: the difference over the 2 extra layers is what a layer costs, and the planner's is
that. (The model's ends, the vocab-parallel embedding, head and loss, add a few collectives per
micro-batch whatever the depth; the planner counts layers.)

Before a sub-layer's input entered as one replicated DTensor, each column-parallel linear
all-reduced its own input gradient: 7 all-reduces a Llama layer (6 a GPT one) where Megatron's
layer makes 4.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict

import pytest
import torch

from orchestrator.planner.mesh_comm import link, mesh_comm, tp_collectives
from orchestrator.planner.shapes import ModelShape, ParallelShape
from tests.conftest import held_port
from tests.planner_cases import preset
from trainers.config import ModelConfig

SHAPE = dict(vocab_size=128, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16, norm="rmsnorm")
B, SEQ = 2, 16
# name: (model overrides, sequence parallelism)
CASES = {
    "gpt": (dict(mlp="gelu", norm="layernorm", pos_emb="learned"), False),
    "llama": (dict(mlp="swiglu"), False),
    "llama-sp": (dict(mlp="swiglu"), True),
    "gpt-sp": (dict(mlp="gelu", norm="layernorm", pos_emb="learned"), True),
    "llama-checkpointing": (dict(mlp="swiglu", activation_checkpointing=True), False),
    "llama-sp-checkpointing": (dict(mlp="swiglu", activation_checkpointing=True), True),
}


def _counter(tp: int):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        calls, sent = 0, 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns, _, op = func._schema.name.partition("::")
            if ns in ("c10d", "_c10d_functional") and not op.startswith(("wait", "_wrap")):
                nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor))
                if op.startswith("all_gather") or op.startswith("allgather"):
                    share = tp - 1  # of the input: (t-1)/t of the output
                elif op.startswith("reduce_scatter"):
                    share = (tp - 1) / tp
                else:
                    share = 2 * (tp - 1) / tp
                self.calls, self.sent = self.calls + 1, self.sent + share * nbytes
            return func(*args, **(kwargs or {}))

    return Count()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from trainers.config import ParallelConfig
    from trainers.head_loss import loss_fn
    from trainers.parallel import build_mesh, build_stages

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, SHAPE["vocab_size"], (B, SEQ), generator=g)
        y = torch.randint(0, SHAPE["vocab_size"], (B, SEQ), generator=g)
        got: Dict[str, Dict[int, tuple]] = {}
        for name, (over, sp) in CASES.items():
            p = ParallelConfig(dp=1, tp=world, pp=1, sequence_parallel=sp)
            mesh = build_mesh("cpu", p)
            for n in (1, 3):
                ((_, model),) = build_stages(
                    ModelConfig(**{**SHAPE, **over}, n_layers=n), p, mesh, torch.device("cpu"), 0
                )
                model.train()
                count = _counter(world)
                with count:
                    loss_fn(mesh, SHAPE["vocab_size"])(model(x), y).backward()
                got.setdefault(name, {})[n] = (count.calls, count.sent)
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("tp") / "counts.pt")
    with held_port() as port:
        mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_planned_tp_collectives_per_layer_are_what_the_trainer_issues(counted, case):
    over, sp = CASES[case]
    m = ModelShape.of(dataclasses.asdict(ModelConfig(**{**SHAPE, **over}, n_layers=1)))
    s = ParallelShape(1, 2, 1, 1, B, SEQ, sequence_parallel=sp)
    chip = preset("chip", "cpu")
    tp_s, tp_calls, _, _ = mesh_comm(m, s, chip, 1, 4)  # fp32: 4-byte activations
    (c1, b1), (c3, b3) = counted[case][1], counted[case][3]
    calls, sent = (c3 - c1) / 2, (b3 - b1) / 2
    assert calls == tp_calls == sum(tp_collectives(m, s)), (case, calls, tp_calls)
    assert sent == pytest.approx(tp_s * link(chip, 2), rel=1e-9), (case, sent, tp_s * link(chip, 2))


@pytest.mark.distributed
def test_a_sub_layer_s_input_gradient_is_reduced_once(counted):
    """Megatron's 4 all-reduces a layer, whatever the number of linears reading one input."""
    assert (counted["llama"][3][0] - counted["llama"][1][0]) / 2 == 4
    assert (counted["gpt"][3][0] - counted["gpt"][1][0]) / 2 == 4
