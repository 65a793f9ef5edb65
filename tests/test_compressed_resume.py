"""A compressed trial that resumes from a checkpoint continues as the uninterrupted one: what the
compression carries from step to step (top-k's error-feedback residuals; PowerSGD's error
feedback, warm-start factors and iteration count) is in each rank's checkpoint
(``trainers.comm.saved`` / ``restore``). Without it, the resumed run restarts the error feedback
and its losses leave the uninterrupted run's at the first resumed step."""

from __future__ import annotations

import shutil

import pytest

from orchestrator import trial
from tests.test_parallel import BASE


@pytest.mark.distributed
@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_a_resumed_compressed_trial_is_the_uninterrupted_one(compose_cfg, tmp_path, compression):
    overrides = [
        *BASE,
        "parallel=dp2",
        "trainer.steps=8",
        "trainer.checkpoint_every=4",
        f"trainer.checkpoint_dir={tmp_path}",
        f"comm.compression={compression}",
        "comm.topk_ratio=0.05",
        "comm.powersgd_rank=1",
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
