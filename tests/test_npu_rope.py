"""torch_npu's RoPE kernel in the decomposition's place on an NPU (``trainers/rope.py``), by the
dispatch logic here: torch_npu cannot import on this machine, so a stand-in computes what op-plugin's
documentation says ``npu_rotary_mul(x, r1, r2, rotary_mode="interleave")`` computes and keeps what its
derivative keeps (``derivatives.yaml``: self, r1, r2); the numerics of the real kernel are the
emulated chip's reference path (the decomposition). The planner counts the kernel's saved input and
its traffic where the trainer calls it: an Atlas A2-class part, B x N < 1000, head_dim even and below
896."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch

from orchestrator.planner import ModelShape
from orchestrator.planner.activations import ActBytes, atlas_a2, core_activation_bytes, layer_activation_bytes
from orchestrator.planner.traffic import ROPE_NPU_PASSES, ROPE_PASSES, layer_traffic_bytes
from tests.planner_cases import preset
from tests.test_npu_kernels import FakeTorchNPU, saved_bytes
from trainers import rope


def _interleaved(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """The documented interleave mode: r1 * x + r2 * x_new, x_new's pairs (-x[2i+1], x[2i])."""
    x_new = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return r1 * x + r2 * x_new


class _Kernel(torch.autograd.Function):
    """Saves self, r1 and r2 as op-plugin's derivative does; the backward is the formula's."""

    @staticmethod
    def forward(ctx, x, r1, r2):
        ctx.save_for_backward(x, r1, r2)
        return _interleaved(x, r1, r2)

    @staticmethod
    def backward(ctx, g):
        x, r1, r2 = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(_interleaved(xx, r1, r2), xx, g)
        return dx, None, None


class FakeRopeNPU(FakeTorchNPU):
    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half"):
        assert rotary_mode == "interleave"  # the trainer's pairs; "half" would rotate i with i + d/2
        assert r1.shape == (1, 1, x.shape[2], x.shape[3]) == r2.shape  # BNSD input, 11SD tables
        assert r1.dtype == x.dtype == r2.dtype
        self.calls.append(tuple(x.shape))
        return _Kernel.apply(x, r1, r2)


def _qk(dtype=torch.float32, b=2, heads=4, kv=2, s=16, d=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, kv, s, d, generator=g).to(dtype).requires_grad_()
    cos, sin = rope.rope_tables(d, 32, 500000.0)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_rotates_as_the_decomposition(dtype):
    """Values and gradients of q and k equal the decomposition's (fp32 to rounding; bf16 to its
    precision: the tables are cast before the products in both)."""
    q, k, cos, sin = _qk(dtype)
    npu = FakeRopeNPU()
    got = rope.npu_rotate(npu, q, k, cos, sin)
    assert npu.calls == [tuple(q.shape), tuple(k.shape)]
    want = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    gq = torch.randn_like(q)
    gk = torch.randn_like(k)
    dq, dk = torch.autograd.grad((got[0] * gq).sum() + (got[1] * gk).sum(), (q, k))
    rq, rk = torch.autograd.grad((want[0] * gq).sum() + (want[1] * gk).sum(), (q, k))
    torch.testing.assert_close(dq, rq, **tol)
    torch.testing.assert_close(dk, rk, **tol)


@pytest.mark.parametrize(
    "a2,shape,dtype,takes",
    [
        (True, (2, 4, 16, 8), torch.float32, True),
        (True, (2, 4, 16, 8), torch.bfloat16, True),
        (False, (2, 4, 16, 8), torch.float16, False),  # the 910A: half mode only
        (True, (10, 99, 4, 8), torch.bfloat16, True),  # B x N = 990
        (True, (10, 100, 4, 8), torch.bfloat16, False),  # B x N = 1000
        (True, (1, 2, 4, 896), torch.bfloat16, False),  # D below 896
        (True, (1, 2, 4, 7), torch.float32, False),  # D even
        (True, (2, 4, 16, 8), torch.float64, False),
    ],
)
def test_the_kernel_runs_where_its_part_and_shapes_allow(a2, shape, dtype, takes):
    q = torch.zeros(shape, dtype=dtype)
    assert rope.npu_rope_takes(q, q, a2) == takes


def test_q_and_k_of_two_dtypes_stay_decomposed():
    q = torch.zeros(1, 2, 4, 8)
    assert not rope.npu_rope_takes(q, q.bfloat16(), True)


def test_no_npu_no_kernel(monkeypatch):
    """On any other device the decomposition runs, even with torch_npu imported."""
    npu = FakeRopeNPU()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    q, k, cos, sin = _qk()
    got = rope.rotate(q, k, cos, sin)
    assert npu.calls == []
    torch.testing.assert_close(got[0], rope.apply_rope(q, cos, sin), rtol=0, atol=0)


def _shape(heads=4, kv=2, d=8) -> ModelShape:
    m = ModelShape.of(preset("model", "llama2_7b"))
    return dataclasses.replace(m, d=heads * d, heads=heads, kv_heads=kv)


def test_the_planner_counts_what_the_kernel_keeps():
    """Over the decomposition's cast tables, the kernel keeps q and k as they came and its two
    pair-repeated tables: the planner's layer and core (selective recompute) counts move by
    exactly the bytes autograd saves, measured here with the stand-in's derivative set."""
    b, heads, kv, s, d = 2, 4, 2, 16, 8
    q, k, cos, sin = _qk(torch.bfloat16, b, heads, kv, s, d)
    kernel = saved_bytes(lambda: rope.npu_rotate(FakeRopeNPU(), q, k, cos, sin))
    decomposed = saved_bytes(lambda: (rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)))
    m = _shape(heads, kv, d)
    pr = SimpleNamespace(param_dtype="bf16", compute_dtype="bf16", fp32_ops=[])
    on, off = ActBytes.of(pr, m, "npu", a2=True), ActBytes.of(pr, m, "npu", a2=False)
    assert on.rope_kernel(m, b, 1) and not off.rope_kernel(m, b, 1)
    for count in (layer_activation_bytes, core_activation_bytes):
        args = (m, s, b, 1, False, on) if count is layer_activation_bytes else (m, s, b, 1, on)
        planned = count(*args) - count(*args[:-1], off)
        assert planned == kernel - decomposed > 0


def test_the_planner_takes_the_kernel_where_the_trainer_does():
    """A 910B's 7B block at tp 8: the kernel's 7 passes of q and k for the decomposition's 26.5;
    a micro-batch with B x N >= 1000, the 910A and a GPU keep the decomposition."""
    # the decomposed SwiGLU: the A2 part's SwiGLU kernel apart (tests/test_npu_kernels.py)
    m = dataclasses.replace(ModelShape.of(preset("model", "llama2_7b")), lean=False)
    pr = SimpleNamespace(param_dtype="fp32", compute_dtype="bf16", fp32_ops=["rms_norm", "softmax"])
    b910, a910 = preset("chip", "ascend910b"), preset("chip", "ascend910a")
    assert atlas_a2(b910) and not atlas_a2(a910) and not atlas_a2(preset("chip", "h100"))
    on = ActBytes.of(pr, m, "npu", atlas_a2(b910))
    off = dataclasses.replace(on, npu_a2=False)
    seq, tp = 4096, 8
    for b, kernel in ((1, True), (250, False)):  # 250 x 32 / 8 = 1000 heads x batch
        qk = seq * b * (m.heads + m.kv_heads) * (m.d // m.heads) / tp * on.linear
        gain = layer_traffic_bytes(m, seq, b, tp, False, off) - layer_traffic_bytes(m, seq, b, tp, False, on)
        assert gain == pytest.approx((ROPE_PASSES - ROPE_NPU_PASSES) * qk if kernel else 0.0)
