"""A Hugging Face Llama ``config.json`` as the model config (``orchestrator/hf_model.py``): the
parameter counts of Llama 3 8B and Llama 3.2 1B built from their published configs equal the
counts of their model cards (8,030,261,248 and 1,235,814,400, each also summed by hand below from
the shapes), Llama 3.1's RoPE scaling against a scalar transcription of Meta's ``apply_scaling``,
a tiny Llama-3-shaped config trains under tp2, and unsupported architectures or fields are one
error line naming the field, exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from orchestrator import hf_model, trial
from orchestrator.planner.shapes import ModelShape
from tests.conftest import cli_in_process
from trainers.config import ModelConfig
from trainers.rope import llama3_scaled

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
LLAMA32_1B = {
    **LLAMA3_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def _folder(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _by_hand(h, layers, ff, vocab, heads, kv, tied):
    head_dim = h // heads
    layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * ff + 2 * h
    return vocab * h * (1 if tied else 2) + layers * layer + h


@pytest.mark.parametrize(
    "name,cfg,published",
    [("Meta-Llama-3-8B", LLAMA3_8B, 8_030_261_248), ("Llama-3.2-1B", LLAMA32_1B, 1_235_814_400)],
)
def test_published_configs_become_the_published_models(tmp_path, name, cfg, published):
    fields = hf_model.model_fields(str(_folder(tmp_path, name, cfg)))
    assert fields["name"] == name and fields["n_kv_heads"] == 8 and fields["rope_theta"] == 500000.0
    m = ModelConfig(**fields)
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    hand = _by_hand(h, cfg["num_hidden_layers"], ff, 128256, 32, 8, cfg["tie_word_embeddings"])
    assert hand == published
    assert ModelShape.of(OmegaConf.structured(m)).n_params == published


def _apply_scaling_reference(freqs, factor, low, high, old):
    """Meta's reference, one frequency at a time (llama-models, ``apply_scaling``)."""
    out = []
    low_wavelen, high_wavelen = old / low, old / high
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_llama3_rope_scaling_is_meta_s():
    head_dim, theta = 64, 500000.0
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    got = llama3_scaled(inv, LLAMA32_1B["rope_scaling"])
    want = _apply_scaling_reference(inv.tolist(), 32.0, 1.0, 4.0, 8192)
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert got[0] == inv[0] and got[-1] == pytest.approx(inv[-1] / 32)  # kept, and scaled


@pytest.mark.distributed
def test_a_llama3_shaped_config_trains_under_tp2(compose_cfg, tmp_path):
    tiny = {
        **LLAMA32_1B,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    d = _folder(tmp_path, "tiny-llama3", tiny)
    overrides = ["+chip=cpu", "trainer=smoke", "trainer.seq_len=32", f"model.hf_config={d}", "parallel=tp2"]
    result = trial.run(compose_cfg([*overrides, "tracking.enabled=false"]), [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    s = result["summary"]
    assert s["losses"][-1] < s["losses"][0]
    assert s["n_params"] == _by_hand(64, 2, 128, 256, 4, 2, False)


@pytest.mark.parametrize(
    "change,line",
    [
        (
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            "architecture ['GPT2LMHeadModel'] is not supported",
        ),
        ({"attention_bias": True}, "attention_bias=True is not built by this trainer"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_models_are_one_line_exit_2(tmp_path, monkeypatch, capfd, change, line):
    d = _folder(tmp_path, "m", {**LLAMA3_8B, **change})
    code, out, err = cli_in_process(["+chip=cpu", f"model.hf_config={d}"], tmp_path, monkeypatch, capfd)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and f"model.hf_config={d}: " in errors[0] and line in errors[0], err[-1500:]
    code, out, err = cli_in_process(["+chip=cpu", f"model.hf_config={tmp_path / 'none'}"], tmp_path, monkeypatch, capfd)
    assert code == 2 and f"{tmp_path / 'none'}: no such file" in err, err[-1500:]
