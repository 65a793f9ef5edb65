"""The operator table from torch_npu's own sources (``python -m orchestrator.npu_ops``) and the
coverage the planner computes with it (``chip.op_table``).

The generator reads op-plugin's ``op_plugin_functions.yaml`` version by version as op-plugin's own
``codegen/utils.py get_version`` does (``all_version``, ``[vA, vB]`` and ``[vA, newest]`` ranges,
``vA, vB`` lists), leaves its ``custom`` (npu_*) section out, and adds torch_npu's
``npu_native_functions.yaml``; the shipped table is its output for torch_npu v7.3.0-pytorch2.7.1
(op-plugin at the commit that tag pins). An operator the model calls that is neither in the table
nor a composite of torch's is unsupported: mapped where the chip has a decomposition, else a
custom kernel to write."""

from __future__ import annotations

import json

import yaml

from orchestrator import npu_ops
from orchestrator.planner import operators
from orchestrator.planner.operators import op_coverage, op_table
from tests.planner_cases import preset

PLUGIN = {
    "all_version": ["v2.1", "v2.2", "v2.5", "v2.6", "v2.7"],
    "official": [
        {"func": "add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor", "op_api": "all_version"},
        {"func": "old_op(Tensor self) -> Tensor", "acl_op": "v2.1, v2.2"},
        {"func": "new_op(Tensor self) -> Tensor", "op_api": ["v2.6", "newest"]},
        {"func": "mid_op(Tensor self) -> Tensor", "acl_op": ["v2.1", "v2.5"]},
        {"func": "both(Tensor self) -> Tensor", "acl_op": "v2.1", "op_api": ["v2.7", "newest"]},
    ],
    "symint": [{"func": "view(Tensor(a) self, SymInt[] size) -> Tensor(a)", "op_api": "all_version"}],
    "custom": [{"func": "npu_thing(Tensor self) -> Tensor", "op_api": "all_version"}],
}
NATIVE = {"backend": "NPU", "supported": ["empty_strided", {"func": "copy_", "op_api": True}], "custom": ["npu_x"]}


def test_versions_are_read_as_op_plugin_reads_them():
    got = npu_ops.op_plugin_ops(PLUGIN, "v2.7")
    assert got == {"add.Tensor", "new_op", "both", "view"}
    assert npu_ops.op_plugin_ops(PLUGIN, "v2.2") == {"add.Tensor", "old_op", "mid_op", "view"}
    assert "both" in npu_ops.op_plugin_ops(PLUGIN, "v2.1")  # acl_op there, op_api from v2.7
    assert npu_ops.native_ops(NATIVE) == {"empty_strided", "copy_"}


def test_the_command_writes_the_table(tmp_path, capsys):
    (tmp_path / "plugin.yaml").write_text(yaml.safe_dump(PLUGIN))
    (tmp_path / "native.yaml").write_text(yaml.safe_dump(NATIVE))
    out = tmp_path / "t.json"
    args = ["--op-plugin", str(tmp_path / "plugin.yaml"), "--native", str(tmp_path / "native.yaml")]
    args += ["--torch", "2.7", "--source", "test", "--out", str(out)]
    assert npu_ops.main(args) == 0
    t = json.loads(out.read_text())
    assert t["ops"] == {
        "aten::add": ["Tensor"],
        "aten::both": ["default"],
        "aten::copy_": ["default"],
        "aten::empty_strided": ["default"],
        "aten::new_op": ["default"],
        "aten::view": ["default"],
    }
    assert t["n_ops"] == 6 and t["torch"] == "2.7" and t["source"] == "test"
    assert npu_ops.main([*args[:4], "--torch", "2.9", "--source", "x", "--out", str(out)]) == 2
    assert "--torch 2.9:" in capsys.readouterr().err


def test_the_shipped_table_is_torch_npu_s():
    """torch_npu v7.3.0-pytorch2.7.1 with its pinned op-plugin: 619 operators; what a Llama
    block needs is there, ATen's flash-attention kernel (a CUDA/CPU one) is not, op-plugin's own
    scaled_dot_product_attention (routed to npu_fusion_attention) is."""
    t = op_table("torch_npu-v7.3.0-pytorch2.7.1")
    assert len(t) == 619
    for op in ("aten::mm", "aten::silu", "aten::rsqrt", "aten::embedding_dense_backward", "aten::_log_softmax"):
        assert op in t, op
    assert "aten::_scaled_dot_product_flash_attention" not in t and "aten::scaled_dot_product_attention" in t
    assert "aten::detach" not in t  # a view: a composite of torch's, counted native by the planner


def test_coverage_comes_from_the_table(monkeypatch):
    """llama2_7b on the 910B: 29 of 31 operators native (22 in torch_npu's table, 7 composites:
    views and slice_backward), the fused-attention pair mapped to npu_fusion_attention. An
    operator taken out of the table is then a custom kernel to write."""
    m, chip = preset("model", "llama2_7b"), preset("chip", "ascend910b")
    cov = op_coverage(m, 1024, "bf16", chip)
    native = [o for o in cov.ops if o.plan == "native"]
    assert (cov.n_total, len(native), cov.count("mapped")) == (31, 29, 2)
    assert sorted(o.op for o in native if o.via == "composite") == [
        "aten::_unsafe_view",
        "aten::detach",
        "aten::select",
        "aten::slice",
        "aten::slice_backward",
        "aten::t",
        "aten::transpose",
    ]
    table = dict(op_table(chip.op_table))
    del table["aten::silu"]
    monkeypatch.setattr(operators, "op_table", lambda name: table)
    cov = op_coverage(m, 1024, "bf16", chip)
    assert "aten::silu" in cov.unresolved and cov.count("custom") == 1
