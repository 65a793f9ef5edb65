"""Weights in the Hugging Face layout: a small random Llama-3-shaped checkpoint (grouped KV heads,
rope_theta 5e5, Llama 3.1's RoPE scaling, untied head), written here as ``save_pretrained`` lays
one out (two safetensors shards and the index), loads into the trainer's model and gives the
logits of a reference written in Hugging Face's own convention (``rotate_half`` RoPE, repeated KV
heads, RMSNorm, SwiGLU; below, sharing no code with ``trainers/model.py``), in one process and
under tp2, pp2 and FSDP; in each layout the first step's loss is the reference's loss on the same
batch and the losses follow the single process's; saved back, the files hold the same bits; bad
folders are one line, exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hydra.core.global_hydra import GlobalHydra

from orchestrator import hf_model, trial
from tests.conftest import cli_in_process, composed, on_ranks
from trainers import hf_weights
from trainers.config import ModelConfig
from trainers.data import StepSampler, SyntheticTokens
from trainers.model import GPT
from trainers.safetensors_format import write_index
from trainers.safetensors_io import Checkpoint, write

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 160,
    "max_position_embeddings": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 512,
}


def random_llama(cfg: dict, seed: int = 0) -> dict:
    """A Hugging Face Llama state dict of random weights (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    h, ff, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def w(*shape, std=0.05):
        return torch.randn(*shape, generator=g) * std

    sd = {
        "model.embed_tokens.weight": w(v, h, std=0.5),
        "model.norm.weight": 1 + w(h, std=0.1),
        "lm_head.weight": w(v, h, std=0.2),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": 1 + w(h, std=0.1),
                p + "self_attn.q_proj.weight": w(h, h, std=0.2),
                p + "self_attn.k_proj.weight": w(kv, h, std=0.2),
                p + "self_attn.v_proj.weight": w(kv, h),
                p + "self_attn.o_proj.weight": w(h, h),
                p + "post_attention_layernorm.weight": 1 + w(h, std=0.1),
                p + "mlp.gate_proj.weight": w(ff, h),
                p + "mlp.up_proj.weight": w(ff, h),
                p + "mlp.down_proj.weight": w(h, ff),
            }
        )
    return sd


def save_pretrained_like(folder, cfg: dict, sd: dict) -> None:
    """config.json, two safetensors shards (the embedding and first half of the layers; the
    rest) and the index, as ``transformers`` writes a sharded checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    half = cfg["num_hidden_layers"] // 2
    first = {k: t for k, t in sd.items() if "embed" in k or any(f"layers.{i}." in k for i in range(half))}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": {}}
    files["model-00002-of-00002.safetensors"] = {k: t for k, t in sd.items() if k not in first}
    size, weight_map = 0, {}
    for name, tensors in files.items():
        size += write(folder / name, tensors.items(), {"format": "pt"})
        weight_map.update({k: name for k in tensors})
    write_index(folder, weight_map, size)


# -- the reference: Hugging Face's Llama forward, in plain torch ---------------------------------


def ref_inv_freq(hd: int, theta: float, sc: dict) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if not sc:
        return inv
    factor, lo, hi, orig = (
        sc["factor"],
        sc["low_freq_factor"],
        sc["high_freq_factor"],
        sc["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - lo) / (hi - lo)
    out = torch.where(wavelen > orig / lo, inv / factor, inv)
    mid = (wavelen <= orig / lo) & (wavelen >= orig / hi)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def ref_logits(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = h // heads, cfg["rms_norm_eps"]
    b, t = ids.shape

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    freqs = torch.outer(
        torch.arange(t, dtype=torch.float64), ref_inv_freq(hd, cfg["rope_theta"], cfg.get("rope_scaling"))
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    x = sd["model.embed_tokens.weight"][ids]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = norm(x, sd[p + "input_layernorm.weight"])
        q = (y @ sd[p + "self_attn.q_proj.weight"].T).view(b, t, heads, hd).transpose(1, 2)
        k = (y @ sd[p + "self_attn.k_proj.weight"].T).view(b, t, kvh, hd).transpose(1, 2)
        v = (y @ sd[p + "self_attn.v_proj.weight"].T).view(b, t, kvh, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kvh, dim=1), v.repeat_interleave(heads // kvh, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, t, h) @ sd[p + "self_attn.o_proj.weight"].T
        y = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = y @ sd[p + "mlp.gate_proj.weight"].T, y @ sd[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return norm(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


# -- tests -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama3"
    sd = random_llama(CONFIG)
    save_pretrained_like(folder, CONFIG, sd)
    return folder, sd


def _model(folder) -> GPT:
    args = ModelConfig(**hf_model.model_fields(str(folder)))
    model = GPT(args, seed=0)
    assert hf_weights.load([model], str(folder), args) == 3 + 9 * CONFIG["num_hidden_layers"]
    return model


def test_loaded_model_gives_the_reference_logits(checkpoint):
    folder, sd = checkpoint
    model = _model(folder).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids), ref_logits(sd, CONFIG, ids)
    assert ref.std() > 1.0  # logits far from zero: a wrong permutation or name would show
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # the RoPE permutation is what makes them equal: loaded without it, they differ
    args = ModelConfig(**hf_model.model_fields(str(folder)))
    raw = GPT(args, seed=0)
    with torch.no_grad():
        for name, p in raw.named_parameters():
            p.copy_(sd[hf_weights.hf_name(name)])
        assert (raw(ids) - ref).abs().max() > 1e-2


def test_saved_then_loaded_is_bit_identical(checkpoint, tmp_path):
    folder, sd = checkpoint
    model = _model(folder)
    out = tmp_path / "out"
    hf_weights.save([model], str(out), model.args, pp_rank=0, pp=1, writer=True)
    back = Checkpoint(str(out))
    assert back.names() == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(back.tensor(name), t), name
    again = GPT(model.args, seed=1)
    hf_weights.load([again], str(out), model.args)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd) and index["metadata"]["total_size"] > 0
    # the exported folder's config.json is the architecture it came from
    assert hf_model.model_fields(str(out)) == {**hf_model.model_fields(str(folder)), "name": "out"}


def first_batch_loss(sd: dict, seq: int, global_batch: int, seed: int) -> float:
    """The reference's mean token cross-entropy on the trial's first global batch
    (``data=synthetic``: the sampler's first ``global_batch`` indices)."""
    ds = SyntheticTokens(CONFIG["vocab_size"], seq, seed)
    sampler = StepSampler(len(ds), global_batch, 0, 1, seed, 1)
    x, y = zip(*(ds[i] for i in sampler))
    logits = ref_logits(sd, CONFIG, torch.stack(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.stack(y).reshape(-1)).item()


LAYOUTS = {
    "tp2": ["parallel=tp2"],
    "pp2": ["parallel=pp2", "parallel.microbatches=2"],
    "fsdp2": ["parallel=dp2", "parallel.dp_shard=fsdp"],
}


@pytest.fixture(scope="module")
def single_losses(checkpoint, tmp_path_factory):
    from trainers.loop import train

    folder, _ = checkpoint
    return train(trial.build_spec(trial.prepare(_compose(folder, []))))["losses"]


def _compose(folder, extra):
    over = ["+chip=cpu", "trainer=smoke", "trainer.steps=4", "trainer.seq_len=32", "trainer.global_batch=4"]
    over += ["trainer.micro_batch=2", "data=synthetic", "precision=fp32", "tracking.enabled=false"]
    over += [f"model.hf_config={folder}", f"model.hf_weights={folder}", *extra]
    cfg = composed(over)
    GlobalHydra.instance().clear()
    return cfg


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_start_from_the_checkpoint(checkpoint, single_losses, layout):
    folder, sd = checkpoint
    want = first_batch_loss(sd, 32, 4, seed=_compose(folder, []).trainer.seed)
    assert single_losses[0] == pytest.approx(want, rel=1e-5)
    result = trial.run(_compose(folder, LAYOUTS[layout]), [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    losses = result["summary"]["losses"]
    assert losses[0] == pytest.approx(want, rel=1e-5), layout
    assert losses == pytest.approx(single_losses, rel=1e-4), layout


def _logits(model, spec, rank: int, ids: torch.Tensor):
    """A layout's logits of ``ids`` from the rank model built with the weights: TP's vocabulary
    shards gathered, the pipeline's hidden states sent from the first stage to the last (which
    alone returns logits)."""
    import torch.distributed as dist

    model.train(False)
    with torch.no_grad():
        if model.schedule is not None:  # pp2: stage 0 on rank 0, stage 1 on rank 1
            if model.has_first:
                dist.send(model.modules[0](ids).contiguous(), dst=1)
                return None
            h = torch.empty(*ids.shape, spec.model.d_model)
            dist.recv(h, src=0)
            return model.modules[0](h)
        y = model.wrapped[0](ids)
        if model.p.tp > 1:  # this rank's vocabulary shard
            parts = [torch.empty_like(y) for _ in range(model.p.tp)]
            dist.all_gather(parts, y.contiguous(), group=model.mesh.group("tp"))
            y = torch.cat(parts, dim=-1)
        return y


@pytest.mark.distributed
def test_every_layout_gives_the_reference_logits(checkpoint, tmp_path):
    folder, sd = checkpoint
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(3))
    ref = ref_logits(sd, CONFIG, ids)
    specs = [(name, trial.build_spec(trial.prepare(_compose(folder, over)))) for name, over in LAYOUTS.items()]
    ranks = on_ranks(_logits, 2, specs, str(tmp_path), ids)
    for name in LAYOUTS:
        holders = [r[name] for r in ranks if name in r]
        assert holders, name
        for logits in holders:
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_trained_model_exports_and_reloads(checkpoint, tmp_path, layout):
    """Gathered from TP shards, or written one file per pipeline stage, with the index."""
    folder, sd = checkpoint
    out = tmp_path / "trained"
    result = trial.run(_compose(folder, [*LAYOUTS[layout], f"trainer.export_hf={out}"]), [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == (2 if layout == "pp2" else 1), files
    back = Checkpoint(str(out))
    assert back.names() == sorted(sd)
    changed = [n for n in sd if not torch.equal(back.tensor(n), sd[n])]
    assert len(changed) == len(sd)  # every tensor trained
    model = GPT(ModelConfig(**hf_model.model_fields(str(folder))), seed=0)
    hf_weights.load([model], str(out), model.args)
    hf_weights.save([model], str(tmp_path / "again"), model.args, 0, 1, True)
    again = Checkpoint(str(tmp_path / "again"))
    assert all(torch.equal(again.tensor(n), back.tensor(n)) for n in sd)


@pytest.mark.parametrize(
    "damage,line",
    [
        ("missing", "no tensor model.layers.3.mlp.down_proj.weight"),
        ("shape", "model.embed_tokens.weight has shape [256, 64], the model needs [512, 64]"),
        ("truncated", "runs past the file's"),
        ("empty", "neither model.safetensors.index.json nor model.safetensors"),
    ],
)
def test_a_bad_weights_folder_is_one_line_and_exit_2(checkpoint, tmp_path, monkeypatch, capfd, damage, line):
    folder, sd = checkpoint
    bad = tmp_path / "bad"
    (bad).mkdir()
    (bad / "config.json").write_text(json.dumps(CONFIG))
    tensors = dict(sd)
    if damage == "missing":
        del tensors["model.layers.3.mlp.down_proj.weight"]
    if damage == "shape":
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:256]
    if damage != "empty":
        write(bad / "model.safetensors", tensors.items())
    if damage == "truncated":
        path = bad / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    over = ["+chip=cpu", "trainer=smoke", f"model.hf_config={bad}", f"model.hf_weights={bad}"]
    code, out, err = cli_in_process(over, tmp_path, monkeypatch, capfd)
    assert code == 2, (out, err)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "model.hf_weights" in errors[0] and line in errors[0], err
