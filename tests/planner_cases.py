"""What the planner's tests share: the schema's defaults, presets merged over them, a model section
with every schema key (Megatron's GPT shapes unless told otherwise), the planner's output contract.
"""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from orchestrator import chips, conf_dir
from orchestrator.config import Config
from orchestrator.planner import ModelShape
from trainers.config import ModelConfig

CONTRACT = {
    "dp",
    "tp",
    "pp",
    "microbatches",
    "schedule",
    "memory_gb",
    "fits",
    "bubble_fraction",
    "comm_share",
    "step_time_s",
    "mfu",
}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "total"}
DEFAULTS = OmegaConf.structured(Config)


def preset(group: str, name: str):
    if group == "chip":  # a chip preset may build on another's (its defaults list)
        return chips.load_preset(name)
    return OmegaConf.merge(DEFAULTS[group], OmegaConf.load(conf_dir() / group / f"{name}.yaml"))


def precision(**kw):
    return OmegaConf.merge(DEFAULTS.precision, kw)


def planner_cfg(**kw):
    return OmegaConf.merge(DEFAULTS.planner, kw)


def model(**kw) -> ModelShape:
    base = dict(
        vocab_size=51200,
        d_model=1024,
        n_layers=4,
        n_heads=16,
        d_ff=4096,
        max_seq_len=2048,
        norm="layernorm",
        mlp="gelu",
        pos_emb="rope",
        tie_embeddings=True,
        attn_impl="fused",
    )
    return ModelShape.of({**dataclasses.asdict(ModelConfig()), **base, **kw})  # the schema's keys, these values


def states(mp) -> float:
    return mp.params + mp.grads + mp.optimizer
