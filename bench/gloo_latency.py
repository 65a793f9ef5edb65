"""A small collective's fixed cost between CPU worker processes, beside the CPU chip's figure.

    python bench/gloo_latency.py [--worlds 2,4] [--calls 300] [--repeats 2] [--kib 2]

Spawns ``world`` gloo processes on this host (one intra-op thread each, as the trainer gives a
worker when there are as many workers as cores), times ``--calls`` all-reduces of ``--kib`` KiB
after a warm-up, and prints the seconds per call (median over ``--repeats`` spawns) beside
``chip.collective_latency_us`` of ``conf/chip/cpu.yaml``, the planner's alpha for the CPU chip.
The planner multiplies the alpha by ``max(1, u)`` when a node's workers ask for more cores than
the host has (``planner/step_time.py``), so a world larger than the cores is expected above it.
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


def _rank(rank: int, world: int, port: int, calls: int, numel: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.ones(numel)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        if rank == 0:
            Path(out).write_text(str((time.perf_counter() - t0) / calls))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kib", type=float, default=2.0)
    args = ap.parse_args()

    import torch.multiprocessing as mp
    from omegaconf import OmegaConf

    from orchestrator import conf_dir
    from orchestrator.launch import free_port

    alpha_us = float(OmegaConf.load(conf_dir() / "chip" / "cpu.yaml").collective_latency_us)
    numel = int(args.kib * 1024 / 4)
    print(f"gloo all_reduce of {args.kib:g} KiB on {os.cpu_count()} cores; chip=cpu collective_latency_us={alpha_us:g}")
    print(f"{'world':>5}  {'us per call (each spawn)':>28}  {'median':>8}  {'/ alpha':>7}")
    for world in (int(w) for w in args.worlds.split(",")):
        each = []
        for _ in range(args.repeats):
            with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
                out = f.name
            mp.spawn(_rank, args=(world, free_port(), args.calls, numel, out), nprocs=world, join=True)
            each.append(float(Path(out).read_text()) * 1e6)
            os.unlink(out)
        med = statistics.median(each)
        print(f"{world:>5}  {', '.join(f'{v:.0f}' for v in each):>28}  {med:>8.0f}  {med / alpha_us:>7.2f}")


if __name__ == "__main__":
    main()
