"""Device, backend and process-group setup for one worker, for any chip.

The control plane decides *which* chip (device type, backend, plugin, env); this module only
applies the decision inside the worker process: environment first (HCCL/NCCL read it when the
communicator is created), then the plugin import, the device from the local rank, and the
process group with the configured timeout.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import resource
from typing import Dict

import torch
import torch.distributed as dist

from trainers.config import RuntimeConfig

# what the elastic agent sets for each worker (its rank, the rendezvous, the restart count)
_LAUNCHER_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def adopt_env(env: Dict[str, str]) -> None:
    """Take over the launching process's environment ``env``, keeping what the launcher set for
    this worker. A worker forked from a forkserver starts with the server's environment, a copy
    of the driver's from when the server started; a variable the driver set or changed since
    (a sweep's job, a user's export in a notebook) would be missing."""
    mine = {k: v for k, v in os.environ.items() if k in _LAUNCHER_KEYS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(mine)


def apply_env(env: Dict[str, str]) -> None:
    """Set backend variables (HCCL_BUFFSIZE, NCCL_BUFFSIZE, ...) unless the user already has."""
    for key, value in env.items():
        os.environ.setdefault(key, str(value))


def select_device(rt: RuntimeConfig, local_rank: int) -> torch.device:
    if rt.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # share the host's cores among this node's workers instead of each taking all of them
        # (torchrun sets OMP_NUM_THREADS=1 for the same reason; the launcher API does not)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if rt.torch_plugin:
        importlib.import_module(rt.torch_plugin)  # torch_npu registers the "npu" device
    if rt.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if rt.device_type == "npu":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def init_process_group(rt: RuntimeConfig) -> None:
    """Join the trial's process group (env:// variables from the launcher). Under torch's
    elastic agent, a restarted worker group reuses the agent's store: its keys are prefixed with
    the restart count, or the new ranks would read the dead ranks' addresses and fail to connect."""
    if dist.is_initialized():
        return
    timeout = _dt.timedelta(seconds=rt.timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend=rt.backend, init_method="env://", timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    dist.init_process_group(
        backend=rt.backend,
        store=dist.PrefixStore(f"attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2**30  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def compile_backend(device_type: str, requested: str = "auto"):
    """The torch.compile backend for this device. On Ascend, Inductor has no NPU code generator in
    most CANN releases: TorchAir's ``get_npu_backend()`` turns the captured graph into a GE graph
    (import torch_npu before torchair). Elsewhere Inductor."""
    if requested != "auto":
        return requested
    if device_type == "npu":
        try:
            import torchair  # type: ignore[import-not-found]

            return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
        except ImportError:
            return "aot_eager"  # graph capture without a device code generator
    return "inductor"
