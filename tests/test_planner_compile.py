"""What ``trainer.compile`` changes in the plan, by the backend a trial's blocks get
(``trainers.rules.compile_backend_name``), and the compiled plan against the H200's allocator.

- Memory: a block compiled with Inductor (AOTAutograd's min-cut partition over Inductor's
  decompositions) saves the matmuls' inputs and outputs and recomputes the elementwise work
  between them (``activations.fused_layer_activation_bytes``, measured with saved-tensor hooks in
  ``tests/test_activation_bytes.py`` and per rank in ``tests/test_rank_activations.py``).
  ``aot_eager`` (the NPU's ``auto``) keeps some of what eager keeps and TorchAir's partition is not
  measured: both are planned with the eager count (``trainers.rules``).
- Step time: only a backend that fuses kernels (Inductor, TorchAir) has the fused memory traffic
  of ``planner/traffic.py``; ``aot_eager`` runs the captured graph's operators one by one.
- On the H200 (``bench/device_check.py``, 2026-12-04, second call; docs/benchmarks.md), the
  caching allocator's peak: llama_1b 87.86 GiB eager and 64.85 GiB compiled (bf16 and fp16),
  gpt2_small 9.68 GiB eager. The plan's allocator-side terms (parameters, gradients, optimizer
  state, activations with the loss's peak: ``planned_alloc_gb`` of the check) are held to them.
"""

from __future__ import annotations

import pytest

from orchestrator import planner
from orchestrator.layout import layout
from orchestrator.planner import ParallelShape
from tests.test_planner_device_steps import AS_RECORDED, GPT2, LLAMA


@pytest.mark.parametrize(
    "device,backend,fused,min_cut,traced",
    [
        ("cuda", "auto", True, True, True),  # Inductor
        ("cpu", "auto", True, True, True),  # Inductor
        ("npu", "auto", False, False, True),  # aot_eager: eager kernels, the eager count (rules)
        ("npu", "torchair", True, False, True),  # fused by the graph engine; its partition unmeasured
        ("cuda", "aot_eager", False, False, True),
        ("cuda", "eager", False, False, False),  # Dynamo's capture only, no AOTAutograd
    ],
)
def test_the_backend_decides_what_compile_changes(compose_cfg, device, backend, fused, min_cut, traced):
    cfg = compose_cfg(["trainer.compile=true", f"trainer.compile_backend={backend}"])
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), device)
    assert (s.fused, s.min_cut, s.traced) == (fused, min_cut, traced)
    off = compose_cfg(["trainer.compile=false", f"trainer.compile_backend={backend}"])
    s = ParallelShape.of(off.parallel, off.trainer, layout(off), device)
    assert (s.fused, s.min_cut, s.traced) == (False, False, False)


def test_compiled_tp_pays_no_dtensor_host_cost(compose_cfg):
    """``bench/compile_host.py``: compiled through AOTAutograd, what tp2 adds to a layer pass is
    its collectives' cost (5.6-6.3 ms against 4 gloo all-reduces at ~1.5 ms here), eager it is
    about twice that; the planner drops ``planner.tp_layer_host_us`` for traced blocks only."""
    base = ["+chip=a100", "precision=bf16", "model=gpt_tiny", "parallel=tp2", "launch.world_size=2"]
    eager = step_parts_of(compose_cfg([*base, "trainer.compile=false"]))
    compiled = step_parts_of(compose_cfg([*base, "trainer.compile=true"]))
    assert eager.tp_layer_passes > 0 and compiled.tp_layer_passes == 0
    assert eager.layer_passes == compiled.layer_passes and eager.tp_calls == compiled.tp_calls


def step_parts_of(cfg):
    from orchestrator.planner.shapes import ModelShape
    from orchestrator.planner.step_time import step_parts

    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
    return step_parts(ModelShape.of(cfg.model), s, cfg.precision, cfg.comm, cfg.chip, cfg.planner)


def _plan(compose_cfg, overrides):
    return planner.preflight(compose_cfg(overrides))


ASCEND = ["+chip=ascend910b", "precision=bf16", *LLAMA]


def test_the_npu_s_compile_backends_change_only_what_they_are_measured_to(compose_cfg):
    """``aot_eager`` (the NPU's ``auto``): eager kernels' traffic and the eager count of
    activations, and no DTensor host cost; ``torchair``: fused traffic, the eager count. Compiled
    blocks trace the decomposition of RMSNorm and SwiGLU, not ``trainers/lean_ops.py``: the eager
    count they get is the decomposition's, more than the lean blocks keep eagerly."""
    lean = _plan(compose_cfg, [*ASCEND, "trainer.compile=false"])
    eager = _plan(compose_cfg, [*ASCEND, "trainer.compile=false", "model.lean_ops=false"])
    assert lean["memory_gb"]["activations"] < eager["memory_gb"]["activations"]
    auto = _plan(compose_cfg, [*ASCEND, "trainer.compile=true"])
    torchair = _plan(compose_cfg, [*ASCEND, "trainer.compile=true", "trainer.compile_backend=torchair"])
    # the blocks as the decomposition keeps them; the final norm, outside them, lean
    assert lean["memory_gb"]["activations"] < auto["memory_gb"]["activations"] < eager["memory_gb"]["activations"]
    assert auto["memory_gb"]["activations"] == pytest.approx(eager["memory_gb"]["activations"], rel=0.01)
    assert auto["step"]["step_time_s"] == pytest.approx(eager["step"]["step_time_s"], rel=0.01)
    assert torchair["memory_gb"]["activations"] == pytest.approx(auto["memory_gb"]["activations"])
    assert torchair["step"]["step_time_s"] < 0.9 * eager["step"]["step_time_s"]


def _allocator_gb(pre) -> float:
    return sum(pre["memory_gb"][k] for k in ("params", "grads", "optimizer", "activations"))


# (case, the check's overrides, the allocator's peak in GiB), planned as the trainer then ran
H200_PEAKS = [
    ("gpt2_small", [*GPT2, "precision=bf16", "trainer.compile=false"], 9.68),
    ("llama_1b", [*LLAMA, *AS_RECORDED, "precision=bf16", "trainer.compile=false"], 87.86),
    ("llama_1b+compile", [*LLAMA, *AS_RECORDED, "precision=bf16", "trainer.compile=true"], 64.85),
    ("llama_1b+compile fp16", [*LLAMA, *AS_RECORDED, "precision=fp16", "trainer.compile=true"], 64.85),
]


@pytest.mark.parametrize("name,overrides,peak_gb", H200_PEAKS, ids=[r[0] for r in H200_PEAKS])
def test_the_allocator_side_plan_is_within_5_percent_of_the_h200_s_peak(compose_cfg, name, overrides, peak_gb):
    planned = _allocator_gb(_plan(compose_cfg, ["+chip=h200", *overrides]))
    assert planned / peak_gb == pytest.approx(1.0, abs=0.05), (name, planned, peak_gb)


def test_what_compile_saves_on_the_h200_is_planned(compose_cfg):
    """Compiled, llama_1b's peak fell by 23.0 GiB (87.86 -> 64.85); the eager count planned for
    both (the plan before the fused count) would have been 38% over the compiled peak."""
    ran = ["+chip=h200", "precision=bf16", *LLAMA, *AS_RECORDED]
    eager = _allocator_gb(_plan(compose_cfg, [*ran, "trainer.compile=false"]))
    compiled = _allocator_gb(_plan(compose_cfg, [*ran, "trainer.compile=true"]))
    assert eager - compiled == pytest.approx(87.86 - 64.85, rel=0.1), (eager, compiled)
