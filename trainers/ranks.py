"""What every rank of a trial must agree on or hear from the others: rank 0's decision, the mean
of a value over the ranks that hold a loss, one number from each rank. Without a process group (one
process) each answers from this rank alone."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from trainers.parallel import acc_dtype


def agree(stop: bool, device: torch.device, world: int) -> bool:
    """Rank 0's decision, taken by every rank (all stop at the same step or none does)."""
    if world == 1 or not dist.is_initialized():
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def global_mean(mine: torch.Tensor, holds_loss: torch.Tensor, world: int) -> float:
    """All ranks: the mean of ``mine`` over the ranks that hold a loss (tp copies and dp replicas
    alike; pipeline ranks without the last stage hold none)."""
    both = torch.cat([mine.reshape(1).float() * holds_loss, holds_loss])
    if dist.is_initialized() and world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return float(both[0] / both[1])


def gather(value: float, device: torch.device, world: int) -> List[float]:
    """One number from every rank, in rank order."""
    mine = torch.tensor([value], dtype=acc_dtype(device), device=device)
    if not dist.is_initialized() or world == 1:
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [float(t) for t in out]
