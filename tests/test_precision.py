"""Dynamic loss scaling: overflow skips the step and backs off, clean steps grow the scale."""
from __future__ import annotations

import torch

from trainers.precision import DynamicLossScaler, PrecisionConfig


def _param(value):
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), value)
    return p


def test_overflow_skips_and_backs_off():
    s = DynamicLossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=1024.0, growth_interval=2), torch.device("cpu"))
    p = _param(float("inf"))
    finite = s.unscale_and_check([p])
    s.update(finite)
    assert not finite and s.scale == 512.0 and s.skipped_steps == 1


def test_unscale_and_growth():
    s = DynamicLossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=8.0, growth_interval=2), torch.device("cpu"))
    p = _param(16.0)
    assert s.unscale_and_check([p]) and p.grad.tolist() == [2.0, 2.0, 2.0]
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 16.0


def test_hysteresis_delays_the_backoff():
    s = DynamicLossScaler(PrecisionConfig(loss_scale="dynamic", init_scale=64.0, hysteresis=2), torch.device("cpu"))
    s.update(False)
    assert s.scale == 64.0 and s.skipped_steps == 1
    s.update(False)
    assert s.scale == 32.0 and s.skipped_steps == 2
    state = s.state_dict()
    t = DynamicLossScaler(PrecisionConfig(loss_scale="dynamic"), torch.device("cpu"))
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_disabled_scaler_is_identity():
    s = DynamicLossScaler(PrecisionConfig(), torch.device("cpu"))
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss and s.unscale_and_check([_param(float("nan"))])
