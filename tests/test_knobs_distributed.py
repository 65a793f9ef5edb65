"""Knobs across processes, each against a single-process reference: comm.overlap (the reduction
changes, the losses do not), evaluation in every layout, dropout under TP, 16-bit parameters with
fp32 master weights (their exact resume under FSDP: tests/test_resume.py).
"""

from __future__ import annotations

import pytest
import torch

from orchestrator import trial
from tests.conftest import Rows, assert_planned_state_bytes, metric_history, single_process
from trainers import comm
from trainers.config import ModelConfig
from trainers.model import GPT

STEPS = 4
BASE = [
    "+chip=cpu",
    "trainer=smoke",
    f"trainer.steps={STEPS}",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "data.num_workers=0",
    "trainer.eval_every=2",
]


@pytest.fixture(scope="module")
def reference():
    rows = Rows()
    summary = single_process([*BASE, "parallel=single", "tracking.enabled=false"], rows)
    summary["val_losses"] = [r["val_loss"] for r in rows.rows if "val_loss" in r]
    return summary


def _buckets(bucket_mb: float) -> int:
    with torch.device("meta"):
        model = GPT(ModelConfig(name="gpt_tiny", tie_embeddings=False))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    return len(comm.buckets(model.parameters(), bucket_mb))


OVERLAP = {  # layout -> (gradient collectives in backward, after backward, FSDP units), rank 0, whole run
    "ddp": (["parallel=dp2"], (STEPS, 0, 0)),
    "ddp-after-backward": (["parallel=dp2", "comm.overlap=false"], (0, STEPS * _buckets(25.0), 0)),
    "ddp-after-backward-small-buckets": (
        ["parallel=dp2", "comm.overlap=false", "comm.bucket_mb=0.05"],
        (0, STEPS * _buckets(0.05), 0),
    ),
    "fsdp": (["parallel=dp2", "parallel.dp_shard=fsdp"], (0, 0, 4 + 1)),  # a unit per block + the root
    "fsdp-one-unit": (["parallel=dp2", "parallel.dp_shard=fsdp", "comm.overlap=false"], (0, 0, 1)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(OVERLAP))
def test_comm_overlap_changes_the_reduction_not_the_losses(compose_cfg, reference, name):
    overrides, expected = OVERLAP[name]
    assert _buckets(0.05) > _buckets(25.0) == 1
    cfg = compose_cfg([*BASE, *overrides, "tracking.enabled=false"])
    result = trial.run(cfg, overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    s = result["summary"]
    assert_planned_state_bytes(cfg, s)
    assert (s["grad_collectives_in_backward"], s["grad_collectives_after_backward"], s["fsdp_units"]) == expected
    assert s["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert s["val_loss"] == pytest.approx(reference["val_losses"][-1], rel=1e-5)


EVAL_LAYOUTS = {  # every layout of tests/test_parallel.py also checks val_loss; here one, through MLflow
    "tp2pp2-sequence-parallel": ["parallel=tp2pp2", "parallel.sequence_parallel=true"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(EVAL_LAYOUTS))
def test_val_loss_matches_the_reference_in_every_layout(compose_cfg, reference, mlflow_uri, name):
    overrides = EVAL_LAYOUTS[name]
    result = trial.run(compose_cfg([*BASE, *overrides, f"tracking.uri={mlflow_uri}"]), overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    # per-step rows at the evaluated steps; the summary's value lands at step 0, as final_loss does
    history = {m.step: m.value for m in metric_history(mlflow_uri, result["run_id"], "val_loss")}
    assert sorted(history) == [0, 1, 3]
    assert [history[1], history[3], history[0]] == pytest.approx(
        [*reference["val_losses"], reference["val_losses"][-1]], rel=1e-5
    )
    assert result["summary"]["val_loss"] == pytest.approx(reference["val_losses"][-1], rel=1e-5)


@pytest.mark.distributed
def test_dropout_masks_agree_across_tp_ranks(compose_cfg, reference):
    """Replicated activations get the same mask on both TP ranks, so the parameters TP
    replicates (the norms) stay equal; different masks would make them drift apart."""
    overrides = ["parallel=tp2", "model.dropout=0.1", "tracking.enabled=false"]
    result = trial.run(compose_cfg([*BASE, *overrides]), overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")
    assert result["summary"]["tp_replica_divergence"] == 0.0
    assert result["summary"]["losses"] != pytest.approx(reference["losses"], rel=1e-5)


BF16 = ["precision=bf16", "precision.param_dtype=bf16"]


@pytest.fixture(scope="module")
def bf16_reference():
    return single_process([*BASE, *BF16, "parallel=single", "tracking.enabled=false"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["parallel=dp2", "parallel=tp2", "parallel=pp2"])
def test_bf16_master_weights_in_each_layout(compose_cfg, bf16_reference, layout):
    """16-bit parameters with fp32 master copies in DDP, TP and PP: each rank holds 2 + 2 + 12
    bytes per local parameter; the losses follow the single-process bf16 run (bf16 rounding
    differs with the reduction order, hence the looser band)."""
    cfg = compose_cfg([*BASE, *BF16, layout, "tracking.enabled=false"])
    result = trial.run(cfg, [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    s = result["summary"]
    assert_planned_state_bytes(cfg, s)
    for held in s["model_state_bytes"]:
        assert held["grads"] == held["params"] and held["optimizer"] == 6 * held["params"]
    assert s["losses"] == pytest.approx(bf16_reference["losses"], rel=2e-3)
