"""Ascend's fused attention kernel, ``torch_npu.npu_fusion_attention`` (``model.attn_impl=npu_fused``).

The kernel (torch_npu op-plugin docs, "torch_npu.npu_fusion_attention"; Atlas A2 training
parts) takes query, key and value in one of its layouts (``BNSD`` here: batch, heads, sequence,
head dim, the model's own), grouped-query key/value with fewer heads as they are, a boolean
``atten_mask`` in which True masks a position out, the softmax ``scale`` and ``keep_prob`` (1 -
dropout), and returns a tuple whose first element is the attention output; it has a backward
kernel, so it trains. A causal mask is given the compressed way: ``sparse_mode=3`` (right-down
causal, the same as left-up for self-attention) with a 2048 x 2048 upper-triangular mask, which
the kernel expands to any sequence length. It keeps no s x s score matrix, which is what makes it
worth having at Llama sizes: the decomposed path materialises one per head and micro-batch.

Grouped-query attention: ``head_num`` is the query's head count N1 (the op-plugin API page,
https://www.hiascend.com/document/detail/zh/Pytorch/60RC3/apiref/apilist/ptaoplist_000445.html),
and for GQA key and value come as [B, N2, S2, D] with N1 a whole multiple of N2 (Huawei Cloud
ModelArts, "NPU_Flash_Attn融合算子约束", the constraints of the same kernel:
https://support.huaweicloud.com/bestpractice-modelarts/modelarts_llm_train_5901150.html). So
neither path here repeats key and value to every query head.

Without an NPU (an emulated Ascend plan on CPU), the same computation runs through
``F.scaled_dot_product_attention`` with its own GQA (``enable_gqa``) as a stand-in, so a
rehearsal trains the same model; the run is tagged emulated.
"""

from __future__ import annotations

import math
from typing import Dict

import torch
import torch.nn.functional as F

# the compressed causal mask's side that sparse_mode 2/3 expect (op-plugin docs)
CAUSAL_MASK_SIDE = 2048
SPARSE_MODE_CAUSAL = 3
_masks: Dict[torch.device, torch.Tensor] = {}


def _causal_mask(device: torch.device) -> torch.Tensor:
    if device not in _masks:
        side = CAUSAL_MASK_SIDE
        _masks[device] = torch.ones(side, side, dtype=torch.bool, device=device).triu(diagonal=1)
    return _masks[device]


def npu_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention of ``q`` (b, heads, s, d) over ``k``, ``v`` (b, kv heads, s, d)."""
    if q.device.type == "npu":
        import torch_npu  # type: ignore[import-not-found]

        return npu_kernel(torch_npu, q, k, v, dropout_p)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)


def npu_kernel(torch_npu, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The call into ``torch_npu.npu_fusion_attention`` (the module is passed in: tests hold the
    arguments to the documented contract without an NPU)."""
    out = torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],  # head_num: this rank's query heads (tensor parallelism shards them); k, v
        # keep their own (fewer) kv heads: the kernel's GQA, no repeat_interleave
        "BNSD",
        atten_mask=_causal_mask(q.device),
        scale=1.0 / math.sqrt(q.shape[-1]),
        keep_prob=1.0 - dropout_p,
        sparse_mode=SPARSE_MODE_CAUSAL,
    )
    return out[0]
