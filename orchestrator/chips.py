"""Chip presets, local accelerator detection, and the runtime a trial's workers get.

``+chip=NAME`` selects a preset from ``conf/chip``; without it the local accelerator is
detected: an Ascend NPU when ``torch_npu`` imports and sees devices, else a CUDA GPU, else the
CPU. Detection initialises no device in this process (:mod:`orchestrator.probe`): the driver that
launches the workers must not hold a context on a device a worker will use.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Dict, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from orchestrator import conf_dir, devices, probe
from orchestrator.config import ChipConfig
from trainers import rules
from trainers.config import RuntimeConfig

log = logging.getLogger("orchestrator")


def preset_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "chip").glob("*.yaml"))


def load_preset(name: str) -> DictConfig:
    """A chip preset merged onto its schema, as ``+chip=NAME`` would compose it: a preset that
    names others in its ``defaults`` list (an SKU's variant, a name kept for one SKU) is merged
    over them, in order, as Hydra does."""
    return OmegaConf.merge(OmegaConf.structured(ChipConfig), _preset_body(name))


def _preset_body(name: str) -> DictConfig:
    path = conf_dir() / "chip" / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(f"no chip preset {name!r}; presets: {', '.join(preset_names())}")
    own = OmegaConf.load(path)
    order = [str(e) for e in (own.pop("defaults", None) or [])]
    if "_self_" not in order:
        order.append("_self_")
    merged = OmegaConf.create({})
    for entry in order:
        merged = OmegaConf.merge(merged, own if entry == "_self_" else _preset_body(entry))
    return merged


def _facts(device_type: str) -> probe.Facts:
    """What this node shows of ``device_type`` (npu | cuda), read without initialising a device in
    this process (the driver): :func:`orchestrator.probe.probe` asks the runtime in a child
    process, else ``npu-smi`` / ``nvidia-smi``; the name and memory are device 0's, from
    ``get_device_name`` and ``get_device_properties(0).total_memory`` (torch_npu's
    ``csrc/npu/Module.cpp`` has the same fields as CUDA's)."""
    return probe.probe(device_type)


def from_device(device_type: str, name: str, memory_gib: Optional[float], count: Optional[int]) -> DictConfig:
    """The preset of a device named ``name`` (:func:`orchestrator.devices.match`), with what the
    device itself says applied: its memory and how many this node shows. A name no preset knows
    gets the generic preset and a warning; its MFU is recorded as unknown."""
    found = devices.match(device_type, name, memory_gib)
    chip = load_preset(found.preset)
    for key, value in found.overrides.items():
        chip[key] = value
    if memory_gib:
        chip.memory_gb = round(memory_gib, 1)
    if count:
        chip.devices_per_node = count
    if not found.known:
        log.warning(
            "device %r matches no chip preset: using the generic %r preset (MFU unknown, the planner's peak a "
            "placeholder); name a preset with +chip=NAME or set chip.peak_tflops",
            name,
            found.preset,
        )
    chip.source = "detected"
    return chip


def detect() -> DictConfig:
    """The preset of the local accelerator, by the device's full name, with its memory and
    ``devices_per_node`` read from the device; the CPU when there is none."""
    for kind in ("npu", "cuda"):
        found = _facts(kind)
        if found.count:
            return from_device(kind, found.name, found.memory_gib, found.count)
    chip = load_preset("cpu")
    chip.source = "detected"
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
    if chip.device_type == "npu":
        found = _facts("npu")
        if not found.count:
            why = f" ({found.error})" if found.error else ""
            return f"chip={chip.name}: torch_npu sees no NPU device here{why}; {hint}"
    if chip.device_type == "cuda" and not _facts("cuda").count:
        return f"chip={chip.name} needs CUDA devices and none is visible here; {hint}"
    return None


def visible_devices(chip: DictConfig) -> Optional[int]:
    """How many devices of this chip this node shows; None where processes are the devices."""
    if chip.emulate or chip.device_type == "cpu":
        return None
    if chip.device_type in probe.KINDS:
        return _facts(chip.device_type).count
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


# HCCL_CONNECT_TIMEOUT's valid range, seconds (CANN environment variable reference,
# HCCL_CONNECT_TIMEOUT: an integer in [120, 7200], default 120)
HCCL_CONNECT_RANGE = (120, 7200)
# HCCL_EXEC_TIMEOUT's range on the Atlas training series (910A): (0, 17340] in steps of 68 s;
# Atlas A2/A3 take [0, 2147483647] in whole seconds, 0 meaning never (the same reference)
HCCL_EXEC_MAX_STEPPED = 17340


def hccl_timeouts(timeout_s: float, step_s: int = 0) -> Tuple[int, int, float]:
    """``comm.timeout_s`` as HCCL's two variables and the process group's timeout:
    ``HCCL_CONNECT_TIMEOUT`` (building the communicator) clamped to its valid range, and
    ``HCCL_EXEC_TIMEOUT`` (one collective on the device) set below the process-group timeout by
    ``trainers.rules.exec_margin_s``, so HCCL's own timeout fires first and its error names the cause
    instead of torch's watchdog aborting the communicator with a bare timeout. Where the part's
    step (68 s on the 910A) makes that impossible, the process-group timeout is raised to the
    smallest that holds, never the other way round."""
    lo, hi = HCCL_CONNECT_RANGE
    connect = int(min(hi, max(lo, round(timeout_s))))
    want = int(float(timeout_s) - rules.exec_margin_s(timeout_s))
    if step_s:
        execute = max(step_s, min(HCCL_EXEC_MAX_STEPPED, want) // step_s * step_s)
    else:
        execute = max(1, want)
    return connect, execute, rules.collective_timeout_s(timeout_s, "hccl", execute)


def runtime(chip: DictConfig, comm: DictConfig, compute_dtype: str) -> RuntimeConfig:
    """What the workers need to know of the chip: device, backend, plugin and environment.

    An emulated chip keeps its plan (its name, peak figures for MFU, env for the record) but
    runs on CPU with gloo.
    """
    # the chip preset's defaults, then what the comm section says (its buffer size and timeout
    # are keys of their own and win over the preset's env), then comm.env, the user's explicit word
    env: Dict[str, str] = {k: str(v) for k, v in chip.env.items()}
    backend = "gloo" if chip.emulate else chip.dist_backend
    timeout_s = float(comm.timeout_s)
    # communication-buffer size for the backend that will really run
    if chip.dist_backend == "hccl":
        env["HCCL_BUFFSIZE"] = str(comm.buffsize_mb)
        connect, execute, pg_timeout = hccl_timeouts(timeout_s, int(chip.exec_timeout_step_s))
        env["HCCL_CONNECT_TIMEOUT"], env["HCCL_EXEC_TIMEOUT"] = str(connect), str(execute)
        if not chip.emulate:
            timeout_s = pg_timeout
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
        timeout_s=timeout_s,
        # MFU against the emulated chip's peak would be meaningless on a CPU: leave it unknown,
        # and so would a generic preset's placeholder peak: unknown, not wrong
        peak_flops=0.0 if chip.emulate or not chip.peak_known else peak * 1e12,
    )
