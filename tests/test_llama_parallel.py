"""The Llama-shaped model (``model=llama_tiny``: RMSNorm, SwiGLU, RoPE, grouped key/value heads)
under parallelism, against the single-process reference on gloo.

Every layout trains the same model from the same seed on the same global batches for 4 steps;
its per-step losses and global gradient norms must match the single-process run of the same
precision (as in ``tests/test_parallel.py``).

Tolerances, relative, per step:
- fp32: 1e-5 (measured: <= 1.2e-7 in loss, <= 3e-7 in grad norm; TP splits the matmul
  reductions and DP/FSDP sum the gradient halves in another order, so bit-equality is not expected).
- bf16 compute (autocast, fp32 parameters), against the bf16 single-process run: loss 5e-4, grad
  norm 1e-2 (measured on tp2pp2, and on dp2tp2 before it was dropped to save suite time:
  <= 5.3e-5 in loss, <= 2.3e-3 in grad norm, the largest at step 2). TP splits the matmuls'
  reductions over the hidden size, DP the weight gradients' reductions over the tokens; under
  autocast each partial result is rounded to bf16 before the all-reduce adds them, where the
  single process rounds once: values differ by about bf16's unit roundoff (2^-9 = 2e-3). The
  loss averages many such errors (~40x below it); the grad norm shows them about whole. The
  bounds are 4-10x the measured figures, and each layout is also held to 1e-5 in fp32 above,
  where a real bug shows (a broken embedding tie: about 7e-2 in loss).
- fp16 compute with dynamic loss scaling, against the fp16 single-process run: loss 1e-4, grad
  norm 1e-3 (measured on tp2pp2 and dp2pp2: <= 1.3e-5 in loss, <= 1.3e-4 in grad norm; fp16's
  unit roundoff is 2^-11). Both also skip the same steps: before the pipeline divided each
  microbatch's loss by their number ahead of the loss scale (torch's ``scale_grads`` divides the
  gradients after the backward), its fp16 backward ran 4x larger and overflowed a step the single
  process did not, 0.12 off in loss.

Tied embeddings (``model.tie_embeddings=true``, the llama_tiny shape otherwise): the vocab-parallel
embedding and the vocab-sharded head are both Shard(0) over the tp mesh, so they stay one parameter
under TP and under FSDP over the TP shards (one initial value, one gradient, counted once by
``count_params``, the grad norm and the checkpoint). Before ``GPT.tie_weights`` was called again
after ``parallelize_module`` and after ``to_empty`` (each gives every module its own new parameter),
every multi-process tied run trained an untied model: about 7e-2 off the reference in the first loss.
FSDP without TP is covered by the one-rank test below (the tie after ``to_empty``).
"""

from __future__ import annotations

import shutil

import pytest

from orchestrator import trial
from tests.conftest import assert_planned_state_bytes, single_process

pytestmark = pytest.mark.distributed

STEPS = 4
BASE = [
    "+chip=cpu",
    "model=llama_tiny",
    "trainer=smoke",
    f"trainer.steps={STEPS}",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "data.num_workers=0",
]
FP32 = {"rel_loss": 1e-5, "rel_grad_norm": 1e-5}
BF16 = {"rel_loss": 5e-4, "rel_grad_norm": 1e-2}
FP16 = {"rel_loss": 1e-4, "rel_grad_norm": 1e-3}
TIED = "model.tie_embeddings=true"

LAYOUTS = {
    "tp2": ["parallel=tp2"],
    "tp2-sequence-parallel": ["parallel=tp2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel=pp2"],
    "tp2pp2": ["parallel=tp2pp2"],
    "dp2tp2-fsdp": ["parallel=dp2tp2"],  # tp > 1: data parallelism is FSDP over the TP shards
    "dp2pp2-ddp": ["parallel=dp2pp2"],
    "tp2pp2-sequence-parallel-activation-checkpointing": [
        "parallel=tp2pp2",
        "parallel.sequence_parallel=true",
        "model.activation_checkpointing=true",
    ],
    "tp2pp2-bf16": ["parallel=tp2pp2", "precision=bf16"],
    # fp16 with dynamic loss scaling against the fp16 single process: the same scale, the same skips
    "tp2pp2-fp16": ["parallel=tp2pp2", "precision=fp16"],
    "dp2pp2-fp16": ["parallel=dp2pp2", "precision=fp16"],
    # Qwen3's per-head q and k norms: one weight over heads split across the TP ranks, whose
    # gradient each rank holds a part of (summed by DTensor), under FSDP over the TP shards too
    "tp2-sequence-parallel-qwen3": ["parallel=tp2", "parallel.sequence_parallel=true", "model.family=qwen3"],
    "dp2tp2-fsdp-qwen3": ["parallel=dp2tp2", "model.family=qwen3"],
}


def _single(extra):
    """This process, no process group: the reference."""
    return single_process([*BASE, "parallel=single", *extra])


@pytest.fixture(scope="module")
def reference():
    """reference(extra) -> the single-process summary with the same model and precision overrides."""
    cache = {}

    def get(extra):
        key = tuple(extra)
        if key not in cache:
            cache[key] = _single(key)
        return cache[key]

    return get


def _non_layout(overrides):
    """The overrides that change the model or the numerics, not the layout: the reference's."""
    return [
        o
        for o in overrides
        if o.startswith(("precision=", "model.")) and not o.startswith("model.activation_checkpointing")
    ]


def _assert_matches(s, ref, tol):
    assert s["losses"] == pytest.approx(ref["losses"], rel=tol["rel_loss"])
    # the clipping norm is the whole model's, across shards, stages and replicas
    assert s["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol["rel_grad_norm"])
    assert s["param_sum_initial"] == pytest.approx(ref["param_sum_initial"], rel=1e-9)  # same init, each value once


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_matches_the_single_process_reference(compose_cfg, reference, name):
    overrides = LAYOUTS[name]
    cfg = compose_cfg([*BASE, *overrides, "tracking.enabled=false"])
    result = trial.run(cfg, overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    assert_planned_state_bytes(cfg, result["summary"])
    tol = BF16 if "precision=bf16" in overrides else FP16 if "precision=fp16" in overrides else FP32
    _assert_matches(result["summary"], reference(_non_layout(overrides)), tol)


TIED_LAYOUTS = {
    "tp2": ["parallel=tp2"],
    "dp2tp2-fsdp": ["parallel=dp2tp2"],  # FSDP over the TP shards
}


@pytest.mark.parametrize("layout", list(TIED_LAYOUTS))
def test_tied_embeddings_stay_tied(compose_cfg, reference, tmp_path, layout):
    """Tied head and embedding under TP, FSDP over the TP shards, and FSDP alone: the same losses
    and grad norms as the tied single-process model, and a checkpoint the single process resumes."""
    root = tmp_path / "ck"
    overrides = [*TIED_LAYOUTS[layout], TIED]
    cfg = compose_cfg(
        [*BASE, *overrides, "tracking.enabled=false", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={root}"]
    )
    result = trial.run(cfg, overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    assert_planned_state_bytes(cfg, result["summary"])  # the tied weight held (and planned) once
    ref = reference([TIED])
    _assert_matches(result["summary"], ref, FP32)
    # the state dict holds the whole model's names (both of the tied weight's): the single process
    # picks up the TP/FSDP checkpoint taken after step 2 and goes on as the reference did
    shutil.rmtree(root / f"step_{STEPS:08d}")
    resumed = _single([TIED, "trainer.checkpoint_every=0", f"trainer.checkpoint_dir={root}"])
    assert resumed["resumed_from_step"] == 2
    assert resumed["losses"] == pytest.approx(ref["losses"][2:], rel=FP32["rel_loss"])


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_tied_parameter_through_materialisation_tp_and_fsdp(one_rank_group):
    """The structure behind the tied runs above, on a one-rank (dp, pp, tp) mesh: a stage built
    on meta and materialised (``to_empty`` unties), made tensor-parallel (``parallelize_module``
    unties) or wrapped by FSDP keeps one parameter for the head and the embedding, with the whole
    model's initial values, parameter count and state-dict names."""
    import torch
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from orchestrator import conf_dir
    from trainers.config import ModelConfig, ParallelConfig
    from trainers.model import GPT, count_params
    from trainers.parallel import apply_fsdp, apply_tp, build_mesh, build_stages, make_stage

    preset = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "llama_tiny.yaml"))
    margs = ModelConfig(**{**preset, "tie_embeddings": True})
    whole = GPT(margs, seed=7)
    p = ParallelConfig(dp=1, tp=1, pp=1)
    mesh = build_mesh("cpu", p)
    ((_, stage),) = build_stages(margs, p, mesh, torch.device("cpu"), seed=7)
    assert stage.head.weight is stage.tok_emb.weight
    assert torch.equal(stage.head.weight, whole.head.weight)
    assert count_params(stage) == count_params(whole)
    apply_fsdp(stage, mesh.sub("dp"))
    assert stage.head.weight is stage.tok_emb.weight
    assert count_params(stage) == count_params(whole)
    assert set(get_model_state_dict(stage)) == set(get_model_state_dict(whole))
    tp = make_stage(margs, 0, 1)
    apply_tp(tp, mesh.sub("tp"), sequence_parallel=False)
    assert tp.head.weight is tp.tok_emb.weight
    assert count_params(tp) == count_params(whole)


CHUNKED = {
    # sequence-parallel head input sliced per rank, the vocab-parallel loss, a pipeline's last stage;
    # with ZB-V's split backward and the attention core recomputed inside sub-layers that keep
    # their input's shard (trainers/sp_regather.py)
    "tp2pp2-zbv-sequence-parallel-selective": [
        "parallel=tp2pp2",
        "parallel.schedule=zbv",
        "parallel.sequence_parallel=true",
        "model.activation_checkpointing=true",
        "model.recompute_granularity=selective",
    ],
    # the FSDP root's head applied by the loss, outside the module's forward
    "dp2tp2-fsdp": ["parallel=dp2tp2"],
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_loss_matches_the_whole_loss_reference(compose_cfg, reference, name):
    """``model.loss_chunks``: the head and the loss over sequence chunks, each recomputed in the
    backward, give the losses and gradients of the single process's head and loss at once."""
    overrides = [*CHUNKED[name], "model.loss_chunks=3"]
    cfg = compose_cfg([*BASE, *overrides, "tracking.enabled=false"])
    result = trial.run(cfg, overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    _assert_matches(result["summary"], reference(()), FP32)
