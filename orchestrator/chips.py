"""Chip presets, local accelerator detection, and the runtime a trial's workers get.

``+chip=NAME`` selects a preset from ``conf/chip``; without it the local accelerator is
detected: an Ascend NPU when ``torch_npu`` imports and sees devices, else a CUDA GPU, else the
CPU. Detection imports torch (and torch_npu) only when it is needed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Dict, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator import conf_dir
from orchestrator.config import ChipConfig
from trainers.config import RuntimeConfig

# CUDA device names (torch.cuda.get_device_name) to presets; first match wins
_CUDA_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "chip").glob("*.yaml"))


def load_preset(name: str) -> DictConfig:
    """A chip preset merged onto its schema, as ``+chip=NAME`` would compose it."""
    path = conf_dir() / "chip" / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(f"no chip preset {name!r}; presets: {', '.join(preset_names())}")
    return OmegaConf.merge(OmegaConf.structured(ChipConfig), OmegaConf.load(path))


def _npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        import torch
        import torch_npu  # noqa: F401  registers torch.npu

        return torch.npu.device_count() if torch.npu.is_available() else 0  # type: ignore[attr-defined]
    except Exception:  # CANN missing or broken: no usable NPU
        return 0


def detect() -> DictConfig:
    """The preset of the local accelerator, with ``devices_per_node`` set to what is visible."""
    n_npu = _npu_count()
    if n_npu:
        chip, count = load_preset("ascend910b"), n_npu
    else:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            preset = next((p for key, p in _CUDA_PRESETS if key in name), "cuda")
            chip, count = load_preset(preset), torch.cuda.device_count()
        else:
            chip, count = load_preset("cpu"), None
    chip.source = "detected"
    if count:
        chip.devices_per_node = count
    return chip


def resolve(cfg: DictConfig) -> DictConfig:
    """Fill ``cfg.chip`` by detection when no ``+chip=NAME`` was given.

    ``chip.KEY=VALUE`` without ``+chip`` composes a chip with no name: the detected chip is
    taken and the keys the user set are applied to it.
    """
    chip = cfg.chip
    if not OmegaConf.is_missing(chip, "name"):
        return cfg
    detected = detect()
    defaults = OmegaConf.structured(ChipConfig)
    for key in chip:
        if not OmegaConf.is_missing(chip, key) and chip[key] != defaults[key]:
            detected[key] = chip[key]
    cfg.chip = detected
    return cfg


def availability_error(chip: DictConfig) -> Optional[str]:
    """Why this chip cannot run here (one line), or None. Emulated chips always run (CPU/gloo)."""
    if chip.emulate or chip.device_type == "cpu":
        return None
    hint = "chip.emulate=true rehearses the chip's plan on CPU with gloo"
    if chip.torch_plugin and importlib.util.find_spec(chip.torch_plugin) is None:
        return (
            f"chip={chip.name} needs {chip.torch_plugin}, which is not installed here "
            f"(pip install '.[npu]' on a machine with Huawei CANN); {hint}"
        )
    if chip.device_type == "npu" and _npu_count() == 0:
        return f"chip={chip.name}: torch_npu imports but sees no NPU device; {hint}"
    if chip.device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            return f"chip={chip.name} needs CUDA devices and none is visible here; {hint}"
    return None


def visible_devices(chip: DictConfig) -> Optional[int]:
    """How many devices of this chip this node shows; None where processes are the devices."""
    if chip.emulate or chip.device_type == "cpu":
        return None
    if chip.device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    if chip.device_type == "npu":
        return _npu_count()
    return None


def socket_env(ifname: Optional[str], backend: str) -> Dict[str, str]:
    """The variables that pin the collectives' sockets to ``comm.socket_ifname`` on every node.
    gloo takes interface names (a comma-separated list). NCCL and HCCL read a bare name as a
    prefix ("eth" matches eth0, eth1, ...) and "=name" as that exact interface, so they get the
    exact form (NCCL docs, "NCCL_SOCKET_IFNAME"; CANN environment variable reference,
    "HCCL_SOCKET_IFNAME"; HCCL_IF_IP, an address of one host, outranks it and stays per node)."""
    if not ifname:
        return {}
    env = {"GLOO_SOCKET_IFNAME": str(ifname)}
    if backend == "nccl":
        env["NCCL_SOCKET_IFNAME"] = "=" + str(ifname)
    elif backend == "hccl":
        env["HCCL_SOCKET_IFNAME"] = "=" + str(ifname)
    return env


def runtime(chip: DictConfig, comm: DictConfig, compute_dtype: str) -> RuntimeConfig:
    """What the workers need to know of the chip: device, backend, plugin and environment.

    An emulated chip keeps its plan (its name, peak figures for MFU, env for the record) but
    runs on CPU with gloo.
    """
    # the chip preset's defaults, then what the comm section says (its buffer size and timeout
    # are keys of their own and win over the preset's env), then comm.env, the user's explicit word
    env: Dict[str, str] = {k: str(v) for k, v in chip.env.items()}
    backend = "gloo" if chip.emulate else chip.dist_backend
    # communication-buffer size for the backend that will really run
    if chip.dist_backend == "hccl":
        env["HCCL_BUFFSIZE"] = str(comm.buffsize_mb)
        env["HCCL_CONNECT_TIMEOUT"] = str(int(comm.timeout_s))
    elif chip.dist_backend == "nccl":
        # NCCL allocates this per channel and per peer: MiB, not HCCL's per-communicator MB
        env["NCCL_BUFFSIZE"] = str(int(float(comm.nccl_buffsize_mb) * 1024 * 1024))
    env.update(socket_env(comm.get("socket_ifname"), chip.dist_backend))
    env.update({k: str(v) for k, v in comm.env.items()})
    peak = float(chip.peak_tflops.get(compute_dtype, chip.peak_tflops.get("fp32", 0.0)))
    return RuntimeConfig(
        device_type="cpu" if chip.emulate else chip.device_type,
        backend=backend,
        torch_plugin=None if chip.emulate else chip.torch_plugin,
        env=env,
        timeout_s=float(comm.timeout_s),
        emulated=bool(chip.emulate),
        # MFU against the emulated chip's peak would be meaningless on a CPU: leave it unknown
        peak_flops=0.0 if chip.emulate else peak * 1e12,
    )
