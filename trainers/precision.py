"""Mixed precision: compute dtype under autocast, FP32 master weights, dynamic loss scaling.

The loss scaler is written against plain gradients plus one all-reduce of the overflow flag over
the whole job, so every rank skips an overflowed step together, whatever parallel layout holds
the parameters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, List

import torch
import torch.distributed as dist

from trainers.config import PrecisionConfig
from trainers.parallel import local

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(args: PrecisionConfig, device: torch.device):
    """Autocast to the compute dtype; a no-op in fp32. Parameters stay fp32 (master weights)."""
    if args.compute_dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[args.compute_dtype])


class DynamicLossScaler:
    """Scale the loss up so small fp16 gradients survive; back off and skip on overflow.

    ``hysteresis`` overflowed steps in a row are needed before the scale backs off (Megatron's
    convention); every overflowed step is skipped. After ``growth_interval`` clean steps the
    scale grows by ``growth_factor``.
    """

    def __init__(self, args: PrecisionConfig, device: torch.device):
        self.enabled = args.loss_scale == "dynamic"
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

    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale in place; return True when every rank's are finite."""
        if not self.enabled:
            return True
        grads = [local(p.grad) for p in params if p.grad is not None]  # DTensor shards in place
        inv = 1.0 / self.scale
        found_inf = torch.zeros(1, device=self.device)
        for g in grads:
            g.mul_(inv)
            found_inf += (~torch.isfinite(g)).any().float()
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
            if self._clean_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
            return
        self.skipped_steps += 1
        self._clean_steps = 0
        self._overflows_left -= 1
        if self._overflows_left <= 0:
            self.scale = max(self.scale * self.backoff_factor, 1.0)
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "overflows_left": self._overflows_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
        self._overflows_left, self.skipped_steps = state["overflows_left"], state["skipped_steps"]
