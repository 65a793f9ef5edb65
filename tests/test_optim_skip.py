"""The optimizer step takes its multiplier and its overflow verdict as device tensors: an overflowed
step changes nothing (parameters, moments, master copies, step counts), a clean one is AdamW on
the multiplied gradient, and neither reads a value back to the host (on the fused and master
paths; the foreach path reads the flag only when asked to, for a loss scaler on an NPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from trainers import optim as optim_mod
from trainers.config import PrecisionConfig, TrainerConfig
from trainers.optim import MasterAdamW

YES, NO = torch.tensor(1.0), torch.tensor(0.0)


def _params(dtype=torch.float32, n=3):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 5).to(dtype)) for _ in range(n)]


def _grads(params, poison=False):
    for i, p in enumerate(params):
        p.grad = torch.randn_like(p)
        if poison and i == 1:
            p.grad[0, 0] = float("inf")


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _no_host_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a host read in the optimizer step")

    for name in ("item", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("kind", ["fused", "master"])
def test_an_overflowed_step_changes_nothing_and_reads_nothing_back(kind, monkeypatch):
    dtype = torch.bfloat16 if kind == "master" else torch.float32
    params = _params(dtype)
    trainer = TrainerConfig(lr=1e-2, weight_decay=0.1)
    opt = optim_mod.build_optimizer(params, trainer, PrecisionConfig(master_weights_fp32=True))
    assert isinstance(opt, MasterAdamW) == (kind == "master") and bool(opt.defaults.get("fused")) == (kind == "fused")
    _grads(params)
    optim_mod.step(opt, torch.tensor(0.5), NO)  # one clean step first: the state exists
    before, state = _snapshot(params, opt)
    _grads(params, poison=True)
    _no_host_reads(monkeypatch)
    optim_mod.step(opt, torch.tensor(float("nan")), YES)
    monkeypatch.undo()
    after, state_after = _snapshot(params, opt)
    assert _same(before, after)
    for k, s in state.items():
        for name, v in s.items():
            assert torch.equal(v, state_after[k][name]), (k, name)
    _grads(params)
    optim_mod.step(opt, torch.tensor(0.5), NO)  # and the next clean step moves them
    assert not _same(before, [p.detach() for p in params])


@pytest.mark.parametrize("kind", ["fused", "master"])
def test_a_clean_step_is_adamw_on_the_multiplied_gradient(kind):
    """Against torch's own single-tensor AdamW stepping gradients multiplied beforehand."""
    params = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    trainer = TrainerConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95)
    if kind == "master":
        opt = MasterAdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = optim_mod.build_optimizer(params, trainer, PrecisionConfig())
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, foreach=False)
    if kind == "fused":
        # build_optimizer puts matrices in a weight-decay group: the reference does the same
        assert all(g["weight_decay"] == 0.1 for g in opt.param_groups)
    for mult in (0.25, 2.0, 0.125):
        torch.manual_seed(int(mult * 8))
        grads = [torch.randn_like(p) for p in params]
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g.clone(), g.clone() * mult
        optim_mod.step(opt, torch.tensor(mult), NO)
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_the_foreach_path_reads_the_flag_only_when_asked():
    params = _params()
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    _grads(params)
    optim_mod.step(opt, torch.tensor(1.0), NO, sync_skip=True)
    before, _ = _snapshot(params, opt)
    _grads(params, poison=True)
    optim_mod.step(opt, torch.tensor(1.0), YES, sync_skip=True)  # a loss scaler on an NPU: skipped
    assert _same(before, [p.detach() for p in params])
    optim_mod.step(opt, torch.tensor(1.0), YES, sync_skip=False)  # no scaler: the trial ends anyway
    assert not torch.isfinite(params[1]).all()


def test_fused_runs_where_the_kernel_is_and_foreach_elsewhere():
    """Not on the NPU: op-plugin's ``_fused_adamw_`` ignores ``grad_scale`` and ``found_inf``
    (``FusedAdamWKernelNpuOpApi.cpp``), so a loss-scaled step would apply the scaled gradient and an
    overflowed one would not be skipped; the foreach path above does both itself."""
    assert optim_mod.fused_on("cpu") and optim_mod.fused_on("cuda") and not optim_mod.fused_on("npu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_global_norm_of_16_bit_gradients_does_not_overflow_in_their_dtype(dtype):
    """300 x 1000 values: the sum of squares (9e7) is past fp16's 65504, the norm (9487) is not."""
    from trainers.parallel import global_grad_norm

    p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    q = torch.nn.Parameter(torch.zeros(10, dtype=dtype))
    p.grad, q.grad = torch.full_like(p, 300.0), torch.full_like(q, -2.0)
    want = (1000 * 300.0**2 + 10 * 4.0) ** 0.5
    assert float(global_grad_norm([p, q], None)) == pytest.approx(want, rel=1e-6)
    p.grad[3] = float("inf")
    assert not torch.isfinite(global_grad_norm([p, q], None))


def test_min_lr_ratio_is_where_the_cosine_ends():
    """``trainer.min_lr_ratio``: warm-up to ``lr``, then the cosine reaches ``lr * min_lr_ratio``
    at the last step, halfway between the two at the middle of the decay."""
    from trainers.optim import lr_at

    a = TrainerConfig(lr=1e-3, lr_warmup_steps=10, steps=110, min_lr_ratio=0.2)
    assert lr_at(0, a) == pytest.approx(1e-4) and lr_at(9, a) == pytest.approx(1e-3)
    assert lr_at(60, a) == pytest.approx(0.6e-3)
    assert lr_at(110, a) == pytest.approx(0.2e-3)
    b = TrainerConfig(lr=1e-3, lr_warmup_steps=10, steps=110, min_lr_ratio=0.0)
    assert lr_at(110, b) == pytest.approx(0.0, abs=1e-12)
