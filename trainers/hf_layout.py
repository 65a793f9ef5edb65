"""The Hugging Face layout of a Llama-family model (Llama, Mistral, Qwen2, Qwen3), without torch:
each parameter's name there, the tensors a checkpoint of an architecture holds, and the check of a
weights folder's headers that the validator runs before launch (``trainers/hf_weights.py`` loads
and saves the tensors).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from trainers import rules
from trainers.safetensors_format import SafetensorsError, entries

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """The Hugging Face name of one of this model's parameters (the same in each family)."""
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    if name in _TOP:
        return _TOP[name]
    raise KeyError(f"{name} has no Hugging Face counterpart")


def expected(m: Any) -> Dict[str, Tuple[int, ...]]:
    """The tensors a checkpoint of model config ``m`` (``model.*``) holds, by Hugging Face name,
    with their shapes; no ``lm_head.weight`` when the head is tied to the embedding, as such
    checkpoints omit it."""
    d, ff, v = int(m.d_model), int(m.d_ff), int(m.vocab_size)
    hd = d // int(m.n_heads)
    kv = rules.kv_heads(m.n_heads, m.n_kv_heads)
    layer = {
        "attn_norm.weight": (d,),
        "attn.wq.weight": (int(m.n_heads) * hd, d),
        "attn.wk.weight": (kv * hd, d),
        "attn.wv.weight": (kv * hd, d),
        "attn.wo.weight": (d, int(m.n_heads) * hd),
        "mlp_norm.weight": (d,),
        "mlp.w1.weight": (ff, d),
        "mlp.w3.weight": (ff, d),
        "mlp.w2.weight": (d, ff),
    }
    if rules.qkv_bias(str(m.family)):
        layer.update({"attn.wq.bias": (int(m.n_heads) * hd,), "attn.wk.bias": (kv * hd,), "attn.wv.bias": (kv * hd,)})
    if rules.qk_norm(str(m.family)):
        layer.update({"attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,)})
    out = {hf_name("tok_emb.weight"): (v, d)}
    for i in range(int(m.n_layers)):
        out.update({hf_name(f"layers.{i}.{k}"): shape for k, shape in layer.items()})
    out[hf_name("norm.weight")] = (d,)
    if not m.tie_embeddings:
        out[hf_name("head.weight")] = (v, d)
    return out


def check(folder: str, m: Any) -> Optional[str]:
    """What is wrong with ``folder`` as the weights of model config ``m``, in one line, or None:
    the headers only are read."""
    try:
        found = entries(Path(folder).expanduser())
    except (SafetensorsError, OSError) as e:
        return str(e)
    for name, shape in expected(m).items():
        if name not in found:
            return f"{folder}: no tensor {name}"
        got = tuple(found[name][1]["shape"])
        if got != shape:
            return f"{folder}: {name} has shape {list(got)}, the model needs {list(shape)}"
    return None


def config_json(m: Any) -> Dict[str, Any]:
    """The ``config.json`` of a model config ``m`` (``model.*``) of one of the families, as its
    ``transformers`` config class reads it: what an exported folder carries, so ``model.hf_config``
    (and ``transformers``) read it back."""
    heads = int(m.n_heads)
    family = str(m.family)
    arch, model_type = rules.ARCHITECTURES[family]
    out: Dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": int(m.d_model),
        "intermediate_size": int(m.d_ff),
        "num_attention_heads": heads,
        "num_hidden_layers": int(m.n_layers),
        "num_key_value_heads": rules.kv_heads(heads, m.n_kv_heads),
        "head_dim": int(m.d_model) // heads,
        "max_position_embeddings": int(m.max_seq_len),
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "tie_word_embeddings": bool(m.tie_embeddings),
        "vocab_size": int(m.vocab_size),
        "torch_dtype": "float32",
    }
    out.update(rules.FIXED_FIELDS[family])
    window, switch = int(m.sliding_window) or None, rules.WINDOW_SWITCH.get(family)
    if switch == "use_sliding_window":
        out.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=int(m.n_layers))
    elif switch:
        out["sliding_window"] = window
    if m.rope_scaling:
        out["rope_scaling"] = dict(m.rope_scaling)
    return out
