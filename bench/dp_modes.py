"""Each data-parallel mode (``parallel.dp_shard``: ddp, zero1, fsdp) side by side on 4 CPU ranks,
tp2 x dp2 with 8 micro-batches a replica: the step time and the bytes each rank sends per step.

    python bench/dp_modes.py [--model gpt_mini] [--steps 12] [--repeats 3] [--seq 128]

All modes run in one spawned gloo group, one after another, each trial ``--repeats`` times in
turn (ddp, zero1, fsdp, ddp, ...), so a slow spell of the shared host lands on every mode; the
step time is the trainer's own median over its steps after the warm-up (``trainers.loop``), then
the median over the repeats. Bytes: the DP collectives one step issues on rank 0, counted by
wrapping ``all_gather_single`` / ``reduce_scatter_single`` (FSDP2's) and ``all_reduce`` on the DP
group (the TP replicas' buckets), as a ring sends them ((n - 1) / n of a gather's output or a
reduce-scatter's input, 2 (n - 1) / n of an all-reduce), beside the planner's
``dp_traffic_bytes`` and its predicted step time for the same trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("ddp", "zero1", "fsdp")


def overrides(model: str, mode: str, steps: int, seq: int):
    return [
        "+chip=cpu",
        f"model={model}",
        "parallel=dp2tp2",
        f"parallel.dp_shard={mode}",
        "trainer=smoke",
        f"trainer.steps={steps}",
        "trainer.global_batch=16",
        "trainer.micro_batch=1",  # 8 micro-batches a replica
        f"trainer.seq_len={seq}",
        "data=synthetic",
        "tracking.enabled=false",
    ]


def _count_one_step(loop, step: int) -> float:
    """Bytes rank 0 sends in the data-parallel collectives of one step (a ring's share)."""
    import torch.distributed as dist

    dp_group = loop.model.mesh.group("dp")
    n = dist.get_world_size(dp_group)
    sent = [0.0]
    gather, scatter, reduce = dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce

    def all_gather_single(output, input, *args, **kwargs):  # noqa: A002 - torch's names
        sent[0] += output.numel() * output.element_size() * (n - 1) / n
        return gather(output, input, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):  # noqa: A002
        sent[0] += input.numel() * input.element_size() * (n - 1) / n
        return scatter(output, input, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        if kwargs.get("group", args[1] if len(args) > 1 else None) is dp_group:
            sent[0] += 2 * tensor.numel() * tensor.element_size() * (n - 1) / n
        return reduce(tensor, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = (
        all_gather_single,
        reduce_scatter_single,
        all_reduce,
    )
    try:
        loop.step(step)
    finally:
        dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = gather, scatter, reduce
    return sent[0]


def _rank(rank: int, world: int, port: int, specs: list, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainers.loop import Loop
    from trainers.reporter import NullReporter

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    got = {name: {"steps": [], "bytes": None} for name, _ in specs}
    try:
        for _ in range(repeats):
            for name, spec in specs:
                loop = Loop(spec, NullReporter())
                steps = loop.targs.steps
                for step in range(steps - 1):
                    loop.step(step)
                sent = _count_one_step(loop, steps - 1)
                summary = loop.summary()
                if rank == 0:
                    got[name]["steps"].append(summary["step_time_median_s"])
                    got[name]["bytes"] = sent
                dist.barrier()
        if rank == 0:
            torch.save(got, os.path.join(out, "modes.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_mini")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    import torch
    import torch.multiprocessing as mp
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import conf_dir, planner, trial
    from orchestrator.config import register_configs
    from orchestrator.launch import free_port
    from orchestrator.layout import layout
    from orchestrator.planner.shapes import ModelShape, ParallelShape

    register_configs()
    specs, planned = [], {}
    for mode in MODES:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = trial.prepare(compose("config", overrides=overrides(args.model, mode, args.steps, args.seq)))
        m, s = ModelShape.of(cfg.model), ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), "cpu")
        n = max(planner.rank_params(m, s, planner.rank_contents(m, s, r)) for r in range(s.pp))
        planned[mode] = (
            planner.dp_traffic_bytes(m, s, n, cfg.precision, cfg.comm, cfg.planner),
            planner.trial_parts(cfg),
            cfg.planner,
        )
        specs.append((mode, trial.build_spec(cfg)))
    GlobalHydra.instance().clear()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(4, free_port(), specs, args.repeats, out), nprocs=4, join=True)
        got = torch.load(os.path.join(out, "modes.pt"))

    print(
        f"{args.model}, dp2 x tp2 on 4 CPU ranks, 8 micro-batches a replica of 1 x {args.seq} tokens, "
        f"{args.steps} steps, {args.repeats} repeat(s) a mode in turn"
    )
    print(f"{'mode':<7}{'step_s':>9}{'runs':>28}{'vs ddp':>8}{'sent_MiB':>10}{'planned_MiB':>12}{'planned_s':>11}")
    base = statistics.median(got["ddp"]["steps"])
    for mode in MODES:
        steps = got[mode]["steps"]
        med = statistics.median(steps)
        planned_bytes, parts, pl = planned[mode]
        est = planner.combine(parts, float(pl.compute_efficiency), float(pl.comm_efficiency))
        runs = ", ".join(f"{x:.3f}" for x in steps)
        print(
            f"{mode:<7}{med:>9.3f}{runs:>28}{med / base:>8.2f}{got[mode]['bytes'] / 2**20:>10.2f}"
            f"{planned_bytes / 2**20:>12.2f}{est.step_time_s:>11.3f}"
        )


if __name__ == "__main__":
    main()
