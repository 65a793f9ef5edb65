"""PowerSGD (torch's ``powerSGD_hook``) with its state kept by parameter, so it survives a change of
DDP's buckets and a checkpoint.

torch's hook keys what it carries between steps by *bucket index*: the error feedback (a flat
tensor laid out as the bucket's gradients) and the warm-start Q factors (the Qs of the bucket's
compressed tensors, grouped by shape). DDP builds its buckets in reverse registration order, then
once, after the first step, rebuilds them in the order the gradients became ready. In one process
that happens before PowerSGD starts (``start_powerSGD_iter`` >= 2 exists for it), but a process
resumed from a checkpoint starts with the first layout again: bucket-indexed state put back as it
was would add one tensor's error to another's (measured: resumed losses 0.16% off the
uninterrupted run by the second resumed step, worse than starting the error feedback afresh).

:class:`KeyedPowerSGD` wraps the hook: it records which parameters each bucket index holds, and
when a bucket arrives with another set, it cuts the bucket-indexed state into per-parameter pieces
and joins them again in the new layout (torch's layouts, read from ``powerSGD_hook``: the error as
the bucket buffer; the Qs of the tensors ``_should_compress`` admits, ``m x rank`` each, grouped
by shape in order of first appearance, since ``batch_tensors_with_same_shape`` is off). P needs no
keeping: each step writes it whole before reading it. A checkpoint holds the per-parameter pieces
(:meth:`state_dict`), so a resumed process continues as the uninterrupted one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

# what PowerSGDState carries besides the bucket-indexed tensors (its iteration, its random
# generator for fresh Qs, its compression counters)
_SCALARS = ("iter", "rng", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


class KeyedPowerSGD:
    """The hook's state (``state``, a ``PowerSGDState``) and the names and shapes of the DDP
    module's parameters; called as the comm hook itself (``register_comm_hook(keyed.state, keyed)``)."""

    def __init__(self, state: Any, named: List[Tuple[str, torch.nn.Parameter]]):
        self.state = state
        self.names = {id(p): n for n, p in named}
        self.shapes = {n: tuple(p.shape) for n, p in named}
        self.layout: Dict[int, List[str]] = {}  # bucket index -> the parameters its state is laid out for
        self.loose: Dict[str, Dict[str, torch.Tensor]] = {}  # name -> {"error", "q"} while in no bucket
        self.confirmed: Set[int] = set()  # bucket indices seen with their layout this step

    # -- the layouts --------------------------------------------------------------------------

    def _qs(self, names: List[str]) -> List[Tuple[str, int, int]]:
        """(name, Q size, P size) of the tensors PowerSGD compresses, in its Q memory's order."""
        groups: "OrderedDict[Tuple[int, int], List[Tuple[str, int, int]]]" = OrderedDict()
        for name in names:
            shape = self.shapes[name]
            n = shape[0]
            m = 1
            for d in shape[1:]:
                m *= d
            r = min(n, m, self.state.matrix_approximation_rank)
            if psgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, m * r, n * r))
        return [x for group in groups.values() for x in group]

    def _pieces(self, idx: int, names: List[str]) -> Dict[str, Dict[str, torch.Tensor]]:
        """Bucket ``idx``'s state cut into per-parameter pieces (views), laid out for ``names``."""
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        err = self.state.error_dict.get(idx)
        if err is not None:
            offset = 0
            for name in names:
                n = 1
                for d in self.shapes[name]:
                    n *= d
                out.setdefault(name, {})["error"] = err[offset : offset + n]
                offset += n
        q = self.state.q_memory_dict.get(idx)
        if q is not None:
            offset = 0
            for name, size, _ in self._qs(names):
                out.setdefault(name, {})["q"] = q[offset : offset + size]
                offset += size
        return out

    def _split(self, idx: int) -> None:
        names = self.layout.pop(idx)
        for name, piece in self._pieces(idx, names).items():
            self.loose.setdefault(name, {}).update(piece)
        for d in (self.state.error_dict, self.state.q_memory_dict, self.state.p_memory_dict):
            d.pop(idx, None)

    def _join(self, idx: int, names: List[str]) -> None:
        pieces = [self.loose.get(n, {}) for n in names]
        if pieces and all("error" in p for p in pieces):
            self.state.error_dict[idx] = torch.cat([p["error"] for p in pieces])
        qs = self._qs(names)
        if qs and all("q" in self.loose.get(n, {}) for n, _, _ in qs):
            q = torch.cat([self.loose[n]["q"] for n, _, _ in qs])
            self.state.q_memory_dict[idx] = q
            self.state.p_memory_dict[idx] = torch.empty(sum(p for _, _, p in qs), device=q.device, dtype=q.dtype)
        for n in names:
            self.loose.pop(n, None)
        self.layout[idx] = names

    # -- the hook -----------------------------------------------------------------------------

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        idx = bucket.index()
        names = [self.names[id(p)] for p in bucket.parameters()]
        if self.layout.get(idx) != names:
            # the buckets changed: every layout not seen this step is stale; cut them all into
            # pieces, then lay this bucket out anew (the others follow as they arrive)
            for other in [i for i in self.layout if i not in self.confirmed]:
                self._split(other)
            self._join(idx, names)
        self.confirmed.add(idx)
        if bucket.is_last():
            self.confirmed = set()
        return psgd.powerSGD_hook(state, bucket)

    # -- a checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Per-parameter pieces (host copies) and the scalars; the live state is not touched."""
        pieces: Dict[str, Dict[str, torch.Tensor]] = {n: dict(p) for n, p in self.loose.items()}
        for idx, names in self.layout.items():
            for name, piece in self._pieces(idx, names).items():
                pieces.setdefault(name, {}).update(piece)
        return {
            "pieces": {n: {k: t.detach().cpu().clone() for k, t in p.items()} for n, p in pieces.items()},
            **{k: getattr(self.state, k) for k in _SCALARS},
        }

    def load_state_dict(self, saved: Dict[str, Any], device: Optional[torch.device]) -> None:
        for k in _SCALARS:
            setattr(self.state, k, saved[k])
        for d in (self.state.error_dict, self.state.q_memory_dict, self.state.p_memory_dict):
            d.clear()
        self.layout, self.confirmed = {}, set()
        self.loose = {n: {k: t.to(device) for k, t in p.items()} for n, p in saved["pieces"].items()}
