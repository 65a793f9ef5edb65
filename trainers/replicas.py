"""Whole replicas under tensor parallelism (``parallel.dp_shard=ddp`` with ``tp > 1``): each
parameter's local gradient (its TP shard) averaged over the data-parallel group once a step.

DDP's reducer does not take DTensor parameters, so this is the trainer's own: fixed buckets of
at most ``comm.bucket_mb`` MiB in reverse registration order (roughly the order the backward
makes the gradients, DDP's first-iteration order), the same on every rank of the DP group since
they hold the same shards. With ``overlap`` (``comm.overlap=true``, no pipeline) a bucket is
all-reduced asynchronously during the last micro-batch's backward as soon as every gradient in it
has been accumulated (post-accumulate-grad hooks, armed only for that micro-batch), as DDP's
reducer does; :meth:`finish` launches what is left and waits. Otherwise every bucket goes after
the backward (under a pipeline the schedule runs the backward, and the reduction follows it).
Megatron's data parallelism beside TP is the same all-reduce of the local shards.
``comm.compression`` fp16 / bf16 puts each bucket on the wire in that dtype (counted in
:class:`trainers.comm.CommStats`, as DDP's cast hook counts); top-k and PowerSGD are DDP's
communication hooks, refused with TP by the validator.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from trainers.comm import CommStats, GradSyncStats, buckets
from trainers.parallel import local, reshard_grad

WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class ReplicaReducer:
    """Averages the local gradients of ``params`` over ``group`` in buckets, once a step."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        group,
        bucket_mb: float,
        sync: GradSyncStats,
        overlap: bool,
        compression: str = "none",
    ) -> None:
        if compression not in WIRE:
            raise ValueError(f"comm.compression={compression} is not a cast (none, fp16, bf16) the TP replicas send")
        self.group, self.sync, self.overlap = group, sync, overlap
        self.world = dist.get_world_size(group)
        self.wire_dtype = WIRE[compression]
        self.stats: Optional[CommStats] = CommStats() if self.wire_dtype is not None else None
        # by the parameters' local shards, whose sizes the gradients' take once resharded
        self.buckets = buckets(params, bucket_mb, tensor=local)
        self.bucket_of: Dict[int, int] = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.armed = False
        self.left: List[int] = []
        self.pending: Dict[int, Tuple[Any, Optional[dist.Work]]] = {}
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    def arm(self) -> None:
        """The next backward is the step's last: reduce each bucket as soon as it is complete."""
        self.armed = True
        self.left = [len(b) for b in self.buckets]
        self.pending = {}

    def _ready(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(param)]
        self.left[i] -= 1
        if self.left[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        for p in bucket:
            reshard_grad(p)
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        # a 16-bit wire carries each rank's share (divided first, as DDP's cast hook does), so the
        # sum stays in range; a dense one is averaged after it
        wire = flat if self.wire_dtype is None else flat.div_(self.world).to(self.wire_dtype)
        if self.stats is not None:
            self.stats.dense_bytes += flat.numel() * flat.element_size()
            self.stats.sent_bytes += wire.numel() * wire.element_size()
        self.sync.note()
        if wire.dtype == torch.bfloat16 and dist.get_backend(self.group) == "gloo":
            if self.wire_dtype is None:  # gloo has no bf16 sum kernel: an uncompressed bucket in fp32
                wire = wire.float()
            else:  # the bf16 wire itself: gather every rank's and sum them in fp32
                parts = [torch.empty_like(wire) for _ in range(self.world)]
                self.pending[i] = (parts, dist.all_gather(parts, wire, group=self.group, async_op=True))
                return
        self.pending[i] = (wire, dist.all_reduce(wire, group=self.group, async_op=True))

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward: launch every bucket not yet launched, wait for all, and
        write each averaged gradient back into its parameter's local gradient."""
        for i in range(len(self.buckets)):
            if i not in self.pending:
                self._launch(i)
        for i, (wire, work) in sorted(self.pending.items()):
            work.wait()
            if isinstance(wire, list):  # gathered bf16 buckets
                wire = torch.stack([w.float() for w in wire]).sum(0)
            wire = wire.div_(self.world) if self.wire_dtype is None else wire.float()
            offset = 0
            for p in self.buckets[i]:
                if p.grad is None:  # a parameter the step did not reach gets its replicas' mean too
                    p.grad = torch.zeros_like(p)
                g = local(p.grad)
                n = g.numel()
                g.copy_(wire[offset : offset + n].view_as(g))
                offset += n
        self.armed, self.pending = False, {}
