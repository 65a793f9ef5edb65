"""Loss scaling: overflow skips the step and (dynamic) backs off, clean steps grow the scale, a
static scale never moves; the optimizer gets 1/scale times the clipping coefficient."""

from __future__ import annotations

import pytest
import torch

from trainers.precision import LossScaler, PrecisionConfig, grad_multiplier

CPU = torch.device("cpu")
YES, NO = torch.tensor(1.0), torch.tensor(0.0)  # found_inf: the step overflowed, or not


def test_overflow_skips_and_backs_off():
    s = LossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=1024.0, growth_interval=2), CPU)
    s.update(YES)
    assert float(s.scale) == 512.0 and int(s.skipped_steps) == 1 and int(s.skipped_in_row) == 1


def test_growth_and_the_multiplier():
    s = LossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=8.0, growth_interval=2), CPU)
    assert float(grad_multiplier(s, torch.tensor(0.5), max_norm=1.0)) == 1 / 8
    assert float(grad_multiplier(s, torch.tensor(4.0), max_norm=1.0)) == pytest.approx(1 / 4 / 8)
    assert float(grad_multiplier(s, torch.tensor(4.0), max_norm=0.0)) == 1 / 8  # no clipping
    s.update(NO)
    assert float(s.scale) == 8.0
    s.update(NO)
    assert float(s.scale) == 16.0
    s.update(YES)  # an overflow resets the clean count: two more clean steps before the next growth
    s.update(NO)
    assert float(s.scale) == 8.0
    s.update(NO)
    assert float(s.scale) == 16.0


def test_static_scale_skips_but_never_moves():
    s = LossScaler(PrecisionConfig(loss_scale="static", init_scale=1024.0, growth_interval=1), CPU)
    assert s.scale_loss(torch.tensor(1.0)) == 1024.0
    s.update(YES)
    s.update(YES)
    assert float(s.scale) == 1024.0 and int(s.skipped_steps) == 2 and int(s.skipped_in_row) == 2
    s.update(NO)
    assert float(s.scale) == 1024.0 and int(s.skipped_in_row) == 0 and int(s.skipped_steps) == 2


def test_hysteresis_delays_the_backoff():
    s = LossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=64.0, hysteresis=2), CPU)
    s.update(YES)
    assert float(s.scale) == 64.0 and int(s.skipped_steps) == 1
    s.update(YES)
    assert float(s.scale) == 32.0 and int(s.skipped_steps) == 2
    s.update(YES)  # the budget was refilled by the backoff: one more overflow does not back off
    assert float(s.scale) == 32.0
    state = s.state_dict()
    t = LossScaler(PrecisionConfig(loss_scale="dynamic"), CPU)
    t.load_state_dict(state)
    assert t.state_dict() == state
    t.update(YES)  # the restored budget is the saved one: this overflow backs off
    assert float(t.scale) == 16.0


def test_the_scaler_state_stays_on_its_device_and_updates_without_a_host_read(monkeypatch):
    """update() is tensor ops only: a host read (Tensor.item / __float__ / __bool__) fails here."""
    s = LossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=8.0, growth_interval=1, hysteresis=1), CPU)

    def refuse(*args, **kwargs):
        raise AssertionError("host read")

    for name in ("item", "__float__", "__bool__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    s.update(NO)
    s.update(YES)
    grad_multiplier(s, torch.tensor(3.0), max_norm=1.0)
    monkeypatch.undo()
    assert float(s.scale) == 8.0  # grew to 16, backed off to 8


def test_disabled_scaler_is_identity():
    s = LossScaler(PrecisionConfig(), CPU)
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss
    assert float(grad_multiplier(s, torch.tensor(0.5), max_norm=1.0)) == 1.0
    s.update(YES)
    assert int(s.skipped_steps) == 0  # nothing is counted: the loop ends such a trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_finite_probe_sees_any_non_finite_value(dtype, bad):
    from trainers.monitor import finite_probe

    x = torch.randn(4, 8, 16).to(dtype)
    assert torch.isfinite(finite_probe(x))
    x[2, 3, 5] = bad
    assert not torch.isfinite(finite_probe(x))
    # fp16 values whose sum is far past fp16's range are still finite: the probe sums in fp32
    assert torch.isfinite(finite_probe(torch.full((4096,), 60000.0, dtype=torch.float16)))


class _Poison(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return x * float("nan") if self.armed else x + 1


def test_the_tracker_names_the_first_non_finite_block_of_any_micro_batch():
    from trainers.monitor import FiniteTracker

    part = torch.nn.Module()
    part.layers = torch.nn.ModuleDict({"2": _Poison(), "5": _Poison(), "7": _Poison()})  # a pipeline stage's blocks
    tracker = FiniteTracker([part], torch.device("cpu"))

    def micro_batch():
        x = torch.ones(3)
        for name in ("2", "5", "7"):
            x = part.layers[name](x)

    micro_batch()
    assert tracker.first_layer() is None
    part.layers["5"].armed = True  # the second micro-batch goes bad at block 5 (and so after it)
    micro_batch()
    part.layers["5"].armed = False
    micro_batch()  # a clean micro-batch later in the step does not hide it
    assert tracker.first_layer() == 5
    tracker.reset()
    micro_batch()
    assert tracker.first_layer() is None


def test_growth_factor_and_backoff_factor_set_how_far_the_scale_moves():
    """``precision.growth_factor`` and ``backoff_factor`` as a config gives them: x3 after each clean
    interval, x0.25 on an overflow (the defaults, 2 and 0.5, would give 16 and 4)."""
    args = PrecisionConfig(
        loss_scale="dynamic", init_scale=8.0, growth_interval=1, growth_factor=3.0, backoff_factor=0.25
    )
    s = LossScaler(args, CPU)
    s.update(NO)
    assert float(s.scale) == 24.0
    s.update(YES)
    assert float(s.scale) == 6.0
