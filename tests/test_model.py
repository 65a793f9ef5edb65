"""The GPT decoder: causality, the attention decomposition, Llama features, parameter counts."""

from __future__ import annotations

import pytest
import torch

from trainers.config import ModelConfig, from_dict
from trainers.model import GPT, count_params

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
LLAMA = dict(TINY, norm="rmsnorm", mlp="swiglu", pos_emb="rope", tie_embeddings=False, n_kv_heads=2)


@pytest.mark.parametrize("kw", [TINY, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("impl", ["fused", "decomposed"])
def test_causal(kw, impl):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**kw, attn_impl=impl)).eval()
    x = torch.randint(0, 64, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 64  # change only the future
    a, b = model(x), model(y)
    assert a.shape == (2, 16, 64)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("kw", [TINY, LLAMA], ids=["gpt", "llama"])
def test_decomposed_attention_matches_fused(kw):
    torch.manual_seed(0)
    fused = GPT(ModelConfig(**kw, attn_impl="fused")).eval()
    decomposed = GPT(ModelConfig(**kw, attn_impl="decomposed")).eval()
    decomposed.load_state_dict(fused.state_dict())
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(fused(x), decomposed(x), rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(ModelConfig(**TINY))
    ckpt = GPT(ModelConfig(**TINY, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 64, (2, 16))
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize(
    "preset,expected,rel",
    [
        ("gpt2_small", 124.4e6, 0.01),  # GPT-2 small: 124M (with the vocabulary padded to 50304)
        ("llama2_7b", 6.74e9, 0.01),  # Llama 2 7B: 6,738,415,616
        ("llama2_13b", 13.02e9, 0.01),  # Llama 2 13B: 13,015,864,320
        ("llama2_70b", 68.98e9, 0.01),  # Llama 2 70B: 68,976,648,192
    ],
)
def test_published_parameter_counts(preset, expected, rel):
    from omegaconf import OmegaConf

    from orchestrator import conf_dir

    args = from_dict(ModelConfig, OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{preset}.yaml")))
    with torch.device("meta"):  # no memory for 70B
        model = GPT(args)
    assert count_params(model) == pytest.approx(expected, rel=rel)
