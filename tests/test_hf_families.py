"""Mistral, Qwen2 and Qwen3 folders as the installed ``transformers`` writes them, against
``transformers`` itself: each trains under tp2 from transformers' own first loss (Qwen2's q, k
and v biases loaded into the tensor-parallel shards, q's and k's in RoPE's channel order; Qwen3's
per-head q and k norms, replicated over the shards' heads, their weights in that order too), and
exports, with a learning rate too small to move an fp32 weight (1e-30), the very tensors it read
and a ``config.json`` that transformers reads back as the same family. A window shorter than the sequence is refused by
name, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test dependency (pyproject's [test])

from orchestrator import hf_model, trial
from tests.conftest import assert_planned_state_bytes, cli_in_process
from tests.test_hf_transformers import SEQ, SHAPE, _compose, first_loss  # the same small shape and trial
from trainers.safetensors_io import Checkpoint

FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # no window: Mistral 7B v0.2 and later; v0.1's 4096 is held against the sequence (below)
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    # head_dim as hidden / heads (Qwen3Config's default is 128): the trainer builds no other
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": SHAPE["hidden_size"] // 4}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, transformers' own loss on the trial's first global batch)}."""
    out = {}
    for family, (config_cls, model_cls, extra) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        torch.manual_seed(0)
        model = model_cls(config_cls(**SHAPE, **extra)).eval()
        if family == "qwen2":  # transformers initialises biases at 0: make them count
            with torch.no_grad():
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0.0, 0.5)
        if family == "qwen3":  # the norms start at 1, which any channel order keeps: make them count
            with torch.no_grad():
                for layer in model.model.layers:
                    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                        norm.weight.normal_(1.0, 0.5)
        model.save_pretrained(folder)
        out[family] = (folder, first_loss(model, folder))
    return out


def test_the_families_read_as_their_model_config(folders):
    qwen = hf_model.model_fields(str(folders["qwen2"][0]))
    mistral = hf_model.model_fields(str(folders["mistral"][0]))
    assert (qwen["family"], qwen["sliding_window"]) == ("qwen2", 0)
    assert (mistral["family"], mistral["sliding_window"]) == ("mistral", 0)
    assert hf_model.model_fields(str(folders["qwen3"][0]))["family"] == "qwen3"


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_starts_from_transformers_own_loss_and_exports_what_it_read(folders, family, tmp_path):
    folder, loss = folders[family]
    out = tmp_path / "exported"
    cfg = _compose(folder, ["parallel=tp2", "trainer.lr=1e-30", f"trainer.export_hf={out}"])
    result = trial.run(cfg, [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    assert result["summary"]["losses"][0] == pytest.approx(loss, rel=1e-5)
    assert_planned_state_bytes(cfg, result["summary"])  # the planner counts the biases
    back = transformers.AutoConfig.from_pretrained(out)
    want = transformers.AutoConfig.from_pretrained(folder)
    assert (back.model_type, back.architectures) == (want.model_type, want.architectures)
    assert back.sliding_window == want.sliding_window
    src, dst = Checkpoint(str(folder)), Checkpoint(str(out))
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family == "qwen3")
    for name in names:  # steps of ~1e-30 leave every weight as it was: the tensors it read, in their layout
        assert torch.equal(dst.tensor(name), src.tensor(name)), name


def test_a_window_shorter_than_the_sequence_is_one_line_and_exit_2(folders, tmp_path, monkeypatch, capfd):
    folder = tmp_path / "windowed"
    folder.mkdir()
    config = json.loads((folders["mistral"][0] / "config.json").read_text())
    config["sliding_window"] = 16
    (folder / "config.json").write_text(json.dumps(config))
    args = ["+chip=cpu", "trainer=smoke", f"trainer.seq_len={SEQ}", f"model.hf_config={folder}"]
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 2, (out, err)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "model.sliding_window=16 is below trainer.seq_len=32" in errors[0], err
