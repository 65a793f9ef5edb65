"""A composed config's process mesh (:class:`trainers.rules.Layout`, torch-free): dp x tp x pp,
with ``parallel.dp=-1`` filled from the world size. The validator, the planner, the effects table
and the trial lifecycle all read it here."""

from __future__ import annotations

from omegaconf import DictConfig

from trainers.rules import Layout

__all__ = ["Layout", "layout", "world_size"]


def world_size(cfg: DictConfig) -> int:
    """``launch.world_size``, or when that is -1 every device of the chip on ``launch.nnodes`` nodes."""
    world = int(cfg.launch.world_size)
    return world if world > 0 else int(cfg.chip.devices_per_node) * int(cfg.launch.nnodes)


def layout(cfg: DictConfig) -> Layout:
    """dp x tp x pp of ``cfg``, with ``parallel.dp=-1`` filled from :func:`world_size`."""
    p = cfg.parallel
    if int(p.dp) > 0:
        return Layout.filled(int(p.dp), int(p.tp), int(p.pp), 0)
    return Layout.filled(-1, int(p.tp), int(p.pp), world_size(cfg))
