"""A GPT-style decoder: pre-norm blocks of causal self-attention and an MLP.

One class per concern, each readable in a screenful. The same module covers GPT-2 (LayerNorm,
GELU, learned positions, tied head) and Llama 2 (RMSNorm, SwiGLU, RoPE, grouped key/value
heads) through :class:`ModelArgs`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelArgs:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = -1
    d_ff: int = 512
    max_seq_len: int = 256
    norm: str = "layernorm"
    mlp: str = "gelu"
    pos_emb: str = "learned"
    tie_embeddings: bool = True
    attn_impl: str = "fused"
    activation_checkpointing: bool = False
    dropout: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads in (-1, 0, None) else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 whatever the compute dtype: the mean of squares overflows fp16
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_norm(args: ModelArgs) -> nn.Module:
    return RMSNorm(args.d_model) if args.norm == "rmsnorm" else nn.LayerNorm(args.d_model)


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate each (even, odd) pair by its position's angle
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.d_model, self.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(args.d_model, self.n_kv * self.hd, bias=False)
        self.wv = nn.Linear(args.d_model, self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hd, args.d_model, bias=False)
        self.rope = args.pos_emb == "rope"
        self.impl = args.attn_impl

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 keeps the module correct when tensor parallelism shards the heads across ranks
        q = self.wq(x).view(b, t, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        if self.rope and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.impl == "fused":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # matmul + softmax + matmul: the decomposition for chips without a fused kernel
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            y = F.softmax(att.float(), dim=-1).to(q.dtype) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.swiglu = args.mlp == "swiglu"
        self.w1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.w2 = nn.Linear(args.d_ff, args.d_model, bias=False)
        self.w3 = nn.Linear(args.d_model, args.d_ff, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attn_norm, self.attn = make_norm(args), Attention(args)
        self.mlp_norm, self.mlp = make_norm(args), MLP(args)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.d_model)
        self.pos_emb = nn.Embedding(args.max_seq_len, args.d_model) if args.pos_emb == "learned" else None
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        if args.pos_emb == "rope":
            cos, sin = rope_tables(args.head_dim, args.max_seq_len)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=tokens.device))
        rope = (self.rope_cos, self.rope_sin) if self.args.pos_emb == "rope" else None
        for layer in self.layers:
            if self.args.activation_checkpointing and self.training:
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        return self.head(self.norm(x))


def count_params(model: nn.Module) -> int:
    """Parameters of the whole model, a tied weight counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
