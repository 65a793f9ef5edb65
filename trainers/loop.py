"""The training loop that runs inside every worker, and the worker entry function.

``worker_entry(spec, reporter)`` is what both launch paths (torch's elastic launcher on one node,
Ray later) call in each worker process. ``spec`` is a plain dict of config sections; metrics
leave through ``reporter`` on rank 0 only. The model's assembly (stages, wrapping, schedule) is
``trainers/assembly.py``, the optimizer ``trainers/optim.py``, the chaos drills
``trainers/faults.py``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainers import checkpoint as ckpt
from trainers import comm as comm_mod
from trainers import data as data_mod
from trainers import faults, measure, rules
from trainers import optim as optim_mod
from trainers.assembly import RankModel
from trainers.clock import StepClock
from trainers.config import TrialSpec
from trainers.memory import model_state_bytes
from trainers.model import GPT, count_params
from trainers.monitor import FiniteTracker, PrecisionMonitor
from trainers.optim import lr_at
from trainers.parallel import acc_dtype, global_grad_norm, param_checksum
from trainers.precision import LossScaler, grad_multiplier
from trainers.profiling import METRIC_KEYS, Profiler
from trainers.report import ROW_TIME, NullReporter, Reporter
from trainers.runtime import (
    adopt_env,
    memory_gb,
    peak_memory_gb,
    release_memory,
    select_device,
    set_deterministic,
    setup,
)
from trainers.step_log import NonFiniteError, StepLog, flush_with  # noqa: F401 (NonFiniteError: re-exported)


def train(spec: TrialSpec, reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Run one trial's training in this process (a process group must be initialised, or this is
    the single-process reference). Returns the summary on rank 0, None elsewhere."""
    reporter = reporter or NullReporter()
    targs, dargs, pargs, rt = spec.trainer, spec.data, spec.precision, spec.runtime
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0 and hasattr(reporter, "open"):
        reporter.open()  # connects to its store while the model is built
    set_deterministic(rt.device_type, targs.deterministic)
    device = select_device(rt, int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(targs.seed)

    scaler = LossScaler(pargs, device)
    model = RankModel(spec, device, scaler)
    p, margs, mesh = model.p, model.margs, model.mesh
    n_params = count_params_global(margs)
    step_ref = [0]
    faults.install_injection(model.modules, targs.fault, step_ref)
    tracker = FiniteTracker(model.modules, device)  # after the drill's hook: it sees its output
    monitor = PrecisionMonitor(model.modules, pargs.monitor)
    profiler = Profiler(
        targs.profile,
        targs.profile_start,
        targs.profile_steps,
        targs.profile_dir or os.path.join(os.getcwd(), "profiles"),
        device,
        rank,
    )
    # one optimizer per stage part (AdamW has no cross-parameter state), so each part's state
    # dict can be taken and restored with its module
    optims = [
        optim_mod.build_optimizer([q for q in m.parameters() if q.requires_grad], targs, pargs) for m in model.modules
    ]

    if rank == 0:
        data_mod.prepare(dargs)
    if dist.is_initialized():
        dist.barrier()
    start_step = 0
    if targs.checkpoint_dir:
        ckpt.check_shared(targs.checkpoint_dir)
    found = ckpt.latest(targs.checkpoint_dir)
    if found is not None:
        start_step, path = found
        extra = ckpt.load(path, model.modules, optims)
        scaler.load_state_dict(extra["scaler"])
        comm_mod.restore(model.comm_states, extra, rank, world, device)
    split = rules.batch_split(targs.global_batch, p.dp, p.pp, targs.micro_batch, p.microbatches)
    # the pipeline schedule cuts the replica's batch into its microbatches itself
    micro = split.per_replica if p.pp > 1 else split.size
    accum = split.per_replica // micro
    loader = data_mod.build_loader(
        dargs,
        seq_len=targs.seq_len,
        vocab_size=margs.vocab_size,
        seed=targs.seed,
        global_batch=targs.global_batch,
        micro_batch=micro,
        dp_rank=model.dp_rank,
        dp_size=p.dp,
        steps=targs.steps,
        start_step=start_step,
        pin_device=device.type if device.type in ("cuda", "npu") else "",
    )
    val_loader = None
    if targs.eval_every > 0:
        val_loader = data_mod.build_val_loader(
            dargs,
            seq_len=targs.seq_len,
            vocab_size=margs.vocab_size,
            seed=targs.seed,
            global_batch=targs.global_batch,
            micro_batch=micro,
            dp_rank=model.dp_rank,
            dp_size=p.dp,
            batches=targs.eval_batches,
        )
    tokens_per_step = targs.global_batch * targs.seq_len
    # 6 N per token for the matmuls forward and backward, plus attention scores 12 L d T
    flops_per_token = 6 * n_params + 12 * margs.n_layers * margs.d_model * targs.seq_len
    holds_loss = torch.tensor([1.0 if model.schedule is None or model.has_last else 0.0], device=device)

    history: List[Dict[str, Any]] = []
    log = StepLog(device, acc_dtype(device), holds_loss, world)
    clock = StepClock(device)

    def deliver(rows: List[Dict[str, Any]]) -> None:
        mem = peak_memory_gb(device)
        for row in rows:
            row["memory_gb"] = mem
        if rank == 0 and rows:
            reporter.log_steps([dict(r) for r in rows])
            history.extend(rows)

    def flush() -> List[Dict[str, Any]]:
        return flush_with(log, clock, tokens_per_step, scaler, deliver)

    param_sum_initial = param_checksum(model.params, mesh)
    state_bytes: Optional[Dict[str, int]] = None
    model.train()
    it = iter(loader)
    profile_logged = False
    timed_steps: List[float] = []  # this rank's step times after the warm-up (trainer.measure=adaptive)
    # a loss scaler expects overflows; where the optimizer has no device-side skip (foreach on an
    # NPU) its step reads the overflow flag back (trainers/optim.py: step)
    sync_skip = scaler.enabled
    for step in range(start_step, targs.steps):
        step_ref[0] = step
        faults.rank_drill(step, rank, targs.fault, targs.checkpoint_dir)
        profiler.step(step)
        if profiler.result is not None and not profile_logged:
            # as soon as the window closes: a trial that dies later (a lost node) keeps its traces
            _log_profile(profiler, reporter)
            profile_logged = True
        monitor.begin(step)
        tracker.reset()
        clock.start()
        faults.straggle(rank, targs.fault)
        lr = lr_at(step, targs)
        for opt in optims:
            for group in opt.param_groups:
                group["lr"] = lr
        loss = model.forward_backward([next(it) for _ in range(accum)])
        # the whole model's norm (across shards, stages and replicas) of the unscaled gradient, on
        # the device; it is finite exactly when every gradient value is, so it is also the
        # overflow flag, global like the norm: every rank skips the same steps
        grad_norm = global_grad_norm(model.params, mesh) / scaler.scale
        found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        first_bad = tracker.local_first()
        stats = monitor.collect() if monitor.active else None
        # 1 / scale times the clipping coefficient: the optimizer applies it as one multiplier
        mult = grad_multiplier(scaler, grad_norm, targs.grad_clip)
        for opt in optims:
            optim_mod.step(opt, mult, found_inf, sync_skip)
        if state_bytes is None or not state_bytes["optimizer"]:  # the rank at its fullest: after an update
            state_bytes = model_state_bytes(model.modules, optims)
        for opt in optims:
            opt.zero_grad(set_to_none=True)
        scaler.update(found_inf)
        host_dt = clock.stop()
        if clock.host_timed and step >= targs.warmup_steps:  # on every rank: the count gates a collective
            timed_steps.append(host_dt)
        row: Dict[str, Any] = {"step": step, "lr": lr, ROW_TIME: time.time()}  # when the step ended (report.py)
        if stats:
            acts = [r for r in stats if r["kind"] == "activation"]
            row["monitor_act_max_abs"] = max(r["max_abs"] for r in acts) if acts else 0.0
            row["monitor_overflow_frac"] = max(r["overflow_fp16"] for r in stats)
            row["monitor_nonfinite"] = sum(r["nonfinite"] for r in stats)
            if rank == 0:
                reporter.log_table(step, "monitor", stats)
        if model.comm_stats is not None:
            row.update(model.comm_stats.take())
        log.add(row, loss, [grad_norm, scaler.scale, scaler.skipped_steps, scaler.skipped_in_row, found_inf, first_bad])
        if val_loader is not None and (step + 1) % targs.eval_every == 0:
            row["val_loss"] = _global_mean(model.evaluate(val_loader), holds_loss, world)
        if rank == 0:
            reporter.on_step(step, host_dt)
        done = step + 1
        due = targs.checkpoint_every > 0 and targs.checkpoint_dir and done % targs.checkpoint_every == 0
        flushed = False
        if done % max(1, targs.log_every) == 0 or done == targs.steps or due:
            # every log_every steps (and before a checkpoint, at the end): the one read-back of the
            # batch's metrics, and of its step times where they come from device events
            rows = flush()
            flushed = True
            if not clock.host_timed:
                timed_steps.extend(r["step_time_s"] for r in rows if r["step"] >= targs.warmup_steps)
        measured = False
        if targs.measure == "adaptive" and done < targs.steps and len(timed_steps) >= measure.MIN_TIMED:
            # rank 0 decides (its times, each step on the CPU, at each read-back elsewhere); the
            # others only take its answer
            if clock.host_timed or flushed:
                measured = _agree(rank == 0 and measure.enough(timed_steps, targs.measure_tolerance), device, world)
            if measured and not flushed:
                flush()
        if due:
            extra = {"scaler": scaler.state_dict(), **comm_mod.saved(model.comm_states, rank, world)}
            path = ckpt.save(targs.checkpoint_dir, done, model.modules, optims, extra)
            if rank == 0:
                reporter.checkpoint(done, str(path))
        if measured:
            break

    profiler.close()
    # every rank's profile split; the summary reports that of the rank that waits on communication most,
    # whole (its compute and comm shares together: one rank's compute with another's comm can sum past 1)
    mine = profiler.result.metrics() if profiler.result else {}
    prof = {k: _gather(mine.get(k, 0.0), device, world) for k in METRIC_KEYS}
    mem = memory_gb(device)
    peaks = _gather(mem["allocated"], device, world)
    reserved = _gather(mem["reserved"], device, world)
    device_used = _gather(mem["device_used"], device, world)
    skipped = _gather(float(scaler.skipped_steps), device, world)  # a host read, once, after the loop
    held = {k: _gather(float((state_bytes or {}).get(k, 0)), device, world) for k in ("params", "grads", "optimizer")}
    param_sum_final = param_checksum(model.params, mesh)
    tp_divergence = model.tp_replica_divergence()
    if rank != 0:
        return None
    if not history:  # resumed from a checkpoint of the last step: nothing left to run
        return {"resumed_from_step": start_step, "world_size": world, "losses": [], "grad_norms": []}
    timed = [r["step_time_s"] for r in history if r["step"] >= targs.warmup_steps] or [
        r["step_time_s"] for r in history
    ]
    median = statistics.median(timed)
    half_width = measure.relative_half_width(timed)
    # CPU workers share one host, whose peak the cpu chip gives; devices add up
    peak_flops = rt.peak_flops * (1 if device.type == "cpu" else world)
    summary = {
        "step_time_median_s": median,
        "tokens_per_s_median": tokens_per_step / median,
        "final_loss": history[-1]["loss"],
        "peak_mem_gb": max(peaks),  # allocated by tensors; reserved and device_used below
        "peak_mem_reserved_gb": max(reserved),
        "device_mem_used_gb": max(device_used),
        "n_params": n_params,
        "mfu": (flops_per_token * tokens_per_step / median) / peak_flops if peak_flops > 0 else None,
        "skipped_steps_total": int(skipped[0]),
        "skipped_steps_per_rank": [int(v) for v in skipped],
        "param_sum_initial": param_sum_initial,
        "param_sum_final": param_sum_final,
        "world_size": world,
        "resumed_from_step": start_step,
        "steps_run": history[-1]["step"] + 1,  # < trainer.steps when trainer.measure=adaptive stopped early
        "step_time_ci_rel": half_width,  # the median's 95% interval half-width / median (None: < 6 timed steps)
        # the median's standard error / median, from the MAD: the noise a comparison of trials uses
        "step_time_se_rel": measure.median_rel_se(timed),
        "bubble_fraction": rules.bubble_fraction(p.pp, p.microbatches, p.schedule, p.virtual_stages),
        # per rank, in rank order: bytes of parameters, gradients and optimizer state held
        "model_state_bytes": [{k: int(held[k][r]) for k in held} for r in range(world)],
        # gradient collectives rank 0 issued during / after the backward passes (DDP), and its
        # FSDP units: how comm.overlap laid out the data-parallel reduction
        "grad_collectives_in_backward": model.sync.in_backward,
        "grad_collectives_after_backward": model.sync.after_backward,
        "fsdp_units": model.fsdp_units,
        "tp_replica_divergence": tp_divergence,
    }
    evals = [r["val_loss"] for r in history if "val_loss" in r]
    if evals:
        summary["val_loss"] = evals[-1]
    summary.update({f"peak_mem_gb_rank{r}": v for r, v in enumerate(peaks)} if world > 1 else {})
    if profiler.result is not None:
        worst = max(range(world), key=lambda r: prof["comm_share"][r])
        summary.update({k: prof[k][worst] for k in METRIC_KEYS})
        summary["profile_rank"] = worst
        if not profile_logged:  # the window ran to the last step
            _log_profile(profiler, reporter)
    reporter.finish(summary)
    summary["losses"] = [r["loss"] for r in history]
    summary["grad_norms"] = [r["grad_norm"] for r in history]
    return summary


def _agree(stop: bool, device: torch.device, world: int) -> bool:
    """Rank 0's decision, taken by every rank (all stop at the same step or none does)."""
    if world == 1 or not dist.is_initialized():
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _log_profile(profiler: Profiler, reporter: Reporter) -> None:
    """This rank's trace and op table as the run's ``profile/`` artifacts (rank 0's reporter;
    other ranks hold a null one)."""
    table = os.path.join(profiler.out_dir, "top_ops.txt")
    with open(table, "w") as f:
        f.write(profiler.result.table)
    for path in (profiler.result.trace_path, table):
        if path:
            reporter.log_artifact(path, "profile")


def count_params_global(margs) -> int:
    with torch.device("meta"):
        return count_params(GPT(margs))


def _global_mean(mine: torch.Tensor, holds_loss: torch.Tensor, world: int) -> float:
    """All ranks: the mean of ``mine`` over the ranks that hold a loss (tp copies and dp replicas
    alike; pipeline ranks without the last stage hold none)."""
    both = torch.cat([mine.reshape(1).float() * holds_loss, holds_loss])
    if dist.is_initialized() and world > 1:
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    return float(both[0] / both[1])


def _gather(value: float, device: torch.device, world: int) -> List[float]:
    """One number from every rank, in rank order."""
    mine = torch.tensor([value], dtype=acc_dtype(device), device=device)
    if not dist.is_initialized() or world == 1:
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


@record  # writes the exception to the elastic error file, so the launcher can report why
def worker_entry(
    spec: TrialSpec,
    reporter: Optional[Reporter] = None,
    env: Optional[Dict[str, str]] = None,
    store: Optional[dist.Store] = None,
) -> Optional[Dict[str, Any]]:
    """Entry point of one worker process: env, process group, train, tear down. ``env``: the
    launching process's environment, which a forked worker takes over (see :func:`adopt_env`).
    ``store``: the trial's rendezvous store, when the launcher holds one (a warm worker group,
    whose processes run one trial after another: each trial's group is built and torn down here)."""
    if env is not None:
        adopt_env(env)
    device = setup(spec.runtime, int(os.environ.get("LOCAL_RANK", "0")), spec.trainer.deterministic, store)
    try:
        return train(spec, reporter)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        release_memory(device)
