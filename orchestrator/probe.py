"""What accelerator this node has, asked without initialising one in this process.

The driver (the process that composes the config, plans and launches the workers) must hold no
device context: on CANN before 8.3.RC1 the first call that initialises torch_npu sets device 0
in the calling process (``NpuSysCtrl::Initialize`` calls ``SetDevice(0)`` unless
``is_lazy_set_device()``, which is ``IsGteCANNVersion("8.3.RC1")``: Ascend/pytorch
``torch_npu/csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp``, ``csrc/core/npu/NPUFunctions.cpp``), and
that context's memory is then missing from rank 0's device, inflating its ``device_mem_used_gb``.
Which torch_npu calls do that (Ascend/pytorch ``torch_npu/npu/__init__.py``, ``npu/utils.py``,
``csrc/npu/Module.cpp``):

- ``device_count()``: ``drvGetDevNum`` of ``libascend_hal.so`` (the driver's count, trimmed by
  ``ASCEND_RT_VISIBLE_DEVICES``), else ``aclrtGetDeviceCount``; sets no device. Older releases
  call ``_npu_getDeviceCount`` (``aclrtGetDeviceCount``) directly; no device either.
  ``is_available()`` is ``device_count() > 0``.
- ``get_device_name(i)``: ``aclrtGetSocName()``, the SoC's name, not device ``i``'s; no device.
- ``get_device_properties(i)``: ``torch_npu.npu._lazy_init()`` first, i.e. ``_npu_init`` ->
  ``NpuSysCtrl::Initialize``, which sets device 0 on CANN < 8.3.RC1; then ``aclrtGetMemInfo``,
  which reads the current device's memory. ``mem_get_info`` likewise, under an ``NPUGuard``.

On CUDA ``torch.cuda.is_available()`` calls ``cudaGetDeviceCount`` (``cuInit``: no context, but
it poisons fork) and ``get_device_properties`` runs ``torch.cuda._lazy_init`` (torch's
``torch/cuda/__init__.py``). So the facts are asked of the runtime in a short child process
(``python -c``: imports torch / torch_npu, prints one JSON line, exits, and its context dies with
it), and only where the child gives no answer at all (it hung past ``PROBE_TIMEOUT_S`` or died
without printing) of the driver's own management tool, ``npu-smi info`` or ``nvidia-smi``, which
read the driver (DCMI / NVML) and create no runtime context either. The child comes first
because it reads what the workers will: the name :mod:`orchestrator.devices` is keyed on
(``aclrtGetSocName``'s "Ascend910B3"; npu-smi prints "910B3", and "Ascend910" for both chips of
an A3), the memory torch reports, and the devices ``ASCEND_RT_VISIBLE_DEVICES`` /
``CUDA_VISIBLE_DEVICES`` leave visible, which the tools ignore (their count is trimmed here as
the runtimes trim theirs). A child that answers with an error (torch_npu does not import, CANN
is broken) is taken at its word, as the workers would fail the same way: no device, and why.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

log = logging.getLogger("orchestrator")

KINDS = ("npu", "cuda")
# the variable each runtime reads its visible devices from
VISIBLE_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
# importing torch_npu (and CANN's libraries) takes seconds to tens of seconds on a loaded host
PROBE_TIMEOUT_S = 180.0
TOOL_TIMEOUT_S = 30.0
MARK = "chip-probe:"  # the child's answer line: torch_npu may print warnings to stdout first


@dataclass(frozen=True)
class Facts:
    """What a node shows of one kind of accelerator: how many, device 0's name and memory (GiB).
    ``source``: who said it (``runtime``, ``npu-smi``, ``nvidia-smi``); ``error``: why none."""

    device_type: str
    count: int = 0
    name: str = ""
    memory_gib: Optional[float] = None
    source: str = ""
    error: str = ""


# Run as `python -c _CHILD KIND` in a process of its own: whatever context its calls create is
# released when it exits. It always prints one MARK line, an error included.
_CHILD = r"""
import json, sys
kind, out = sys.argv[1], {"count": 0}
try:
    import torch
    if kind == "npu":
        import torch_npu  # noqa: F401  registers torch.npu
    mod = getattr(torch, kind)
    n = int(mod.device_count()) if mod.is_available() else 0
    if n:
        out.update(name=str(mod.get_device_name(0)), total_memory=int(mod.get_device_properties(0).total_memory))
    out["count"] = n
except BaseException as e:
    out["error"] = "%s: %s" % (type(e).__name__, e)
print(MARK + json.dumps(out), flush=True)
""".replace("MARK", repr(MARK))


def runtime_present(kind: str) -> bool:
    """Whether the runtime the workers would use is installed, asked without importing torch_npu
    or touching a device: torch_npu's spec; a torch built with CUDA (or ROCm)."""
    if kind == "npu":
        return importlib.util.find_spec("torch_npu") is not None
    import torch

    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def run_child(kind: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """The child's stdout, or None where it gave none (it could not start or ran past ``timeout``)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, kind], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("the %s probe process gave no answer (%s)", kind, type(e).__name__)
        return None
    if proc.returncode != 0 and MARK not in proc.stdout:
        log.warning("the %s probe process died (exit %s): %s", kind, proc.returncode, proc.stderr.strip()[-500:])
    return proc.stdout


def parse_child_output(kind: str, stdout: Optional[str]) -> Optional[Facts]:
    """The child's answer (its last MARK line), or None where it printed none."""
    for line in reversed((stdout or "").splitlines()):
        line = line.strip()
        if not line.startswith(MARK):
            continue
        try:
            got = json.loads(line[len(MARK) :])
        except ValueError:
            return None
        if got.get("error"):
            return Facts(kind, source="runtime", error=str(got["error"]))
        count = int(got.get("count") or 0)
        if not count:
            return Facts(kind, source="runtime")
        memory = got.get("total_memory")
        return Facts(kind, count, str(got.get("name", "")), float(memory) / 2**30 if memory else None, "runtime")
    return None


def visible_count(found: int, visible: Optional[str]) -> int:
    """How many of ``found`` devices a runtime shows under its visible-devices variable: all when
    unset, none when empty; else the entries before the first that is not a device here (the
    runtimes stop there: torch_npu ``_parse_visible_devices`` / ``_device_count_ascend_hal``, torch
    ``_parse_visible_devices``). A UUID entry (``GPU-...``, ``MIG-...``) counts as one device."""
    if visible is None:
        return found
    n = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < found:
            n += 1
        elif entry.startswith(("GPU-", "MIG-")):
            n += 1
        else:
            break
    return min(n, found)


# `npu-smi info`: two rows per chip; the first "| NPU  Name | Health | Power(W) Temp(C) ... |", the
# second "| Chip [Phy-ID] | Bus-Id | AICore(%) Memory-Usage(MB) HBM-Usage(MB) |", the HBM pair last.
# The process table below it ("| NPU Chip | Process id | ...") has no health word in column 2.
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+([^|\s]+)\s*\|\s*([A-Za-z]+)\s*\|")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def parse_npu_smi(text: str, visible: Optional[str] = None) -> Facts:
    """Chips, the first chip's name (as torch_npu spells it: "910B3" -> "Ascend910B3") and its HBM
    (the last used / total pair of the row after the name, MB) from ``npu-smi info``."""
    lines = text.splitlines()
    names: List[str] = []
    memory: Optional[float] = None
    for i, line in enumerate(lines):
        m = _NPU_ROW.match(line.strip())
        if not m:
            continue
        names.append(m.group(2))
        if memory is None and i + 1 < len(lines):
            totals = [int(t) for _, t in _PAIR.findall(lines[i + 1]) if int(t) > 0]
            memory = totals[-1] / 1024 if totals else None
    if not names:
        return Facts("npu", source="npu-smi", error="npu-smi lists no NPU")
    name = names[0] if names[0].upper().startswith("ASCEND") else "Ascend" + names[0]
    return Facts("npu", visible_count(len(names), visible), name, memory, "npu-smi")


def parse_nvidia_smi(text: str, visible: Optional[str] = None) -> Facts:
    """GPUs, the first one's name and memory (MiB, with or without the unit) from
    ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader[,nounits]``."""
    rows = []
    for line in text.splitlines():
        if "," not in line:
            continue
        name, total = (part.strip() for part in line.rsplit(",", 1))
        total = total.removesuffix("MiB").strip()
        rows.append((name, float(total) / 1024 if re.fullmatch(r"\d+(\.\d+)?", total) else None))
    if not rows:
        return Facts("cuda", source="nvidia-smi", error="nvidia-smi lists no GPU")
    return Facts("cuda", visible_count(len(rows), visible), rows[0][0], rows[0][1], "nvidia-smi")


_TOOLS = {
    "npu": (["npu-smi", "info"], parse_npu_smi),
    "cuda": (["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"], parse_nvidia_smi),
}


def run_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT_S) -> Optional[str]:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def tool_facts(kind: str, runner: Optional[Callable[[Sequence[str]], Optional[str]]] = None) -> Optional[Facts]:
    """The facts from the driver's management tool, or None where it is absent or fails."""
    argv, parse = _TOOLS[kind]
    out = (runner or run_tool)(argv)
    if out is None:
        return None
    return parse(out, os.environ.get(VISIBLE_ENV[kind]))


def probe(kind: str) -> Facts:
    """What this node shows of ``kind`` (npu | cuda), this process touching no device: the
    runtime in a child process, else the management tool. Asked once per visible-devices value
    (:func:`cache_clear` forgets)."""
    if kind not in KINDS:
        raise ValueError(f"no probe for device type {kind!r}; expected one of {KINDS}")
    return _probe(kind, os.environ.get(VISIBLE_ENV[kind]))


@functools.lru_cache(maxsize=None)
def _probe(kind: str, _visible: Optional[str]) -> Facts:
    if not runtime_present(kind):
        return Facts(kind, error="torch_npu is not installed" if kind == "npu" else "torch is built without CUDA")
    facts = parse_child_output(kind, run_child(kind))
    if facts is not None:
        return facts
    tool = _TOOLS[kind][0][0]
    facts = tool_facts(kind)
    if facts is not None:
        log.warning("%s devices read from %s: the runtime's probe process gave no answer", kind, tool)
        return facts
    return Facts(kind, error=f"the {kind} runtime's probe process gave no answer and {tool} none either")


cache_clear = _probe.cache_clear
