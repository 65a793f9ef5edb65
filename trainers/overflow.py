"""The overflow flag of an Ascend NPU that saturates.

torch_npu runs the NPU in inf/nan mode only on the Ascend 910B1 and later (``IsSupportInfNan``,
``torch_npu/csrc/core/npu/NpuVariables.cpp``), and not there either when
``INF_NAN_MODE_FORCE_DISABLE=1`` is exported. Elsewhere (the 910A) an fp16 overflow saturates to
+-65504 instead of becoming inf, so a gradient norm stays finite and a loss scaler that looks only
at it never sees an overflow: no step is skipped and the scale never backs off. The device records
the overflow in its float status instead, which torch_npu's own GradScaler reads
(``torch_npu/npu/utils.py``: ``get_npu_overflow_flag`` reads ``npu_get_float_status`` of an
8-float buffer, word 0 non-zero on overflow; ``clear_npu_overflow_flag`` runs
``npu_clear_float_status``; both v7.3.0-pytorch2.7.1). :class:`SaturationFlag` clears it before a
step's forward and folds it into the step's gradient norm before the norm's all-reduce, on the
device: a flagged rank makes the global norm inf on every rank, so every rank skips the step and
the scale backs off, as on a chip in inf/nan mode. Where torch_npu reports inf/nan mode, or the
device is not an NPU, or no loss scaler runs, it does nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class SaturationFlag:
    """The device's float status, on a saturating NPU; inactive elsewhere."""

    def __init__(self, device: torch.device, npu: Any = None):
        self.device = device
        self.npu = npu  # the torch_npu module where the flag is read; None: inactive

    @classmethod
    def of(cls, device: torch.device, loss_scaling: bool) -> "SaturationFlag":
        """Active where a loss scaler runs on an NPU that torch_npu does not run in inf/nan mode."""
        if not loss_scaling or device.type != "npu":
            return cls(device)
        import torch_npu  # type: ignore[import-not-found]

        return cls(device, None if torch_npu.npu.utils.is_support_inf_nan() else torch_npu)

    @property
    def active(self) -> bool:
        return self.npu is not None

    def _status(self) -> torch.Tensor:
        return torch.zeros(8, dtype=torch.float32, device=self.device)

    def clear(self) -> None:
        """Before the step's forward: what earlier work set does not count against this step."""
        if self.active:
            self.npu.npu_clear_float_status(self._status())

    def local_inf(self) -> Optional[torch.Tensor]:
        """A 0-dim device tensor, inf where the float status shows an overflow since
        :meth:`clear` and 0 otherwise (no host read), to add to the local sum of squares of the
        gradient norm before its all-reduce; None when inactive."""
        if not self.active:
            return None
        word = self.npu.npu_get_float_status(self._status())[0]
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.where(word != 0, torch.full_like(zero, float("inf")), zero)
