"""fp16 loss scaling on an NPU that saturates (the 910A, or ``INF_NAN_MODE_FORCE_DISABLE=1``):
an overflow shows in the device's float status, not as inf, and the step must still be skipped
and the scale backed off (``trainers/overflow.py``). torch_npu cannot import here: a fake module
stands in, with torch_npu's calls as ``torch_npu/npu/utils.py`` makes them
(``npu_clear_float_status`` and ``npu_get_float_status`` of an 8-float buffer, word 0 non-zero on
overflow, ``npu.utils.is_support_inf_nan``), and the training loop runs on the CPU with that flag.

Seen failing before the flag was read: the run below skipped no step and kept its scale."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import single_process
from trainers import overflow
from trainers.overflow import SaturationFlag
from trainers.reporter import NullReporter


class FakeNPU:
    """torch_npu's float-status calls: ``overflow_at`` the steps (counted by clears) whose
    status shows an overflow."""

    def __init__(self, overflow_at=(), inf_nan=False):
        self.overflow_at, self.inf_nan = set(overflow_at), inf_nan
        self.clears, self.reads = 0, 0
        self.npu = types.SimpleNamespace(utils=types.SimpleNamespace(is_support_inf_nan=lambda: self.inf_nan))

    def npu_clear_float_status(self, status):
        assert status.shape == (8,) and status.dtype == torch.float32
        self.clears += 1
        return status

    def npu_get_float_status(self, status):
        assert status.shape == (8,)
        self.reads += 1
        out = torch.zeros_like(status)
        out[0] = 1.0 if self.clears - 1 in self.overflow_at else 0.0
        return out


def test_the_flag_is_read_only_where_the_npu_saturates(monkeypatch):
    cpu, npu = torch.device("cpu"), types.SimpleNamespace(type="npu")  # no NPU device type without torch_npu
    assert not SaturationFlag.of(cpu, loss_scaling=True).active
    fake = FakeNPU(inf_nan=True)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert not SaturationFlag.of(npu, loss_scaling=True).active  # a 910B in inf/nan mode: the norm says it
    fake.inf_nan = False
    assert SaturationFlag.of(npu, loss_scaling=True).npu is fake
    assert not SaturationFlag.of(npu, loss_scaling=False).active  # no scaler, no skipping
    flag = SaturationFlag(cpu, FakeNPU(overflow_at={0}))
    flag.clear()
    assert float(flag.local_inf()) == float("inf")
    flag.clear()
    assert float(flag.local_inf()) == 0.0


def test_a_saturated_overflow_skips_the_step_and_backs_the_scale_off(monkeypatch):
    """fp16 with dynamic scaling, hysteresis 1: the float status shows an overflow at step 2 while
    every gradient is finite (as saturation leaves them). Step 2 is skipped and the scale halves."""
    fake = FakeNPU(overflow_at={2})

    def of(device, loss_scaling):
        return SaturationFlag(device, fake if loss_scaling else None)

    monkeypatch.setattr(overflow.SaturationFlag, "of", staticmethod(of))
    over = ["+chip=cpu", "model=gpt_tiny", "trainer=smoke", "trainer.steps=5", "precision=fp16"]
    over += ["precision.hysteresis=1", "precision.init_scale=1024", "trainer.log_every=1"]
    rows = []

    class Rows(NullReporter):
        def log_steps(self, batch):
            rows.extend(batch)

    summary = single_process(over, Rows())
    assert fake.clears == 5 and fake.reads == 5  # cleared before each step's forward, read after
    assert summary["skipped_steps_total"] == 1
    norms = summary["grad_norms"]
    assert [n != n for n in norms] == [False, False, True, False, False]  # step 2's norm: nan, skipped
    assert [r["loss_scale"] for r in rows][:3] == [1024.0, 1024.0, 512.0]
    assert all(torch.isfinite(torch.tensor(summary["losses"])))


@pytest.mark.parametrize("flagged", [False, True])
def test_the_flag_makes_the_global_norm_inf(flagged):
    from trainers.parallel import global_grad_norm

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    extra = torch.tensor(float("inf") if flagged else 0.0)
    norm = global_grad_norm([p], None, extra)
    assert (not torch.isfinite(norm)) == flagged and (flagged or float(norm) == 6.0)
