"""bf16 and fp16 (with dynamic loss scaling) train gpt_tiny to within a band of fp32.

Band: the mean of the last 5 of 20 losses within 3% of fp32's (measured: about 1%)."""

from __future__ import annotations

import pytest

from orchestrator import trial
from trainers.loop import train

COMMON = [
    "+chip=cpu",
    "trainer.steps=20",
    "trainer.global_batch=8",
    "trainer.micro_batch=8",
    "trainer.seq_len=64",
    "data.num_workers=0",
]


def _tail(compose_cfg, precision):
    losses = train(trial.build_spec(trial.prepare(compose_cfg([*COMMON, f"precision={precision}"]))))["losses"]
    return sum(losses[-5:]) / 5, losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_trains_within_the_fp32_band(compose_cfg, precision):
    ref, ref_losses = _tail(compose_cfg, "fp32")
    low, losses = _tail(compose_cfg, precision)
    assert low == pytest.approx(ref, rel=0.03)
    assert losses != ref_losses  # the dtype really changed the arithmetic
    assert low < losses[0] - 1.0


def test_compile_runs_the_same_model(compose_cfg):
    """torch.compile per block (aot_eager here: graph capture without a C++ toolchain in the
    loop); the losses match eager within fp32 noise."""
    eager = train(trial.build_spec(trial.prepare(compose_cfg([*COMMON, "trainer.steps=3"]))))["losses"]
    compiled = train(
        trial.build_spec(
            trial.prepare(
                compose_cfg([*COMMON, "trainer.steps=3", "trainer.compile=true", "trainer.compile_backend=aot_eager"])
            )
        )
    )["losses"]
    assert compiled == pytest.approx(eager, rel=1e-4)
