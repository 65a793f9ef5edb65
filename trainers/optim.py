"""The optimizer: AdamW over the parameters as stored, or over fp32 master copies of 16-bit ones.

``precision.param_dtype`` fp32: ``torch.optim.AdamW`` (two fp32 moments per parameter).
16-bit parameters without ``precision.master_weights_fp32``: the same AdamW steps the 16-bit
parameters directly, its moments in the parameter dtype. With master weights:
:class:`MasterAdamW`, whose state per 16-bit parameter holds ``master`` (an fp32 copy with the
parameter's DTensor placement, so a shard's master is a shard) and the two fp32 moments; each
step it updates the master from an fp32 copy of the gradient (made, used and dropped parameter
by parameter) and writes it back into the 16-bit parameter, as Megatron's
Float16OptimizerWithFloat16Params keeps fp32 copies. The state is keyed by the module's own
parameters, so ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and DCP
save and reshard it like any optimizer's.

Per parameter, in bytes: 4 + 4 grads + 8 fp32; 2 + 2 + 12 (16-bit with master); 2 + 2 + 4
(16-bit without), what ``orchestrator/planner`` plans and ``trainers/memory.py`` measures.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from trainers.config import PrecisionConfig, TrainerConfig
from trainers.parallel import local

MASTER_STATE = ("master", "exp_avg", "exp_avg_sq")


def lr_at(step: int, a: TrainerConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < a.lr_warmup_steps:
        return a.lr * (step + 1) / a.lr_warmup_steps
    span = max(1, a.steps - a.lr_warmup_steps)
    progress = min(1.0, (step - a.lr_warmup_steps) / span)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's update rule) on fp32 master copies of 16-bit
    parameters. ``step(grad_scale=s)`` multiplies the gradients by ``s`` in fp32 first: the
    loss scaler's ``1 / scale`` and the clipping coefficient, so an fp16 gradient is unscaled
    after its cast to fp32, not in fp16."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["master"] = p.detach().float()  # a DTensor stays a DTensor, same placements
            state["exp_avg"] = torch.zeros_like(state["master"])
            state["exp_avg_sq"] = torch.zeros_like(state["master"])
        return state

    @torch.no_grad()
    def step(self, closure=None, grad_scale=1.0, found_inf: Optional[torch.Tensor] = None):
        """``grad_scale``: a float or a 0-dim tensor on the device; ``found_inf``: a 0-dim float
        tensor, 1 where the step overflowed. Such a step changes nothing (parameter, master,
        moments, step count), decided on the device, with no host round trip."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                grad = p.grad
                if _placements(grad) != _placements(p):  # e.g. a Partial gradient of a Replicate parameter
                    grad = grad.redistribute(p.device_mesh, p.placements)
                # local shards from here: master, moments, parameter and gradient share placements
                g = local(grad).float()  # the transient fp32 gradient, dropped with this iteration
                master, m, v = (local(state[k]) for k in MASTER_STATE)
                if found_inf is None:
                    if not (isinstance(grad_scale, float) and grad_scale == 1.0):
                        g.mul_(grad_scale)
                    state["step"] += 1
                    t = float(state["step"])
                    master.mul_(1 - lr * wd)
                    m.lerp_(g, 1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                    master.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                else:
                    apply = 1.0 - found_inf.to(device=g.device, dtype=torch.float32)
                    # an overflowed step's gradient is zeroed (inf x 0 is NaN: nan_to_num) and every
                    # rate below is multiplied by `apply`, so the state comes out as it went in
                    g.mul_(grad_scale * apply).nan_to_num_(0.0, 0.0, 0.0)
                    step_t = state["step"] = state["step"].to(g.device) + apply
                    t = torch.clamp(step_t, min=1.0)
                    master.mul_(1 - lr * wd * apply)
                    m.lerp_(g, (1 - beta1) * apply)
                    v.mul_(1 - (1 - beta2) * apply).addcmul_(g, g, value=1 - beta2)
                    denom = (v.sqrt() / torch.sqrt(1 - beta2**t)).add_(eps)
                    master.add_(torch.div(m, denom, out=denom).mul_(-lr * apply / (1 - beta1**t)))
                local(p).copy_(master)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # Optimizer.load_state_dict casts every floating-point state tensor to its parameter's
        # dtype (16-bit here); the master copy and the moments must stay fp32
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k in MASTER_STATE:
                if k in saved.get(i, {}):
                    self.state[p][k] = saved[i][k].to(device=p.device, dtype=torch.float32)


def _placements(t: torch.Tensor):
    return getattr(t, "placements", None)


def build_optimizer(
    params: List[torch.nn.Parameter], a: TrainerConfig, precision: PrecisionConfig
) -> torch.optim.Optimizer:
    """AdamW over ``params``; on fp32 master copies when they are 16-bit and
    ``precision.master_weights_fp32`` is set. No weight decay on norms and biases (everything
    one-dimensional); DTensor and plain parameters in separate groups, as the foreach kernels
    cannot mix them."""
    from torch.distributed.tensor import DTensor

    groups = []
    for is_dt in (False, True):
        for decay in (True, False):
            ps = [p for p in params if isinstance(p, DTensor) == is_dt and (p.dim() >= 2) == decay]
            if ps:
                groups.append({"params": ps, "weight_decay": a.weight_decay if decay else 0.0})
    sixteen = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
    if sixteen and precision.master_weights_fp32:
        return MasterAdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8)
    kind = {"fused": True} if fused_on(params[0].device.type if params else "cpu") else {"foreach": True}
    return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, **kind)


def fused_on(device_type: str) -> bool:
    """Whether AdamW runs torch's fused kernel here: one kernel per parameter group that unscales
    the gradients by a device tensor and skips an overflowed step by a device flag
    (``grad_scale`` / ``found_inf``, the protocol ``torch.amp.GradScaler`` drives; DTensor
    parameters dispatch it shard by shard). CUDA and CPU have the kernel (``_fused_adamw_``, CPU
    since torch 2.4). Not on Ascend: op-plugin's ``_fused_adamw_``
    (``op_plugin/ops/opapi/FusedAdamWKernelNpuOpApi.cpp``, master of 2026-08-21) takes
    ``grad_scale`` and ``found_inf`` and ignores both, calling ``aclnnApplyAdamWV2`` per tensor with
    the raw gradient: the loss scale would never be divided out and an overflowed fp16 step would
    be applied. So the NPU takes the foreach path (:func:`step`), which unscales and skips itself
    (``tests/test_optim_skip.py``)."""
    return device_type in ("cuda", "cpu")


@torch.no_grad()
def step(optim: torch.optim.Optimizer, grad_scale, found_inf: Optional[torch.Tensor] = None, sync_skip: bool = False):
    """One optimizer step with the gradients multiplied by ``grad_scale`` (1 / loss scale times
    the clipping coefficient, a 0-dim device tensor or a float), skipped where ``found_inf``
    (a 0-dim float tensor) is 1.

    On the device, without a host round trip: the fused kernel's own ``grad_scale`` (it divides)
    and ``found_inf``; :class:`MasterAdamW` by its rates times ``1 - found_inf``. The foreach
    kernels have no skip flag: with ``sync_skip`` (a loss scaler is on, so overflows are expected
    and must be skipped) the flag is read back to the host, the one sync such a step keeps;
    without it a non-finite step is not skipped here (the trial ends at the next metric read)."""
    if isinstance(optim, MasterAdamW):
        optim.step(grad_scale=grad_scale, found_inf=found_inf)
        return
    if optim.defaults.get("fused"):
        scale = grad_scale if torch.is_tensor(grad_scale) else torch.tensor(float(grad_scale))
        optim.grad_scale = (1.0 / scale).to(torch.float32)  # type: ignore[attr-defined]
        optim.found_inf = found_inf  # type: ignore[attr-defined]
        optim.step()
        return
    if found_inf is not None and sync_skip and bool(found_inf.item()):
        return
    if torch.is_tensor(grad_scale) or grad_scale != 1.0:
        # one multi-tensor kernel over the local gradients (as torch's own clip_grad_norm_ does),
        # not one small kernel per parameter
        grads = [local(p.grad) for group in optim.param_groups for p in group["params"] if p.grad is not None]
        if grads and torch.is_tensor(grad_scale) and grads[0].device.type == "npu":
            # a device scalar times each gradient: plain broadcast multiplies, which every backend
            # has (the foreach overload taking a tensor scalar, torch 2.1, is not known to be in
            # torch_npu's op table)
            for g in grads:
                g.mul_(grad_scale)
        elif grads:
            torch._foreach_mul_(grads, grad_scale)
    optim.step()
