"""The host's fixed cost per layer, eager and compiled, without and with tensor parallelism.

    python bench/compile_host.py [--tp 1,2] [--layers 2,8] [--steps 20] [--rounds 5]
                                 [--backends eager,inductor]

The planner charges each layer's forward and backward a fixed host cost per micro-batch
(``planner.layer_host_us``: the operators' dispatch) and, under tensor parallelism, more
(``planner.tp_layer_host_us``: DTensor's sharding propagation and redistributions on every
sharded operator). Does ``trainer.compile`` take them away? Compiled, a block is one graph of
plain local tensors and functional collectives, so DTensor's per-operator work is done once at
trace time. This bench measures it on the trainer's own model (``trainers/model.py``), tensor-
parallel as the trainer shards it (``trainers.parallel.apply_tp``), each block compiled as
``trainers/assembly.py`` compiles it: a model so small (d 64, one sequence of 16 tokens) that
its arithmetic is negligible, so a pass's wall time is the host's. It times forward and backward
passes with 2 and 8 layers (``--layers``) in alternating rounds (the median round of each); the
difference over the 6 extra layers is the cost per layer pass, printed per backend and TP size,
with what TP adds (tp2 minus tp1) beside. One gloo process per TP rank, one thread each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=16, norm="rmsnorm", mlp="swiglu"
)


def _wall_per_pass(model, x, y, loss_fn, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss_fn(model(x), y).backward()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainers.config import ModelConfig, ParallelConfig
    from trainers.head_loss import loss_fn
    from trainers.model import GPT
    from trainers.parallel import apply_tp, build_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = build_mesh("cpu", ParallelConfig(dp=1, tp=world, pp=1))
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, SHAPE["vocab_size"], (1, SHAPE["max_seq_len"]), generator=g)
        y = torch.randint(0, SHAPE["vocab_size"], (1, SHAPE["max_seq_len"]), generator=g)
        loss = loss_fn(mesh, SHAPE["vocab_size"])  # the trainer's: vocab-parallel where tp > 1
        models = {}
        for backend in args.backends:
            for n in args.layers:
                model = GPT(ModelConfig(**SHAPE, n_layers=n), seed=0)
                if world > 1:
                    apply_tp(model, mesh.sub("tp"), sequence_parallel=False)
                if backend != "eager":
                    for block in model.layers.values():
                        block.compile(backend=backend)
                for _ in range(2):  # compiled and warm
                    loss(model(x), y).backward()
                models[(backend, n)] = model
        rounds = {k: [] for k in models}
        for _ in range(args.rounds):
            for k, model in models.items():
                rounds[k].append(_wall_per_pass(model, x, y, loss, args.steps))
        if rank == 0:
            lines = [f"{b} {n} {statistics.median(rounds[(b, n)])}" for b, n in models]
            Path(out).write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--steps", type=int, default=20, help="passes a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="eager,inductor")
    args = ap.parse_args()
    args.layers = [int(v) for v in args.layers.split(",")]
    args.backends = args.backends.split(",")
    lo, hi = min(args.layers), max(args.layers)

    import torch.multiprocessing as mp

    from orchestrator.launch import free_port

    print(f"a layer's forward and backward, one sequence of {SHAPE['max_seq_len']} tokens, d {SHAPE['d_model']}")
    cols = (f"ms/pass {lo}L", f"ms/pass {hi}L")
    print(f"{'tp':>3}  {'backend':>9}  {cols[0]:>11}  {cols[1]:>11}  {'us/layer':>9}")
    per_layer = {}
    for tp in (int(v) for v in args.tp.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
            out = f.name
        mp.spawn(_rank, args=(tp, free_port(), args, out), nprocs=tp, join=True)
        got = {}
        for line in Path(out).read_text().splitlines():
            b, n, s = line.split()
            got[(b, int(n))] = float(s)
        os.unlink(out)
        for b in args.backends:
            us = (got[(b, hi)] - got[(b, lo)]) / (hi - lo) * 1e6
            per_layer[(tp, b)] = us
            print(f"{tp:>3}  {b:>9}  {got[(b, lo)] * 1e3:>11.2f}  {got[(b, hi)] * 1e3:>11.2f}  {us:>9.0f}")
    tps = sorted({tp for tp, _ in per_layer})
    if len(tps) > 1:
        for b in args.backends:
            added = per_layer[(tps[-1], b)] - per_layer[(tps[0], b)]
            print(f"tp{tps[-1]} adds {added:.0f} us a layer pass over tp{tps[0]} ({b})")


if __name__ == "__main__":
    main()
