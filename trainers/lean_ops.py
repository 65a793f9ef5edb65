"""RMSNorm and SwiGLU that keep for their backward only what the math needs.

Autograd's own decomposition of ``x * rsqrt(mean(x^2) + eps) * w`` saves the input cast to the
norm's dtype (fp32 under ``precision.fp32_ops``), the normalised values and the rsqrt: 8 + 8
bytes a hidden unit in fp32 where the input is 2 (bf16). ``silu(a) * b`` saves a, silu(a) and b.
These functions save the input as it came (and the per-token rsqrt) and a and b, and recompute
the rest in the backward, as fused kernels do (Megatron's fused RMSNorm and bias-SwiGLU,
torch_npu's ``npu_rms_norm`` and ``npu_swiglu``). The forward runs the same operations in the same
order as the decomposition, so its values are the same to the bit; the backward is the analytic
gradient, equal to autograd's to float rounding (``tests/test_lean_ops.py``).

Under ``torch.compile`` the decomposition is used instead: Inductor's min-cut partition decides
what a compiled block keeps (``orchestrator/planner/activations.py``, the fused count).
"""

from __future__ import annotations

from typing import Optional

import torch


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w, computed in ``dtype``, y in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        xc = x.to(dtype)
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        y = (xc * rstd * w.to(dtype)).to(x.dtype)
        ctx.save_for_backward(x, w, rstd)
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, rstd = ctx.saved_tensors
        xc, gc, wc = x.to(ctx.dtype), g.to(ctx.dtype), w.to(ctx.dtype)
        normed = xc * rstd
        gw = gc * wc
        # d/dx of x r w: r (g w) - x r^3 mean(g w x) = r (g w - normed mean(g w normed))
        dx = rstd * (gw - normed * (gw * normed).mean(-1, keepdim=True))
        dw = (gc * normed).reshape(-1, normed.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None, None


class _SwiGLU(torch.autograd.Function):
    """silu(a) * b, keeping a and b; silu and its derivative recomputed in the backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b = ctx.saved_tensors
        # aten's own silu_backward, silu'(a) = s (1 + a (1 - s)) in one kernel, as autograd's
        # decomposition calls it: 11 passes of the d_ff-wide tensor where the formula took 26
        return torch.ops.aten.silu_backward(g * b, a), g * torch.nn.functional.silu(a)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The lean RMSNorm, in ``dtype`` (None: x's), outside autocast (the caller's precision
    policy decides the dtype, as ``trainers.model.in_dtype`` does)."""
    if x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type):
        return _RMSNorm.apply(x, w, eps, dtype or x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _RMSNorm.apply(x, w, eps, dtype or x.dtype)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(a, b)


def lean(enabled: bool = True) -> bool:
    """Whether to take the lean functions (``model.lean_ops``): not while Dynamo traces (compiled
    blocks keep what their backend's partition decides, over the decomposition)."""
    return enabled and not torch.compiler.is_compiling()
