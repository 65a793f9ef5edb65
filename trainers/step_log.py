"""Per-step metrics kept on the device and read back in batches.

Every step leaves its loss and a small vector of device scalars (the global gradient norm, the
loss scale, the overflow flag, the skip counters, this rank's first non-finite block) in
:class:`StepLog`; nothing is read back to the host until :meth:`StepLog.flush`, every
``trainer.log_every`` steps (and before a checkpoint, an adaptive stop and the end). A flush makes
one all-reduce of the losses (the global-batch mean, as a single process would compute it) and one
device-to-host copy of everything, then fills the rows: the same values a per-step ``.item()``
would have given, recorded per step.

The non-finite verdict is taken at the flush too: an overflowed step was already skipped on the
device (``trainers/optim.py``), and a flush that finds one where no loss scaler absorbs it (or
``precision.max_consecutive_skips`` in a row) raises :class:`NonFiniteError` naming the step and
the first block whose output went non-finite (a second collective, only then).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from trainers.precision import LossScaler

# the device scalars of one step, in this order
FIELDS = ("grad_norm", "loss_scale", "skipped_steps", "skipped_in_row", "found_inf", "first_bad")
NO_LAYER = float(1 << 30)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm went non-finite where no loss scaler could absorb it."""


class StepLog:
    def __init__(self, device: torch.device, dtype: torch.dtype, holds_loss: torch.Tensor, world: int):
        self.device, self.dtype, self.holds_loss, self.world = device, dtype, holds_loss, world
        self.rows: List[Dict[str, Any]] = []
        self._loss: List[torch.Tensor] = []
        self._stats: List[torch.Tensor] = []

    def add(self, row: Dict[str, Any], loss: torch.Tensor, scalars: List[torch.Tensor]) -> None:
        """One step: its host-known fields, its loss and the device scalars of :data:`FIELDS`."""
        self.rows.append(row)
        self._loss.append(loss.detach().reshape(()).float())
        self._stats.append(torch.stack([s.detach().reshape(()).to(self.dtype) for s in scalars]))

    def __len__(self) -> int:
        return len(self.rows)

    def flush(self, step_times: List[float], tokens_per_step: int, scaler: LossScaler) -> List[Dict[str, Any]]:
        """All ranks: the pending rows filled in (``step_times`` from the step clock, one per row).
        Raises :class:`NonFiniteError` after returning nothing: the caller's rows before the bad
        step are in ``err.rows``."""
        if not self.rows:
            return []
        rows, self.rows = self.rows, []
        n = len(rows)
        losses = torch.cat([torch.stack(self._loss) * self.holds_loss, self.holds_loss])
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        stats = torch.stack(self._stats)
        self._loss, self._stats = [], []
        flat = torch.cat([(losses[:-1] / losses[-1]).to(self.dtype), stats.flatten()]).tolist()  # the one copy
        table = [dict(zip(FIELDS, flat[n + i * len(FIELDS) : n + (i + 1) * len(FIELDS)])) for i in range(n)]
        bad = [i for i, t in enumerate(table) if t["found_inf"] > 0]
        first_bad = self._first_bad_layers(stats, bad)
        for i, (row, t) in enumerate(zip(rows, table)):
            dt = step_times[i]
            row.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt if dt > 0 else float("nan"))
            row["loss"] = flat[i]
            row["grad_norm"] = float("nan") if t["found_inf"] > 0 else t["grad_norm"]
            row["loss_scale"] = t["loss_scale"]
            row["skipped_steps"] = int(t["skipped_steps"])
            if i in first_bad:
                row["overflow_layer"] = first_bad[i]  # the skipped step's first non-finite block
        for i in bad:
            if not scaler.enabled or table[i]["skipped_in_row"] >= scaler.max_consecutive_skips:
                layer = first_bad.get(i)
                where = (
                    f"first in layer {layer} (block output)"
                    if layer is not None
                    else "forward activations finite, first in the backward pass"
                )
                why = "" if not scaler.enabled else f" ({int(table[i]['skipped_in_row'])} overflowed steps in a row)"
                err = NonFiniteError(f"non-finite values at step {rows[i]['step']}{why}: {where}")
                err.rows = rows[:i]  # type: ignore[attr-defined]
                raise err
        return rows

    def _first_bad_layers(self, stats: torch.Tensor, bad: List[int]) -> Dict[int, int]:
        """Row index -> the smallest non-finite block index over the job, for the overflowed rows
        (a MIN all-reduce, taken by every rank alike: the overflow flags are global)."""
        if not bad:
            return {}
        col = FIELDS.index("first_bad")
        firsts = stats[bad, col].contiguous()
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(firsts, op=dist.ReduceOp.MIN)
        out = {}
        for i, v in zip(bad, firsts.tolist()):
            if v < NO_LAYER and math.isfinite(v):
                out[i] = int(v)
        return out


def flush_with(
    log: StepLog, clock, tokens_per_step: int, scaler: LossScaler, deliver: Callable
) -> List[Dict[str, Any]]:
    """Flush ``log`` with the step times of ``clock`` and hand the rows to ``deliver`` (also the
    rows before a non-finite step, before the error goes on)."""
    times = clock.collect()
    try:
        rows = log.flush(times, tokens_per_step, scaler)
    except NonFiniteError as err:
        deliver(err.rows)  # type: ignore[attr-defined]
        raise
    deliver(rows)
    return rows
