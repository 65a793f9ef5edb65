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
from trainers import faults, measure, ranks, rules
from trainers import optim as optim_mod
from trainers.assembly import RankModel
from trainers.clock import StepClock, cores_per_worker, host_figures, median_or_zero
from trainers.config import TrialSpec
from trainers.memory import model_state_bytes
from trainers.model import GPT, count_params
from trainers.monitor import FiniteTracker, PrecisionMonitor
from trainers.optim import lr_at
from trainers.overflow import SaturationFlag
from trainers.parallel import acc_dtype, global_grad_norm, param_checksum
from trainers.precision import LossScaler, grad_multiplier
from trainers.profiling import METRIC_KEYS, Profiler
from trainers.reporter import ROW_TIME, NullReporter, Reporter
from trainers.runtime import (
    adopt_env,
    memory_gb,
    peak_memory_gb,
    ran_with,
    release_memory,
    select_device,
    set_deterministic,
    setup,
)
from trainers.step_log import NonFiniteError, StepLog, flush_with  # noqa: F401 (NonFiniteError: re-exported)


def train(spec: TrialSpec, reporter: Optional[Reporter] = None) -> Optional[Dict[str, Any]]:
    """Run one trial's training in this process (a process group must be initialised, or this is
    the single-process reference). Returns the summary on rank 0, None elsewhere."""
    loop = Loop(spec, reporter or NullReporter())
    for step in range(loop.start_step, loop.targs.steps):
        if loop.step(step):
            break
    if loop.targs.export_hf:
        loop.export_hf(loop.targs.export_hf)
    return loop.summary()


class Loop:
    """One trial's training on this rank, in three parts as a reader meets them: built from the
    spec (:meth:`__init__`: model, optimizers, a checkpoint's state, data), stepped
    (:meth:`step`: the update, its record, the read-back, the adaptive stop and the checkpoint),
    summarised (:meth:`summary`)."""

    def __init__(self, spec: TrialSpec, reporter: Reporter):
        self.reporter = reporter
        self.targs, self.dargs, self.pargs, self.rt = spec.trainer, spec.data, spec.precision, spec.runtime
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.rank == 0 and hasattr(reporter, "open"):
            reporter.open()  # connects to its store while the model is built
        set_deterministic(self.rt.device_type, self.targs.deterministic)
        self.device = select_device(self.rt, int(os.environ.get("LOCAL_RANK", "0")))
        torch.manual_seed(self.targs.seed)
        self._build_model(spec)
        self.start_step = self._resume()
        self._build_data()
        self.history: List[Dict[str, Any]] = []
        self.log = StepLog(self.device, acc_dtype(self.device), self.holds_loss, self.world)
        self.clock = StepClock(self.device)
        self.param_sum_initial = param_checksum(self.model.params, self.model.mesh)
        self.state_bytes: Optional[Dict[str, int]] = None
        self.model.train()
        self.it = iter(self.loader)
        self.profile_logged = False
        self.timed_steps: List[float] = []  # this rank's step times after the warm-up (trainer.measure=adaptive)
        self.timed_cpu: List[float] = []  # and its CPU seconds of the same steps
        # a loss scaler expects overflows; where the optimizer has no device-side skip (foreach on an
        # NPU) its step reads the overflow flag back (trainers/optim.py: step)
        self.sync_skip = self.scaler.enabled

    # -- built --------------------------------------------------------------------------------

    def _build_model(self, spec: TrialSpec) -> None:
        targs, device = self.targs, self.device
        self.scaler = LossScaler(self.pargs, device)
        # a saturating NPU (910A) shows an fp16 overflow in its float status, not as inf
        self.saturation = SaturationFlag.of(device, self.scaler.enabled)
        self.model = RankModel(spec, device, self.scaler)
        self.n_params = count_params_global(self.model.margs)
        self.step_ref = [0]
        faults.install_injection(self.model.modules, targs.fault, self.step_ref)
        self.tracker = FiniteTracker(self.model.modules, device)  # after the drill's hook: it sees its output
        self.monitor = PrecisionMonitor(self.model.modules, self.pargs.monitor)
        out_dir = targs.profile_dir or os.path.join(os.getcwd(), "profiles")
        self.profiler = Profiler(targs.profile, targs.profile_start, targs.profile_steps, out_dir, device, self.rank)
        # one optimizer per stage part (AdamW has no cross-parameter state), so each part's state
        # dict can be taken and restored with its module
        self.optims = [
            optim_mod.build_optimizer([q for q in m.parameters() if q.requires_grad], targs, self.pargs)
            for m in self.model.modules
        ]

    def _resume(self) -> int:
        """The step to start from: the latest checkpoint's, its state loaded, else 0."""
        if self.rank == 0:
            data_mod.prepare(self.dargs)
        if dist.is_initialized():
            dist.barrier()
        if self.targs.checkpoint_dir:
            ckpt.check_shared(self.targs.checkpoint_dir)
        found = ckpt.latest(self.targs.checkpoint_dir)
        if found is None:
            return 0
        start_step, path = found
        extra = ckpt.load(path, self.model.modules, self.optims)
        self.scaler.load_state_dict(extra["scaler"])
        comm_mod.restore(self.model.comm_states, extra, self.rank, self.world, self.device)
        return start_step

    def _build_data(self) -> None:
        targs, p, margs, model = self.targs, self.model.p, self.model.margs, self.model
        split = rules.batch_split(targs.global_batch, p.dp, p.pp, targs.micro_batch, p.microbatches)
        # the pipeline schedule cuts the replica's batch into its microbatches itself
        micro = split.per_replica if p.pp > 1 else split.size
        self.accum = split.per_replica // micro
        common = dict(
            seq_len=targs.seq_len,
            vocab_size=margs.vocab_size,
            seed=targs.seed,
            global_batch=targs.global_batch,
            micro_batch=micro,
            dp_rank=model.dp_rank,
            dp_size=p.dp,
        )
        pin = self.device.type if self.device.type in ("cuda", "npu") else ""
        self.loader = data_mod.build_loader(
            self.dargs, **common, steps=targs.steps, start_step=self.start_step, pin_device=pin
        )
        self.val_loader = None
        if targs.eval_every > 0:
            self.val_loader = data_mod.build_val_loader(self.dargs, **common, batches=targs.eval_batches)
        self.tokens_per_step = targs.global_batch * targs.seq_len
        # 6 N per token for the matmuls forward and backward, plus attention scores 12 L d T
        self.flops_per_token = 6 * self.n_params + 12 * margs.n_layers * margs.d_model * targs.seq_len
        has_loss = model.schedule is None or model.has_last
        self.holds_loss = torch.tensor([1.0 if has_loss else 0.0], device=self.device)

    # -- stepped ------------------------------------------------------------------------------

    def step(self, step: int) -> bool:
        """One optimizer step and what follows it; True when the adaptive timing says stop."""
        targs = self.targs
        self.step_ref[0] = step
        faults.rank_drill(step, self.rank, targs.fault, targs.checkpoint_dir)
        self.profiler.step(step)
        if self.profiler.result is not None and not self.profile_logged:
            # as soon as the window closes: a trial that dies later (a lost node) keeps its traces
            self.profiler.log_to(self.reporter)
            self.profile_logged = True
        self.monitor.begin(step)
        self.tracker.reset()
        self.clock.start()
        faults.straggle(self.rank, targs.fault)
        lr = lr_at(step, targs)
        loss, grad_norm, found_inf, first_bad, stats = self._update(lr)
        host_dt = self.clock.stop()
        if step >= targs.warmup_steps:
            self.timed_cpu.append(self.clock.cpu_s[-1])
            if self.clock.host_timed:  # on every rank: the count gates a collective
                self.timed_steps.append(host_dt)
        self._record(step, lr, loss, grad_norm, found_inf, first_bad, stats)
        if self.rank == 0:
            self.reporter.on_step(step, host_dt)
        return self._after(step + 1)

    def _update(self, lr: float):
        """Forward, backward and the optimizer step: (loss, grad norm, overflow flag, the first
        non-finite layer, the precision monitor's stats), all on the device."""
        model, scaler = self.model, self.scaler
        for opt in self.optims:
            for group in opt.param_groups:
                group["lr"] = lr
        self.saturation.clear()
        loss = model.forward_backward([next(self.it) for _ in range(self.accum)])
        # the whole model's norm (across shards, stages and replicas) of the unscaled gradient, on
        # the device; it is finite exactly when every gradient value is (and, on a saturating NPU,
        # the float status shows no overflow), so it is also the overflow flag, global like the
        # norm: every rank skips the same steps
        grad_norm = global_grad_norm(model.params, model.mesh, self.saturation.local_inf()) / scaler.scale
        found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        first_bad = self.tracker.local_first()
        stats = self.monitor.collect() if self.monitor.active else None
        # 1 / scale times the clipping coefficient: the optimizer applies it as one multiplier
        mult = grad_multiplier(scaler, grad_norm, self.targs.grad_clip)
        for opt in self.optims:
            optim_mod.step(opt, mult, found_inf, self.sync_skip)
        if self.state_bytes is None or not self.state_bytes["optimizer"]:  # the rank at its fullest: after an update
            self.state_bytes = model_state_bytes(model.modules, self.optims)
        for opt in self.optims:
            opt.zero_grad(set_to_none=True)
        scaler.update(found_inf)
        return loss, grad_norm, found_inf, first_bad, stats

    def _record(self, step, lr, loss, grad_norm, found_inf, first_bad, stats) -> None:
        """The step's row, added to the batch read back at the next flush."""
        scaler = self.scaler
        row: Dict[str, Any] = {"step": step, "lr": lr, ROW_TIME: time.time()}  # when the step ended (report.py)
        if stats:
            acts = [r for r in stats if r["kind"] == "activation"]
            row["monitor_act_max_abs"] = max(r["max_abs"] for r in acts) if acts else 0.0
            row["monitor_overflow_frac"] = max(r["overflow_fp16"] for r in stats)
            row["monitor_nonfinite"] = sum(r["nonfinite"] for r in stats)
            if self.rank == 0:
                self.reporter.log_table(step, "monitor", stats)
        if self.model.comm_stats is not None:
            row.update(self.model.comm_stats.take())
        device_values = [grad_norm, scaler.scale, scaler.skipped_steps, scaler.skipped_in_row, found_inf, first_bad]
        self.log.add(row, loss, device_values)
        if self.val_loader is not None and (step + 1) % self.targs.eval_every == 0:
            row["val_loss"] = ranks.global_mean(self.model.evaluate(self.val_loader), self.holds_loss, self.world)

    def _deliver(self, rows: List[Dict[str, Any]]) -> None:
        mem = peak_memory_gb(self.device)
        for row in rows:
            row["memory_gb"] = mem
        if self.rank == 0 and rows:
            self.reporter.log_steps([dict(r) for r in rows])
            self.history.extend(rows)

    def _flush(self) -> List[Dict[str, Any]]:
        return flush_with(self.log, self.clock, self.tokens_per_step, self.scaler, self._deliver)

    def _after(self, done: int) -> bool:
        """After ``done`` steps: the read-back, the adaptive stop, the checkpoint."""
        targs = self.targs
        due = targs.checkpoint_every > 0 and targs.checkpoint_dir and done % targs.checkpoint_every == 0
        flushed = False
        if done % max(1, targs.log_every) == 0 or done == targs.steps or due:
            # every log_every steps (and before a checkpoint, at the end): the one read-back of the
            # batch's metrics, and of its step times where they come from device events
            rows = self._flush()
            flushed = True
            if not self.clock.host_timed:
                self.timed_steps.extend(r["step_time_s"] for r in rows if r["step"] >= targs.warmup_steps)
        measured = False
        if targs.measure == "adaptive" and done < targs.steps and len(self.timed_steps) >= measure.MIN_TIMED:
            # rank 0 decides (its times, each step on the CPU, at each read-back elsewhere); the
            # others only take its answer
            if self.clock.host_timed or flushed:
                enough = self.rank == 0 and measure.enough(self.timed_steps, targs.measure_tolerance)
                measured = ranks.agree(enough, self.device, self.world)
            if measured and not flushed:
                self._flush()
        if due:
            extra = {
                "scaler": self.scaler.state_dict(),
                **comm_mod.saved(self.model.comm_states, self.rank, self.world),
            }
            path = ckpt.save(targs.checkpoint_dir, done, self.model.modules, self.optims, extra)
            if self.rank == 0:
                self.reporter.checkpoint(done, str(path))
        return measured

    # -- summarised ---------------------------------------------------------------------------

    def export_hf(self, folder: str) -> None:
        """The model as it is now, in the Hugging Face layout (collective)."""
        from trainers import hf_weights

        mesh = self.model.mesh
        writer = mesh is None or (mesh.dp_rank == 0 and mesh.tp_rank == 0)
        pp_rank, pp = (mesh.pp_rank, self.model.p.pp) if mesh else (0, 1)
        hf_weights.save(self.model.modules, folder, self.model.margs, pp_rank, pp, writer)

    def _gathered(self) -> Dict[str, Any]:
        """Every rank's figures, in rank order (every rank takes part in each gather)."""
        device, world = self.device, self.world
        self.profiler.close()
        mine = self.profiler.result.metrics() if self.profiler.result else {}
        mem = memory_gb(device)
        held = self.state_bytes or {}
        return {
            "prof": {k: ranks.gather(mine.get(k, 0.0), device, world) for k in METRIC_KEYS},
            "peaks": ranks.gather(mem["allocated"], device, world),
            "reserved": ranks.gather(mem["reserved"], device, world),
            "device_used": ranks.gather(mem["device_used"], device, world),
            "skipped": ranks.gather(float(self.scaler.skipped_steps), device, world),  # a host read, once
            "held": {k: ranks.gather(float(held.get(k, 0)), device, world) for k in ("params", "grads", "optimizer")},
            "param_sum_final": param_checksum(self.model.params, self.model.mesh),
            "tp_divergence": self.model.tp_replica_divergence(),
            "cpu_s": ranks.gather(median_or_zero(self.timed_cpu), device, world),
            "cores": ranks.gather(cores_per_worker(), device, world),
        }

    def summary(self) -> Optional[Dict[str, Any]]:
        """The trial's summary on rank 0 (None elsewhere), also given to the reporter."""
        g = self._gathered()
        if self.rank != 0:
            return None
        world, targs, history = self.world, self.targs, self.history
        if not history:  # resumed from a checkpoint of the last step: nothing left to run
            return {"resumed_from_step": self.start_step, "world_size": world, "losses": [], "grad_norms": []}
        timed = [r["step_time_s"] for r in history if r["step"] >= targs.warmup_steps] or [
            r["step_time_s"] for r in history
        ]
        summary = self._figures(timed, g)
        evals = [r["val_loss"] for r in history if "val_loss" in r]
        if evals:
            summary["val_loss"] = evals[-1]
        summary.update({f"peak_mem_gb_rank{r}": v for r, v in enumerate(g["peaks"])} if world > 1 else {})
        if self.profiler.result is not None:
            prof = g["prof"]
            worst = max(range(world), key=lambda r: prof["comm_share"][r])
            summary.update({k: prof[k][worst] for k in METRIC_KEYS})
            summary["profile_rank"] = worst
            if not self.profile_logged:  # the window ran to the last step
                self.profiler.log_to(self.reporter)
        self.reporter.finish(summary)
        summary["losses"] = [r["loss"] for r in history]
        summary["grad_norms"] = [r["grad_norm"] for r in history]
        return summary

    def _figures(self, timed: List[float], g: Dict[str, Any]) -> Dict[str, Any]:
        world, p, model = self.world, self.model.p, self.model
        median = statistics.median(timed)
        # CPU workers share one host, whose peak the cpu chip gives; devices add up
        peak_flops = self.rt.peak_flops * (1 if self.device.type == "cpu" else world)
        held = g["held"]
        return {
            "step_time_median_s": median,
            "tokens_per_s_median": self.tokens_per_step / median,
            "final_loss": self.history[-1]["loss"],
            "peak_mem_gb": max(g["peaks"]),  # allocated by tensors; reserved and device_used below
            "peak_mem_reserved_gb": max(g["reserved"]),
            "device_mem_used_gb": max(g["device_used"]),
            "n_params": self.n_params,
            "mfu": (self.flops_per_token * self.tokens_per_step / median) / peak_flops if peak_flops > 0 else None,
            "skipped_steps_total": int(g["skipped"][0]),
            "skipped_steps_per_rank": [int(v) for v in g["skipped"]],
            "param_sum_initial": self.param_sum_initial,
            "param_sum_final": g["param_sum_final"],
            "world_size": world,
            "deterministic": torch.are_deterministic_algorithms_enabled(),  # as the worker ran
            "resumed_from_step": self.start_step,
            "steps_run": self.history[-1]["step"] + 1,  # < trainer.steps when trainer.measure=adaptive stopped early
            "step_time_ci_rel": measure.relative_half_width(timed),  # 95% interval half-width / median (None: < 6)
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
            "tp_replica_divergence": g["tp_divergence"],
            **host_figures(g["cpu_s"], g["cores"], median),
        }


def count_params_global(margs) -> int:
    with torch.device("meta"):
        return count_params(GPT(margs))


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
        return ran_with(train(spec, reporter), spec.runtime, spec.trainer.deterministic)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        release_memory(device)
