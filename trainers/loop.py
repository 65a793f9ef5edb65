"""The training loop that runs inside every worker, and the worker entry function.

``worker_entry(spec, reporter)`` is what both launch paths (torch's elastic launcher on one node,
Ray later) call in each worker process. ``spec`` is a plain dict of config sections; metrics
leave through ``reporter`` on rank 0 only.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from trainers import checkpoint as ckpt
from trainers import comm as comm_mod
from trainers import data as data_mod
from trainers import rules
from trainers.config import FaultConfig, TrainerConfig, TrialSpec
from trainers.model import GPT, RMSNorm, count_params, cross_entropy
from trainers.memory import model_state_bytes
from trainers.monitor import FiniteTracker, PrecisionMonitor
from trainers.parallel import (apply_fsdp, build_mesh, build_stages, clip_grads_,
                               acc_dtype, param_checksum)
from trainers.precision import DynamicLossScaler, autocast
from trainers.profiling import Profiler
from trainers.report import NullReporter, Reporter
from trainers.runtime import (apply_env, compile_backend, init_process_group, peak_memory_gb,
                              select_device, synchronize)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm went non-finite where no loss scaler could absorb it."""


def lr_at(step: int, a: TrainerConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < a.lr_warmup_steps:
        return a.lr * (step + 1) / a.lr_warmup_steps
    span = max(1, a.steps - a.lr_warmup_steps)
    progress = min(1.0, (step - a.lr_warmup_steps) / span)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(params: List[torch.nn.Parameter], a: TrainerConfig) -> torch.optim.Optimizer:
    # no weight decay on norms and biases (everything one-dimensional); DTensor and plain
    # parameters in separate groups, as the foreach kernels cannot mix them
    from torch.distributed.tensor import DTensor

    groups = []
    for is_dt in (False, True):
        for decay in (True, False):
            ps = [p for p in params if isinstance(p, DTensor) == is_dt and (p.dim() >= 2) == decay]
            if ps:
                groups.append({"params": ps, "weight_decay": a.weight_decay if decay else 0.0})
    return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, foreach=True)


def _maybe_inject_fault(step: int, rank: int, fault: FaultConfig, marker_dir: Optional[str]) -> None:
    """Chaos drill: the chosen rank dies hard at the chosen step, once per trial (a marker in the
    checkpoint folder, or the elastic restart count, tells a restarted group it already fired)."""
    if fault.at_step != step or fault.kill_rank != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if marker_dir:
        marker = os.path.join(marker_dir, f"fault_fired_rank{rank}_step{step}")
        if os.path.exists(marker):
            return
        os.makedirs(marker_dir, exist_ok=True)
        open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def _inject_hook(trainer_step: List[int], at_step: int, inject: str):
    """Chaos drill: a NaN in one block's output at one step; or (inject=overflow) the output
    scaled by 1e5 through fp16, which overflows to inf as an fp16 activation would."""
    def hook(module, inputs, output):
        if trainer_step[0] != at_step:
            return output
        if inject == "overflow":
            return (output * 1e5).to(torch.float16).to(output.dtype)
        return output + float("nan")
    return hook


def _fp32_forward(forward, device_type: str):
    def run(x, *args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            return forward(x.float(), *args, **kwargs).to(x.dtype)
    return run


def force_fp32(module: torch.nn.Module, ops: List[str], device_type: str) -> None:
    """Run the listed ops (norms) in fp32 whatever the autocast dtype: autocast's own fp32 lists
    differ between CUDA, CPU and NPU, so the choice is made here, explicitly."""
    wanted = tuple(t for op, t in (("layer_norm", torch.nn.LayerNorm), ("rms_norm", RMSNorm)) if op in ops)
    for m in module.modules():
        if wanted and isinstance(m, wanted):
            m.forward = _fp32_forward(m.forward, device_type)


class _Model:
    """This rank's share of the model: its stage modules, wrapped for data parallelism, and how
    one optimizer step runs through them (micro-batch accumulation, or a pipeline schedule)."""

    def __init__(self, spec: TrialSpec, device: torch.device, scaler: DynamicLossScaler):
        self.margs, self.targs, self.pargs = spec.model, spec.trainer, spec.precision
        self.p = copy.copy(spec.parallel)
        comm = spec.comm
        self.device, self.scaler = device, scaler
        world = dist.get_world_size() if dist.is_initialized() else 1
        p = self.p
        if not dist.is_initialized():
            p.dp = p.tp = p.pp = 1  # the single-process reference
        elif p.dp * p.tp * p.pp != world:
            p.dp = world // (p.tp * p.pp)
        self.mesh = build_mesh(device.type, p) if dist.is_initialized() else None
        self.dp_rank = self.mesh.dp_rank if self.mesh else 0
        seed = self.targs.seed
        if self.mesh is None:
            stages = [(0, GPT(self.margs, seed=seed).to(device))]
        else:
            stages = build_stages(self.margs, p, self.mesh, device, seed)
        self.n_stages = p.pp * rules.stages_per_rank(p.pp, p.schedule, p.virtual_stages)
        self.stage_ids = [sid for sid, _ in stages]
        self.modules = [m for _, m in stages]
        for m in self.modules:
            force_fp32(m, self.pargs.fp32_ops if self.pargs.compute_dtype != "fp32" else [], device.type)
            if self.targs.compile:
                # per block, as torchtitan does: each block's graph is the same, so it compiles once
                backend = compile_backend(device.type, self.targs.compile_backend)
                for block in m.layers.values():
                    block.compile(backend=backend)
        self.comm_stats = None
        self.wrapped: List[torch.nn.Module] = []
        for m in self.modules:
            wrapping = rules.dp_wrapping(p.dp, p.tp, p.dp_shard)
            if wrapping == "fsdp":
                self.wrapped.append(apply_fsdp(m, self.mesh.sub("dp")))
            elif wrapping == "ddp":
                ddp = DDP(m, process_group=self.mesh.group("dp"), bucket_cap_mb=float(comm.bucket_mb),
                          device_ids=[device.index] if device.type in ("cuda", "npu") else None)
                stats = comm_mod.register(ddp, comm.compression, self.mesh.group("dp"),
                                          topk_ratio=float(comm.topk_ratio), powersgd_rank=int(comm.powersgd_rank))
                self.comm_stats = stats or self.comm_stats
                self.wrapped.append(ddp)
            else:
                self.wrapped.append(m)
        self.params = [q for m in self.modules for q in m.parameters() if q.requires_grad]
        self.has_last = self.n_stages - 1 in self.stage_ids
        self.has_first = 0 in self.stage_ids
        self.schedule = self._build_schedule() if p.pp > 1 else None

    def _build_schedule(self):
        from torch.distributed import pipelining as pl

        stages = [pl.PipelineStage(m, sid, self.n_stages, self.device, group=self.mesh.group("pp"))
                  for sid, m in zip(self.stage_ids, self.wrapped)]
        cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
               "interleaved_1f1b": pl.ScheduleInterleaved1F1B, "zbv": pl.ScheduleZBVZeroBubble}[self.p.schedule]

        def loss_fn(logits, target):
            return self.scaler.scale_loss(cross_entropy(logits, target))

        # scale_grads: gradients are averaged over the microbatches, as a single process
        # accumulating the same micro-batches would
        arg = stages[0] if cls in (pl.ScheduleGPipe, pl.Schedule1F1B) else stages
        return cls(arg, n_microbatches=self.p.microbatches, loss_fn=loss_fn, scale_grads=True)

    def train(self) -> None:
        for m in self.wrapped:
            m.train()

    def _sync_ctx(self, sync: bool):
        """Gradient all-reduce only on the last micro-batch of an accumulation."""
        if sync:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for m in self.wrapped:
            if isinstance(m, DDP):
                stack.enter_context(m.no_sync())
            elif hasattr(m, "set_requires_gradient_sync"):
                m.set_requires_gradient_sync(False)
                stack.callback(m.set_requires_gradient_sync, True)
        return stack

    def forward_backward(self, batches) -> torch.Tensor:
        """One optimizer step's forward and backward; returns this rank's mean loss (unscaled),
        or NaN-free zero on pipeline ranks that do not hold the loss."""
        if self.schedule is None:
            accum = len(batches)
            loss_acc = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(batches):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with self._sync_ctx(i == accum - 1):
                    with autocast(self.pargs, self.device):
                        logits = self.wrapped[0](x)
                    loss = cross_entropy(logits, y) / accum
                    self.scaler.scale_loss(loss).backward()
                loss_acc += loss.detach()
            return loss_acc
        (x, y), = batches
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        losses: List[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        with autocast(self.pargs, self.device):
            self.schedule.step(*args, target=y if self.has_last else None, losses=losses if self.has_last else None)
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([l.detach().float() for l in losses]).mean() / self.scaler.scale


def train(spec: TrialSpec, reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Run one trial's training in this process (a process group must be initialised, or this is
    the single-process reference). Returns the summary on rank 0, None elsewhere."""
    reporter = reporter or NullReporter()
    targs, dargs, pargs, rt = spec.trainer, spec.data, spec.precision, spec.runtime
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = select_device(rt, int(os.environ.get("LOCAL_RANK", "0")))
    if targs.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(targs.seed)

    scaler = DynamicLossScaler(pargs, device)
    model = _Model(spec, device, scaler)
    p, margs, mesh = model.p, model.margs, model.mesh
    n_params = count_params_global(margs)
    step_ref = [0]
    for m in model.modules:
        key = str(targs.fault.nan_layer)
        if targs.fault.nan_at_step >= 0 and key in m.layers:
            m.layers[key].register_forward_hook(_inject_hook(step_ref, targs.fault.nan_at_step, targs.fault.inject))
    tracker = FiniteTracker(model.modules, device)  # after the drill's hook: it sees its output
    monitor = PrecisionMonitor(model.modules, pargs.monitor)
    profiler = Profiler(targs.profile, targs.profile_start, targs.profile_steps,
                        targs.profile_dir or os.path.join(os.getcwd(), "profiles"), device, rank)
    # one optimizer per stage part (AdamW has no cross-parameter state), so each part's state
    # dict can be taken and restored with its module
    optims = [build_optimizer([q for q in m.parameters() if q.requires_grad], targs) for m in model.modules]

    if rank == 0:
        data_mod.prepare(dargs)
    if dist.is_initialized():
        dist.barrier()
    start_step = 0
    found = ckpt.latest(targs.checkpoint_dir)
    if found is not None:
        start_step, path = found
        extra = ckpt.load(path, model.modules, optims)
        scaler.load_state_dict(extra["scaler"])
    split = rules.batch_split(targs.global_batch, p.dp, p.pp, targs.micro_batch, p.microbatches)
    # the pipeline schedule cuts the replica's batch into its microbatches itself
    micro = split.per_replica if p.pp > 1 else split.size
    accum = split.per_replica // micro
    loader = data_mod.build_loader(
        dargs, seq_len=targs.seq_len, vocab_size=margs.vocab_size, seed=targs.seed,
        global_batch=targs.global_batch, micro_batch=micro, dp_rank=model.dp_rank, dp_size=p.dp,
        steps=targs.steps, start_step=start_step, pin_memory=device.type == "cuda",
    )
    tokens_per_step = targs.global_batch * targs.seq_len
    # 6 N per token for the matmuls forward and backward, plus attention scores 12 L d T
    flops_per_token = 6 * n_params + 12 * margs.n_layers * margs.d_model * targs.seq_len
    holds_loss = torch.tensor([1.0 if model.schedule is None or model.has_last else 0.0], device=device)

    pending: List[Dict[str, Any]] = []
    pending_loss: List[torch.Tensor] = []
    history: List[Dict[str, Any]] = []

    def flush() -> None:
        if not pending:
            return
        # the logged loss is the global-batch mean, as a single process would compute it: the
        # ranks that hold a loss contribute it (tp copies and dp replicas alike), then divide
        losses = torch.cat([torch.stack(pending_loss).float() * holds_loss, holds_loss])
        if dist.is_initialized() and world > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        losses = (losses[:-1] / losses[-1]).tolist()
        mem = peak_memory_gb(device)
        for row, loss in zip(pending, losses):
            row["loss"] = loss
            row["memory_gb"] = mem
        if rank == 0:
            reporter.log_steps([dict(r) for r in pending])
            history.extend(pending)
        pending.clear()
        pending_loss.clear()

    param_sum_initial = param_checksum(model.params, mesh)
    state_bytes: Optional[Dict[str, int]] = None
    model.train()
    it = iter(loader)
    for step in range(start_step, targs.steps):
        step_ref[0] = step
        _maybe_inject_fault(step, rank, targs.fault, targs.checkpoint_dir)
        profiler.step(step)
        monitor.begin(step)
        tracker.reset()
        t0 = time.perf_counter()
        lr = lr_at(step, targs)
        for opt in optims:
            for group in opt.param_groups:
                group["lr"] = lr
        loss = model.forward_backward([next(it) for _ in range(accum)])
        finite = scaler.unscale_and_check(model.params)
        grad_norm = float("nan")
        if finite:
            grad_norm = clip_grads_(model.params, targs.grad_clip, mesh)
            finite = math.isfinite(grad_norm)
        # every rank reaches here with the same `finite` (the flag and the norm are global)
        first_bad = None if finite else tracker.first_layer()
        if not finite and (not scaler.enabled or scaler.skipped_in_row + 1 >= scaler.max_consecutive_skips):
            where = f"first in layer {first_bad} (block output)" if first_bad is not None else \
                "forward activations finite, first in the backward pass"
            why = "" if not scaler.enabled else f" ({scaler.skipped_in_row + 1} overflowed steps in a row)"
            raise NonFiniteError(f"non-finite values at step {step}{why}: {where}")
        stats = monitor.collect() if monitor.active else None
        for opt in optims:
            if finite:
                opt.step()
        if state_bytes is None:  # what the rank holds at its fullest: after the first step's update
            state_bytes = model_state_bytes(model.modules, optims)
        for opt in optims:
            opt.zero_grad(set_to_none=True)
        scaler.update(finite)
        synchronize(device)
        dt = time.perf_counter() - t0
        row = {"step": step, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt, "lr": lr, "grad_norm": grad_norm}
        row["loss_scale"] = scaler.scale
        row["skipped_steps"] = scaler.skipped_steps
        if first_bad is not None:
            row["overflow_layer"] = first_bad  # the skipped step's first non-finite block
        if stats:
            acts = [r for r in stats if r["kind"] == "activation"]
            row["monitor_act_max_abs"] = max(r["max_abs"] for r in acts) if acts else 0.0
            row["monitor_overflow_frac"] = max(r["overflow_fp16"] for r in stats)
            row["monitor_nonfinite"] = sum(r["nonfinite"] for r in stats)
            if rank == 0:
                reporter.log_table(step, "monitor", stats)
        if model.comm_stats is not None:
            row.update(model.comm_stats.take())
        pending.append(row)
        pending_loss.append(loss)
        if rank == 0:
            reporter.on_step(step, dt)
        done = step + 1
        due = targs.checkpoint_every > 0 and targs.checkpoint_dir and done % targs.checkpoint_every == 0
        if done % max(1, targs.log_every) == 0 or done == targs.steps or due:
            flush()
        if due:
            path = ckpt.save(targs.checkpoint_dir, done, model.modules, optims, {"scaler": scaler.state_dict()})
            if rank == 0:
                reporter.checkpoint(done, str(path))

    profiler.close()
    comm_shares = _gather(profiler.result.comm_share if profiler.result else 0.0, device, world)
    peaks = _gather(peak_memory_gb(device), device, world)
    skipped = _gather(float(scaler.skipped_steps), device, world)
    held = {k: _gather(float((state_bytes or {}).get(k, 0)), device, world) for k in ("params", "grads", "optimizer")}
    param_sum_final = param_checksum(model.params, mesh)
    if rank != 0:
        return None
    if not history:  # resumed from a checkpoint of the last step: nothing left to run
        return {"resumed_from_step": start_step, "world_size": world, "losses": [], "grad_norms": []}
    timed = [r["step_time_s"] for r in history if r["step"] >= targs.warmup_steps] or [r["step_time_s"] for r in history]
    median = statistics.median(timed)
    # CPU workers share one host, whose peak the cpu chip gives; devices add up
    peak_flops = rt.peak_flops * (1 if device.type == "cpu" else world)
    summary = {
        "step_time_median_s": median,
        "tokens_per_s_median": tokens_per_step / median,
        "final_loss": history[-1]["loss"],
        "peak_mem_gb": max(peaks),
        "n_params": n_params,
        "mfu": (flops_per_token * tokens_per_step / median) / peak_flops if peak_flops > 0 else None,
        "skipped_steps_total": scaler.skipped_steps,
        "skipped_steps_per_rank": [int(v) for v in skipped],
        "param_sum_initial": param_sum_initial,
        "param_sum_final": param_sum_final,
        "world_size": world,
        "resumed_from_step": start_step,
        "bubble_fraction": rules.bubble_fraction(p.pp, p.microbatches, p.schedule, p.virtual_stages),
        # per rank, in rank order: bytes of parameters, gradients and optimizer state held
        "model_state_bytes": [{k: int(held[k][r]) for k in held} for r in range(world)],
    }
    summary.update({f"peak_mem_gb_rank{r}": v for r, v in enumerate(peaks)} if world > 1 else {})
    if profiler.result is not None:
        summary.update(profiler.result.metrics())
        summary["comm_share"] = max(comm_shares)  # the rank that waits on communication most
        table = os.path.join(profiler.out_dir, "top_ops.txt")
        with open(table, "w") as f:
            f.write(profiler.result.table)
        for path in (profiler.result.trace_path, table):
            if path:
                reporter.log_artifact(path, "profile")
    reporter.finish(summary)
    summary["losses"] = [r["loss"] for r in history]
    summary["grad_norms"] = [r["grad_norm"] for r in history]
    return summary


def count_params_global(margs) -> int:
    with torch.device("meta"):
        return count_params(GPT(margs))


def _gather(value: float, device: torch.device, world: int) -> List[float]:
    """One number from every rank, in rank order."""
    mine = torch.tensor([value], dtype=acc_dtype(device), device=device)
    if not dist.is_initialized() or world == 1:
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


@record  # writes the exception to the elastic error file, so the launcher can report why
def worker_entry(spec: TrialSpec, reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Entry point of one worker process: env, process group, train, tear down."""
    rt = spec.runtime
    apply_env(rt.env)
    init_process_group(rt)
    try:
        return train(spec, reporter)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
