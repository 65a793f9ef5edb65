"""Keys that act, each with a test that fails when the key is ignored: ``precision.loss_scale=static``,
``precision.param_dtype`` and ``master_weights_fp32``, ``comm.overlap`` (with ``comm.bucket_mb``),
``trainer.eval_every`` / ``eval_batches``, ``model.dropout``, ``precision.fp32_ops``, the straggler
drill ``trainer.fault.straggle_s``; and the validator's refusals of what the trainer cannot honour.

Single-process tests run ``trainers.loop.train`` here; ``distributed`` ones launch gloo workers
and compare with the single-process reference (1e-5 relative, as tests/test_parallel.py): those
are in tests/test_knobs_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orchestrator import trial
from orchestrator.results import Point, quality_gate
from orchestrator.trial import ConfigError
from tests.conftest import Rows, cli_in_process
from trainers import data
from trainers.config import ModelConfig, PrecisionConfig
from trainers.loop import NonFiniteError, train
from trainers.model import GPT, cross_entropy
from trainers.optim import MasterAdamW
from trainers.precision import FP32_OPS, apply_op_policy

ONE = ["+chip=cpu", "trainer=smoke", "data.num_workers=0", "tracking.enabled=false"]


def _train(compose_cfg, overrides):
    rows = Rows()
    summary = train(trial.build_spec(trial.prepare(compose_cfg([*ONE, *overrides]))), rows)
    return summary, rows.rows


# --- precision.loss_scale=static ------------------------------------------------------------------

FP16_PARAMS = ["precision=fp16", "precision.param_dtype=fp16", "precision.loss_scale=static"]


def test_static_loss_scale_never_moves(compose_cfg):
    """growth_interval=1 would double a dynamic scale after every clean step; ignored, the key
    used to turn scaling off (scale 1)."""
    s, rows = _train(
        compose_cfg, [*FP16_PARAMS, "precision.init_scale=1024", "precision.growth_interval=1", "trainer.steps=3"]
    )
    assert [r["loss_scale"] for r in rows] == [1024.0] * 3
    assert s["skipped_steps_total"] == 0 and s["param_sum_final"] != s["param_sum_initial"]


def test_static_loss_scale_skips_overflows_and_ends_the_trial(compose_cfg):
    overflow = [*FP16_PARAMS, "precision.init_scale=1e8", "precision.backoff_factor=1e-5"]
    s, rows = _train(compose_cfg, [*overflow, "trainer.steps=2", "precision.max_consecutive_skips=3"])
    assert s["skipped_steps_total"] == 2 and [r["loss_scale"] for r in rows] == [1e8, 1e8]
    assert s["param_sum_final"] == s["param_sum_initial"]  # both steps skipped
    with pytest.raises(NonFiniteError, match="2 overflowed steps in a row"):
        _train(compose_cfg, [*overflow, "trainer.steps=4", "precision.max_consecutive_skips=2"])


# --- precision.param_dtype, precision.master_weights_fp32 -----------------------------------------


@pytest.mark.parametrize(
    "overrides,per_param",
    [
        ([], (4, 4, 8)),
        (["precision=bf16", "precision.param_dtype=bf16"], (2, 2, 12)),
        (["precision=bf16", "precision.param_dtype=bf16", "precision.master_weights_fp32=false"], (2, 2, 4)),
        (["precision=fp16", "precision.param_dtype=fp16"], (2, 2, 12)),
    ],
    ids=["fp32", "bf16-master", "bf16-no-master", "fp16-master"],
)
def test_param_dtype_and_master_weights_set_the_bytes_held(compose_cfg, overrides, per_param):
    """What the planner plans per parameter: params + grads + optimizer tensors."""
    s, _ = _train(compose_cfg, [*overrides, "trainer.steps=2"])
    n = s["n_params"]
    assert s["model_state_bytes"] == [dict(zip(("params", "grads", "optimizer"), (n * b for b in per_param)))]
    assert all(loss == loss for loss in s["losses"])


def test_master_adamw_is_adamw_on_fp32():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MasterAdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(3):
        g = torch.randn(4, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b)


def test_master_weights_keep_what_bf16_cannot_hold():
    """Updates of 1e-4 on 1.0 are below bf16's half-ulp (2^-9): AdamW on the bf16 parameter
    rounds each back to 1.0; the fp32 master accumulates them and the parameter follows."""

    def run(opt_cls, steps):
        p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        opt = opt_cls([p], lr=1e-4, weight_decay=0.0)
        for _ in range(steps):
            p.grad = torch.ones_like(p)
            opt.step()
        return p, opt

    p, opt = run(MasterAdamW, 1)
    state = opt.state[p]
    assert set(state) == {"step", "master", "exp_avg", "exp_avg_sq"}  # no fp32 gradient kept
    assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
    assert torch.all(p == 1.0) and torch.all(state["master"] < 1.0)
    p, opt = run(MasterAdamW, 100)
    assert torch.all(p < 1.0) and torch.equal(p, opt.state[p]["master"].to(torch.bfloat16))
    plain, _ = run(lambda ps, **kw: torch.optim.AdamW(ps, **kw), 100)
    assert torch.all(plain == 1.0)
    # a reload keeps the master and the moments in fp32 (Optimizer.load_state_dict would cast them)
    q = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    fresh = MasterAdamW([q], lr=1e-4)
    fresh.load_state_dict(opt.state_dict())
    for k in ("master", "exp_avg", "exp_avg_sq"):
        assert fresh.state[q][k].dtype == torch.float32 and torch.equal(fresh.state[q][k], opt.state[p][k])


# --- trainer.eval_every, trainer.eval_batches, model.dropout ---------------------------------------

# lr 1e-30 leaves every fp32 parameter at its initial value: the evaluated model is untrained
UNTRAINED = ["trainer.lr=1e-30", "trainer.steps=4", "trainer.eval_every=2", "trainer.eval_batches=2"]


def _untrained_val_loss(cfg) -> float:
    """The initial model's mean loss over the held-out split's first eval_batches global batches."""
    spec = trial.build_spec(cfg)
    model = GPT(spec.model, seed=spec.trainer.seed).eval()
    loader = data.build_val_loader(
        spec.data,
        seq_len=spec.trainer.seq_len,
        vocab_size=spec.model.vocab_size,
        seed=spec.trainer.seed,
        global_batch=spec.trainer.global_batch,
        micro_batch=spec.trainer.micro_batch,
        dp_rank=0,
        dp_size=1,
        batches=spec.trainer.eval_batches,
    )
    with torch.no_grad():
        losses = [cross_entropy(model(x), y) for x, y in loader]
    assert len(losses) == 2 * spec.trainer.global_batch // spec.trainer.micro_batch
    return float(torch.stack(losses).mean())


def test_eval_every_measures_the_held_out_split_and_dropout_acts_only_in_training(compose_cfg):
    plain, plain_rows = _train(compose_cfg, UNTRAINED)
    assert [r["step"] for r in plain_rows if "val_loss" in r] == [1, 3]
    assert plain["val_loss"] == plain_rows[3]["val_loss"]
    expected = _untrained_val_loss(trial.prepare(compose_cfg([*ONE, *UNTRAINED])))
    assert plain["val_loss"] == pytest.approx(expected, rel=1e-6)

    dropped, dropped_rows = _train(compose_cfg, [*UNTRAINED, "model.dropout=0.1"])
    assert dropped["losses"] != plain["losses"]  # dropout acts while training ...
    assert [r.get("val_loss") for r in dropped_rows] == [r.get("val_loss") for r in plain_rows]  # ... not in eval
    # evaluating draws nothing from the training RNG and touches no gradient
    no_eval, _ = _train(compose_cfg, [*UNTRAINED, "model.dropout=0.1", "trainer.eval_every=0"])
    assert no_eval["losses"] == dropped["losses"] and "val_loss" not in no_eval


# --- trainer.grad_clip, model.norm_eps ----------------------------------------------------------------


def test_grad_clip_bounds_the_norm_the_optimizer_sees(compose_cfg):
    """A bound the global gradient norm never reaches changes no bit (0 is off); a bound below it
    rescales every step's gradients, which AdamW's moments keep: the trajectory moves."""
    steps = ["trainer.steps=4", "trainer.log_every=1"]
    off, _ = _train(compose_cfg, [*steps, "trainer.grad_clip=0"])
    loose, _ = _train(compose_cfg, [*steps, "trainer.grad_clip=1e9"])
    tight, _ = _train(compose_cfg, [*steps, "trainer.grad_clip=1e-3"])
    assert min(off["grad_norms"]) > 1e-3  # the tight bound binds at every step
    assert loose["losses"] == off["losses"]
    assert tight["losses"][0] == off["losses"][0]  # before any update
    assert tight["losses"][2:] != pytest.approx(off["losses"][2:], rel=1e-4)
    assert tight["grad_norms"][0] == off["grad_norms"][0]  # the norm is measured before the clip


@pytest.mark.parametrize("model", ["gpt_tiny", "llama_tiny"])  # LayerNorm, RMSNorm
def test_norm_eps_reaches_every_norm(compose_cfg, model):
    """model.norm_eps is the epsilon of every norm of the model built (Llama: rms_norm_eps):
    a large one changes the first loss."""
    base, _ = _train(compose_cfg, [f"model={model}", "trainer.steps=1"])
    big, _ = _train(compose_cfg, [f"model={model}", "trainer.steps=1", "model.norm_eps=10"])
    assert big["losses"][0] != pytest.approx(base["losses"][0], rel=1e-4)


TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)


@pytest.mark.parametrize("impl", ["fused", "decomposed"])
def test_dropout_masks_only_in_train_mode(impl):
    x = torch.randint(0, 64, (2, 16))
    plain = GPT(ModelConfig(**TINY, attn_impl=impl), seed=1)
    dropped = GPT(ModelConfig(**TINY, attn_impl=impl, dropout=0.2), seed=1)
    torch.testing.assert_close(dropped.eval()(x), plain.eval()(x), rtol=0, atol=0)
    assert not torch.allclose(dropped.train()(x), plain.train()(x))


@pytest.mark.parametrize("impl", ["fused", "decomposed"])
def test_dropout_on_the_residual_branches_and_the_attention_probabilities(impl):
    """A residual branch's output dropout zeroes entries and scales the rest by 1/(1-p); the
    attention output also moves where nothing was zeroed, as its probabilities were dropped."""
    block = GPT(ModelConfig(**TINY, attn_impl=impl, dropout=0.2), seed=1).layers["0"]
    h = torch.randn(2, 16, 32)
    for branch, probs_dropped in ((block.mlp, False), (block.attn, True)):
        ref = branch.eval()(h) / 0.8
        out = branch.train()(h)
        kept = out != 0
        assert 0.6 < kept.float().mean() < 0.95
        assert torch.allclose(out[kept], ref[kept], rtol=1e-5, atol=1e-6) != probs_dropped


# --- precision.fp32_ops ---------------------------------------------------------------------------

WATCHED = {"aten::native_layer_norm": "layer_norm", "aten::rsqrt": "rms_norm", "aten::_softmax": "softmax"}


class _Dtypes(TorchDispatchMode):
    """The dtype each watched aten op computes in (below autocast)."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = WATCHED.get(func._schema.name)
        if op is not None:
            self.seen.setdefault(op, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compute", ["bf16", "fp16"])
@pytest.mark.parametrize("op", FP32_OPS)
def test_each_fp32_op_runs_in_fp32_only_when_listed(op, compute):
    norm = "rmsnorm" if op == "rms_norm" else "layernorm"
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[compute]
    for listed, want in ((True, torch.float32), (False, low)):
        model = GPT(ModelConfig(**TINY, norm=norm, attn_impl="decomposed"))
        others = [o for o in FP32_OPS if o != op]
        apply_op_policy(model, PrecisionConfig(compute_dtype=compute, fp32_ops=others + [op] if listed else others))
        rec = _Dtypes()
        with torch.autocast("cpu", dtype=low), rec:
            model(torch.randint(0, 64, (2, 8)))
        assert rec.seen[op] == {want}, (listed, rec.seen)
        for other in set(rec.seen) - {op}:
            assert rec.seen[other] == {torch.float32}


@pytest.mark.parametrize("op", FP32_OPS)
def test_the_trainer_follows_fp32_ops(compose_cfg, op):
    """Through the config and the trainer: one bf16 step with ``op`` listed, one without. (Its
    effect on the loss can be nil: CPU 16-bit softmax kernels accumulate in fp32 internally.)"""
    common = [
        "precision=bf16",
        "model.attn_impl=decomposed",
        "trainer.steps=1",
        *(["model.norm=rmsnorm"] if op == "rms_norm" else []),
    ]
    for listed, want in ((True, torch.float32), (False, torch.bfloat16)):
        ops = [o for o in FP32_OPS if o != op or listed]
        rec = _Dtypes()
        with rec:
            _train(compose_cfg, [*common, f"precision.fp32_ops=[{','.join(ops)}]"])
        assert rec.seen[op] == {want}, (listed, rec.seen)


# --- trainer.fault.straggle_s ---------------------------------------------------------------------


def test_a_straggler_is_late_to_every_step_and_changes_no_number(compose_cfg):
    """Rank 0 sleeps straggle_s inside each timed step: every step time is at least that (a
    bound, not a race: a step cannot take less than its sleep), and the losses are those of the
    run without it. Ignored, the step times of gpt_tiny on this machine are far below 1 s."""
    _, plain_rows = _train(compose_cfg, ["trainer.steps=2", "trainer.warmup_steps=0"])
    _, late_rows = _train(compose_cfg, ["trainer.steps=2", "trainer.warmup_steps=0", "trainer.fault.straggle_s=1.0"])
    assert all(r["step_time_s"] >= 1.0 for r in late_rows), [r["step_time_s"] for r in late_rows]
    assert [r["loss"] for r in late_rows] == [r["loss"] for r in plain_rows]
    # its runs carry the drill as the `fault` tag, as the other drills' do; a plain run none
    tags = trial.trial_tags(trial.prepare(compose_cfg([*ONE, "trainer.fault.straggle_s=1.0"])))
    assert "straggle_s: 1.0" in tags["fault"]
    assert "fault" not in trial.trial_tags(trial.prepare(compose_cfg(ONE)))


# --- the validator ---------------------------------------------------------------------------------

REFUSED = [
    (["precision.param_dtype=bf16"], "precision.param_dtype=bf16 needs precision.compute_dtype=bf16"),
    (["precision=fp16", "precision.param_dtype=bf16"], "precision.param_dtype=bf16 needs precision.compute_dtype=bf16"),
    (["precision.fp32_ops=[softmax,gelu]"], "precision.fp32_ops: unknown gelu"),
    (["precision=bf16", "precision.fp32_ops=[layer_norm]"], "precision.fp32_ops=['layer_norm'] leaves out softmax"),
    (["parallel=dp2", "comm.overlap=false", "comm.compression=fp16"], "comm.overlap=false with comm.compression=fp16"),
    (["trainer.eval_every=5", "data.val_fraction=0"], "trainer.eval_every=5 needs a held-out split"),
    (["trainer.eval_every=5", "trainer.eval_batches=0"], "trainer.eval_batches=0"),
    (["trainer.fault.straggle_s=-1"], "trainer.fault.straggle_s=-1"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_what_cannot_be_honoured_is_refused(compose_cfg, overrides, message):
    with pytest.raises(ConfigError) as info:
        trial.prepare(compose_cfg([*ONE, *overrides]))
    assert any(line.startswith(message) for line in info.value.errors), info.value.errors


def test_what_can_be_honoured_passes(compose_cfg):
    for overrides in (
        ["precision=bf16", "precision.param_dtype=bf16", "precision.fp32_ops=[softmax]"],
        ["precision=bf16", "model.attn_impl=decomposed", "precision.fp32_ops=[]"],
        ["parallel=dp2", "comm.overlap=false"],
        ["trainer.eval_every=5", "data=synthetic", "data.val_fraction=0"],
    ):
        trial.prepare(compose_cfg([*ONE, *overrides]))


def test_the_cli_exits_2_naming_fp32_ops(tmp_path, monkeypatch, capfd):
    args = ["+chip=cpu", "trainer=smoke", "precision=bf16", "precision.fp32_ops=[rms_norm]"]
    code, _, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 2 and "precision.fp32_ops" in err, err


# --- the tuner's quality gate ----------------------------------------------------------------------


def _point(final, val=None):
    p = Point("h", status="finished")
    p.values, p.final_losses, p.val_losses = [1.0], [final], [] if val is None else [val]
    return p


def test_the_quality_gate_compares_val_loss_when_both_have_it():
    base = _point(3.0, val=3.2)
    assert quality_gate(_point(3.0, val=4.0), base, 0.05).startswith("rejected by the quality gate: val loss")
    assert quality_gate(_point(4.0, val=3.25), base, 0.05) is None  # training loss off, held-out loss in band
    assert "final loss" in quality_gate(_point(4.0), base, 0.05)  # the point never evaluated
    assert quality_gate(_point(3.05, val=9.0), _point(3.0), 0.05) is None
