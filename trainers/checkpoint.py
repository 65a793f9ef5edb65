"""Sharded checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, loss scaler,
RNG and data position; resharding on load; never a half-written one.

A checkpoint is written into ``step_<N>.tmp/`` by every rank (DCP shards plus a small per-rank
file), then rank 0 writes ``COMPLETE.json`` listing every file with its size and renames the
folder to ``step_<N>/``. Only a folder whose manifest exists and whose files still have the
listed sizes counts: a crash mid-write, or a truncated file, falls back to the previous one.
State-dict keys are the whole model's parameter names, so a checkpoint taken with one parallel
layout loads into another (DCP reshards). The folder must be on storage every rank can reach: a path
every node mounts, or a URI that fsspec and DCP's fsspec reader/writer understand (``file://``,
``s3://``, ...); :func:`check_shared` proves it before a trial reads it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MANIFEST = "COMPLETE.json"
_STEP = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _fs(root: str):
    """The fsspec filesystem of ``root`` (a path, or a URI such as ``file://`` or ``s3://``) and
    the path on it."""
    import fsspec

    return fsspec.core.url_to_fs(str(root))


def is_uri(root: str) -> bool:
    return "://" in str(root)


def _join(root: str, name: str) -> str:
    return str(root).rstrip("/") + "/" + name


def is_complete(path: str) -> bool:
    """The manifest exists and every file it lists has the recorded size."""
    fs, base = _fs(str(path))
    try:
        files = json.loads(fs.cat_file(_join(base, MANIFEST)))["files"]
        return all(fs.size(_join(base, name)) == size for name, size in files.items())
    except (OSError, ValueError, KeyError):
        return False


def latest(root: Optional[str]) -> Optional[Tuple[int, str]]:
    """The newest complete checkpoint under ``root``: (steps done, its folder as given in
    ``root``'s form: a path or a URI), or None."""
    if not root:
        return None
    fs, base = _fs(root)
    if not fs.isdir(base):
        return None
    names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
    found = sorted(((int(m.group(1)), n) for n in names if (m := _STEP.match(n))), reverse=True)
    return next(((step, _join(root, n)) for step, n in found if is_complete(_join(root, n))), None)


def check_shared(root: str) -> None:
    """Collective, before any rank reads ``root``: every rank must see what rank 0 writes there,
    or the ranks would resume from different checkpoints (or none). Raises on every rank, naming
    the ranks that cannot, when ``trainer.checkpoint_dir`` is node-local storage on a trial that
    spans nodes."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    import uuid

    fs, base = _fs(root)
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = _join(base, f".probe_{token[0]}")
    if dist.get_rank() == 0:
        fs.makedirs(base, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"written by rank 0")
    _barrier()
    seen: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, fs.exists(probe))  # objects: any backend, any device
    if dist.get_rank() == 0:
        fs.rm(probe)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise RuntimeError(
            f"trainer.checkpoint_dir={root} is not shared storage: rank(s) {blind} cannot see what rank 0 "
            "wrote there (use a path every node mounts, or a URI such as s3://...)"
        )


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


def _writer(folder: str):
    from torch.distributed.checkpoint import FileSystemWriter

    if is_uri(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(folder)
    return FileSystemWriter(folder)


def _reader(folder: str):
    from torch.distributed.checkpoint import FileSystemReader

    if is_uri(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(folder)
    return FileSystemReader(folder)


def save(
    root: str, step: int, parts: List[torch.nn.Module], optims: List[torch.optim.Optimizer], extra: Dict[str, Any]
) -> str:
    """Collective: every rank calls it. ``step`` is the number of steps done. Returns the folder
    (a path or a URI, as ``root`` is). ``root`` is anything fsspec opens and DCP's fsspec
    writer writes to; on an object store the rename is a copy, and the manifest with its sizes
    is what makes a folder count."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank() if dist.is_initialized() else 0
    fs, base = _fs(root)
    final, tmp = _join(base, f"step_{step:08d}"), _join(base, f"step_{step:08d}.tmp")
    tmp_id = _join(str(root), f"step_{step:08d}.tmp")
    if rank == 0:
        if fs.exists(tmp):
            fs.rm(tmp, recursive=True)
        fs.makedirs(tmp, exist_ok=True)
    _barrier()
    dcp.save({"model": _model_state(parts), "optim": _optim_state(parts, optims)}, storage_writer=_writer(tmp_id))
    with fs.open(_join(tmp, f"extra_rank{rank}.pt"), "wb") as f:
        torch.save({**extra, "rng": torch.get_rng_state()}, f)
    _barrier()
    if rank == 0:
        files = {str(p).rstrip("/").rsplit("/", 1)[-1]: fs.size(p) for p in sorted(fs.ls(tmp, detail=False))}
        with fs.open(_join(tmp, MANIFEST), "w") as f:
            f.write(json.dumps({"step": step, "files": files}, indent=1))
        if fs.exists(final):
            fs.rm(final, recursive=True)
        fs.mv(tmp, final, recursive=True)
    _barrier()
    return _join(str(root), f"step_{step:08d}")


def load(path: str, parts: List[torch.nn.Module], optims: List[torch.optim.Optimizer]) -> Dict[str, Any]:
    """Collective: load into the freshly built parts and optimizers (any layout); returns this
    rank's extra state (its own file, or rank 0's when the checkpoint had fewer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    path = str(path)
    state = {"model": _model_state(parts), "optim": _optim_state(parts, optims)}
    dcp.load(state, storage_reader=_reader(path))
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(parts, optims):
        mine = set(_model_state([part]))
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in mine})
        names = set(_optim_state([part], [opt]))
        set_optimizer_state_dict(part, opt, {k: v for k, v in state["optim"].items() if k in names}, options=opts)
    rank = dist.get_rank() if dist.is_initialized() else 0
    fs, base = _fs(path)
    own = _join(base, f"extra_rank{rank}.pt")
    has_own = fs.exists(own)
    with fs.open(own if has_own else _join(base, "extra_rank0.pt"), "rb") as f:
        extra = torch.load(f, weights_only=False)
    if has_own:
        torch.set_rng_state(extra["rng"])
    return extra
