"""Which chip preset a device is: its full name, as the vendor's runtime reports it, to a preset.

Names are matched whole, not by substring: an "NVIDIA H100 PCIe" is not the SXM part, an
"NVIDIA H200" is not an H20, and an "NVIDIA GH200 480GB" is none of them. Where one preset
stands for several parts (an A100 PCIe card and the SXM module have the same compute but not the
same links), the match carries the keys that differ. A name no rule knows gets the vendor's
generic preset (``cuda``, ``npu``), whose peak figures are unknown: the caller warns, and MFU is
recorded as unknown rather than wrong.

Sources of the names:
- NVIDIA: the driver's list of supported GPUs (README of NVIDIA's open GPU kernel modules,
  "Compatible GPUs"), which is what ``torch.cuda.get_device_name()`` returns.
- Ascend: ``torch.npu.get_device_name()`` returns the SoC name of ``aclrtGetSocName()``; the
  names torch_npu knows are listed in its ``csrc/core/npu/NpuVariables.cpp`` (Ascend910A ...
  Ascend910B4-1, Ascend910_9391 ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

# PCIe Gen4 x16, GB/s per direction: an A100 / A800 card's path to the node's other cards
_PCIE4_GBPS = 32.0

# (pattern on the upper-cased name, preset, keys that differ from the preset), first match wins
_CUDA_RULES: Tuple[Tuple[str, Optional[str], Dict[str, Any]], ...] = (
    (r"\bGH200\b", None, {}),  # Grace Hopper: CPU-coupled memory, no preset
    (r"\bH200 NVL\b", "h200_nvl", {}),
    (r"\bH200\b", "h200", {}),  # the SXM part reports plain "NVIDIA H200"
    (r"\bH100 NVL\b", "h100_nvl", {}),
    (r"\bH100 PCIE\b", "h100_pcie", {}),
    (r"\bH100\b.*\b(HBM3|SXM)", "h100_sxm", {}),  # "NVIDIA H100 80GB HBM3"
    (r"\bH800 (PCIE|NVL)\b", None, {}),  # the cut-down Hopper on PCIe: no preset
    (r"\bH800\b", "h800", {}),
    (r"\bH20\b", "h20", {}),
    (r"\bA800\b.*\bPCIE\b", "a800", {"intra_node_gbps": _PCIE4_GBPS}),
    (r"\bA800\b", "a800", {}),
    (r"\bA100\b.*\bPCIE\b", "a100_{gb}", {"intra_node_gbps": _PCIE4_GBPS}),  # "A100-PCIE-40GB", "A100 80GB PCIe"
    (r"\bA100\b", "a100_{gb}", {}),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB"
)

_NPU_RULES: Tuple[Tuple[str, Optional[str], Dict[str, Any]], ...] = (
    (r"^ASCEND910B1$", "ascend910b1", {}),
    (r"^ASCEND910B2C?$", "ascend910b2", {}),
    (r"^ASCEND910B3$", "ascend910b3", {}),
    (r"^ASCEND910B4$", "ascend910b4", {}),
    (r"^ASCEND910B4-1$", "ascend910b4", {"memory_gb": 64}),  # the 64 GB variant of the 910B4
    (r"^ASCEND910(A|PROA)$", "ascend910a", {}),
)


@dataclass
class DeviceMatch:
    """The preset of a device name, the keys that differ from it, and whether a rule knew it."""

    preset: str
    overrides: Dict[str, Any] = field(default_factory=dict)
    known: bool = True


def match(device_type: str, name: str, memory_gib: Optional[float] = None) -> DeviceMatch:
    """The preset for a device of ``device_type`` (cuda | npu) named ``name``. ``memory_gib``:
    the device's own memory, when one is present; it chooses between memory variants the name
    does not spell (an A100 whose name carries no size) and is not applied here (see
    :func:`orchestrator.chips.detect`)."""
    rules = _CUDA_RULES if device_type == "cuda" else _NPU_RULES
    generic = "cuda" if device_type == "cuda" else "npu"
    key = " ".join(str(name).upper().replace("_", " ").split()) if device_type == "cuda" else str(name).upper()
    for pattern, preset, overrides in rules:
        if re.search(pattern, key):
            if preset is None:
                return DeviceMatch(generic, known=False)
            if "{gb}" in preset:
                preset = preset.format(gb=_a100_memory(key, memory_gib))
            return DeviceMatch(preset, dict(overrides))
    return DeviceMatch(generic, known=False)


def _a100_memory(key: str, memory_gib: Optional[float]) -> str:
    """40gb or 80gb: from the name when it says, else from the device's memory."""
    found = re.search(r"\b(40|80)GB\b", key.replace("-", " "))
    if found:
        return f"{found.group(1)}gb"
    return "40gb" if memory_gib is not None and memory_gib < 60 else "80gb"
