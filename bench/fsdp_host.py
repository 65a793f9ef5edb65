"""The host work FSDP adds to a CPU rank, as the rate its cores move FSDP's bytes, beside the CPU chip's figure.

    python bench/fsdp_host.py [--model gpt_mini] [--tp 1] [--micro-batch 8] [--seq 128]
                              [--steps 4] [--rounds 5] [--repeats 2]

Spawns ``2 x tp`` gloo processes on this host (one intra-op thread each, as the trainer gives a
worker when there are at least as many workers as cores) holding the trainer's model
(``trainers/model.py``) on a (dp 2, tp) mesh, tensor-parallel as the trainer shards it where
``--tp`` > 1, and times each rank's process CPU time (every thread of it, gloo's included) over
forward and backward passes, in alternating rounds (the median round of each): with the model
wrapped in FSDP2 units as the trainer wraps it (``trainers.parallel.apply_fsdp``: each block a
unit, the root one more, resharded after the forward) and without (the same model, every rank
its own copy). The difference is FSDP's host work: its hooks, the copies into and out of its
buffers, gloo's sends and receives. A pass gathers every unit twice (forward and backward) and
reduce-scatters its gradients once, so FSDP moves three times the rank's (TP-local) parameter
bytes a pass; those bytes over the extra CPU seconds are the rate, GB/s, printed (median over
``--repeats`` spawns) beside ``chip.host_copy_gbps`` of ``conf/chip/cpu.yaml``, what the planner
charges a CPU rank for FSDP's bytes (``planner/step_time.py``).
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


def _cpu_per_pass(model, x, y, loss_fn, steps: int) -> float:
    import torch.distributed as dist

    loss_fn(model(x), y).backward()
    dist.barrier()
    t0 = time.process_time()
    for _ in range(steps):
        loss_fn(model(x), y).backward()
    return (time.process_time() - t0) / steps


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from orchestrator import conf_dir
    from trainers.config import ModelConfig, ParallelConfig
    from trainers.head_loss import loss_fn
    from trainers.model import GPT
    from trainers.parallel import apply_fsdp, apply_tp, build_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml"))
        margs = ModelConfig(**{k: v for k, v in spec.items() if k in ModelConfig.__dataclass_fields__})
        mesh = build_mesh("cpu", ParallelConfig(dp=2, tp=args.tp, pp=1))  # the trainer's own
        g = torch.Generator().manual_seed(rank // args.tp)
        x = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq), generator=g)
        y = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq), generator=g)
        loss = loss_fn(mesh, margs.vocab_size)  # the trainer's: vocab-parallel where tp > 1
        models = {}
        for wrapped in (False, True):
            model = GPT(margs, seed=0)
            if args.tp > 1:
                apply_tp(model, mesh.sub("tp"), sequence_parallel=False)
            models[wrapped] = apply_fsdp(model, mesh.sub("dp")) if wrapped else model
        # alternated, rounds of a few passes each, so a busy spell of the host falls on both
        rounds = {False: [], True: []}
        for _ in range(args.rounds):
            for wrapped, model in models.items():
                rounds[wrapped].append(_cpu_per_pass(model, x, y, loss, args.steps))
        times = {k: statistics.median(v) for k, v in rounds.items()}
        moved = 3 * sum(p.numel() * p.element_size() for p in models[False].parameters())  # TP-local
        rate = torch.tensor([moved / max(times[True] - times[False], 1e-9) / 1e9])
        dist.all_reduce(rate)
        if rank == 0:
            Path(out).write_text(f"{rate.item() / world} {times[False]} {times[True]}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_mini")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="passes a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from orchestrator import conf_dir
    from orchestrator.launch import free_port

    chip_gbps = float(OmegaConf.load(conf_dir() / "chip" / "cpu.yaml").host_copy_gbps)
    world = 2 * args.tp
    print(
        f"{args.model}, dp2 tp{args.tp} ({world} gloo processes on {os.cpu_count()} cores), micro-batch "
        f"{args.micro_batch} x {args.seq}; chip=cpu host_copy_gbps={chip_gbps:g}"
    )
    print(f"{'spawn':>5}  {'plain CPU s/pass':>16}  {'FSDP CPU s/pass':>15}  {'GB/s moved':>10}")
    each = []
    for i in range(args.repeats):
        with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
            out = f.name
        mp.spawn(_rank, args=(world, free_port(), args, out), nprocs=world, join=True)
        rate, plain, fsdp = (float(v) for v in Path(out).read_text().split())
        os.unlink(out)
        each.append(rate)
        print(f"{i:>5}  {plain:>16.4f}  {fsdp:>15.4f}  {rate:>10.3f}")
    print(f"median {statistics.median(each):.3f} GB/s of FSDP's gathered and reduced bytes per CPU second")


if __name__ == "__main__":
    main()
