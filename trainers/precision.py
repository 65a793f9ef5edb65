"""Mixed precision: parameter and compute dtypes, the ops forced to fp32, loss scaling.

* ``precision.param_dtype``: the dtype the parameters are stored in (:func:`cast_params`); with
  16-bit parameters the optimizer keeps fp32 master copies or not (``trainers/optim.py``).
* ``precision.compute_dtype``: autocast's dtype (:func:`autocast`).
* ``precision.fp32_ops``: each of softmax, layer_norm, rms_norm runs in fp32 when listed and in
  the compute dtype when not, explicitly and outside autocast (:func:`apply_op_policy`):
  autocast's own per-op fp32 lists differ between CUDA, CPU and NPU.
* ``precision.loss_scale``: none, dynamic, or static (``init_scale`` kept for the whole run).

The loss scaler is written against plain gradients plus one all-reduce of the overflow flag over
the whole job, so every rank skips an overflowed step together, whatever parallel layout holds
the parameters. It does not unscale the gradients itself: the optimizer step takes
``1 / scale`` (times the clipping coefficient) as one multiplier, applied in fp32 where master
weights are kept (``trainers/optim.py``), so small fp16 gradients are not flushed to zero by an
unscale in fp16 (as Megatron unscales its fp32 main gradients).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist

from trainers.config import PrecisionConfig
from trainers.model import Attention, LayerNorm, RMSNorm
from trainers.monitor import finite_probe
from trainers.parallel import local

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_OPS = ("softmax", "layer_norm", "rms_norm")


def autocast(args: PrecisionConfig, device: torch.device):
    """Autocast to the compute dtype; a no-op in fp32."""
    if args.compute_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[args.compute_dtype])


def cast_params(module: torch.nn.Module, param_dtype: str) -> None:
    """Store the module's floating-point parameters in ``param_dtype``, in place (tied weights
    stay tied; DTensor parameters keep their placements). Buffers (the RoPE tables) stay fp32."""
    dtype = DTYPES[param_dtype]
    if dtype == torch.float32:
        return
    buffers = [(name.rpartition(".")[0], name.rpartition(".")[2], b) for name, b in module.named_buffers()]
    module.to(dtype)
    for owner, leaf, b in buffers:
        module.get_submodule(owner)._buffers[leaf] = b


def apply_op_policy(module: torch.nn.Module, args: PrecisionConfig) -> None:
    """Each norm and attention softmax of ``module`` runs in fp32 when listed in
    ``precision.fp32_ops``, in the compute dtype otherwise. Fused attention kernels keep their
    softmax statistics in fp32 whatever this says (the validator refuses what that cannot honour)."""
    unknown = set(args.fp32_ops) - set(FP32_OPS)
    if unknown:
        raise ValueError(f"precision.fp32_ops: unknown ops {sorted(unknown)}")
    compute = DTYPES[args.compute_dtype]
    pick = {op: torch.float32 if op in args.fp32_ops else compute for op in FP32_OPS}
    for m in module.modules():
        if isinstance(m, LayerNorm):
            m.compute_dtype = pick["layer_norm"]
        elif isinstance(m, RMSNorm):
            m.compute_dtype = pick["rms_norm"]
        elif isinstance(m, Attention):
            m.softmax_dtype = pick["softmax"]


class LossScaler:
    """Scale the loss up so small fp16 gradients survive; skip the step on overflow.

    ``dynamic``: ``hysteresis`` overflowed steps in a row are needed before the scale backs off
    (Megatron's convention); after ``growth_interval`` clean steps it grows by ``growth_factor``.
    ``static``: the scale stays ``init_scale``; overflowed steps are still skipped and counted.
    Either way every overflowed step is skipped, and ``max_consecutive_skips`` in a row end the
    trial (the loop raises).
    """

    def __init__(self, args: PrecisionConfig, device: torch.device):
        self.enabled = args.loss_scale in ("dynamic", "static")
        self.dynamic = args.loss_scale == "dynamic"
        self.scale = float(args.init_scale) if self.enabled else 1.0
        self.growth_interval, self.growth_factor = args.growth_interval, args.growth_factor
        self.backoff_factor, self.hysteresis = args.backoff_factor, max(1, args.hysteresis)
        self.device = device
        self._clean_steps, self._overflows_left = 0, self.hysteresis
        self.skipped_steps = 0
        self.skipped_in_row = 0
        self.max_consecutive_skips = args.max_consecutive_skips

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def all_finite(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """True when every rank's gradients are finite (a collective when scaling is on). The
        gradients are left scaled: the optimizer step divides by :attr:`scale`."""
        if not self.enabled:
            return True
        # every gradient's fp32 sum, added up: finite exactly when every value is (trainers.monitor.
        # finite_probe); one read of each gradient, where isfinite().any() makes two temporaries
        probes = [finite_probe(local(p.grad)) for p in params if p.grad is not None]
        total = torch.stack(probes).sum() if probes else torch.zeros((), device=self.device)
        found_inf = (~torch.isfinite(total)).float().reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() == 0)

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        self.skipped_in_row = 0 if finite else self.skipped_in_row + 1
        if finite:
            self._clean_steps += 1
            self._overflows_left = self.hysteresis
            if self.dynamic and self._clean_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
            return
        self.skipped_steps += 1
        self._clean_steps = 0
        self._overflows_left -= 1
        if self._overflows_left <= 0:
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, 1.0)
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "overflows_left": self._overflows_left,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
        self._overflows_left, self.skipped_steps = state["overflows_left"], state["skipped_steps"]


def grad_multiplier(scaler: LossScaler, grad_norm: float, max_norm: float) -> float:
    """What the optimizer multiplies the raw (scaled) gradients by: ``1 / scale`` times the
    clipping coefficient, computed from the true (unscaled) global norm ``grad_norm``."""
    coef = 1.0
    if max_norm > 0 and grad_norm == grad_norm and grad_norm > max_norm:
        coef = max_norm / (grad_norm + 1e-6)
    return coef / scaler.scale if scaler.enabled else coef
