"""Numerics: where a non-finite value starts, and per-layer statistics of activations and
gradients in the dtypes that matter.

``FiniteTracker`` is always on: one fp32 sum per block output (:func:`finite_probe`), kept on the
device (no host sync); when a step goes non-finite, the first block whose forward output was
non-finite names the layer (read back with the step's other metrics, ``trainers/step_log.py``).
``PrecisionMonitor`` (``precision.monitor=k``) records, every k steps, per block: max |x| and mean
|x| of the forward output and of the gradient flowing into it, the count of inf/nan, and the
fractions of values that would overflow or underflow fp16 and bf16 (values are measured as
computed; under tensor or sequence parallelism, on this rank's shard). A few channel means are
kept as a fingerprint, so two runs (two chips, two dtypes) can be compared layer by layer with a
cosine similarity.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05
BF16_MIN_NORMAL = 1.1754943508222875e-38
FINGERPRINT = 16  # channel means kept per layer and sample


def blocks(parts: List[torch.nn.Module]) -> List[tuple[int, torch.nn.Module]]:
    """(global layer index, block) of this rank's stage parts."""
    out = []
    for part in parts:
        out.extend((int(name), block) for name, block in part.layers.items())
    return sorted(out, key=lambda t: t[0])


def finite_probe(x: torch.Tensor) -> torch.Tensor:
    """A scalar that is finite exactly when every value of ``x`` is (and the values do not sum
    past fp32's range, 3.4e38, itself an overflow for any training): the fp32 sum. One read of
    ``x``, no temporary: ``torch.isfinite(x).all()`` builds boolean and absolute-value tensors
    of ``x``'s size (about 30x the time of the sum on a CPU, measured on a 16x128x256 block
    output)."""
    return x.detach().sum(dtype=torch.float32)


class FiniteTracker:
    """The first block (by global index) whose forward output held a non-finite value."""

    def __init__(self, parts: List[torch.nn.Module], device: torch.device):
        self.none = 1 << 30
        owned = blocks(parts)
        # one slot per block of this rank: its outputs' probes, summed over the step's micro-batches
        # (a NaN or inf stays one), kept on the device until a step goes non-finite
        self.sums = torch.zeros(len(owned), dtype=torch.float32, device=device)
        self.layers = torch.tensor([idx for idx, _ in owned], dtype=torch.int64, device=device)
        for slot, (_, block) in enumerate(owned):
            block.register_forward_hook(self._hook(slot))

    def _hook(self, slot: int):
        def hook(module, inputs, output):
            out = output.to_local() if hasattr(output, "to_local") else output
            self.sums[slot] += finite_probe(out)

        return hook

    def reset(self) -> None:
        self.sums.zero_()

    def local_first(self) -> torch.Tensor:
        """This rank's smallest non-finite block index of the step, as a 0-dim fp32 tensor on the
        device (``2**30`` when none): no host read, no collective (``trainers/step_log.py`` takes
        the job's minimum when a step overflowed)."""
        none = torch.full((), float(self.none), dtype=torch.float32, device=self.sums.device)
        if not self.sums.numel():
            return none
        return torch.where(torch.isfinite(self.sums), none, self.layers.float()).min()

    def first_layer(self) -> Optional[int]:
        """All ranks: the smallest non-finite layer index over the job (a collective)."""
        import torch.distributed as dist

        first = self.local_first()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        value = int(first)
        return None if value == self.none else value


def tensor_stats(x: torch.Tensor) -> Dict[str, Any]:
    x = (x.to_local() if hasattr(x, "to_local") else x).detach().float()
    finite = torch.isfinite(x)
    a = torch.where(finite, x.abs(), torch.zeros_like(x))
    n = max(1, x.numel())
    nonzero = a > 0
    return {
        "max_abs": float(a.max()) if x.numel() else 0.0,
        "mean_abs": float(a.sum() / n),
        "nonfinite": int((~finite).sum()),
        "overflow_fp16": float(((a > FP16_MAX) | ~finite).sum() / n),
        "underflow_fp16": float((nonzero & (a < FP16_MIN_NORMAL)).sum() / n),
        "underflow_bf16": float((nonzero & (a < BF16_MIN_NORMAL)).sum() / n),
        "fingerprint": [float(v) for v in x.reshape(-1, x.shape[-1])[:, :FINGERPRINT].mean(0)] if x.dim() else [],
    }


class PrecisionMonitor:
    """Per-layer statistics on sampled steps; hooks cost nothing on the other steps."""

    def __init__(self, parts: List[torch.nn.Module], every: int):
        self.every = every
        self.active = False
        self.step = -1
        self.rows: List[Dict[str, Any]] = []
        if every > 0:
            for idx, block in blocks(parts):
                block.register_forward_hook(self._forward(idx))
                block.register_full_backward_hook(self._backward(idx))

    def begin(self, step: int) -> None:
        self.step = step
        self.active = self.every > 0 and step % self.every == 0
        self.rows = []

    def _forward(self, idx: int):
        def hook(module, inputs, output):
            if self.active:
                self.rows.append({"step": self.step, "layer": idx, "kind": "activation", **tensor_stats(output)})

        return hook

    def _backward(self, idx: int):
        def hook(module, grad_input, grad_output):
            if self.active and grad_output and grad_output[0] is not None:
                self.rows.append({"step": self.step, "layer": idx, "kind": "gradient", **tensor_stats(grad_output[0])})

        return hook

    def collect(self) -> List[Dict[str, Any]]:
        """All ranks: every rank's rows of this step, merged per (layer, kind) on rank 0 (first
        micro-batch, first rank holding the layer). A collective, on sampled steps only."""
        import torch.distributed as dist

        rows = self.rows
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
        merged: Dict[tuple, Dict[str, Any]] = {}
        for r in rows:
            key = (r["layer"], r["kind"])
            if key not in merged:
                merged[key] = dict(r)
            else:  # micro-batches and ranks: worst case of each statistic
                m = merged[key]
                m["max_abs"] = max(m["max_abs"], r["max_abs"])
                m["nonfinite"] += r["nonfinite"]
                for k in ("overflow_fp16", "underflow_fp16", "underflow_bf16"):
                    m[k] = max(m[k], r[k])
        self.rows = []
        return sorted(merged.values(), key=lambda r: (r["kind"], r["layer"]))
