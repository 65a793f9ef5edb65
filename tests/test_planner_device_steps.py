"""The planner's step time with its default assumptions (no fit) against the steps measured on one
NVIDIA H200 by ``bench/device_check.py`` (2026-12-04, two runs of the check;
docs/benchmarks.md#the-device-check). The device is not here, so the measurements are recorded
figures; a new device check prints the planned step beside each measured one.

What they hold the defaults to: gpt2_small's step is set by the host (its GPU busy 44-58% of the
step), so the per-layer dispatch cost (``planner.layer_host_us``) decides it; llama_1b's by the
device (98.6% busy), so the compute efficiency does."""

from __future__ import annotations

import pytest

from orchestrator import planner

# (model, the check's overrides, median step seconds in each run, compile off, bf16)
H200 = [
    ("gpt2_small", ["trainer.seq_len=1024", "trainer.global_batch=16", "trainer.micro_batch=8"], (0.0517, 0.0716)),
    ("llama_1b", ["trainer.seq_len=2048", "trainer.global_batch=16", "trainer.micro_batch=16"], (0.5307, 0.5354)),
]


@pytest.mark.parametrize("name,overrides,measured", H200, ids=[r[0] for r in H200])
def test_the_default_step_time_is_within_a_third_of_the_h200_s(compose_cfg, name, overrides, measured):
    cfg = compose_cfg(["+chip=h200", f"model={name}", "precision=bf16", *overrides])
    planned = planner.preflight(cfg)["step"]["step_time_s"]
    for step_s in measured:
        assert 2 / 3 < planned / step_s < 4 / 3, (name, planned, step_s)
