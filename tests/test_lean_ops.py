"""``trainers/lean_ops.py`` against autograd's decomposition it replaces: the forward to the bit,
the backward to float rounding (and gradcheck in float64), in each dtype the precision policy
gives it (the norm in fp32 over a bf16 residual, or in the input's own dtype)."""

from __future__ import annotations

import pytest
import torch

from trainers import lean_ops


def _decomposed_rms(x, w, eps, dtype):
    xc = x.to(dtype)
    return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * w.to(dtype)).to(x.dtype)


@pytest.mark.parametrize(
    "x_dtype,norm_dtype,rel",
    [
        (torch.float32, torch.float32, 1e-6),
        (torch.bfloat16, torch.float32, 1e-2),
        (torch.bfloat16, torch.bfloat16, 5e-2),
    ],
)
def test_rms_norm_is_the_decomposition(x_dtype, norm_dtype, rel):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 5, 32, generator=g).to(x_dtype)
    w0 = (1 + 0.1 * torch.randn(32, generator=g)).to(torch.float32 if norm_dtype == torch.float32 else x_dtype)
    grad = torch.randn(2, 5, 32, generator=g).to(x_dtype)
    outs = []
    for fn in (lean_ops.rms_norm, _decomposed_rms):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, 1e-5, norm_dtype)
        y.backward(grad)
        outs.append((y, x.grad, w.grad))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = outs
    assert torch.equal(y, y_ref)  # the same operations in the same order
    assert torch.allclose(dx.float(), dx_ref.float(), rtol=rel, atol=rel * dx_ref.abs().max().item())
    assert torch.allclose(dw.float(), dw_ref.float(), rtol=rel, atol=rel * dw_ref.abs().max().item())


def test_swiglu_is_silu_times_the_gate():
    g = torch.Generator().manual_seed(1)
    a0, b0, grad = (torch.randn(4, 16, generator=g) for _ in range(3))
    outs = []
    for fn in (lean_ops.swiglu, lambda a, b: torch.nn.functional.silu(a) * b):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = fn(a, b)
        y.backward(grad)
        outs.append((y, a.grad, b.grad))
    for lean, ref in zip(*outs):
        assert torch.allclose(lean, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(outs[0][0], outs[1][0])


def test_float64_gradients_are_exact():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: lean_ops.rms_norm(x, w, 1e-5, torch.float64), (x, w))
    a = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lean_ops.swiglu, (a, b))
