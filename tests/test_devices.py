"""Real chips by their logic: device names to presets, the worker's set-up order, HCCL's timeouts.

No NPU or GPU is here: detection is checked on the names the vendors' runtimes really report
(NVIDIA's driver list of supported GPUs; the SoC names torch_npu knows), and the set-up order on
a recorder standing in for ``torch.cuda`` / ``torch.npu`` and ``init_process_group``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

from orchestrator import chips, devices
from tests.conftest import cli_env
from trainers import rules, runtime
from trainers.config import RuntimeConfig

# full device name -> preset, memory (GB), dense bf16 (fp16 where the part has no bf16) TFLOPS,
# intra-node GB/s per direction
NAMES = [
    ("NVIDIA A100-SXM4-40GB", "a100_40gb", 40, 312, 300),
    ("NVIDIA A100-SXM4-80GB", "a100_80gb", 80, 312, 300),
    ("NVIDIA A100-PCIE-40GB", "a100_40gb", 40, 312, 32),
    ("NVIDIA A100 80GB PCIe", "a100_80gb", 80, 312, 32),
    ("NVIDIA A800-SXM4-80GB", "a800", 80, 312, 200),
    ("NVIDIA A800 80GB PCIe", "a800", 80, 312, 32),
    ("NVIDIA H100 80GB HBM3", "h100_sxm", 80, 989.4, 450),
    ("NVIDIA H100 PCIe", "h100_pcie", 80, 756, 64),
    ("NVIDIA H100 NVL", "h100_nvl", 94, 835.5, 64),
    ("NVIDIA H800", "h800", 80, 989.4, 200),
    ("NVIDIA H20", "h20", 96, 148, 450),
    ("NVIDIA H200", "h200", 141, 989.4, 450),
    ("NVIDIA H200 NVL", "h200_nvl", 141, 835.5, 64),
    ("Ascend910B1", "ascend910b1", 64, 414, 196),
    ("Ascend910B2", "ascend910b2", 64, 376, 196),
    ("Ascend910B2C", "ascend910b2", 64, 376, 196),
    ("Ascend910B3", "ascend910b3", 64, 313, 196),
    ("Ascend910B4", "ascend910b4", 32, 280, 196),
    ("Ascend910B4-1", "ascend910b4", 64, 280, 196),
    ("Ascend910A", "ascend910a", 32, 256, 30),
    ("Ascend910ProA", "ascend910a", 32, 256, 30),
]
UNKNOWN = [
    ("cuda", "NVIDIA GH200 480GB"),  # not an H200
    ("cuda", "NVIDIA H800 PCIe"),
    ("cuda", "NVIDIA GeForce RTX 4090"),
    ("cuda", "NVIDIA H100"),  # no form factor in the name: not given the SXM figures
    ("npu", "Ascend910_9391"),  # Atlas A3
    ("npu", "Ascend910PremiumA"),
    ("npu", "Ascend910B"),
]


@pytest.mark.parametrize("name,preset,memory,peak,link", NAMES)
def test_each_device_name_gets_its_sku_preset_and_figures(name, preset, memory, peak, link):
    kind = "npu" if name.startswith("Ascend") else "cuda"
    chip = chips.from_device(kind, name, None, 8)
    assert chip.name == preset and chip.source == "detected" and chip.devices_per_node == 8
    assert chip.memory_gb == memory
    dtype = "bf16" if "bf16" in chip.dtypes else "fp16"
    assert chip.peak_tflops[dtype] == pytest.approx(peak)
    assert chip.intra_node_gbps == link
    assert chip.peak_known and chip.device_type == kind


def test_the_910a_has_no_bf16_and_no_npu_fused_attention(compose_cfg):
    chip = chips.load_preset("ascend910a")
    assert "bf16" not in chip.dtypes and "bf16" not in chip.peak_tflops
    assert chip.decompositions["aten::_scaled_dot_product_"] == "model.attn_impl=decomposed"
    assert chips.load_preset("ascend910b3").decompositions["aten::_scaled_dot_product_"] == "model.attn_impl=npu_fused"


@pytest.mark.parametrize("kind,name", UNKNOWN)
def test_an_unknown_device_gets_the_generic_preset_a_warning_and_no_mfu(kind, name, caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        chip = chips.from_device(kind, name, 93.1, 4)
    assert chip.name == kind and not chip.peak_known
    assert chip.memory_gb == 93.1 and chip.devices_per_node == 4  # the device's own
    assert any(name in r.getMessage() and "MFU unknown" in r.getMessage() for r in caplog.records)
    rt = chips.runtime(chip, _comm(), "bf16")
    assert rt.peak_flops == 0.0  # the trainer records mfu as None, not a placeholder's figure


def test_memory_is_read_from_the_device_when_one_is_present():
    assert chips.from_device("cuda", "NVIDIA H200", 139.8, 1).memory_gb == 139.8
    # an A100 whose name carries no size is told apart by its memory
    assert devices.match("cuda", "NVIDIA A100-SXM4", 39.4).preset == "a100_40gb"
    assert devices.match("cuda", "NVIDIA A100-SXM4", 79.2).preset == "a100_80gb"


@pytest.mark.parametrize("kept,sku", [("a100", "a100_80gb"), ("h100", "h100_sxm"), ("ascend910b", "ascend910b3")])
def test_the_names_in_use_keep_working_as_the_sku_they_stand_for(compose_cfg, kept, sku):
    composed = compose_cfg([f"+chip={kept}"]).chip
    loaded, base = chips.load_preset(kept), chips.load_preset(sku)
    for chip in (composed, loaded):  # Hydra's composition and the detector's loader agree
        assert chip.name == kept
        for key in ("memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "dtypes", "decompositions"):
            assert chip[key] == base[key], (kept, key)


def _comm(**kw):
    from omegaconf import OmegaConf

    from orchestrator.config import CommConfig

    return OmegaConf.merge(OmegaConf.structured(CommConfig), kw)


@pytest.mark.parametrize("timeout_s", [5, 60, 119, 600, 1800, 7200, 20000])
@pytest.mark.parametrize("preset", ["ascend910b3", "ascend910a"])
def test_hccl_timeouts_stay_in_range_and_below_the_collective_timeout(timeout_s, preset):
    chip = chips.load_preset(preset)
    rt = chips.runtime(chip, _comm(timeout_s=timeout_s), "fp16")
    connect, execute = int(rt.env["HCCL_CONNECT_TIMEOUT"]), int(rt.env["HCCL_EXEC_TIMEOUT"])
    assert chips.HCCL_CONNECT_RANGE[0] <= connect <= chips.HCCL_CONNECT_RANGE[1]
    assert connect == min(7200, max(120, timeout_s))
    assert execute >= 1  # 0 would mean "never": the hang would wait for torch's watchdog alone
    # the backend's own execution timeout fires first, with time to report, and never after
    assert rt.timeout_s >= timeout_s and rt.timeout_s >= execute + rules.exec_margin_s(execute)
    if chip.exec_timeout_step_s:
        assert execute % 68 == 0 and execute <= chips.HCCL_EXEC_MAX_STEPPED
    if timeout_s >= 600:  # room for both: the user's timeout is kept as it is
        assert rt.timeout_s == timeout_s


def test_an_exported_exec_timeout_longer_than_the_collective_timeout_raises_the_latter():
    assert rules.collective_timeout_s(600, "hccl", 1836) == 1836 + rules.exec_margin_s(1836)
    assert rules.collective_timeout_s(600, "hccl", 300) == 600
    assert rules.collective_timeout_s(600, "hccl", 0) == 600  # 0: HCCL never times out
    assert rules.collective_timeout_s(600, "nccl", 1836) == 600


class _Recorder:
    """Stands in for a device module (``torch.cuda`` / ``torch.npu``), the plugin import and
    ``dist.init_process_group``, writing down what the worker's set-up calls, in order."""

    def __init__(self):
        self.calls = []

    def set_device(self, index):
        self.calls.append(["set_device", index])

    def import_module(self, name):
        self.calls.append(["import", name])
        if name == "torch_npu" and torch._C._get_privateuse1_backend_name() != "npu":
            # what importing torch_npu does first: the "npu" device type (for good, in this process)
            torch.utils.rename_privateuse1_backend("npu")
        return types.ModuleType(name)

    def init_process_group(self, backend=None, **kw):
        env = {k: os.environ.get(k) for k in ("HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG", "HCCL_EXEC_TIMEOUT")}
        device = kw.get("device_id")
        bound = str(device) if device is not None else None
        self.calls.append(["init", backend, bound, kw["timeout"].total_seconds(), env])


def setup_calls(kind: str, backend: str, plugin: str | None) -> list:
    """What ``trainers.runtime.setup`` calls, in order, for a worker of local rank 3 on a device of
    ``kind``, with a recorder in place of the device runtime. Run in a process of its own: the NPU
    case renames torch's privateuse1 device to "npu" for good, as torch_npu does."""
    rec = _Recorder()
    for key in ("HCCL_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG", "HCCL_EXEC_TIMEOUT", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(key, None)
    runtime.importlib.import_module = rec.import_module
    runtime.dist.is_initialized = lambda: False
    runtime.dist.init_process_group = rec.init_process_group
    runtime.torch.use_deterministic_algorithms = lambda *a, **k: None
    if kind == "npu":
        torch.npu = types.SimpleNamespace(set_device=rec.set_device)
    else:
        torch.cuda.set_device = rec.set_device
    env = {"HCCL_EXEC_TIMEOUT": "540"} if backend == "hccl" else {}
    rt = RuntimeConfig(device_type=kind, backend=backend, torch_plugin=plugin, env=env, timeout_s=600)
    device = runtime.setup(rt, local_rank=3, deterministic=True)
    return [str(device), rec.calls]


@pytest.mark.parametrize("kind,backend,plugin", [("npu", "hccl", "torch_npu"), ("cuda", "nccl", None)])
def test_the_process_group_is_created_after_the_device_is_set_and_bound_to_it(kind, backend, plugin):
    code = (
        "import json, sys; from tests.test_devices import setup_calls; "
        f"print(json.dumps(setup_calls({kind!r}, {backend!r}, {plugin!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    device, calls = json.loads(proc.stdout.strip().splitlines()[-1])
    assert device == f"{kind}:3"
    names = [c[0] for c in calls]
    assert names == (["import", "set_device", "init"] if plugin else ["set_device", "init"])
    _, got_backend, device_id, timeout, env = calls[-1]
    assert got_backend == backend and device_id == f"{kind}:3"  # device_id: bound to the device
    assert timeout == 600 >= int(env.get("HCCL_EXEC_TIMEOUT") or 0)
    # the backend's variables are in place before the communicator is created
    if kind == "npu":
        assert env["HCCL_DETERMINISTIC"] == "true" and env["HCCL_EXEC_TIMEOUT"] == "540"
    else:
        assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_cpu_worker_joins_without_binding_a_device(monkeypatch):
    rec = _Recorder()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.dist, "init_process_group", rec.init_process_group)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    assert runtime.setup(RuntimeConfig(), local_rank=0) == torch.device("cpu")
    assert rec.calls[-1][1] == "gloo" and rec.calls[-1][2] is None
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"  # the NPU case ran elsewhere


def test_torchair_is_used_only_when_named():
    assert runtime.compile_backend("npu") == "aot_eager"
    assert runtime.compile_backend("cuda") == "inductor" and runtime.compile_backend("cpu") == "inductor"
    assert runtime.compile_backend("cuda", "aot_eager") == "aot_eager"
    if "torchair" not in sys.modules:
        with pytest.raises(ImportError):
            runtime.compile_backend("npu", "torchair")


def _chip(preset: str, **kw):
    from omegaconf import OmegaConf

    return OmegaConf.merge(chips.load_preset(preset), kw)


def test_nccl_s_buffer_is_set_in_bytes_on_an_nccl_chip_and_nowhere_else():
    """comm.nccl_buffsize_mb is MiB per channel and peer; NCCL_BUFFSIZE takes bytes. An HCCL chip
    takes comm.buffsize_mb (HCCL_BUFFSIZE, MB per communicator) and no NCCL variable; a chip whose
    backend is set to gloo gets neither."""
    rt = chips.runtime(_chip("h100_sxm"), _comm(nccl_buffsize_mb=8, buffsize_mb=300), "bf16")
    assert rt.backend == "nccl" and rt.env["NCCL_BUFFSIZE"] == str(8 * 1024 * 1024)
    assert "HCCL_BUFFSIZE" not in rt.env
    rt = chips.runtime(_chip("ascend910b3"), _comm(nccl_buffsize_mb=8, buffsize_mb=300), "bf16")
    assert rt.backend == "hccl" and rt.env["HCCL_BUFFSIZE"] == "300" and "NCCL_BUFFSIZE" not in rt.env
    rt = chips.runtime(_chip("h100_sxm", dist_backend="gloo"), _comm(nccl_buffsize_mb=8), "bf16")
    assert rt.backend == "gloo" and not {"NCCL_BUFFSIZE", "HCCL_BUFFSIZE"} & set(rt.env)


def test_the_exec_timeout_step_rounds_hccl_s_exec_timeout_down_to_its_multiples():
    """chip.exec_timeout_step_s: the 910A takes HCCL_EXEC_TIMEOUT in steps of 68 s; without a
    step (A2/A3) it is whole seconds, just under the collective timeout."""

    def exec_timeout(step_s: int) -> int:
        chip = _chip("ascend910b3", exec_timeout_step_s=step_s)
        return int(chips.runtime(chip, _comm(timeout_s=600), "bf16").env["HCCL_EXEC_TIMEOUT"])

    stepped, plain = exec_timeout(68), exec_timeout(0)
    assert plain == int(600 - rules.exec_margin_s(600))
    assert stepped % 68 == 0 and plain - 68 < stepped <= plain


def test_mfu_s_peak_is_the_chip_s_for_the_compute_dtype_else_fp32_and_none_when_unknown():
    chip = _chip("a100_80gb", peak_tflops={"fp32": 7.0})  # the A100 lists no fp8 figure
    assert "fp8" not in chip.peak_tflops
    assert chips.runtime(chip, _comm(), "fp32").peak_flops == 7.0e12
    assert chips.runtime(chip, _comm(), "fp8").peak_flops == 7.0e12  # none of its own: fp32's
    assert chips.runtime(chip, _comm(), "bf16").peak_flops == chip.peak_tflops.bf16 * 1e12
    assert chips.runtime(_chip("a100_80gb", peak_known=False), _comm(), "bf16").peak_flops == 0.0
