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
from orchestrator.planner.traffic import (
    RMSNORM_NPU_PASSES,
    RMSNORM_PASSES,
    SWIGLU_NPU_PASSES,
    SWIGLU_PASSES,
    head_traffic_bytes,
    layer_traffic_bytes,
)
from tests.planner_cases import preset
from trainers import lean_ops


def _swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The documented formula: x's halves along ``dim``, A and B, give swish(A) * B."""
    a, b = x.chunk(2, dim=dim)
    return a * torch.sigmoid(a) * b


class _SwiGLUKernel(torch.autograd.Function):
    """Keeps its input, as op-plugin's derivative does (npu_swiglu_backward(grad, self, dim))."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        return _swiglu(x, dim)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(_swiglu(xx, ctx.dim), xx, g)
        return dx, None


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

    def npu_swiglu(self, x, dim=-1):
        assert x.is_contiguous()  # the kernel takes no strided input
        self.calls.append(("swiglu", x.dtype, dim))
        return _SwiGLUKernel.apply(x, dim)

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
    assert lean_ops.torch_npu_of(torch.zeros(1)) is None


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swiglu_kernel_equals_the_lean_one(dtype):
    """npu_swiglu over w1's and w3's outputs concatenated: the lean SwiGLU's values and
    gradients (fp32 to rounding), and the same bytes kept for the backward (a and b's)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 24, generator=g).to(dtype).requires_grad_()
    b = torch.randn(2, 8, 24, generator=g).to(dtype).requires_grad_()
    npu = FakeTorchNPU(a2=True)
    got, want = lean_ops.npu_swiglu(npu, a, b), lean_ops._SwiGLU.apply(a, b)
    assert npu.calls == [("swiglu", dtype, -1)]
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    dy = torch.randn_like(got)
    for x, y in zip(torch.autograd.grad(got, (a, b), dy), torch.autograd.grad(want, (a, b), dy)):
        torch.testing.assert_close(x, y, **tol)
    assert saved_bytes(lambda: lean_ops.npu_swiglu(FakeTorchNPU(), a, b)) == saved_bytes(
        lambda: lean_ops._SwiGLU.apply(a, b)
    )


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize(
    "a2,dtypes,takes",
    [
        (True, (torch.bfloat16, torch.bfloat16), True),
        (True, (torch.float32, torch.float32), True),
        (False, (torch.float16, torch.float16), False),  # the 910A: no such kernel
        (True, (torch.bfloat16, torch.float32), False),
        (True, (torch.float64, torch.float64), False),
    ],
)
def test_the_swiglu_kernel_runs_where_its_part_takes_it(a2, dtypes, takes):
    a, b = torch.zeros(2, 4, dtype=dtypes[0]), torch.zeros(2, 4, dtype=dtypes[1])
    assert lean_ops.npu_swiglu_takes(a, b, a2) == takes


def test_no_npu_no_swiglu_kernel(monkeypatch):
    """On any other device the lean SwiGLU runs, even with torch_npu imported."""
    import sys

    npu = FakeTorchNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(lean_ops.swiglu(a, b), torch.nn.functional.silu(a) * b, rtol=0, atol=0)
    assert npu.calls == []


def test_the_planner_counts_the_swiglu_kernel_on_an_a2_part():
    """A 910B's block: 16 passes of the d_ff-wide tensor for the lean SwiGLU's 18; the 910A, a
    GPU and the decomposition (model.lean_ops=false) keep theirs."""
    from types import SimpleNamespace

    m = ModelShape.of(preset("model", "llama2_7b"))
    pr = SimpleNamespace(param_dtype="bf16", compute_dtype="bf16", fp32_ops=[])
    a2, a1 = ActBytes.of(pr, m, "npu", a2=True), ActBytes.of(pr, m, "npu", a2=False)
    seq, b, tp = 4096, 1, 8
    f = seq * b * m.d_ff / tp * a2.linear
    rope = dataclasses.replace(m, learned_pos=True)  # RoPE's kernel apart
    gain = layer_traffic_bytes(rope, seq, b, tp, False, a1) - layer_traffic_bytes(rope, seq, b, tp, False, a2)
    assert gain == pytest.approx((SWIGLU_PASSES - SWIGLU_NPU_PASSES) * f)
    decomposed = dataclasses.replace(rope, lean=False)
    assert layer_traffic_bytes(decomposed, seq, b, tp, False, a1) == layer_traffic_bytes(
        decomposed, seq, b, tp, False, a2
    )
