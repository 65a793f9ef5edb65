"""The step loop reads nothing back to the host per step: its device values (loss, grad norm,
loss scale, the overflow verdict and counters, the first non-finite block) come back in one copy
every ``trainer.log_every`` steps, and a run of twice the steps with the same number of read-backs
makes the same number of host reads. Every value a row records is still there, per step, equal
to what the read-back of that step alone would have given."""

from __future__ import annotations

import math
import traceback

import pytest
import torch

from orchestrator import trial
from tests.conftest import Rows
from trainers.loop import train

ONE = ["+chip=cpu", "trainer=smoke", "data.num_workers=0", "tracking.enabled=false", "trainer.warmup_steps=1"]
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


def _host_reads(compose_cfg, monkeypatch, overrides):
    """(host reads of tensor values made in train(), rows, summary)."""
    spec = trial.build_spec(trial.prepare(compose_cfg([*ONE, *overrides])))
    count = [0]
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            # the loader's sampler indexes a host permutation (trainers/data.py): a CPU tensor on
            # any device, no device wait; every other read of a tensor value counts
            if not any("torch/utils/data/" in f.filename for f in traceback.extract_stack(limit=12)):
                count[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    rows = Rows()
    try:
        summary = train(spec, rows)
    finally:
        monkeypatch.undo()
    return count[0], rows.rows, summary


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_twice_the_steps_with_one_read_back_each_make_the_same_host_reads(compose_cfg, monkeypatch, precision):
    extra = [f"precision={precision}"]
    short, rows_short, _ = _host_reads(compose_cfg, monkeypatch, [*extra, "trainer.steps=4", "trainer.log_every=4"])
    long, rows_long, _ = _host_reads(compose_cfg, monkeypatch, [*extra, "trainer.steps=8", "trainer.log_every=8"])
    assert len(rows_short) == 4 and len(rows_long) == 8
    assert long == short, f"{long - short} host reads for 4 more steps"
    # and each read-back costs a fixed number of reads, whatever its number of steps
    four, rows_four, _ = _host_reads(compose_cfg, monkeypatch, [*extra, "trainer.steps=8", "trainer.log_every=4"])
    assert four > long and rows_four == rows_four  # one more read-back makes more reads
    keys = ("loss", "grad_norm", "loss_scale", "skipped_steps", "step_time_s", "tokens_per_s")
    for row in rows_long:
        assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in keys), row


def test_the_rows_read_back_in_batches_equal_those_read_back_every_step(compose_cfg):
    def run(log_every):
        rows = Rows()
        spec = trial.build_spec(trial.prepare(compose_cfg([*ONE, "trainer.steps=6", f"trainer.log_every={log_every}"])))
        train(spec, rows)
        return rows.rows

    keys = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps", "lr")
    one, six = run(1), run(6)
    assert [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in six]
