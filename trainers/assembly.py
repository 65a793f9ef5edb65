"""This rank's share of the model, assembled: its pipeline stages (tensor-parallel where tp > 1),
stored in ``precision.param_dtype`` with the fp32-ops policy applied, wrapped for data
parallelism as ``rules.dp_wrapping`` says, and how one optimizer step's forward and backward
(micro-batch accumulation, or a pipeline schedule) and a held-out evaluation run through them.

``parallel.dp_shard`` decides how replicas meet (``rules.DP_MODES``), ``comm.overlap`` when:

* ``ddp`` without TP: DDP's bucket hooks all-reduce during the last micro-batch's backward
  (overlap on); off: no DDP wrapper, the gradients are all-reduced in buckets of
  ``comm.bucket_mb`` once the backward has returned. With TP (DTensor parameters, which DDP does
  not take): the same buckets over the gradients' local shards (``trainers/replicas.py``),
  reduced during the last backward (overlap on, no pipeline) or after it.
* ``zero1`` and ``fsdp`` (FSDP2), overlap on: each block is an FSDP unit (its all-gather and
  reduce-scatter overlap the neighbouring blocks' compute); off: one unit for the whole stage
  (``fully_shard`` of the stage root only). ``fsdp`` (ZeRO-3) reshards a unit after each forward
  and backward and reduce-scatters every micro-batch's gradients into their shards
  (``trainers/pipeline_stage.py`` under a pipeline): the least memory, the most traffic;
  ``zero1`` keeps it gathered from the step's first forward to its last backward
  (``reshard_after_forward=False``, ``set_reshard_after_backward(False)`` on all micro-batches
  but the last) and its whole gradients until then: one all-gather and one reduce-scatter a step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainers import comm as comm_mod
from trainers import rules
from trainers.config import TrialSpec
from trainers.head_loss import ChunkedHeadLoss, loss_fn
from trainers.model import GPT
from trainers.parallel import acc_dtype, apply_fsdp, build_mesh, build_stages, local
from trainers.pipeline_stage import stage_class
from trainers.precision import LossScaler, apply_op_policy, autocast, cast_params
from trainers.replicas import ReplicaReducer
from trainers.runtime import compile_backend


class RankModel:
    """This rank's stage modules, wrapped for data parallelism, and how one optimizer step and
    one evaluation run through them."""

    def __init__(self, spec: TrialSpec, device: torch.device, scaler: LossScaler):
        self.margs, self.targs, self.pargs, self.comm = spec.model, spec.trainer, spec.precision, spec.comm
        self.p = copy.copy(spec.parallel)
        self.device, self.scaler = device, scaler
        world = dist.get_world_size() if dist.is_initialized() else 1
        p = self.p
        if not dist.is_initialized():
            p.dp = p.tp = p.pp = 1  # the single-process reference
        elif p.dp * p.tp * p.pp != world:
            p.dp = world // (p.tp * p.pp)
        self.mesh = build_mesh(device.type, p) if dist.is_initialized() else None
        self.dp_rank = self.mesh.dp_rank if self.mesh else 0
        # the token cross-entropy of the head's output: over the vocabulary shards under TP (the
        # logits stay sharded), so no rank holds the whole vocabulary's logits
        self.loss = loss_fn(self.mesh, self.margs.vocab_size)
        seed = self.targs.seed
        if self.mesh is None:
            stages = [(0, GPT(self.margs, seed=seed).to(device))]
        else:
            stages = build_stages(self.margs, p, self.mesh, device, seed)
        self.n_stages = p.pp * rules.stages_per_rank(p.pp, p.schedule, p.virtual_stages)
        self.stage_ids = [sid for sid, _ in stages]
        self.modules = [m for _, m in stages]
        if self.margs.hf_weights:  # each rank reads its shards, before any DP wrapping
            from trainers import hf_weights

            hf_weights.load(self.modules, self.margs.hf_weights, self.margs)
        for m in self.modules:
            # before wrapping: FSDP shards, and DDP buckets, the parameters as they are stored
            cast_params(m, self.pargs.param_dtype)
            apply_op_policy(m, self.pargs)
            if self.targs.compile:
                # per block, as torchtitan does: each block's graph is the same, so it compiles once
                backend = compile_backend(device.type, self.targs.compile_backend)
                for block in m.layers.values():
                    block.compile(backend=backend)
        self.wrapping = rules.dp_wrapping(p.dp, p.tp, p.dp_shard)
        self.sync = comm_mod.GradSyncStats()
        self.comm_stats: Optional[comm_mod.CommStats] = None
        self.comm_states: List[Any] = []  # each DDP module's compression state (a checkpoint keeps it)
        # DDP without overlap: plain modules, gradients all-reduced after the backward
        self.reduce_after_backward = self.wrapping == "ddp" and p.tp == 1 and not self.comm.overlap
        self.wrapped: List[torch.nn.Module] = [self._wrap(m) for m in self.modules]
        # replicas under TP: the trainer's own bucketed all-reduce of the local gradient shards,
        # during the last backward where the trainer runs it (no pipeline), else after it
        self.replicas: Optional[ReplicaReducer] = None
        if self.wrapping == "ddp" and p.tp > 1:
            self.replicas = ReplicaReducer(
                [q for m in self.modules for q in m.parameters() if q.requires_grad],
                self.mesh.group("dp"),
                float(self.comm.bucket_mb),
                self.sync,
                overlap=bool(self.comm.overlap) and p.pp == 1,
                compression=str(self.comm.compression),
            )
            self.comm_stats = self.replicas.stats
        self.fsdp_units = sum(_fsdp_units(m) for m in self.modules)
        self.params = [q for m in self.modules for q in m.parameters() if q.requires_grad]
        self.has_last = self.n_stages - 1 in self.stage_ids
        self.has_first = 0 in self.stage_ids
        if self.has_last and self.margs.loss_chunks > 1:
            # the last stage gives out the final norm's output; the loss applies the head
            head = self.modules[self.stage_ids.index(self.n_stages - 1)].head
            self.loss = ChunkedHeadLoss(
                head,
                self.loss,
                self.margs.loss_chunks,
                p.tp if p.sequence_parallel and p.tp > 1 else 1,
                functools.partial(autocast, self.pargs, device),
            )
        self.schedule = self._build_schedule() if p.pp > 1 else None
        # dropout: every rank of a TP group draws the same masks (same seed, same draws), so
        # replicated activations stay replicated; each pipeline stage gets its own stream, as
        # Megatron's _set_random_seed offsets the seed by 100 x the pipeline rank
        torch.manual_seed(seed + 100 * (self.mesh.pp_rank if self.mesh else 0))

    def _wrap(self, m: torch.nn.Module) -> torch.nn.Module:
        if rules.sharded(self.wrapping):
            keep = self.wrapping == "zero1"
            if self.comm.overlap:
                return apply_fsdp(m, self.mesh.sub("dp"), reshard_after_forward=not keep)
            from torch.distributed.fsdp import fully_shard

            # one unit: its parameters stay gathered from the forward through the backward
            # (reshard_after_forward=False), so nothing is re-gathered mid-backward either
            return fully_shard(m, mesh=self.mesh.sub("dp"), reshard_after_forward=False)
        if self.p.tp > 1:
            return m  # replicas under TP: ReplicaReducer
        if self.wrapping == "ddp" and self.comm.overlap:
            ddp = DDP(
                m,
                process_group=self.mesh.group("dp"),
                bucket_cap_mb=float(self.comm.bucket_mb),
                device_ids=[self.device.index] if self.device.type in ("cuda", "npu") else None,
            )
            stats, state = comm_mod.register(
                ddp,
                self.comm.compression,
                self.mesh.group("dp"),
                self.sync,
                topk_ratio=float(self.comm.topk_ratio),
                powersgd_rank=int(self.comm.powersgd_rank),
            )
            self.comm_stats = stats or self.comm_stats
            self.comm_states.append(state)
            return ddp
        return m

    def _build_schedule(self):
        from torch.distributed import pipelining as pl

        stages = [
            stage_class(self.wrapping, self.p.schedule)(m, sid, self.n_stages, self.device, group=self.mesh.group("pp"))
            for sid, m in zip(self.stage_ids, self.wrapped)
        ]
        cls = {
            "gpipe": pl.ScheduleGPipe,
            "1f1b": pl.Schedule1F1B,
            "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
            "zbv": pl.ScheduleZBVZeroBubble,
        }[self.p.schedule]

        n = self.p.microbatches

        def scaled_loss(logits, target):
            # each microbatch's loss divided by their number before the loss scale, as a single
            # process accumulating the same micro-batches divides it: the gradients are their mean,
            # and the backward's fp16 values are as large as the single process's. (torch's
            # scale_grads=True divides the gradients after the backward instead, so every
            # microbatch's backward ran n times larger: llama_tiny fp16 tp2pp2 and dp2pp2 overflowed
            # a step the single process did not.)
            return self.scaler.scale_loss(self.loss(logits, target) / n)

        arg = stages[0] if cls in (pl.ScheduleGPipe, pl.Schedule1F1B) else stages
        schedule = cls(arg, n_microbatches=n, loss_fn=scaled_loss, scale_grads=False)
        # the last stage's outputs (the head's logits, b x s x vocab a micro-batch) are kept for
        # step() to return unless return_outputs=False (torch >= 2.8): logits resident at the
        # step's peak (measured on gpt_tiny pp2's last stage, vocab 4096: 31.5 MiB -> 27.5 MiB)
        self._no_outputs = {"return_outputs": False} if "return_outputs" in _params(schedule.step) else {}
        return schedule

    def train(self, mode: bool = True) -> None:
        for m in self.wrapped:
            m.train(mode)

    def _sync_ctx(self, sync: bool):
        """Gradient reduction only on the last micro-batch of an accumulation (``fsdp``, ZeRO-3,
        reduce-scatters every micro-batch's into its sharded gradients); ``zero1`` keeps its units
        gathered after every backward but the last."""
        if sync or self.wrapping == "fsdp":
            if self.replicas is not None and self.replicas.overlap:
                self.replicas.arm()
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in self.wrapped:
            if isinstance(m, DDP):
                stack.enter_context(m.no_sync())
            elif hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(False)
                stack.callback(m.set_requires_gradient_sync, True)
                if self.wrapping == "zero1":
                    m.set_reshard_after_backward(False)
                    stack.callback(m.set_reshard_after_backward, True)
        return stack

    def forward_backward(self, batches) -> torch.Tensor:
        """One optimizer step's forward and backward, gradients reduced over the replicas; returns
        this rank's mean loss (unscaled), or zero on pipeline ranks that do not hold the loss."""
        if self.schedule is None:
            accum = len(batches)
            loss_acc = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(batches):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with self._sync_ctx(i == accum - 1):
                    with autocast(self.pargs, self.device):
                        logits = self.wrapped[0](x)
                    loss = self.loss(logits, y) / accum
                    # nothing saves the head's output (the loss keeps its fp32 log-softmax): holding
                    # it through the backward kept b x s x vocab in the compute dtype alive at the
                    # step's peak (1.95 GiB for llama_1b at 16 x 2048 on an H200)
                    del logits
                    self.scaler.scale_loss(loss).backward()
                loss_acc += loss.detach()
        else:
            ((x, y),) = batches
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            losses: List[torch.Tensor] = []
            args = (x,) if self.has_first else ()
            with autocast(self.pargs, self.device):
                self.schedule.step(
                    *args,
                    target=y if self.has_last else None,
                    losses=losses if self.has_last else None,
                    **self._no_outputs,
                )
            loss_acc = (
                torch.stack([x.detach().float() for x in losses]).sum() / self.scaler.scale  # each was / n
                if self.has_last
                else torch.zeros((), device=self.device)
            )
        if self.reduce_after_backward:
            comm_mod.allreduce_after_backward(self.params, self.mesh.group("dp"), self.comm.bucket_mb, self.sync)
        if self.replicas is not None:
            self.replicas.finish()
        return loss_acc

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        """Mean loss of these held-out micro-batches (whole replica batches under a pipeline) in
        eval mode, without gradients; zero on pipeline ranks that do not hold the loss. Every
        rank of the job takes part (FSDP gathers, TP all-reduces, the pipeline's sends)."""
        self.train(False)
        try:
            losses: List[torch.Tensor] = []
            for x, y in batches:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with autocast(self.pargs, self.device):
                    if self.schedule is None:
                        losses.append(self.loss(self.wrapped[0](x), y))
                    else:
                        for xm, ym in zip(x.chunk(self.p.microbatches), y.chunk(self.p.microbatches)):
                            loss = self._pipeline_forward(xm, ym)
                            if loss is not None:
                                losses.append(loss)
            if not losses:
                return torch.zeros((), device=self.device)
            return torch.stack([x.float() for x in losses]).mean()
        finally:
            self.train(True)

    def _pipeline_forward(self, x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
        """One micro-batch forward through every stage, in stage order, with explicit send/recv
        between the ranks holding consecutive stages; the loss on the rank holding the last.
        Not the schedule's own ``eval()``: in torch 2.13 ZB-V's runtime still runs its
        backward-input actions there and fails, so one path serves every schedule. Every rank
        walks the stages in the same order, so each send meets its recv."""
        group, me = self.mesh.group("pp"), self.mesh.pp_rank
        owner = {
            sid: r
            for r in range(self.p.pp)
            for sid in rules.stage_ids(self.p.pp, self.p.schedule, self.p.virtual_stages, r)
        }
        mine = dict(zip(self.stage_ids, self.wrapped))
        h: torch.Tensor = x
        for s in range(self.n_stages):
            if owner[s] != me:
                continue
            if s > 0 and owner[s - 1] != me:
                h = _recv(owner[s - 1], group, self.device)
            h = local(mine[s](h))
            if s == self.n_stages - 1:
                return self.loss(h, y)
            if owner[s + 1] != me:
                _send(h, owner[s + 1], group)
        return None

    def tp_replica_divergence(self) -> float:
        """All ranks (a collective over each TP group when tp > 1): the largest difference across
        a TP group of the sum of a parameter that TP replicates (norms, and what is not sharded
        over tp): 0 when every TP rank applied the same updates, e.g. drew the same dropout masks."""
        if self.mesh is None or self.mesh.tp == 1:
            return 0.0
        sums = [local(q).detach().to(acc_dtype(self.device)).sum() for q in self.params if _tp_replicated(q)]
        if not sums:
            return 0.0
        hi = torch.stack(sums)
        lo = hi.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.mesh.group("tp"))
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.mesh.group("tp"))
        return float((hi - lo).max())


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEADER = 8  # dtype code, ndim, up to 6 dims


def _send(t: torch.Tensor, group_dst: int, group) -> None:
    # shape and dtype first: under sequence parallelism a stage's output is this rank's
    # sequence shard, and its dtype follows the parameters' and the compute dtype
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _WIRE_DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(t.device), group_dst=group_dst, group=group)
    dist.send(t.contiguous(), group_dst=group_dst, group=group)


def _recv(group_src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, group_src=group_src, group=group)
    dtype, ndim = _WIRE_DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, group_src=group_src, group=group)
    return out


def _tp_replicated(q: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(q, DTensor):
        return True
    names = q.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(q.placements[names.index("tp")], Replicate)


def _params(fn) -> set:
    import inspect

    return set(inspect.signature(fn).parameters)


def _fsdp_units(m: torch.nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(sub, FSDPModule) for sub in m.modules())
