"""Accelerator detection initialises no device in the driver (orchestrator/probe.py), by its logic.

No NPU or GPU is here. A stand-in ``torch_npu`` package, importable by the driver and by its
child processes alike, answers the probe's calls in a child and raises on them in the driver;
``torch.cuda``'s device calls are made to raise in the driver. The management tools' output is
parsed on what ``npu-smi info`` and ``nvidia-smi`` really print (samples quoted from public
issues, cited at each).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap

import pytest
import torch

from orchestrator import chips, probe


@pytest.fixture(autouse=True)
def _fresh_probe():
    probe.cache_clear()
    yield
    probe.cache_clear()


# --- the driver path, end to end: a real child process, a stand-in torch_npu ---------------------------

FAKE_TORCH_NPU = '''
"""Stands in for torch_npu: registers torch.npu, whose calls write down the calling process and
raise when that process is the driver (FAKE_NPU_DRIVER_PID)."""
import json, os, types

import torch


def _call(name, value):
    with open(os.environ["FAKE_NPU_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), name]) + "\\n")
    if str(os.getpid()) == os.environ["FAKE_NPU_DRIVER_PID"]:
        raise RuntimeError("torch.npu.%s called in the driver" % name)
    return value


class _Props:
    name = "Ascend910B3"
    total_memory = 64 * 2**30  # what aclrtGetMemInfo reports for a 64 GB part, in bytes


torch.npu = types.SimpleNamespace(
    is_available=lambda: _call("is_available", True),
    device_count=lambda: _call("device_count", 8),
    get_device_name=lambda device=None: _call("get_device_name", "Ascend910B3"),
    get_device_properties=lambda device=None: _call("get_device_properties", _Props()),
    mem_get_info=lambda device=None: _call("mem_get_info", (0, 0)),
    set_device=lambda device: _call("set_device", None),
    current_device=lambda: _call("current_device", 0),
    synchronize=lambda device=None: _call("synchronize", None),
)
'''


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """A ``torch_npu`` on the driver's sys.path and on its children's PYTHONPATH; the log of calls."""
    root = tmp_path / "site"
    (root / "torch_npu").mkdir(parents=True)
    (root / "torch_npu" / "__init__.py").write_text(FAKE_TORCH_NPU)
    log = tmp_path / "npu_calls.jsonl"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_NPU_LOG", str(log))
    monkeypatch.setenv("FAKE_NPU_DRIVER_PID", str(os.getpid()))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    had_npu = hasattr(torch, "npu")
    yield log
    sys.modules.pop("torch_npu", None)  # had the driver imported it (the failure this guards against)
    if not had_npu and hasattr(torch, "npu"):
        del torch.npu


def _calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_npu_detection_asks_a_child_process_and_never_touches_the_npu_in_the_driver(fake_torch_npu):
    chip = chips.detect()
    assert chip.name == "ascend910b3" and chip.device_type == "npu" and chip.source == "detected"
    assert chip.memory_gb == 64.0 and chip.devices_per_node == 8
    # the checks before launch ask the same (cached) answer: no second child
    assert chips.availability_error(chip) is None and chips.visible_devices(chip) == 8

    calls = _calls(fake_torch_npu)
    pids = {pid for pid, _ in calls}
    assert os.getpid() not in pids, calls  # the driver called nothing of torch.npu
    assert len(pids) == 1  # one probe process answered every question
    # the child made the call that sets device 0 on CANN < 8.3 (get_device_properties -> _lazy_init)
    assert {"device_count", "get_device_name", "get_device_properties"} <= {name for _, name in calls}
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")  # not even imported here


def test_a_child_that_cannot_use_the_npu_is_taken_at_its_word(fake_torch_npu, tmp_path, monkeypatch):
    # torch_npu is installed but broken (CANN missing): the child says why; the workers would fail alike
    broken = tmp_path / "site" / "torch_npu" / "__init__.py"
    broken.write_text("raise ImportError('libascendcl.so: cannot open shared object file')\n")
    monkeypatch.setattr(probe, "run_tool", lambda argv: pytest.fail(f"{argv[0]} asked although the runtime answered"))
    assert chips.detect().name == "cpu"
    why = chips.availability_error(chips.load_preset("ascend910b3"))
    assert "sees no NPU device" in why and "libascendcl.so" in why


def _raise(name):
    def call(*a, **k):
        raise AssertionError(f"torch.cuda.{name} called in the driver")

    return call


def test_cuda_detection_makes_no_cuda_call_in_the_driver(monkeypatch):
    for name in (
        "is_available",
        "device_count",
        "get_device_name",
        "get_device_properties",
        "mem_get_info",
        "set_device",
        "current_device",
        "synchronize",
        "init",
        "_lazy_init",
    ):
        monkeypatch.setattr(torch.cuda, name, _raise(name))
    asked = []

    def child(kind, timeout=probe.PROBE_TIMEOUT_S):
        asked.append(kind)
        # what the child prints on an H200 node
        return probe.MARK + json.dumps({"count": 1, "name": "NVIDIA H200", "total_memory": int(139.8 * 2**30)})

    monkeypatch.setattr(probe, "runtime_present", lambda kind: kind == "cuda")
    monkeypatch.setattr(probe, "run_child", child)
    chip = chips.detect()
    assert chip.name == "h200" and chip.memory_gb == 139.8 and chip.devices_per_node == 1
    assert chips.visible_devices(chip) == 1 and chips.availability_error(chip) is None
    assert asked == ["cuda"]


def test_the_child_runs_on_the_real_torch_here():
    # this torch is a CPU build: the child imports it, finds no GPU, and says so on its answer line
    out = probe.run_child("cuda")
    assert probe.parse_child_output("cuda", out) == probe.Facts("cuda", source="runtime")


def test_no_child_is_started_where_the_runtime_is_not_installed(monkeypatch):
    monkeypatch.setattr(probe, "runtime_present", lambda kind: False)
    monkeypatch.setattr(probe, "run_child", lambda *a, **k: pytest.fail("a probe process was started"))
    assert chips.detect().name == "cpu"
    assert "not installed" in probe.probe("npu").error


# --- the child's answer -------------------------------------------------------------------------------


def test_the_answer_line_is_found_among_what_else_the_child_prints():
    noise = "[W compiler_depend.ts:51] Warning: CANN package version ...\nsome import banner\n"
    answer = probe.MARK + json.dumps({"count": 8, "name": "Ascend910B3", "total_memory": 65536 * 2**20})
    facts = probe.parse_child_output("npu", noise + answer + "\n")
    assert facts == probe.Facts("npu", 8, "Ascend910B3", 64.0, "runtime")
    err = probe.parse_child_output("npu", probe.MARK + json.dumps({"count": 0, "error": "ImportError: no CANN"}))
    assert err.count == 0 and err.error == "ImportError: no CANN"
    none = probe.parse_child_output("npu", probe.MARK + json.dumps({"count": 0}))
    assert none == probe.Facts("npu", source="runtime")
    # no answer line (killed, or died in native code before printing), or a torn one: no answer
    assert probe.parse_child_output("npu", noise) is None
    assert probe.parse_child_output("npu", None) is None
    assert probe.parse_child_output("npu", probe.MARK + '{"count": 8, "na') is None


# --- the fallback order --------------------------------------------------------------------------------

NVIDIA_SMI_H100 = "NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559\n"


def test_the_tool_is_asked_only_when_the_child_gives_no_answer(monkeypatch, caplog):
    monkeypatch.setattr(probe, "runtime_present", lambda kind: kind == "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(probe, "run_child", lambda kind, timeout=None: None)  # timed out
    tools = []
    monkeypatch.setattr(probe, "run_tool", lambda argv: tools.append(argv) or NVIDIA_SMI_H100)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        chip = chips.detect()
    assert chip.name == "h100_sxm" and chip.devices_per_node == 2 and chip.memory_gb == 79.6
    assert tools == [["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]]
    assert any("nvidia-smi" in r.getMessage() for r in caplog.records)

    # the child answers "none": the tool is not asked, and there is no GPU
    probe.cache_clear()
    tools.clear()
    monkeypatch.setattr(probe, "run_child", lambda kind, timeout=None: probe.MARK + '{"count": 0}')
    assert chips.detect().name == "cpu" and tools == []

    # neither answers: no GPU, and the reason says both were asked
    probe.cache_clear()
    monkeypatch.setattr(probe, "run_child", lambda kind, timeout=None: None)
    monkeypatch.setattr(probe, "run_tool", lambda argv: None)
    assert probe.probe("cuda").count == 0 and "nvidia-smi" in probe.probe("cuda").error


def test_the_answer_is_asked_again_when_the_visible_devices_change(monkeypatch):
    monkeypatch.setattr(probe, "runtime_present", lambda kind: kind == "cuda")
    asked = []

    def child(kind, timeout=None):
        n = probe.visible_count(8, os.environ.get("CUDA_VISIBLE_DEVICES"))
        asked.append(n)
        return probe.MARK + json.dumps({"count": n, "name": "NVIDIA H200", "total_memory": 150 * 10**9})

    monkeypatch.setattr(probe, "run_child", child)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert probe.probe("cuda").count == 2 and probe.probe("cuda").count == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert probe.probe("cuda").count == 1
    assert asked == [2, 1]


# --- the tools' output ---------------------------------------------------------------------------------

# `npu-smi info` on an Atlas 800T A2 with 910B4-1 chips (Project-HAMi/HAMi-WebUI#47, its first two NPUs;
# bus ids masked there), followed by the process table npu-smi prints under the chips
NPU_SMI_910B4_1 = textwrap.dedent(
    """\
    +------------------------------------------------------------------------------------------------+
    | npu-smi 25.2.0                   Version: 25.2.0                                               |
    +---------------------------+---------------+----------------------------------------------------+
    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    +===========================+===============+====================================================+
    | 0     910B4-1             | OK            | 91.3        33                0    / 0             |
    | 0                         | 0000:xx:00.0  | 0           0    / 0          3197 / 65536         |
    +===========================+===============+====================================================+
    | 1     910B4-1             | OK            | 88.1        32                0    / 0             |
    | 0                         | 0000:xx:00.0  | 0           0    / 0          3197 / 65536         |
    +===========================+===============+====================================================+
    +---------------------------+---------------+----------------------------------------------------+
    | NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
    +===========================+===============+====================================================+
    | 0       0                 | 2319814       | python3.11               | 61064                   |
    +===========================+===============+====================================================+
    | No running processes found in NPU 1                                                            |
    +===========================+===============+====================================================+
    """
)

# `npu-smi info` on an Atlas A3 (vllm-project/vllm-ascend#2534, its first two cards): two chips per card,
# each its own device, both named "Ascend910"
NPU_SMI_A3 = textwrap.dedent(
    """\
    +---------------------------+---------------+----------------------------------------------------+
    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    +===========================+===============+====================================================+
    | 0     Ascend910           | OK            | 178.5       36                0    / 0             |
    | 0     0                   | 0000:9D:00.0  | 0           0    / 0          3416 / 65536         |
    +------------------------------------------------------------------------------------------------+
    | 0     Ascend910           | OK            | -           36                0    / 0             |
    | 1     1                   | 0000:9F:00.0  | 0           0    / 0          3195 / 65536         |
    +===========================+===============+====================================================+
    | 1     Ascend910           | OK            | 186.3       36                0    / 0             |
    | 0     2                   | 0000:99:00.0  | 0           0    / 0          3415 / 65536         |
    +------------------------------------------------------------------------------------------------+
    | 1     Ascend910           | OK            | -           36                0    / 0             |
    | 1     3                   | 0000:9B:00.0  | 0           0    / 0          3196 / 65536         |
    +===========================+===============+====================================================+
    """
)


def test_npu_smi_chips_name_and_hbm():
    facts = probe.parse_npu_smi(NPU_SMI_910B4_1)
    assert facts == probe.Facts("npu", 2, "Ascend910B4-1", 64.0, "npu-smi")  # the process rows are no chips
    chip = chips.from_device("npu", facts.name, facts.memory_gib, facts.count)
    assert chip.name == "ascend910b4" and chip.memory_gb == 64.0 and chip.devices_per_node == 2

    a3 = probe.parse_npu_smi(NPU_SMI_A3)
    assert (a3.count, a3.name, a3.memory_gib) == (4, "Ascend910", 64.0)  # each chip of a card is a device
    assert chips.from_device("npu", a3.name, a3.memory_gib, a3.count).name == "npu"  # not told apart: generic

    # the tool ignores ASCEND_RT_VISIBLE_DEVICES; the runtime would show these many
    assert probe.parse_npu_smi(NPU_SMI_A3, "0,1").count == 2
    assert probe.parse_npu_smi(NPU_SMI_A3, "").count == 0
    assert probe.parse_npu_smi(NPU_SMI_A3, "2,9,3").count == 1  # 9 is no device here: the runtime stops
    assert probe.parse_npu_smi("npu-smi: command failed\n").count == 0


# `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader`: the lines public logs record, e.g.
# "NVIDIA H100 80GB HBM3, 81559 MiB" and "NVIDIA H200, 143771 MiB"; with nounits the unit is left off
@pytest.mark.parametrize(
    "text,name,preset,memory",
    [
        ("NVIDIA H100 80GB HBM3, 81559 MiB\n", "NVIDIA H100 80GB HBM3", "h100_sxm", 79.6),
        ("NVIDIA H200, 143771 MiB\nNVIDIA H200, 143771 MiB\n", "NVIDIA H200", "h200", 140.4),
        ("NVIDIA A100-SXM4-80GB, 81920\n", "NVIDIA A100-SXM4-80GB", "a100_80gb", 80.0),
        ("NVIDIA A100-PCIE-40GB, 40960\n", "NVIDIA A100-PCIE-40GB", "a100_40gb", 40.0),
    ],
)
def test_nvidia_smi_name_and_memory(text, name, preset, memory):
    facts = probe.parse_nvidia_smi(text)
    assert facts.name == name and facts.count == text.count("\n") and facts.source == "nvidia-smi"
    chip = chips.from_device("cuda", facts.name, facts.memory_gib, facts.count)
    assert chip.name == preset and chip.memory_gb == memory


def test_nvidia_smi_count_follows_cuda_visible_devices():
    eight = "NVIDIA H200, 143771 MiB\n" * 8
    assert probe.parse_nvidia_smi(eight, None).count == 8
    assert probe.parse_nvidia_smi(eight, "1").count == 1
    assert probe.parse_nvidia_smi(eight, "").count == 0
    assert probe.parse_nvidia_smi(eight, "-1").count == 0  # torch: a negative index ends the list
    assert probe.parse_nvidia_smi(eight, "GPU-6a3b2c1d-0000-1111-2222-333344445555,GPU-7f00").count == 2
    assert probe.parse_nvidia_smi("No devices were found\n").count == 0
