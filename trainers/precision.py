"""Mixed precision: parameter and compute dtypes, the ops forced to fp32, loss scaling.

* ``precision.param_dtype``: the dtype the parameters are stored in (:func:`cast_params`); with
  16-bit parameters the optimizer keeps fp32 master copies or not (``trainers/optim.py``).
* ``precision.compute_dtype``: autocast's dtype (:func:`autocast`).
* ``precision.fp32_ops``: each of softmax, layer_norm, rms_norm runs in fp32 when listed and in
  the compute dtype when not, explicitly and outside autocast (:func:`apply_op_policy`):
  autocast's own per-op fp32 lists differ between CUDA, CPU and NPU.
* ``precision.loss_scale``: none, dynamic, or static (``init_scale`` kept for the whole run).

The loss scaler is written against plain gradients: a step overflowed exactly when the global
gradient norm (``trainers.parallel.global_grad_norm``, one all-reduce over the whole job) is not
finite, so every rank skips an overflowed step together, whatever parallel layout holds the
parameters. It does not unscale the gradients itself: the optimizer step takes ``1 / scale``
(times the clipping coefficient) as one multiplier, applied in fp32 where master weights are kept
(``trainers/optim.py``), so small fp16 gradients are not flushed to zero by an unscale in fp16
(as Megatron unscales its fp32 main gradients). Nothing here reads a value back to the host.
"""

from __future__ import annotations

import contextlib

import torch

from trainers.config import PrecisionConfig
from trainers.model import Attention, LayerNorm, RMSNorm

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
    trial (the loop raises when it reads the counters back).

    The state lives on the device as 0-dim tensors and :meth:`update` is a handful of tensor ops
    on them, so the overflow decision and the scale's move never wait on the host: the loop reads
    ``scale``, ``skipped_steps`` and ``skipped_in_row`` back with the other metrics every
    ``trainer.log_every`` steps (torch's ``GradScaler`` keeps its scale on the device the same way,
    ``torch._amp_update_scale_``; this one adds Megatron's hysteresis).
    """

    def __init__(self, args: PrecisionConfig, device: torch.device):
        self.enabled = args.loss_scale in ("dynamic", "static")
        self.dynamic = args.loss_scale == "dynamic"
        self.growth_interval, self.growth_factor = args.growth_interval, args.growth_factor
        self.backoff_factor, self.hysteresis = args.backoff_factor, max(1, args.hysteresis)
        self.device = device
        self.max_consecutive_skips = args.max_consecutive_skips

        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.float32, device=device)

        self.scale = torch.full((), float(args.init_scale) if self.enabled else 1.0, device=device)
        self.skipped_steps, self.skipped_in_row = zero(), zero()
        self._clean_steps, self._overflows_left = zero(), zero() + self.hysteresis

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, found_inf: torch.Tensor) -> None:
        """One step's verdict, ``found_inf`` a 0-dim float tensor (1: the step overflowed and was
        skipped), taken on the device: no host round trip."""
        if not self.enabled:
            return
        bad = found_inf.reshape(()).to(torch.float32)
        ok = 1.0 - bad
        self.skipped_steps.add_(bad)
        self.skipped_in_row.add_(1.0).mul_(bad)  # one more in a row, or back to none
        self._clean_steps.add_(1.0).mul_(ok)
        # an overflow takes one from the hysteresis budget; a clean step refills it
        left = torch.where(bad > 0, self._overflows_left - 1.0, torch.full_like(bad, self.hysteresis))
        backoff = (bad > 0) & (left <= 0)
        self._overflows_left.copy_(torch.where(backoff, torch.full_like(bad, self.hysteresis), left))
        if self.dynamic:
            grow = (ok > 0) & (torch.remainder(self._clean_steps, self.growth_interval) == 0)
            scaled = torch.where(grow, self.scale * self.growth_factor, self.scale)
            self.scale.copy_(torch.where(backoff, torch.clamp(self.scale * self.backoff_factor, min=1.0), scaled))

    def state_dict(self) -> dict:
        """Host numbers (a checkpoint's extra state): read back here, at checkpoint time only."""
        return {
            "scale": float(self.scale),
            "clean_steps": int(self._clean_steps),
            "overflows_left": int(self._overflows_left),
            "skipped_steps": int(self.skipped_steps),
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self._clean_steps.fill_(float(state["clean_steps"]))
        self._overflows_left.fill_(float(state["overflows_left"]))
        self.skipped_steps.fill_(float(state["skipped_steps"]))


def grad_multiplier(scaler: LossScaler, grad_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the optimizer multiplies the raw (scaled) gradients by, on the device: ``1 / scale``
    times the clipping coefficient, computed from the true (unscaled) global norm ``grad_norm``
    (a 0-dim tensor). Non-finite where the norm is; such a step is skipped whatever this says."""
    norm = grad_norm.to(torch.float32)
    coef = torch.ones_like(norm)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return coef / scaler.scale if scaler.enabled else coef
