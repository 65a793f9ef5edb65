"""A GPT-style decoder: pre-norm blocks of causal self-attention and an MLP.

One class per concern, each readable in a screenful. The same module covers GPT-2 (LayerNorm,
GELU, learned positions, tied head) and Llama 2 (RMSNorm, SwiGLU, RoPE, grouped key/value
heads) through :class:`ModelConfig`.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainers import lean_ops
from trainers.attention import npu_fused
from trainers.config import ModelConfig
from trainers.rope import rope_tables, rotate


def in_dtype(dtype: Optional[torch.dtype], fn, x: torch.Tensor, *params: Optional[torch.Tensor]) -> torch.Tensor:
    """``fn(x, *params)`` computed in ``dtype`` outside autocast, the result in ``x``'s dtype;
    ``dtype`` None: as given (autocast decides). The precision policy (``trainers/precision.py``)
    sets the dtype of each norm and softmax."""
    if dtype is None:
        return fn(x, *params)
    if x.dtype == dtype and not torch.is_autocast_enabled(x.device.type):
        # already in that dtype, no autocast to leave: the casts and the context would be no-ops
        # (about 1.5 ms a step of gpt_tiny's fp32 step on a CPU, bench/trainer_throughput.py)
        if all(p is None or p.dtype == dtype for p in params):
            return fn(x, *params)
    with torch.autocast(x.device.type, enabled=False):
        return fn(x.to(dtype), *(p.to(dtype) if p is not None else None for p in params)).to(x.dtype)


class RMSNorm(nn.Module):
    compute_dtype: Optional[torch.dtype] = None  # precision.fp32_ops decides; None: the input's

    def __init__(self, dim: int, eps: float = 1e-5, lean: bool = True):
        super().__init__()
        self.eps, self.lean = eps, lean
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if lean_ops.lean(self.lean):  # keeps the input and the rsqrt only (trainers/lean_ops.py)
            return lean_ops.rms_norm(x, self.weight, self.eps, self.compute_dtype)
        return in_dtype(self.compute_dtype, self._norm, x, self.weight)


class LayerNorm(nn.LayerNorm):
    compute_dtype: Optional[torch.dtype] = None  # precision.fp32_ops decides; None: autocast's

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_dtype(self.compute_dtype, self._norm, x, self.weight, self.bias)


def make_norm(args: ModelConfig) -> nn.Module:
    if args.norm == "rmsnorm":
        return RMSNorm(args.d_model, eps=args.norm_eps, lean=args.lean_ops)
    return LayerNorm(args.d_model, eps=args.norm_eps)


class Attention(nn.Module):
    softmax_dtype: Optional[torch.dtype] = None  # decomposed path; precision.fp32_ops decides
    # selective recompute (model.recompute_granularity): the core is recomputed in the backward,
    # set by GPT.forward for the blocks that recompute
    recompute_core: bool = False

    def __init__(self, args: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads, args.head_dim
        bias = args.qkv_bias  # Qwen2's q, k and v projections carry biases
        self.wq = nn.Linear(args.d_model, self.n_heads * self.hd, bias=bias)
        self.wk = nn.Linear(args.d_model, self.n_kv * self.hd, bias=bias)
        self.wv = nn.Linear(args.d_model, self.n_kv * self.hd, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.hd, args.d_model, bias=False)
        # Qwen3: each head's q and k RMS-normalised over head_dim before RoPE, one weight for all
        # heads (under TP each rank normalises its own heads: trainers/parallel.py)
        self.q_norm = RMSNorm(self.hd, eps=args.norm_eps, lean=args.lean_ops) if args.qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps=args.norm_eps, lean=args.lean_ops) if args.qk_norm else None
        self.rope = args.pos_emb == "rope"
        self.impl = args.attn_impl
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 keeps the module correct when tensor parallelism shards the heads across ranks
        q, k = self.wq(x).view(b, t, -1, self.hd), self.wk(x).view(b, t, -1, self.hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        if self.recompute_core and self.training:
            # the core keeps nothing for the backward but q, k, v: it runs again there, its dropout
            # masks redrawn from the same generator state (checkpoint's preserve_rng_state)
            y = checkpoint(self._core, q, k, v, rope, use_reentrant=False)
        else:
            y = self._core(q, k, v, rope)
        return F.dropout(self.wo(y.transpose(1, 2).reshape(b, t, -1)), self.dropout if self.training else 0.0)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope) -> torch.Tensor:
        """RoPE and attention of the heads: (b, heads, s, d) out."""
        if self.rope and rope is not None:
            q, k = rotate(q, k, *rope)
        # dropout draws from the default generator: every rank of a TP group has the same seed and
        # draws masks of the same local shapes in the same order, so the masks of replicated
        # activations (the residual branches) agree across the group
        p = self.dropout if self.training else 0.0
        # grouped-query attention: k, v keep their kv heads throughout (no full-width copies)
        if self.impl == "npu_fused":  # Ascend's kernel takes grouped kv heads as they are
            y = npu_fused(q, k, v, p)
        elif self.impl == "fused":
            # SDPA's own GQA (torch >= 2.5): query head h reads kv head h // (heads / kv heads), as
            # repeat_interleave gave it. Its flash kernels keep k and v at kv width (the CPU's in
            # torch 2.13: tests/test_saved_activations.py); where none applies (a CPU with
            # dropout) the math fallback repeats them internally, as this module did before
            gqa = k.shape[1] != q.shape[1]
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        else:
            y = self._decomposed(q, k, v, p)
        return y

    def _decomposed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        """matmul + softmax + matmul: the decomposition for chips without a fused kernel. Under
        GQA the ``rep`` query heads of each kv head are stacked along the rows of one matmul
        against that kv head: (b, kv, rep * t, d) @ (b, kv, d, t), the same products as
        repeating k and v to every query head, without the full-width copies (a broadcasting
        matmul would make them: it expands and reshapes its operands for ``bmm``)."""
        b, h, t, d = q.shape
        g = k.shape[1]
        qg = q.reshape(b, g, (h // g) * t, d)  # head g * rep + j -> rows [j * t, (j + 1) * t) of group g
        att = ((qg @ k.transpose(-2, -1)) / math.sqrt(d)).view(b, h, t, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        probs = in_dtype(self.softmax_dtype, lambda a: F.softmax(a, dim=-1), att).to(q.dtype)
        y = F.dropout(probs, p).view(b, g, (h // g) * t, t) @ v
        return y.view(b, h, t, d)


class MLP(nn.Module):
    def __init__(self, args: ModelConfig):
        super().__init__()
        self.swiglu, self.lean = args.mlp == "swiglu", args.lean_ops
        self.w1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.w2 = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.w3 = nn.Linear(args.d_model, args.d_ff, bias=False) if self.swiglu else None
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:  # keeps w1's and w3's outputs only, eagerly (trainers/lean_ops.py)
            a, b = self.w1(x), self.w3(x)
            h = lean_ops.swiglu(a, b) if lean_ops.lean(self.lean) else F.silu(a) * b
        else:
            h = F.gelu(self.w1(x), approximate="tanh")
        return F.dropout(self.w2(h), self.dropout if self.training else 0.0)


class Block(nn.Module):
    def __init__(self, args: ModelConfig):
        super().__init__()
        self.attn_norm, self.attn = make_norm(args), Attention(args)
        self.mlp_norm, self.mlp = make_norm(args), MLP(args)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The decoder. Pipeline stages are the same class with parts removed: a stage without the
    embedding takes hidden states in, a stage without the head gives hidden states out, and
    ``layers`` keeps each block under its global index so parameter names match the whole model.
    """

    def __init__(self, args: ModelConfig, seed: int = 0):
        super().__init__()
        self.args = args
        self.tok_emb: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_emb = nn.Embedding(args.max_seq_len, args.d_model) if args.pos_emb == "learned" else None
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm: Optional[nn.Module] = make_norm(args)
        self.head: Optional[nn.Linear] = nn.Linear(args.d_model, args.vocab_size, bias=False)
        self.tie_weights()
        if args.pos_emb == "rope":
            self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights(seed)

    def tie_weights(self) -> None:
        """The head uses the embedding's parameter (``tie_embeddings``). Again after anything
        that gives each module its own new parameter: ``to_empty`` from meta, ``apply_tp``."""
        if self.args.tie_embeddings and self.tok_emb is not None and self.head is not None:
            self.head.weight = self.tok_emb.weight

    def init_buffers(self) -> None:
        if self.args.pos_emb == "rope":
            a = self.args
            cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, dict(a.rope_scaling or {}))
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, N(0, 0.02) with residual projections scaled by 1/sqrt(2 L).

        Each parameter draws from its own generator seeded by (seed, name), so any part of the
        model (a pipeline stage, a tensor-parallel or FSDP shard) gets exactly the values the
        whole model would have: a shard is cut from the full tensor drawn on the CPU.
        """
        for name, p in self.named_parameters():
            full = init_tensor(name, tuple(p.shape), seed, self.args.n_layers)
            copy_into(p, full)
        self.init_buffers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            t = x.shape[1]
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(t, device=x.device))
        rope = (self.rope_cos, self.rope_sin) if self.args.pos_emb == "rope" else None
        a = self.args
        for i, layer in enumerate(self.layers.values()):
            # the first recompute_layers blocks of this stage chunk recompute (all with -1)
            recompute = (
                a.activation_checkpointing and self.training and (a.recompute_layers < 0 or i < a.recompute_layers)
            )
            selective = recompute and a.recompute_granularity == "selective"
            if layer.attn.recompute_core != selective:
                layer.attn.recompute_core = selective
            layer.full_recompute = recompute and not selective  # read by trainers/sp_regather.py
            if recompute and not selective:
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None and self.args.loss_chunks <= 1:
            x = self.head(x)  # else the loss applies the head, chunk by chunk (trainers/head_loss.py)
        return x


def init_tensor(name: str, shape: tuple, seed: int, n_layers: int) -> torch.Tensor:
    """The full initial value of parameter ``name``, independent of every other parameter."""
    if len(shape) < 2:  # norm weights 1, biases 0
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=g)


def copy_into(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full CPU tensor into a parameter, or into this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)


def count_params(model: nn.Module) -> int:
    """Parameters of the whole model, a tied weight counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
