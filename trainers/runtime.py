"""Device, backend and process-group setup for one worker, for any chip.

The control plane decides *which* chip (device type, backend, plugin, env); this module only
applies the decision inside the worker process: environment first (HCCL/NCCL read it when the
communicator is created), then the plugin import, the device from the local rank, and the
process group with the configured timeout.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib
import os
import resource
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from trainers import rules
from trainers.config import RuntimeConfig
from trainers.host import host_cores

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


def ran_with(summary: Optional[Dict[str, Any]], rt: RuntimeConfig, deterministic: bool) -> Optional[Dict[str, Any]]:
    """``summary`` with ``backend_env``: the value of every backend variable the config sets (and
    ``trainer.deterministic``'s) as this worker ran with it, "" where unset. The validator refuses
    an exported value that would override one of the config's, but HCCL's two timeouts may be
    exported on purpose: the run records what the ranks used (``orchestrator/validate_env.py``)."""
    if summary is not None:
        names = sorted(rules.backend_env(rt.env, rt.device_type, deterministic))
        summary["backend_env"] = {k: os.environ.get(k, "") for k in names}
    return summary


def select_device(rt: RuntimeConfig, local_rank: int) -> torch.device:
    if rt.device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # share the host's cores among this node's workers instead of each taking all of them
        # (torchrun sets OMP_NUM_THREADS=1 for the same reason; the launcher API does not)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(rules.worker_threads(host_cores(), local_world))
    if rt.torch_plugin:
        importlib.import_module(rt.torch_plugin)  # torch_npu registers the "npu" device
    if rt.device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if rt.device_type == "npu":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def set_deterministic(device_type: str, on: bool) -> None:
    """``trainer.deterministic``: deterministic kernels and collectives, or the fastest ones.
    The environment is set unless the user exported it; call before the process group."""
    if on:
        apply_env(rules.determinism_env(device_type))
    torch.use_deterministic_algorithms(on, warn_only=True)


def setup(
    rt: RuntimeConfig, local_rank: int, deterministic: bool = False, store: Optional[dist.Store] = None
) -> torch.device:
    """A worker's runtime, in the order the devices' libraries need it: backend environment, the
    plugin import and the current device, then the process group bound to that device. HCCL and
    NCCL create their communicators on the current device; torch_npu registers the "hccl" backend
    when it is imported (torch's device-backend autoload does it too, unless a site sets
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), and its docs set the device before
    ``init_process_group`` (torch_npu, "Distributed training" quick start). ``store``: see
    :func:`init_process_group`."""
    apply_env(rt.env)
    set_deterministic(rt.device_type, deterministic)
    device = select_device(rt, local_rank)
    init_process_group(rt, device, store)
    return device


def init_process_group(
    rt: RuntimeConfig, device: Optional[torch.device] = None, store: Optional[dist.Store] = None
) -> None:
    """Join the trial's process group (env:// variables from the launcher). ``device``: the
    worker's accelerator, passed as ``device_id`` (torch binds the group to it; for NCCL, whose
    backend supports splitting, it also creates the communicator at once, so a bad device or
    network fails here rather than in the first collective; torch_npu's ProcessGroupHCCL
    implements neither ``supportsSplitting`` nor ``eagerConnectSingleDevice`` (v7.3.0-pytorch2.7.1),
    so HCCL still connects at the first collective); None or the CPU: no binding (gloo). Under torch's elastic agent, a
    restarted worker group reuses the agent's store: its keys are prefixed with the restart
    count, or the new ranks would read the dead ranks' addresses and fail to connect. ``store``: a
    store the launcher already holds for this trial (a warm worker group's: rank 0 bound its port
    itself), with RANK and WORLD_SIZE from the environment."""
    if dist.is_initialized():
        return
    exported = os.environ.get("HCCL_EXEC_TIMEOUT", "").strip()
    seconds = rules.collective_timeout_s(rt.timeout_s, rt.backend, float(exported) if exported.isdigit() else None)
    timeout = _dt.timedelta(seconds=seconds)
    join = _dt.timedelta(seconds=rules.join_timeout_s(seconds, rt.backend))
    _join(rt, device, store, join)
    if join != timeout:  # every rank has joined: a collective now waits comm.timeout_s at most
        dist.distributed_c10d._set_pg_timeout(timeout)


def _join(rt: RuntimeConfig, device: Optional[torch.device], store: Optional[dist.Store], timeout) -> None:
    bound = {"device_id": device} if device is not None and device.type != "cpu" else {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if store is None and attempt is None:
        dist.init_process_group(backend=rt.backend, init_method="env://", timeout=timeout, **bound)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if store is None:
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        tcp = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=not agent_store and rank == 0,
            timeout=timeout,
            multi_tenant=not agent_store,
        )
        store = dist.PrefixStore(f"attempt_{attempt}", tcp)
    dist.init_process_group(backend=rt.backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)


def release_memory(device: torch.device) -> None:
    """After a trial: what its tensors held goes back to the device and the peak counters
    restart, so a later trial in the same process (a warm worker group's) reports its own peaks.
    On CPU the peak resident set cannot be reset: it stays the process's."""
    gc.collect()
    if device.type in ("cuda", "npu"):
        mod = _device_module(device)  # torch_npu mirrors torch.cuda's memory API (its npu/memory.py)
        mod.empty_cache()
        mod.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def _device_module(device: torch.device):
    return torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated device memory (tensors only); on CPU the process's peak resident set."""
    if device.type in ("cuda", "npu"):
        return _device_module(device).max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_gb(device: torch.device) -> Dict[str, float]:
    """What this rank's device holds, GiB: ``allocated`` (peak of live tensors), ``reserved``
    (peak the caching allocator held: allocated plus its slack and fragmentation, what the planner
    is compared against) and ``device_used`` (the device's own count of used memory now: reserved
    plus the runtime's context, communicator buffers and other processes' memory, total - free of
    ``mem_get_info``). torch_npu has the same calls on ``torch.npu`` (its ``npu/memory.py``:
    ``max_memory_reserved``, ``max_memory_allocated``; ``mem_get_info`` in ``npu/__init__.py``).
    On CPU all three are the process's peak resident set."""
    if device.type in ("cuda", "npu"):
        mod = _device_module(device)
        free, total = mod.mem_get_info(device)
        return {
            "allocated": mod.max_memory_allocated(device) / 2**30,
            "reserved": mod.max_memory_reserved(device) / 2**30,
            "device_used": (total - free) / 2**30,
        }
    rss = peak_memory_gb(device)
    return {"allocated": rss, "reserved": rss, "device_used": rss}


def compile_backend(device_type: str, requested: str = "auto"):
    """The torch.compile backend for this device. ``auto``: Inductor on CUDA and CPU; on Ascend,
    ``aot_eager`` (graph capture and AOT autograd, kernels from torch_npu's eager ops), because
    TorchAir, the NPU's graph compiler, is a beta feature aimed at inference (TorchAir user
    guide, hiascend "torchair" overview; its aclgraph mode cannot capture a backward pass), so it
    is not what a training trial gets unless asked for: ``torchair`` builds its
    ``get_npu_backend()`` (torch_npu imported first, as its guide says). Any other name is
    torch.compile's own."""
    if requested == "torchair":
        import torchair  # type: ignore[import-not-found]

        return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    return rules.compile_backend_name(device_type, requested)
