"""Sharded checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, loss scaler,
RNG and data position; resharding on load; never a half-written one.

A checkpoint is written into ``step_<N>.tmp/`` by every rank (DCP shards plus a small per-rank
file), then rank 0 writes ``COMPLETE.json`` listing every file with its size and renames the
folder to ``step_<N>/``. Only a folder whose manifest exists and whose files still have the
listed sizes counts: a crash mid-write, or a truncated file, falls back to the previous one.
State-dict keys are the whole model's parameter names, so a checkpoint taken with one parallel
layout loads into another (DCP reshards). The folder must be on storage every rank can reach.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MANIFEST = "COMPLETE.json"
_STEP = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_complete(path: Path) -> bool:
    """The manifest exists and every file it lists has the recorded size."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def latest(root: Optional[str]) -> Optional[Tuple[int, Path]]:
    """The newest complete checkpoint under ``root``: (steps done, folder), or None."""
    if not root or not Path(root).is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP.match(p.name))), reverse=True)
    return next(((step, p) for step, p in found if is_complete(p)), None)


def _model_state(parts: List[torch.nn.Module]) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state: Dict[str, Any] = {}
    for part in parts:
        state.update(get_model_state_dict(part))
    return state


def _optim_state(parts: List[torch.nn.Module], optims: List[torch.optim.Optimizer]) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # flattened: keys carry the parameter's full name, unique across pipeline stages
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    state: Dict[str, Any] = {}
    for part, opt in zip(parts, optims):
        state.update(get_optimizer_state_dict(part, opt, options=opts))
    return state


def save(
    root: str, step: int, parts: List[torch.nn.Module], optims: List[torch.optim.Optimizer], extra: Dict[str, Any]
) -> Path:
    """Collective: every rank calls it. ``step`` is the number of steps done. Returns the folder."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(root) / f"step_{step:08d}"
    tmp = Path(root) / f"step_{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save({"model": _model_state(parts), "optim": _optim_state(parts, optims)}, checkpoint_id=str(tmp))
    torch.save({**extra, "rng": torch.get_rng_state()}, tmp / f"extra_rank{rank}.pt")
    _barrier()
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    _barrier()
    return final


def load(path: Path, parts: List[torch.nn.Module], optims: List[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Collective: load into the freshly built parts and optimizers (any layout); returns this
    rank's extra state (its own file, or rank 0's when the checkpoint had fewer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    state = {"model": _model_state(parts), "optim": _optim_state(parts, optims)}
    dcp.load(state, checkpoint_id=str(path))
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(parts, optims):
        mine = set(_model_state([part]))
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in mine})
        names = set(_optim_state([part], [opt]))
        set_optimizer_state_dict(part, opt, {k: v for k, v in state["optim"].items() if k in names}, options=opts)
    rank = dist.get_rank() if dist.is_initialized() else 0
    own = path / f"extra_rank{rank}.pt"
    extra = torch.load(own if own.is_file() else path / "extra_rank0.pt", weights_only=False)
    if own.is_file():
        torch.set_rng_state(extra["rng"])
    return extra
