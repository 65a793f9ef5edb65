"""A Llama-family model's (Llama, Mistral, Qwen2) weights from and to the Hugging Face layout
(``model.hf_weights=FOLDER``, ``trainer.export_hf=FOLDER``).

Names: the trainer's ``layers.{i}.attn.wq`` is ``model.layers.{i}.self_attn.q_proj`` and so on
(:func:`hf_name`). RoPE: this model rotates each (even, odd) channel pair of a head (Meta's
original layout); Hugging Face's Llama rotates channel i with channel i + head_dim / 2
(``rotate_half``), and its checkpoints hold q_proj and k_proj with each head's rows permuted to
match (``convert_llama_weights_to_hf.py``'s ``permute``). Loading undoes that permutation per
head (:func:`from_hf_rows`), saving redoes it (:func:`to_hf_rows`), so the same weights give the
same logits in both implementations (``tests/test_hf_weights.py`` checks them against a reference
written in Hugging Face's convention).

Loading is per parameter: each rank reads, from the mapped files, the tensors of the parameters
it holds and keeps its own shard of each (``copy_into``, as the initialisation does), before
FSDP or DDP wraps the modules; no rank holds the whole model. Saving gathers one parameter at a
time (``full_tensor``, a collective over the ranks sharing it) and each pipeline rank writes its
stage's tensors to its own file of a sharded checkpoint with an index, as ``save_pretrained``
lays one out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from trainers.config import ModelConfig
from trainers.hf_layout import config_json, hf_name
from trainers.model import copy_into
from trainers.safetensors_format import write_index
from trainers.safetensors_io import Checkpoint, write


def _rotary(name: str) -> bool:
    """q_proj's and k_proj's weight and bias (Qwen2), and Qwen3's q_norm and k_norm weights (one
    head's channels): their rows are in RoPE's channel order."""
    return name.endswith(
        ("attn.wq.weight", "attn.wk.weight", "attn.wq.bias", "attn.wk.bias", "attn.q_norm.weight", "attn.k_norm.weight")
    )


def from_hf_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q_proj / k_proj rows (a weight's, or a bias's entries), per head, from the half-split
    order to the (even, odd) pair order: row i of a head's first half goes to 2i, row i of its
    second half to 2i + 1."""
    out = w.shape[0]
    return w.reshape(out // head_dim, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`from_hf_rows`."""
    out = w.shape[0]
    return w.reshape(out // head_dim, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


@torch.no_grad()
def load(modules: List[torch.nn.Module], folder: str, args: ModelConfig) -> int:
    """Copy each parameter these stage modules hold (this rank's shard of it) from the folder;
    returns the number of tensors read. Before any DP wrapping."""
    ckpt = Checkpoint(folder)
    done = 0
    for module in modules:
        for name, p in module.named_parameters():
            full = ckpt.tensor(hf_name(name))
            if _rotary(name):
                full = from_hf_rows(full, args.head_dim)
            copy_into(p, full)  # this rank's shard, converted to the parameter's dtype
            done += 1
    return done


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def save(modules: List[torch.nn.Module], folder: str, args: ModelConfig, pp_rank: int, pp: int, writer: bool) -> None:
    """Collective over every rank: write the model to ``folder`` in the Hugging Face layout, one
    file per pipeline rank (``model-0000k-of-0000p.safetensors``) and the index. ``writer``: this
    rank writes its stage's file (one rank per pipeline stage: DP and TP rank 0). Parameters are
    written in their own dtype; rank 0 writes ``config.json`` beside them."""
    tensors: Dict[str, torch.Tensor] = {}
    seen = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = _full(p.detach())  # every rank sharing the parameter takes part
            if writer:
                t = full.cpu()
                tensors[hf_name(name)] = to_hf_rows(t, args.head_dim) if _rotary(name) else t
    out = Path(folder)
    file = f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    size = write(out / file, tensors.items(), {"format": "pt"}) if writer else 0
    mine = ({n: file for n in tensors}, size) if writer else ({}, 0)
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        (out / "config.json").write_text(json.dumps(config_json(args), indent=2))
        weight_map: Dict[str, str] = {}
        for names, _ in parts:
            weight_map.update(names)
        write_index(out, weight_map, sum(size for _, size in parts))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
