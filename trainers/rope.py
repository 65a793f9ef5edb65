"""Rotary position embedding: its frequency tables and its rotation of q and k.

The trainer's RoPE rotates interleaved pairs (channels 2i and 2i+1 by position x frequency i);
Hugging Face folders, whose rotation pairs channel i with i + head_dim/2, are permuted into this
order on load and back on export (``trainers/hf_weights.py``).

On an Ascend NPU the rotation is torch_npu's fused kernel where it runs,
``torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")``: ``r1 * x + r2 * x_new`` with
``x_new`` each pair (x[2i], x[2i+1]) turned to (-x[2i+1], x[2i]) (op-plugin
``docs/context/torch_npu-npu_rotary_mul.md``), so ``r1`` and ``r2`` are the cos and sin tables
with each frequency repeated for its pair. The kernel keeps its input for the backward
(op-plugin ``derivatives.yaml``: ``npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)``),
one more copy of q and k than the decomposition keeps (the planner counts it:
``orchestrator/planner/activations.py``); where it does not run (:func:`npu_rope_takes`) the
decomposition below does.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from trainers import lean_ops, rules


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies for a longer context (Meta's reference ``apply_scaling``, the
    rule its config.json's ``rope_scaling`` names ``llama3``): wavelengths shorter than
    ``original / high_freq_factor`` kept, longer than ``original / low_freq_factor`` divided by
    ``factor``, those between blended linearly in ``original / wavelength``."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelen < original / high, inv_freq, torch.where(wavelen > original / low, inv_freq / factor, blended)
    )


def rope_tables(
    head_dim: int, seq_len: int, theta: float = 10000.0, scaling: Optional[dict] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate each (even, odd) pair by its position's angle
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k, (b, heads, s, head_dim) each, rotated by their positions: torch_npu's kernel on
    an NPU that runs it for both, else :func:`apply_rope`."""
    npu = lean_ops.torch_npu_of(q)
    if npu is not None and npu_rope_takes(q, k, lean_ops.inf_nan(npu)):
        return npu_rotate(npu, q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def npu_rotate(npu: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The kernel's call (the module passed in: tests hold it to the documented formula without an
    NPU): BNSD input with (1, 1, S, D) tables in the input's dtype, one pair for q and k."""
    s = q.shape[-2]
    r1 = cos[:s].repeat_interleave(2, dim=-1).to(q.dtype)[None, None]
    r2 = sin[:s].repeat_interleave(2, dim=-1).to(q.dtype)[None, None]
    return (
        npu.npu_rotary_mul(q, r1, r2, rotary_mode="interleave"),
        npu.npu_rotary_mul(k, r1, r2, rotary_mode="interleave"),
    )


NPU_ROPE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_rope_takes(q: torch.Tensor, k: torch.Tensor, a2: bool) -> bool:
    """Whether the kernel runs this rotation: eagerly (a compiled block keeps its traced
    decomposition), plain 4-D tensors of one dtype it takes, on a part and in shapes its
    interleaved mode allows (:func:`trainers.rules.npu_rope`)."""
    if torch.compiler.is_compiling() or not lean_ops.plain(q, k):
        return False
    if q.dim() != 4 or q.dtype != k.dtype or q.dtype not in NPU_ROPE_DTYPES:
        return False
    b, heads, _, d = q.shape
    return rules.npu_rope(a2, b, heads, d)
