"""The GPT decoder: causality, the attention decomposition, Llama features, parameter counts."""

from __future__ import annotations

import pytest
import torch

from trainers.config import ModelConfig, from_dict
from trainers.model import GPT, count_params

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
LLAMA = dict(TINY, norm="rmsnorm", mlp="swiglu", pos_emb="rope", tie_embeddings=False, n_kv_heads=2)


@pytest.mark.parametrize("kw", [TINY, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("impl", ["fused", "decomposed", "npu_fused"])
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


@pytest.mark.parametrize("kw", [TINY, LLAMA], ids=["gpt", "llama"])
def test_npu_fused_attention_trains_the_same_model_off_the_npu(kw):
    """An emulated Ascend plan (attn_impl=npu_fused on CPU) computes what fused attention does."""
    torch.manual_seed(0)
    fused = GPT(ModelConfig(**kw, attn_impl="fused"))
    npu = GPT(ModelConfig(**kw, attn_impl="npu_fused"))
    npu.load_state_dict(fused.state_dict())
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(fused(x), npu(x), rtol=1e-6, atol=1e-6)


class _DocumentedFusionAttention:
    """``npu_fusion_attention`` as its documentation states it (op-plugin docs): BNSD layout,
    kv heads fewer than query heads shared in groups, a bool mask where True is masked out,
    sparse_mode=3 expanding the compressed 2048 x 2048 mask to the sequence, ``scale`` on the
    scores, ``keep_prob`` for dropout; returns a tuple whose first element is the output."""

    def __init__(self):
        self.calls = []

    def npu_fusion_attention(self, q, k, v, head_num, input_layout, *, atten_mask, scale, keep_prob, sparse_mode):
        self.calls.append(dict(head_num=head_num, layout=input_layout, keep_prob=keep_prob, sparse_mode=sparse_mode))
        assert input_layout == "BNSD" and head_num == q.shape[1] and sparse_mode == 3
        assert atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
        s = q.shape[2]
        masked = atten_mask[:s, :s]  # right-down causal on a square: the compressed mask's corner
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) * scale
        probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
        return (probs @ v, None, None, None, 0, 0, 0)


def test_the_npu_kernel_call_follows_the_documented_contract():
    from trainers.attention import npu_kernel

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    fake = _DocumentedFusionAttention()
    got = npu_kernel(fake, q, k, v, dropout_p=0.1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fake.calls[0]["keep_prob"] == pytest.approx(0.9)


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
