"""A Llama 3.1 folder as the installed ``transformers`` writes it, against ``transformers`` itself:
its ``save_pretrained`` output (the current config form, RoPE in ``rope_parameters``) and the
same folder with the config in the form transformers 4 wrote (``rope_theta`` and ``rope_scaling``
at the top level) both train under tp2 from transformers' own first loss, and the exported
config reads back in transformers as the RoPE it came with. Another RoPE type (YaRN) is one
``error:`` line, exit 2, in either form.

Before ``orchestrator.hf_model`` read ``rope_parameters``, the current form trained with theta
1e4 and no scaling (seen failing on that code: first loss 7.3688 where transformers computes
7.1721, and a YaRN config in the current form was accepted); the legacy form matched.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency (pyproject's [test])
from hydra.core.global_hydra import GlobalHydra

from orchestrator import hf_model, trial
from tests.conftest import cli_in_process, composed
from trainers.data import StepSampler, SyntheticTokens

ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.2,  # logits far from uniform, so a wrong RoPE shows in the loss
)
SEQ, BATCH = 32, 4


def _config(rope: dict):
    """A LlamaConfig with this RoPE, in the form the installed transformers takes."""
    try:
        return transformers.LlamaConfig(**SHAPE, rope_parameters=dict(rope))
    except TypeError:  # transformers 4: rope_theta and rope_scaling
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return transformers.LlamaConfig(**SHAPE, rope_theta=rope["rope_theta"], rope_scaling=scaling)


def _legacy(config: dict) -> dict:
    """The config as transformers 4 wrote it: rope_theta and rope_scaling, no rope_parameters."""
    out = dict(config)
    params = dict(out.pop("rope_parameters", None) or {})
    if params:
        out["rope_theta"] = params.pop("rope_theta")
        out["rope_scaling"] = params if params.get("rope_type", "default") != "default" else None
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{form: folder} of one random Llama 3.1-shaped model, and transformers' own loss on the
    trial's first global batch."""
    root = tmp_path_factory.mktemp("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(ROPE)).eval()
    current = root / "current"
    model.save_pretrained(current)
    legacy = root / "legacy"
    shutil.copytree(current, legacy)
    written = json.loads((current / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps(_legacy(written), indent=2))
    loss = first_loss(model, current)
    return {"current": current, "legacy": legacy, "written": written, "loss": loss, "model": model}


def first_loss(model, folder) -> float:
    """transformers' own loss of ``model`` on the first global batch a trial of ``folder`` trains on."""
    seed = _compose(folder, []).trainer.seed
    ds = SyntheticTokens(SHAPE["vocab_size"], SEQ, seed)
    x, y = zip(*(ds[i] for i in StepSampler(len(ds), BATCH, 0, 1, seed, 1)))
    with torch.no_grad():
        logits = model(input_ids=torch.stack(x)).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.stack(y).reshape(-1)).item()


def _compose(folder, extra):
    over = ["+chip=cpu", "trainer=smoke", "trainer.steps=2", f"trainer.seq_len={SEQ}", f"trainer.global_batch={BATCH}"]
    over += ["trainer.micro_batch=2", "data=synthetic", "precision=fp32", "tracking.enabled=false"]
    over += [f"model.hf_config={folder}", f"model.hf_weights={folder}", *extra]
    cfg = composed(over)
    GlobalHydra.instance().clear()
    return cfg


def test_both_config_forms_read_as_the_same_model(folders):
    """The installed transformers writes RoPE where this test expects it, and both forms give the
    trainer one model: theta 5e5 and Llama 3.1's scaling."""
    written = folders["written"]
    current = hf_model.model_fields(str(folders["current"]))
    legacy = hf_model.model_fields(str(folders["legacy"]))
    assert {**legacy, "name": "current"} == current
    assert current["rope_theta"] == 500000.0
    assert current["rope_scaling"] == {k: v for k, v in ROPE.items() if k != "rope_theta"}
    if "rope_parameters" in written:  # transformers 5: nothing of RoPE at the top level
        assert written.get("rope_theta") is None and written.get("rope_scaling") is None


@pytest.mark.distributed
def test_tp2_starts_from_transformers_own_loss_and_exports_what_it_reads(folders, tmp_path):
    """The current form under tp2 (the legacy form is the same model config to the field, above,
    so the same run; the suite's time goes to one)."""
    out = tmp_path / "exported"
    cfg = _compose(folders["current"], ["parallel=tp2", f"trainer.export_hf={out}"])
    result = trial.run(cfg, [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    assert result["summary"]["losses"][0] == pytest.approx(folders["loss"], rel=1e-5)
    back = transformers.AutoConfig.from_pretrained(out)
    want = transformers.AutoConfig.from_pretrained(folders["current"])
    for name in ("rope_parameters", "rope_theta", "rope_scaling"):
        assert getattr(back, name, None) == getattr(want, name, None), name
    assert back.num_key_value_heads == 2 and back.tie_word_embeddings is False


@pytest.mark.parametrize("form", ["current", "legacy"])
def test_a_yarn_folder_is_one_line_and_exit_2(folders, form, tmp_path, monkeypatch, capfd):
    config = dict(folders["written"])
    config.pop("rope_theta", None), config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}
    if form == "legacy":
        config = _legacy(config)
    bad = tmp_path / "yarn"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    args = ["+chip=cpu", "trainer=smoke", f"model.hf_config={bad}"]
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 2, (out, err)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    field = "rope_parameters.rope_type" if form == "current" else "rope_scaling.rope_type"
    assert len(errors) == 1 and f"{field}='yarn' is not built by this trainer" in errors[0], err
