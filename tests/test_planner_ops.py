"""Operator coverage of a model on a chip, captured on meta tensors: mapped, missing and
unresolved operators, and the probe that grades them on a real device.
"""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from orchestrator import planner, trial
from orchestrator.planner import ModelShape
from tests.planner_cases import preset
from trainers.ops import (
    FUSED_ATTENTION,
    FUSED_ATTENTION_BACKWARD,
    NPU_FUSED_ATTENTION,
    NPU_FUSED_ATTENTION_BACKWARD,
    capture_ops,
    probe_ops,
)

# --- operator coverage on meta tensors -------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt_tiny", "llama2_7b"])
def test_op_coverage_against_ascend910b_on_meta(compose_cfg, name):
    cfg = compose_cfg(["+chip=ascend910b", f"model={name}", "precision=bf16"])
    body = OmegaConf.to_container(cfg.model)
    cap = capture_ops(body, seq_len=cfg.trainer.seq_len, compute_dtype="bf16")
    assert cap.param_devices == ["meta"]  # built and run without storage
    assert cap.n_params == ModelShape.of(cfg.model).n_params  # the analytic count is the model's
    assert {FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD} <= set(cap.names)
    assert {"aten::mm", "aten::embedding_dense_backward", "aten::nll_loss_backward"} <= set(cap.names)
    assert "aten::bmm" not in cap.names  # the fused kernel is one op, not meta's math fallback
    cov = planner.op_coverage(cfg.model, cfg.trainer.seq_len, "bf16", cfg.chip)
    mapped = [o.op for o in cov.ops if o.plan == "mapped"]
    assert mapped == [FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD]
    # the 910B's own fused kernel stands in for ATen's, and is native there
    assert cov.model_overrides == {"attn_impl": "npu_fused"} and cov.unresolved == []
    npu = capture_ops({**body, "attn_impl": "npu_fused"}, seq_len=cfg.trainer.seq_len, compute_dtype="bf16")
    assert {NPU_FUSED_ATTENTION, NPU_FUSED_ATTENTION_BACKWARD} <= set(npu.names) and "aten::bmm" not in npu.names
    assert cov.n_total == len(cap.names)
    assert cov.coverage == pytest.approx((cov.n_total - 2) / cov.n_total)
    assert cov.replacement_rate == pytest.approx(2 / cov.n_total)
    if name == "llama2_7b":
        assert {"aten::silu", "aten::silu_backward", "aten::rsqrt"} <= set(cap.names)  # SwiGLU, RMSNorm


def test_llama2_70b_ops_are_captured_on_meta():
    body = OmegaConf.to_container(preset("model", "llama2_70b"))
    cap = capture_ops(body, seq_len=4096, compute_dtype="bf16")
    assert cap.param_devices == ["meta"] and cap.n_params == pytest.approx(68.98e9, rel=0.001)
    assert "aten::_to_copy" in cap.names  # the fp32 norm and loss inside a bf16 model


def test_a_chip_without_fused_attention_gets_it_mapped_and_still_trains(compose_cfg):
    from trainers.loop import train

    cfg = compose_cfg(
        [
            "+chip=cpu",
            "trainer=smoke",
            "trainer.steps=8",
            "trainer.global_batch=8",
            "trainer.micro_batch=4",
            "trainer.seq_len=32",
            "data.num_workers=1",
        ]
    )
    cfg.chip.unsupported_ops = ["aten::_scaled_dot_product_flash_attention*"]
    cfg.chip.decompositions = {"aten::_scaled_dot_product_": "model.attn_impl=decomposed"}
    report = planner.preflight(cfg)
    json.dumps(report)  # preflight.json
    assert report["feasible"] and report["reasons"] == []
    assert report["model_overrides"] == {"attn_impl": "decomposed"}
    plans = {o["op"]: o for o in report["ops"]["ops"]}
    assert plans[FUSED_ATTENTION]["plan"] == "mapped" and plans[FUSED_ATTENTION]["via"] == "model.attn_impl=decomposed"
    assert report["ops"]["n_mapped"] == 2 and report["ops"]["coverage"] < 1.0
    for key, value in report["model_overrides"].items():
        cfg.model[key] = value
    spec = trial.build_spec(trial.prepare(cfg))
    assert spec.model.attn_impl == "decomposed"
    losses = train(spec)["losses"]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_an_op_without_mapping_needs_a_custom_kernel(compose_cfg):
    cfg = compose_cfg(["+chip=cpu"])
    cfg.chip.unsupported_ops = ["aten::gelu*"]
    cov = planner.op_coverage(cfg.model, 64, "fp32", cfg.chip)
    assert cov.unresolved == ["aten::gelu", "aten::gelu_backward"]
    assert cov.count("custom") == 2 and cov.replacement_rate == pytest.approx(2 / cov.n_total)
    report = planner.preflight(cfg)
    assert not report["feasible"]
    assert report["reasons"] == ["operators without support or mapping on cpu: aten::gelu, aten::gelu_backward"]


def test_a_decomposition_that_needs_a_missing_op_is_unresolved(compose_cfg):
    """The decomposed attention runs bmm + softmax: a chip without bmm cannot use it."""
    cfg = compose_cfg(["+chip=cpu"])
    cfg.chip.unsupported_ops = ["aten::_scaled_dot_product_flash_attention*", "aten::bmm"]
    cfg.chip.decompositions = {"aten::_scaled_dot_product_*": "model.attn_impl=decomposed"}  # a glob works too
    cov = planner.op_coverage(cfg.model, 64, "fp32", cfg.chip)
    assert cov.model_overrides == {"attn_impl": "decomposed"}
    assert cov.unresolved == ["aten::bmm"]


def test_probe_grades_ops_on_a_real_device():
    """On the CPU every op of the model runs natively, fused attention through its CPU flash
    kernel; the meta backend has no fused attention kernel, so the probe reports the math path."""
    llama = dict(norm="rmsnorm", mlp="swiglu", pos_emb="rope", tie_embeddings=False, n_heads=8, n_kv_heads=2)
    cpu = probe_ops("cpu", llama)
    assert {r["status"] for r in cpu.values()} <= {"native", "unused"}
    assert cpu[FUSED_ATTENTION]["status"] == "native" and "flash" in cpu[FUSED_ATTENTION]["detail"]
    assert set(capture_ops(llama).names) <= set(cpu)
    meta = probe_ops("meta", llama)
    assert meta[FUSED_ATTENTION]["status"] == "fallback"
    assert meta[FUSED_ATTENTION_BACKWARD]["status"] == "fallback"
    assert "math path" in meta[FUSED_ATTENTION]["detail"]
