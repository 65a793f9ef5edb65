"""Device memory a communicator really takes, against the planner's term for it.

    python bench/comm_memory.py [--world N] [--buffsize-mb 4] [--json]

Starts ``--world`` processes (default: every visible GPU or NPU, at least 1; on a machine with
neither, two gloo processes on the CPU, where there is no device memory to measure and the
script only checks its own plumbing), each of which binds its device, reads the device's used
memory (total - free of ``mem_get_info``: communicator buffers live outside the caching
allocator, so ``memory_reserved`` does not see them), creates the process group, runs a first
all-reduce (NCCL and HCCL create the communicator and its buffers lazily, at the first
collective), synchronises and reads it again. The difference, on the rank that grew most, is set
beside :func:`orchestrator.planner.memory.communicator_bytes` for the same settings, so
``planner.nccl_channels`` (NCCL) or the HCCL_BUFFSIZE rule can be calibrated. A median over
``--repeats`` fresh process groups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def device_kind() -> tuple[str, int]:
    """The accelerator here and how many: ("npu", n) when torch_npu imports and sees devices,
    ("cuda", n), else ("cpu", 0)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu", torch.npu.device_count()  # type: ignore[attr-defined]
        except Exception:  # CANN missing or broken: no usable NPU
            pass
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", 0


def _used_bytes(device) -> int:
    """The device's own count of used memory once its queued work is done (the trainer's reading,
    ``trainers.runtime.memory_gb``: total - free of ``mem_get_info``; on CPU the peak RSS)."""
    from trainers.runtime import memory_gb, synchronize

    synchronize(device)
    return int(memory_gb(device)["device_used"] * 2**30)


def _rank(rank: int, world: int, port: int, kind: str, env: dict, out: str) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from trainers.config import RuntimeConfig
    from trainers.runtime import select_device

    backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[kind]
    rt = RuntimeConfig(device_type=kind, backend=backend, torch_plugin="torch_npu" if kind == "npu" else None)
    device = select_device(rt, rank)
    x = torch.ones(1 << 20, device=device)  # the device's context exists before the first reading
    before = _used_bytes(device)
    from trainers.runtime import init_process_group

    init_process_group(rt, device)
    dist.all_reduce(x)
    after = _used_bytes(device)
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"before": before, "after": after}, f)


def measure(world: int, kind: str, env: dict) -> int:
    """Bytes the fullest rank's device memory grew by from process-group creation to the end of
    its first all-reduce."""
    import tempfile

    import torch.multiprocessing as mp

    from orchestrator.launch import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, free_port(), kind, env, out), nprocs=world)
        rows = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return max(r["after"] - r["before"] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=0, help="processes (default: every visible device, >= 1)")
    ap.add_argument("--buffsize-mb", type=float, default=None, help="NCCL_BUFFSIZE (MiB) / HCCL_BUFFSIZE (MB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()

    from omegaconf import OmegaConf

    from orchestrator.config import CommConfig, PlannerConfig
    from orchestrator.planner.memory import communicator_bytes

    kind, count = device_kind()
    world = args.world or (count if kind != "cpu" else 2)
    comm = OmegaConf.structured(CommConfig)
    env = {}
    if args.buffsize_mb is not None:
        comm.nccl_buffsize_mb, comm.buffsize_mb = args.buffsize_mb, int(args.buffsize_mb)
    if kind == "cuda":
        env["NCCL_BUFFSIZE"] = str(int(float(comm.nccl_buffsize_mb) * 2**20))
    elif kind == "npu":
        env["HCCL_BUFFSIZE"] = str(comm.buffsize_mb)
    backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[kind]
    planned = communicator_bytes(backend, comm, OmegaConf.structured(PlannerConfig))
    grown = [measure(world, kind, env) for _ in range(max(1, args.repeats))]
    measured = statistics.median(grown)
    row = {
        "device": kind,
        "backend": backend,
        "world": world,
        "buffsize": env,
        "measured_mib": measured / 2**20 if kind != "cpu" else None,  # host RSS is not device memory
        "planned_mib": planned / 2**20,
        "repeats_mib": [g / 2**20 for g in grown] if kind != "cpu" else None,
    }
    if kind != "cpu" and planned > 0:
        row["planned_over_measured"] = planned / measured if measured > 0 else None
        if backend == "nccl" and measured > 0:
            # the channel count that would make the planner's term equal the measurement
            per_channel = planned / int(PlannerConfig().nccl_channels)
            row["fitted_nccl_channels"] = measured / per_channel
    if args.json:
        print(json.dumps(row))
        return
    print(f"communicator memory: {kind} / {backend}, world {world}, {max(1, args.repeats)} fresh groups")
    measured_txt = "n/a (CPU: no device memory)" if row["measured_mib"] is None else f"{row['measured_mib']:.1f}"
    print(f"  measured (device used, first all-reduce): {measured_txt} MiB")
    print(f"  planned  (planner.memory.communicator_bytes): {row['planned_mib']:.1f} MiB")
    if row.get("fitted_nccl_channels"):
        print(f"  planner.nccl_channels that fits: {row['fitted_nccl_channels']:.1f}")


if __name__ == "__main__":
    main()
