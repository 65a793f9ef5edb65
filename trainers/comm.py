"""Gradient communication of DDP: overlapped with the backward pass as communication hooks
(plain all-reduce, or compressed: fp16 / bf16 casts, PowerSGD, top-k sparsification with error
feedback), or, with ``comm.overlap=false``, all-reduced in buckets after the whole backward
(:func:`allreduce_after_backward`). Each compression hook counts the bytes it puts on the wire,
so the compressed volume can be logged beside the dense one; every gradient collective is
counted as issued during or after the backward pass (:class:`GradSyncStats`).

Top-k keeps the ``ratio`` largest-magnitude entries of (gradient + residual) per bucket and
carries the rest to the next step (error feedback, Stich et al. 2018; Lin et al. 2018, "Deep
Gradient Compression"). Safe range for ``comm.topk_ratio``: 0.01 to 0.3. Below 0.01 the residual
grows for many steps before it is sent and the loss lags dense training; above ~0.3 an
all-gather of values and indices moves more bytes than the dense all-reduce it replaces.

What a compression carries from step to step (top-k's residuals, PowerSGD's error feedback, warm
start and iteration count) is part of a checkpoint (:func:`state_dict`, :func:`load_state_dict`),
so a resumed compressed trial continues as the uninterrupted one. Top-k keeps its residual per
parameter, not per bucket, so DDP's rebuilding of its buckets after the first step (in order of
gradient readiness) cannot hand one tensor's residual to another.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    dense_bytes: int = 0  # what a plain all-reduce of the same buckets would send, per rank
    sent_bytes: int = 0  # what the compressed collective sent, per rank

    def take(self) -> Dict[str, float]:
        out = {"comm_dense_mb": self.dense_bytes / 2**20, "comm_sent_mb": self.sent_bytes / 2**20}
        self.dense_bytes = self.sent_bytes = 0
        return out


@dataclass
class GradSyncStats:
    """Gradient collectives this rank issued while the autograd engine ran a backward pass
    (DDP's bucket hooks) and after it returned (``comm.overlap=false``)."""

    in_backward: int = 0
    after_backward: int = 0

    def note(self) -> None:
        # -1 outside a backward pass; DDP calls its hooks (the last buckets too, from a callback
        # queued on the graph task) before loss.backward() returns
        if torch._C._current_graph_task_id() >= 0:
            self.in_backward += 1
        else:
            self.after_backward += 1


@dataclass
class _State:
    group: Optional[dist.ProcessGroup]
    world: int
    stats: CommStats
    ratio: float = 0.1
    dtype: torch.dtype = torch.float16
    names: Dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name in the module
    residuals: Dict[str, torch.Tensor] = field(default_factory=dict)  # top-k: parameter name -> residual


def _done(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def _cast_hook(state: _State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in a 16-bit dtype; the result is written back in fp32."""
    buf = bucket.buffer()
    wire = buf.to(state.dtype).div_(state.world)
    state.stats.dense_bytes += buf.numel() * buf.element_size()
    state.stats.sent_bytes += wire.numel() * wire.element_size()
    if state.dtype == torch.bfloat16 and dist.get_backend(state.group) == "gloo":
        # gloo has no bf16 reduction kernel: gather the bf16 shards and sum them in fp32
        parts = [torch.empty_like(wire) for _ in range(state.world)]
        dist.all_gather(parts, wire, group=state.group)
        buf.copy_(torch.stack([p.float() for p in parts]).sum(0))
        return _done(buf)
    fut = dist.all_reduce(wire, group=state.group, async_op=True).get_future()

    def write_back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(write_back)


def _topk_hook(state: _State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Per tensor of the bucket (as DGC does per layer, so small-gradient tensors such as norms
    still get their share), keep the top ``ratio`` of |gradient + residual|; all-gather the kept
    values and their int32 indices; the rest stays in the residual for the next step."""
    buf = bucket.buffer()
    acc = buf.clone()
    names = [state.names[id(p)] for p in bucket.parameters()]
    picks, spans, offset = [], [], 0
    for name, g in zip(names, bucket.gradients()):
        n = g.numel()
        if name in state.residuals:
            acc[offset : offset + n] += state.residuals[name]
        k = max(1, int(state.ratio * n))
        picks.append(acc[offset : offset + n].abs().topk(k, sorted=False).indices + offset)
        spans.append((name, offset, n))
        offset += n
    idx = torch.cat(picks)
    vals = acc[idx]
    residual = acc.clone()
    residual[idx] = 0
    for name, start, n in spans:
        state.residuals[name] = residual[start : start + n]
    idx32 = idx.to(torch.int32)
    all_vals = [torch.empty_like(vals) for _ in range(state.world)]
    all_idx = [torch.empty_like(idx32) for _ in range(state.world)]
    dist.all_gather(all_vals, vals, group=state.group)
    dist.all_gather(all_idx, idx32, group=state.group)
    out = torch.zeros_like(buf)
    for v, i in zip(all_vals, all_idx):
        out.index_add_(0, i.long(), v)
    buf.copy_(out.div_(state.world))
    state.stats.dense_bytes += buf.numel() * buf.element_size()
    state.stats.sent_bytes += idx.numel() * (vals.element_size() + idx32.element_size())
    return _done(buf)


def _counted(hook, sync: GradSyncStats):
    def counted(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        sync.note()
        return hook(state, bucket)

    return counted


def register(
    ddp, compression: str, group, sync: GradSyncStats, *, topk_ratio: float = 0.1, powersgd_rank: int = 4
) -> Tuple[Optional[CommStats], Any]:
    """Install the communication hook for ``compression`` on a DDP module (``none``: DDP's plain
    all-reduce, averaged over the group); returns the byte counters of a compressed one and the
    hook's state (what :func:`state_dict` saves)."""
    world = dist.get_world_size(group)
    stats = CommStats()
    if compression == "none":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(group, _counted(allreduce_hook, sync))
        return None, None
    if compression in ("fp16", "bf16"):
        dtype = torch.float16 if compression == "fp16" else torch.bfloat16
        state: Any = _State(group, world, stats, dtype=dtype)
        ddp.register_comm_hook(state, _counted(_cast_hook, sync))
    elif compression == "topk":
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        state = _State(group, world, stats, ratio=topk_ratio, names=names)
        ddp.register_comm_hook(state, _counted(_topk_hook, sync))
    elif compression == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        from trainers.powersgd_keyed import KeyedPowerSGD

        keyed = KeyedPowerSGD(state, list(ddp.module.named_parameters()))
        ddp.register_comm_hook(state, _counted(keyed, sync))
        return None, keyed  # PowerSGD's own volume depends on its per-tensor rank decisions: not counted
    else:
        raise ValueError(f"unknown gradient compression {compression!r}")
    return stats, state


def _to(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def state_dict(state: Any) -> Optional[Dict[str, Any]]:
    """What a compression hook's ``state`` carries between steps, on the host (None: nothing):
    top-k's residuals; PowerSGD's per-parameter error feedback and warm-start Qs, its iteration
    and random generator (:class:`trainers.powersgd_keyed.KeyedPowerSGD`)."""
    if isinstance(state, _State):
        return {"residuals": _to(state.residuals, "cpu")} if state.residuals else None
    return None if state is None else state.state_dict()


def load_state_dict(state: Any, saved: Optional[Dict[str, Any]], device: Any) -> None:
    """Put back what :func:`state_dict` saved into a hook's fresh ``state``."""
    if not saved or state is None:
        return
    if isinstance(state, _State):
        state.residuals = _to(saved["residuals"], device)
        return
    state.load_state_dict(saved, device)


def buckets(
    params: Iterable[torch.nn.Parameter],
    bucket_mb: float,
    tensor: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda p: p.grad,
) -> List[List[torch.nn.Parameter]]:
    """Parameters in DDP's order (reverse of registration, roughly the order the backward
    produces their gradients), cut into buckets of at most ``bucket_mb`` MiB of one dtype each by
    the size of ``tensor(p)`` (the gradient; those without one left out); a tensor larger than
    that is a bucket of its own."""
    cap = bucket_mb * 2**20
    out: List[List[torch.nn.Parameter]] = []
    size, dtype = 0.0, None
    for p in reversed([p for p in params if tensor(p) is not None]):
        t = tensor(p)
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > cap or dtype != t.dtype:
            out.append([])
            size, dtype = 0.0, t.dtype
        out[-1].append(p)
        size += nbytes
    return out


@torch.no_grad()
def allreduce_after_backward(
    params: Iterable[torch.nn.Parameter], group, bucket_mb: float, sync: GradSyncStats
) -> None:
    """``comm.overlap=false``: average the gradients over ``group`` once the whole backward has
    run, one flat all-reduce per bucket of ``comm.bucket_mb`` (all issued, then waited on)."""
    world = dist.get_world_size(group)
    pending = []
    for bucket in buckets(params, bucket_mb):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        sync.note()
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        flat.div_(world)
        offset = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def saved(states: List[Any], rank: int, world: int) -> Dict[str, Any]:
    """A rank's compression states for its checkpoint's extra file, with whose they are."""
    return {"comm": {"rank": rank, "world": world, "states": [state_dict(s) for s in states]}}


def restore(states: List[Any], extra: Dict[str, Any], rank: int, world: int, device: Any) -> None:
    """Put a checkpoint's compression states back, when they are this rank's of the same world:
    each rank's residuals are its own gradients' (another rank's file, or a checkpoint of another
    world size, starts the error feedback afresh, as a new layout must)."""
    comm = extra.get("comm")
    if not comm or comm["rank"] != rank or comm["world"] != world or len(comm["states"]) != len(states):
        return
    for state, saved_state in zip(states, comm["states"]):
        load_state_dict(state, saved_state, device)
