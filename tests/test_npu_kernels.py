"""torch_npu's fused RMSNorm in the lean norm's place on an NPU (``trainers/lean_ops.py``), by the
dispatch logic here: torch_npu cannot import on this machine, so a stand-in module computes what
the kernel's documentation says it computes (op-plugin docs, ``torch_npu.npu_rms_norm``: y = x /
rms(x) * gamma with an fp32 rstd, y in x's dtype) and records its calls; the numerics of the
real kernel are the emulated chip's reference path (the lean norm, ``tests/test_lean_ops.py``).
The planner counts the kernel's traffic where the trainer calls it, not under sequence
parallelism (DTensor inputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orchestrator.planner import ModelShape
from orchestrator.planner.activations import ActBytes
from orchestrator.planner.traffic import RMSNORM_NPU_PASSES, RMSNORM_PASSES, head_traffic_bytes, layer_traffic_bytes
from tests.planner_cases import preset
from trainers import lean_ops


class FakeTorchNPU:
    """npu_rms_norm as documented, and the inf/nan mode support that tells a 910B-class part."""

    def __init__(self, a2: bool = True):
        self.calls = []
        support = a2

        class Utils:
            @staticmethod
            def is_support_inf_nan():
                return support

        class Npu:
            utils = Utils

        self.npu = Npu

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append((x.dtype, gamma.dtype, epsilon))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd


@pytest.mark.parametrize(
    "x_dtype,w_dtype,a2,takes",
    [
        (torch.float32, torch.float32, False, True),
        (torch.float16, torch.float16, False, True),
        (torch.float16, torch.float32, False, False),  # the 910A: equal pairs only
        (torch.bfloat16, torch.float32, True, True),
        (torch.float16, torch.float32, True, True),
        (torch.bfloat16, torch.bfloat16, True, True),
        (torch.float32, torch.bfloat16, True, False),
    ],
)
def test_the_kernel_runs_on_the_pairs_its_part_takes(x_dtype, w_dtype, a2, takes):
    x, w = torch.randn(2, 8, 64).to(x_dtype), (1 + 0.1 * torch.randn(64)).to(w_dtype)
    assert lean_ops.npu_rms_norm_takes(x, w, a2) == takes
    npu = FakeTorchNPU(a2)
    y = lean_ops._rms_norm(npu, x, w, 1e-5, torch.float32)
    assert len(npu.calls) == int(takes)
    if takes:
        assert npu.calls[0] == (x_dtype, w_dtype, 1e-5)  # eps reaches the kernel as epsilon
    ref = lean_ops._RMSNorm.apply(x, w, 1e-5, torch.float32)  # the lean norm in fp32: the reference path
    assert y.dtype == x.dtype
    torch.testing.assert_close(y, ref, rtol=1e-2 if x_dtype != torch.float32 else 1e-6, atol=1e-2)


def test_no_npu_no_kernel():
    """On any other device the lean norm runs (nothing looked up)."""
    assert lean_ops._torch_npu(torch.zeros(1)) is None


def test_the_planner_counts_the_kernel_where_the_trainer_calls_it():
    """On an NPU a block's two lean norms are one kernel each way (5 passes of the residual
    dtype) instead of the lean decomposition's 22 of the norm dtype and the casts around it;
    with sequence parallelism (DTensor inputs) the lean path stays, as in the trainer."""
    from types import SimpleNamespace

    m = ModelShape.of(preset("model", "llama2_7b"))
    pr = SimpleNamespace(param_dtype="fp32", compute_dtype="bf16", fp32_ops=["rms_norm", "softmax"])
    npu = ActBytes.of(pr, m, "npu")
    gpu = dataclasses.replace(npu, npu_kernels=False)  # the same chip without the kernel
    assert npu.npu_kernels and not ActBytes.of(pr, m, "cuda").npu_kernels
    seq, b, tp = 4096, 1, 2
    td = seq * b * m.d
    base = layer_traffic_bytes(m, seq, b, tp, False, gpu)
    fused = layer_traffic_bytes(m, seq, b, tp, False, npu)
    norm_bytes = npu.norm  # fp32 (fp32_ops): no cast around it, the residual is fp32 too
    assert base - fused == pytest.approx(2 * (RMSNORM_PASSES * norm_bytes - RMSNORM_NPU_PASSES * npu.residual) * td)
    assert layer_traffic_bytes(m, seq, b, tp, True, npu) == layer_traffic_bytes(m, seq, b, tp, True, gpu)
    assert head_traffic_bytes(m, seq, b, tp, npu) < head_traffic_bytes(m, seq, b, tp, gpu)
    assert head_traffic_bytes(m, seq, b, tp, npu, sp=True) == head_traffic_bytes(m, seq, b, tp, gpu, sp=True)
