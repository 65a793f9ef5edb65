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

On an Ascend NPU the lean RMSNorm is torch_npu's fused kernel, ``torch_npu.npu_rms_norm(x, gamma,
epsilon) -> (y, rstd)`` (op-plugin ``op_plugin_functions.yaml``; its docs: ``rstd`` in fp32, the
same saved set as :class:`_RMSNorm`'s, one kernel reading x and writing y; backward
``npu_rms_norm_backward(dy, x, gamma, rstd)``), where its dtype pairs allow (:func:`npu_rms_norm_takes`)
and the tensors are plain (a sequence-parallel norm's are DTensors, which have no sharding rule for
it). Its reduction and product run in fp32 whatever ``dtype`` asks (the rstd it returns is fp32).
The lean SwiGLU there is ``torch_npu.npu_swiglu`` over w1's and w3's outputs concatenated
(:func:`npu_swiglu`), on the parts that have it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional

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
    policy decides the dtype, as ``trainers.model.in_dtype`` does); torch_npu's fused kernel on an
    NPU that takes it."""
    npu = torch_npu_of(x)
    if x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type):
        return _rms_norm(npu, x, w, eps, dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _rms_norm(npu, x, w, eps, dtype)


def _rms_norm(npu: Any, x: torch.Tensor, w: torch.Tensor, eps: float, dtype: Optional[torch.dtype]):
    if npu is not None and npu_rms_norm_takes(x, w, inf_nan(npu)):
        return npu.npu_rms_norm(x, w, epsilon=eps)[0]
    return _RMSNorm.apply(x, w, eps, dtype or x.dtype)


# npu_rms_norm's (input, gamma) dtypes (op-plugin docs, torch_npu.npu_rms_norm): the Atlas A2/A3
# training parts (910B and later) take 16-bit inputs with fp32 or same-dtype gamma; the Atlas
# training series (910A) only equal fp16 or fp32 pairs
NPU_RMS_NORM_PAIRS = {(torch.float16, torch.float16), (torch.float32, torch.float32)}
NPU_RMS_NORM_PAIRS_A2 = NPU_RMS_NORM_PAIRS | {
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
}


def npu_rms_norm_takes(x: torch.Tensor, w: torch.Tensor, a2: bool) -> bool:
    """Whether torch_npu's kernel runs this norm: plain tensors (no DTensor) in a pair of dtypes
    the part takes (``a2``: a 910B-class part, told by torch_npu's inf/nan mode support, which
    starts at the 910B1 as the A2 dtype table does)."""
    return plain(x, w) and (x.dtype, w.dtype) in (NPU_RMS_NORM_PAIRS_A2 if a2 else NPU_RMS_NORM_PAIRS)


def plain(*tensors: torch.Tensor) -> bool:
    """Whether none of ``tensors`` is a DTensor: torch_npu's fused kernels here take plain tensors
    (DTensor has no sharding rule for them)."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(t, DTensor) for t in tensors)


def torch_npu_of(x: torch.Tensor) -> Any:
    """torch_npu where ``x`` is on an NPU (imported by then: the device exists only through it)."""
    return sys.modules.get("torch_npu") if x.device.type == "npu" else None


@functools.lru_cache(maxsize=None)
def inf_nan(npu: Any) -> bool:
    """torch_npu's inf/nan mode support: the 910B1 and later parts (Atlas A2/A3), the same line
    op-plugin draws for its aclnn kernels (``GetSocVersion() >= Ascend910B1``)."""
    return bool(npu.npu.utils.is_support_inf_nan())


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The lean SwiGLU; torch_npu's kernel on an NPU that takes it (:func:`npu_swiglu_takes`)."""
    npu = torch_npu_of(a)
    if npu is not None and npu_swiglu_takes(a, b, inf_nan(npu)):
        return npu_swiglu(npu, a, b)
    return _SwiGLU.apply(a, b)


def npu_swiglu(npu: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch_npu.npu_swiglu(x, dim=-1)``: x's halves along ``dim``, A and B, give ``silu(A) * B``
    (op-plugin docs, ``torch_npu.npu_swiglu``; contiguous input), so w1's and w3's outputs are
    concatenated first. Its derivative keeps x (``derivatives.yaml``: ``npu_swiglu_backward(grad,
    self, dim)``), a and b's bytes: the lean set. The module is passed in: tests hold the call to
    the documented formula without an NPU."""
    return npu.npu_swiglu(torch.cat((a, b), dim=-1), dim=-1)


def npu_swiglu_takes(a: torch.Tensor, b: torch.Tensor, a2: bool) -> bool:
    """Whether torch_npu's SwiGLU runs: on the Atlas A2 training parts (the only ones its
    documentation lists), for plain tensors of one dtype it takes (fp32, fp16, bf16)."""
    return a2 and plain(a, b) and a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16, torch.float32)


def lean(enabled: bool = True) -> bool:
    """Whether to take the lean functions (``model.lean_ops``): not while Dynamo traces (compiled
    blocks keep what their backend's partition decides, over the decomposition)."""
    return enabled and not torch.compiler.is_compiling()
