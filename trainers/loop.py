"""The training loop that runs inside every worker, and the worker entry function.

``worker_entry(spec, reporter)`` is what both launch paths (torch's elastic launcher on one node,
Ray later) call in each worker process. ``spec`` is a plain dict of config sections; metrics
leave through ``reporter`` on rank 0 only.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import time
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from trainers import data as data_mod
from trainers.model import GPT, ModelArgs, count_params, cross_entropy
from trainers.precision import DynamicLossScaler, PrecisionArgs, autocast
from trainers.report import NullReporter, Reporter
from trainers.runtime import RuntimeArgs, apply_env, init_process_group, peak_memory_gb, select_device, synchronize


class NonFiniteError(RuntimeError):
    """The loss or gradient norm went non-finite where no loss scaler could absorb it."""


@dataclass
class FaultArgs:
    kill_rank: int = -1
    at_step: int = -1
    nan_layer: int = -1
    nan_at_step: int = -1


@dataclass
class TrainArgs:
    steps: int = 50
    global_batch: int = 16
    micro_batch: int = 8
    seq_len: int = 128
    seed: int = 1234
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    warmup_steps: int = 3
    log_every: int = 10
    deterministic: bool = True
    fault: FaultArgs = field(default_factory=FaultArgs)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainArgs":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["fault"] = FaultArgs(**{k: v for k, v in dict(d.get("fault") or {}).items()
                                   if k in {f.name for f in fields(FaultArgs)}})
        return cls(**kw)


def lr_at(step: int, a: TrainArgs) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < a.lr_warmup_steps:
        return a.lr * (step + 1) / a.lr_warmup_steps
    span = max(1, a.steps - a.lr_warmup_steps)
    progress = min(1.0, (step - a.lr_warmup_steps) / span)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model: torch.nn.Module, a: TrainArgs) -> torch.optim.Optimizer:
    # no weight decay on norms, biases and (by convention) nothing one-dimensional
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, foreach=True)


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def _maybe_inject_fault(step: int, rank: int, fault: FaultArgs) -> None:
    """Chaos drill: the chosen rank dies hard at the chosen step, once per trial."""
    if fault.at_step == step and fault.kill_rank == rank and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def _nan_hook(trainer_step: List[int], at_step: int):
    def hook(module, inputs, output):
        if trainer_step[0] == at_step:
            return output + float("nan")
        return output
    return hook


def train(spec: Dict[str, Any], reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Run one trial's training in this process (a process group must be initialised or the
    world must be a single process). Returns the summary on rank 0, None elsewhere."""
    reporter = reporter or NullReporter()
    margs = ModelArgs.from_dict(spec["model"])
    targs = TrainArgs.from_dict(spec["trainer"])
    dargs = data_mod.DataArgs.from_dict(spec["data"])
    pargs = PrecisionArgs.from_dict(spec["precision"])
    rt = RuntimeArgs.from_dict(spec["runtime"])
    comm = spec.get("comm", {})
    parallel = spec.get("parallel", {})
    if int(parallel.get("tp", 1)) > 1 or int(parallel.get("pp", 1)) > 1:
        raise NotImplementedError("tensor and pipeline parallelism are not yet supported by this trainer")

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = select_device(rt, local_rank)
    dp = world  # data parallel only, for now
    accum = targs.global_batch // (dp * targs.micro_batch)

    seed_everything(targs.seed, targs.deterministic)
    model = GPT(margs).to(device)
    n_params = count_params(model)
    step_ref = [0]
    if 0 <= targs.fault.nan_layer < margs.n_layers and targs.fault.nan_at_step >= 0:
        model.layers[targs.fault.nan_layer].register_forward_hook(_nan_hook(step_ref, targs.fault.nan_at_step))
    ddp = None
    if world > 1:
        ddp = DDP(model, device_ids=[local_rank] if device.type in ("cuda", "npu") else None,
                  bucket_cap_mb=float(comm.get("bucket_mb", 25.0)))
    fwd = ddp if ddp is not None else model
    opt = build_optimizer(model, targs)
    scaler = DynamicLossScaler(pargs, device)

    if rank == 0:
        data_mod.prepare(dargs)
    if dist.is_initialized():
        dist.barrier()
    loader = data_mod.build_loader(
        dargs, seq_len=targs.seq_len, vocab_size=margs.vocab_size, seed=targs.seed,
        global_batch=targs.global_batch, micro_batch=targs.micro_batch, dp_rank=rank, dp_size=dp,
        steps=targs.steps, pin_memory=device.type == "cuda",
    )
    tokens_per_step = targs.global_batch * targs.seq_len
    # 6 N per token for matmuls forward and backward, plus attention scores 12 L d T
    flops_per_token = 6 * n_params + 12 * margs.n_layers * margs.d_model * targs.seq_len

    pending: List[Dict[str, Any]] = []
    pending_loss: List[torch.Tensor] = []
    history: List[Dict[str, Any]] = []

    def flush() -> None:
        if not pending:
            return
        losses = torch.stack(pending_loss).float()
        if dist.is_initialized() and world > 1:
            # the logged loss is the global-batch mean, as a single process would compute it
            dist.all_reduce(losses, op=dist.ReduceOp.SUM)
            losses /= world
        mem = peak_memory_gb(device)
        for row, loss in zip(pending, losses.tolist()):
            row["loss"] = loss
            row["memory_gb"] = mem
        if rank == 0:
            reporter.log_steps([dict(r) for r in pending])
            history.extend(pending)
        pending.clear()
        pending_loss.clear()

    fwd.train()
    it = iter(loader)
    for step in range(targs.steps):
        step_ref[0] = step
        _maybe_inject_fault(step, rank, targs.fault)
        t0 = time.perf_counter()
        lr = lr_at(step, targs)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_acc = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces only on the last micro-batch of the accumulation
            sync = ddp is None or micro == accum - 1
            ctx = ddp.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with autocast(pargs, device):
                    logits = fwd(x)
                loss = cross_entropy(logits, y) / accum
                scaler.scale_loss(loss).backward()
            loss_acc += loss.detach()
        finite = scaler.unscale_and_check(model.parameters())
        grad_norm = float("nan")
        if finite:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), targs.grad_clip))
            if not math.isfinite(grad_norm):
                if scaler.enabled:
                    finite = False
                else:
                    raise NonFiniteError(f"non-finite gradient norm at step {step}")
        if finite:
            opt.step()
        scaler.update(finite)
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        dt = time.perf_counter() - t0
        row = {"step": step, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt, "lr": lr,
               "grad_norm": grad_norm}
        if scaler.enabled:
            row["loss_scale"] = scaler.scale
            row["skipped_steps"] = scaler.skipped_steps
        pending.append(row)
        pending_loss.append(loss_acc)
        if rank == 0:
            reporter.on_step(step, dt)
        if (step + 1) % max(1, targs.log_every) == 0 or step == targs.steps - 1:
            flush()

    if rank != 0:
        return None
    timed = [r["step_time_s"] for r in history if r["step"] >= targs.warmup_steps] or [r["step_time_s"] for r in history]
    median = statistics.median(timed)
    peak_flops = rt.peak_flops * world
    summary = {
        "step_time_median_s": median,
        "tokens_per_s_median": tokens_per_step / median,
        "final_loss": history[-1]["loss"],
        "peak_mem_gb": peak_memory_gb(device),
        "n_params": n_params,
        "mfu": (flops_per_token * tokens_per_step / median) / peak_flops if peak_flops > 0 else None,
        "skipped_steps": scaler.skipped_steps,
        "world_size": world,
    }
    reporter.finish(summary)
    summary["losses"] = [r["loss"] for r in history]
    return summary


@record  # writes the exception to the elastic error file, so the launcher can report why
def worker_entry(spec: Dict[str, Any], reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Entry point of one worker process: env, process group, train, tear down."""
    rt = RuntimeArgs.from_dict(spec["runtime"])
    apply_env(rt.env)
    init_process_group(rt)
    try:
        return train(spec, reporter)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
