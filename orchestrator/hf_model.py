"""A Hugging Face model's architecture as this tool's model config: ``model.hf_config=FOLDER`` (or
the path of its ``config.json``) fills the ``model`` section from the folder's ``config.json``, so
the planner, the operator coverage and every layout work on it as on the shipped presets.

Supported: the Llama family (``LlamaForCausalLM``, ``model_type: llama``: Llama 2 and 3, grouped
KV heads, ``rope_theta``, Llama 3.1's RoPE scaling of type ``llama3`` (as transformers 5 writes it,
in ``rope_parameters``, or as 4 did, ``rope_theta`` and ``rope_scaling``), ``rms_norm_eps``, tied
or untied head), the fields read by ``transformers``' ``LlamaConfig``; Mistral
(``MistralForCausalLM``: the same layers, with a ``sliding_window`` the validator holds against
the sequence length) and Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``: q, k and v with biases; its window
only where ``use_sliding_window`` is set), as ``model.family``. Anything else, or a config with a
field whose value the trainer does not build (Llama's biases in attention or MLP, another
activation, another RoPE scaling, a head dimension other than hidden / heads), is one error line
naming the field. The values from ``config.json`` win over ``model.*`` keys given beside it.
Its weights load with ``model.hf_weights`` (``trainers/hf_weights.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig, open_dict

from trainers import rules

# config.json's architecture -> (its model_type, model.family)
ARCHITECTURES = {arch: (model_type, family) for family, (arch, model_type) in rules.ARCHITECTURES.items()}


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
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES and ARCHITECTURES[a][0] == hf.get("model_type")]
    if not known:
        raise HFConfigError(
            f"{key}: architecture {archs or hf.get('model_type')} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    family = known[0][1]
    checks = [("hidden_act", hf.get("hidden_act", "silu"), "silu")]
    checks += [(f, hf.get(f, want), want) for f, want in rules.FIXED_FIELDS[family].items()]
    bad = [(f, v, want) for f, v, want in checks if v != want]
    kinds = sorted(set(hf.get("layer_types") or []) - {"full_attention", "sliding_attention"})
    if kinds:
        bad.append(("layer_types", kinds, "full_attention or sliding_attention"))
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    if hf.get("head_dim") not in (None, hidden // heads):
        bad.append(("head_dim", hf["head_dim"], hidden // heads))
    theta, scaling, rope_field = rope(hf, key)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        bad.append((rope_field, rope_type, " or ".join(ROPE_TYPES)))
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
        "rope_theta": theta,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_scaling": {k: scaling[k] for k in LLAMA3_KEYS if k in scaling} if rope_type == "llama3" else {},
        "family": family,
        "sliding_window": sliding_window(hf, family),
    }
    return out


def sliding_window(hf: Dict[str, Any], family: str) -> int:
    """The attention window the config asks for, 0 for none: Mistral's ``sliding_window`` (null:
    none); Qwen2's only where ``use_sliding_window`` is set or a layer's type is
    ``sliding_attention`` (its configs carry a ``sliding_window`` value either way)."""
    window, switch = int(hf.get("sliding_window") or 0), rules.WINDOW_SWITCH.get(family)
    sliding = switch is not None and (bool(hf.get(switch)) or "sliding_attention" in (hf.get("layer_types") or []))
    return window if sliding else 0


# RoPE types the trainer builds: none (transformers' "default") and Llama 3.1's frequency rule
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope(hf: Dict[str, Any], key: str):
    """(theta, scaling with its ``rope_type``, the field naming the type) from either form
    ``config.json`` takes. transformers 5 writes one ``rope_parameters`` object holding
    ``rope_theta`` and ``rope_type`` (``default``: no scaling) with the type's own fields
    (``LlamaConfig(...).to_dict()`` in 5.25 keeps nothing at the top level); transformers 4 wrote
    ``rope_theta`` at the top level and a ``rope_scaling`` object (or null) whose type is under
    ``rope_type`` or, older, ``type``. Both present (a config edited by hand, or converted) must
    agree, or it is refused by name rather than one of them guessed."""
    params = hf.get("rope_parameters")
    legacy = hf.get("rope_scaling") or {}
    top = hf.get("rope_theta")
    if params is None:
        scaling = dict(legacy)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        return float(top if top is not None else 10000.0), scaling, "rope_scaling.rope_type"
    if not isinstance(params, dict) or "rope_theta" not in params:
        # per attention type ({"full_attention": {...}, "sliding_attention": {...}}) is another family's
        raise HFConfigError(f"{key}: rope_parameters={params!r} is not one RoPE (rope_theta, rope_type) as Llama's")
    theta = float(params["rope_theta"])
    if top is not None and float(top) != theta:
        raise HFConfigError(f"{key}: rope_theta={top} and rope_parameters.rope_theta={theta} disagree")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    old = legacy.get("rope_type", legacy.get("type")) if legacy else None
    if old is not None and old != scaling["rope_type"]:
        raise HFConfigError(
            f"{key}: rope_scaling.rope_type={old!r} and rope_parameters.rope_type={scaling['rope_type']!r} disagree"
        )
    return theta, scaling, "rope_parameters.rope_type"


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
