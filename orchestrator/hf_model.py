"""A Hugging Face model's architecture as this tool's model config: ``model.hf_config=FOLDER`` (or
the path of its ``config.json``) fills the ``model`` section from the folder's ``config.json``, so
the planner, the operator coverage and every layout work on it as on the shipped presets.

Supported: the Llama family (``LlamaForCausalLM``, ``model_type: llama``: Llama 2 and 3, grouped
KV heads, ``rope_theta``, Llama 3.1's ``rope_scaling`` of type ``llama3``, ``rms_norm_eps``, tied
or untied head), the fields read by ``transformers``' ``LlamaConfig``. Anything else, or a Llama
config with a field whose value the trainer does not build (biases in attention or MLP, another
activation, another RoPE scaling, a head dimension other than hidden / heads), is one error line
naming the field. The values from ``config.json`` win over ``model.*`` keys given beside it.
Its weights load with ``model.hf_weights`` (``trainers/hf_weights.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig, open_dict

ARCHITECTURES = ("LlamaForCausalLM",)


class HFConfigError(ValueError):
    """One line naming ``model.hf_config`` and the field."""


def _path(where: str) -> Path:
    p = Path(where).expanduser()
    return p / "config.json" if p.is_dir() else p


def model_fields(where: str) -> Dict[str, Any]:
    """The ``model`` keys a Llama-family ``config.json`` stands for; raises HFConfigError."""
    path = _path(where)
    key = f"model.hf_config={where}"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFConfigError(f"{key}: {path}: no such file") from None
    except ValueError as e:
        raise HFConfigError(f"{key}: {path} is not JSON ({e})") from None
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or not set(archs) & set(ARCHITECTURES):
        raise HFConfigError(
            f"{key}: architecture {archs or hf.get('model_type')} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    bad = [
        (f, v, want)
        for f, v, want in (
            ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
            ("attention_bias", hf.get("attention_bias", False), False),
            ("mlp_bias", hf.get("mlp_bias", False), False),
        )
        if v != want
    ]
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    if hf.get("head_dim") not in (None, hidden // heads):
        bad.append(("head_dim", hf["head_dim"], hidden // heads))
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if scaling and rope_type != "llama3":
        bad.append(("rope_scaling.rope_type", rope_type, "llama3"))
    if bad:
        f, v, want = bad[0]
        raise HFConfigError(f"{key}: {f}={v!r} is not built by this trainer (it builds {want!r})")
    out: Dict[str, Any] = {
        "name": path.parent.name,  # the model's folder
        "vocab_size": int(hf["vocab_size"]),
        "d_model": hidden,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "d_ff": int(hf["intermediate_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "pos_emb": "rope",
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_scaling": {
            k: scaling[k]
            for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if k in scaling
        },
    }
    if scaling and "rope_type" not in out["rope_scaling"]:
        out["rope_scaling"]["rope_type"] = rope_type
    return out


def apply(cfg: DictConfig) -> Optional[str]:
    """Fill ``cfg.model`` from ``model.hf_config`` when it is set; the error line, or None."""
    where = cfg.model.get("hf_config")
    if not where:
        return None
    try:
        fields = model_fields(str(where))
    except HFConfigError as e:
        return str(e)
    except (KeyError, TypeError) as e:
        return f"model.hf_config={where}: config.json lacks or mistypes {e}"
    with open_dict(cfg.model):
        for k, v in fields.items():
            cfg.model[k] = v
    return None
