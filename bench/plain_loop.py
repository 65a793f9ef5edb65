"""The plainest loop that trains the same model as a trial: the baseline the trainer is held to.

    from bench.plain_loop import plain_loop, plain_loop_stats
    plain_loop(spec, steps=40, warmup=5)                      # CPU, the median step time in s
    plain_loop_stats(spec, steps=12, warmup=4, device="cuda") # a dict: median, every step, memory

From the same :class:`trainers.config.TrialSpec` the trial runs: ``trainers.model.GPT`` with the
trial's model config and seed, the same micro-batch, gradient accumulation
(``global_batch // micro_batch`` micro-batches a step, one process doing what the trial's data
parallel ranks do together) and sequence length; the compute dtype through ``torch.autocast``,
the parameters stored in ``precision.param_dtype``, the norms listed in ``precision.fp32_ops`` in
fp32 as the trial's precision policy runs them; ``trainer.compile`` compiles each block, as the
trainer does (one graph, compiled once); AdamW with the kernel the trainer picks
(``trainers.optim.fused_on``: fused on CUDA and the CPU, ``foreach`` on an NPU). What it
leaves out is what a trial adds: the data loader (the tokens are random and already on the
device), loss scaling with its overflow check (fp16 multiplies the loss by ``precision.init_scale``
and the gradients by its inverse, one multi-tensor kernel, no check), fp32 master copies of 16-bit
parameters, clipping, metrics, checkpoints, the process group.

On CUDA (or an NPU) each step is timed between two device events, and the host synchronises
once, after the last step, so no step waits on the host; on the CPU each step is timed with
``perf_counter`` (the CPU runs the step before the call returns).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from trainers.config import TrialSpec
from trainers.model import GPT, Attention, LayerNorm, RMSNorm, cross_entropy
from trainers.optim import fused_on
from trainers.precision import DTYPES, cast_params
from trainers.runtime import compile_backend


def _device_module(device: torch.device):
    return getattr(torch, device.type) if device.type in ("cuda", "npu") else None


def build(spec: TrialSpec, device: torch.device, compile: Optional[bool] = None) -> GPT:
    """The trial's model on ``device``: parameters in ``precision.param_dtype``, the fp32 ops of
    ``precision.fp32_ops`` in fp32, each block compiled when ``compile`` (default
    ``trainer.compile``)."""
    p = spec.precision
    model = GPT(spec.model, seed=spec.trainer.seed).to(device)
    cast_params(model, p.param_dtype)  # the trial's own cast: the RoPE tables stay fp32
    fp32 = set(p.fp32_ops)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.compute_dtype = torch.float32 if "rms_norm" in fp32 else None
        elif isinstance(m, LayerNorm):
            m.compute_dtype = torch.float32 if "layer_norm" in fp32 else None
        elif isinstance(m, Attention):
            m.softmax_dtype = torch.float32 if "softmax" in fp32 else None
    if spec.trainer.compile if compile is None else compile:
        torch._dynamo.reset()  # a fresh model: no guards or recompilation limit carried over from the last one
        backend = compile_backend(device.type, spec.trainer.compile_backend)
        for block in model.layers.values():
            block.compile(backend=backend)
    return model


def _time_steps(
    step: Callable[[], None], steps: int, device: torch.device
) -> Tuple[List[float], Optional[float], Optional[float]]:
    """Run ``step`` ``steps`` times; (each step's time in s, the device's peak allocated and
    reserved GB, both None on the CPU). On CUDA or an NPU each step is timed between two device
    events and the host synchronises once, after the last, so no step waits on the host; on the
    CPU each step is timed with ``perf_counter`` (the CPU runs the step before the call returns)."""
    mod = _device_module(device)
    times: List[float] = []
    if mod is not None:
        events = [(mod.Event(enable_timing=True), mod.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        mod.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
        allocated = mod.max_memory_allocated(device) / 2**30
        reserved = mod.max_memory_reserved(device) / 2**30
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        allocated = reserved = None
    return times, allocated, reserved


def plain_loop_stats(
    spec: TrialSpec,
    steps: int,
    warmup: int,
    device: Union[str, torch.device] = "cpu",
    compile: Optional[bool] = None,
    optimizer: str = "auto",
) -> Dict[str, Any]:
    """Train the trial's model ``steps`` steps; the median step time over the steps after
    ``warmup`` (``step_s``), every step's time (``times``), and the device's peak memory
    (``allocated_gb``, ``reserved_gb``; None on the CPU). ``optimizer``: ``fused`` | ``foreach``
    | ``auto`` (the trainer's choice, ``trainers.optim.fused_on``)."""
    device = torch.device(device)
    mod = _device_module(device)
    t, p = spec.trainer, spec.precision
    torch.manual_seed(t.seed)
    if mod is not None:
        mod.reset_peak_memory_stats(device)
    model = build(spec, device, compile)
    fused = optimizer == "fused" or (optimizer == "auto" and fused_on(device.type))
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, **kind)
    accum = max(1, t.global_batch // t.micro_batch)
    vocab = spec.model.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(t.seed)
    batches = [torch.randint(0, vocab, (t.micro_batch, t.seq_len + 1), generator=gen).to(device) for _ in range(accum)]
    dtype = DTYPES[p.compute_dtype]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    scale = float(p.init_scale) if p.loss_scale != "none" else 1.0
    params = [q for q in model.parameters() if q.requires_grad]

    def step() -> None:
        for b in batches:
            with autocast:
                loss = cross_entropy(model(b[:, :-1]), b[:, 1:])
            (loss * (scale / accum)).backward()
        if scale != 1.0:
            torch._foreach_mul_([q.grad for q in params if q.grad is not None], 1.0 / scale)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, allocated, reserved = _time_steps(step, steps, device)
    model = opt = batches = params = None  # the memory goes back before the next loop
    if spec.trainer.compile if compile is None else compile:
        torch._dynamo.reset()  # nor do the compiled graphs keep anything of this model
    if mod is not None:
        mod.empty_cache()
    timed = times[warmup:] or times
    return {
        "step_s": statistics.median(timed),
        "times": times,
        "allocated_gb": allocated,
        "reserved_gb": reserved,
        "tokens_per_step": t.global_batch * t.seq_len,
    }


def plain_loop(
    spec: TrialSpec,
    steps: int,
    warmup: int,
    device: Union[str, torch.device] = "cpu",
    compile: Optional[bool] = None,
    optimizer: str = "auto",
) -> float:
    """Median step time (s) of the plain loop over the steps after ``warmup``
    (:func:`plain_loop_stats`)."""
    return plain_loop_stats(spec, steps, warmup, device, compile, optimizer)["step_s"]
