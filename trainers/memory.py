"""What a rank really holds of the model's state, in bytes: the figure the planner's
params + grads + optimizer terms are checked against (``tests/test_state_bytes.py``)."""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from trainers.parallel import local


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def model_state_bytes(modules: Iterable[torch.nn.Module], optims: List[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes of this rank's parameters (local shards; a tied weight once), their gradients, and
    the optimizer's tensors (moments, and fp32 master copies where the optimizer steps those).
    The optimizer's scalar step counters (one 0-d tensor per parameter tensor) are bookkeeping,
    not state that grows with the model, and are left out, as the planner leaves them out."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    state = [
        v
        for opt in optims
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for v in state),
    }
