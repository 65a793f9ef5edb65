"""A trial that resumes from a checkpoint continues as the uninterrupted one, for what carries
state from step to step beyond the model and the optimizer: gradient compression (top-k's
error-feedback residuals; PowerSGD's error feedback, warm-start factors and iteration count, in
each rank's checkpoint by ``trainers.comm.saved`` / ``restore``), the fp16 loss scaler caught
between a backoff and its next growth, the fp32 master weights of bf16 parameters under FSDP, and
the pipeline schedules whose ranks hold more than one stage (interleaved 1F1B, ZB-V), and each
data-parallel mode beside TP or a pipeline. Without the
state, the resumed run leaves the uninterrupted one at the first resumed step (a fresh scaler
overflows again and skips it)."""

from __future__ import annotations

import shutil

import pytest

from orchestrator import trial
from tests.test_parallel import BASE

CASES = {
    "topk": ["parallel=dp2", "comm.compression=topk", "comm.topk_ratio=0.05"],
    "powersgd": ["parallel=dp2", "comm.compression=powersgd", "comm.powersgd_rank=1"],
    # 1e8 overflows fp16 twice (backed off x 0.01 each time) and then fits; at the checkpoint of
    # step 4 the scale is 1e4 with two of its three overflow-free steps counted towards a growth
    "fp16-mid-backoff": [
        "parallel=dp2",
        "precision=fp16",
        "precision.init_scale=1e8",
        "precision.backoff_factor=0.01",
        "precision.growth_interval=3",
    ],
    # FSDP2 shards of bf16 parameters with their fp32 masters sharded alike: DCP keeps the masters
    "bf16-masters-fsdp": ["parallel=dp2", "parallel.dp_shard=fsdp", "precision=bf16", "precision.param_dtype=bf16"],
    "interleaved_1f1b": ["parallel=pp2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    # each data-parallel mode beside TP or a pipeline: whole TP replicas (their own bucketed
    # all-reduce), zero1's sharded fp32 masters beside TP, ZeRO-3's per-micro-batch reduction
    # under a pipeline
    "dp2tp2-ddp": ["parallel=dp2tp2"],
    "dp2tp2-zero1-bf16-masters": [
        "parallel=dp2tp2",
        "parallel.dp_shard=zero1",
        "precision=bf16",
        "precision.param_dtype=bf16",
    ],
    "dp2pp2-fsdp": ["parallel=dp2pp2", "parallel.dp_shard=fsdp", "parallel.microbatches=2"],
    "zbv": ["parallel=pp2", "parallel.schedule=zbv"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_trial_is_the_uninterrupted_one(compose_cfg, tmp_path, case):
    overrides = [
        *BASE,
        *CASES[case],
        "trainer.steps=8",
        "trainer.checkpoint_every=4",
        f"trainer.checkpoint_dir={tmp_path}",
        "tracking.enabled=false",
    ]
    first = trial.run(compose_cfg(overrides), [], progress=False)
    assert first["status"] == "finished", first.get("reason")
    losses = first["summary"]["losses"]
    shutil.rmtree(tmp_path / "step_00000008")
    again = trial.run(compose_cfg(overrides), [], progress=False)
    assert again["status"] == "finished", again.get("reason")
    assert again["summary"]["resumed_from_step"] == 4
    assert again["summary"]["losses"] == pytest.approx(losses[4:], rel=1e-6, abs=1e-6)
    if case == "bf16-masters-fsdp":  # fp32 masters and Adam's two moments, 12 B a parameter, on half each
        s = first["summary"]
        assert [held["optimizer"] for held in s["model_state_bytes"]] == [6 * s["n_params"]] * 2
    if case == "fp16-mid-backoff":  # two overflows before the checkpoint (counted in it), none after
        assert first["summary"]["skipped_steps_total"] == 2 == again["summary"]["skipped_steps_total"]
