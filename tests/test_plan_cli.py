"""The `python -m orchestrator.plan` command: every layout as JSON, the composed layout as a
table, bad overrides, the chip's operator table.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from orchestrator import chips, tracking
from tests.conftest import ROOT, cli_env
from tests.planner_cases import CONTRACT, MEMORY_KEYS
from trainers.ops import (
    FUSED_ATTENTION,
)

# --- the CLI --------------------------------------------------------------------------------------


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.plan", *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_plans_every_layout_of_32_devices_as_json():
    # a global batch of 256 admits dp=32: plain DDP layouts that cannot fit beside FSDP ones that do
    # (the shortlist of the search, issue 26: the points that fit, with their knobs; those that do
    # not are counted on stderr by the rule they break)
    proc = plan_cli("+chip=ascend910b", "model=llama2_13b", "trainer.global_batch=256", "--devices", "32", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) >= 3
    knobs = {"micro_batch", "virtual_stages", "activation_checkpointing", "recompute_granularity", "dp_shard"}
    knobs |= {"sequence_parallel", "recompute_layers", "compile", "loss_chunks"}
    for row in rows:
        assert set(row) == CONTRACT | {"n_params", "pipeline_rank"} | knobs and set(row["memory_gb"]) == MEMORY_KEYS
        assert row["dp"] * row["tp"] * row["pp"] == 32
        assert isinstance(row["fits"], bool) and 0 <= row["bubble_fraction"] < 1 and 0 <= row["comm_share"] < 1
        parts = sum(v for k, v in row["memory_gb"].items() if k != "total")
        assert row["memory_gb"]["total"] == pytest.approx(parts)
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)
    assert all(r["fits"] for r in rows) and "memory: the most loaded rank exceeds ascend910b's" in proc.stderr


def test_cli_plans_the_composed_layout_as_a_table():
    proc = plan_cli(
        "+chip=ascend910b",
        "model=llama2_7b",
        "parallel=tp8pp4",
        "parallel.microbatches=8",
        "trainer.global_batch=32",
        "model.tie_embeddings=false",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dp1tp8pp4" in proc.stdout and "coverage" in proc.stdout and "replacement rate" in proc.stdout
    assert "model.attn_impl=npu_fused" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["parallel.tpp=2"], "parallel.tpp"),
        (["model=llama2_13", "--devices", "8"], "model/llama2_13"),
        (["+chip=ascend910b", "model=llama2_13b", "parallel.tp=3"], "parallel.tp=3 does not divide model.n_heads=40"),
    ],
)
def test_cli_bad_overrides_exit_2_with_one_line_each(args, needle):
    proc = plan_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    assert any(needle in line for line in lines) and proc.stdout == ""


def test_cli_probe_writes_the_chip_table(tmp_path):
    out = tmp_path / "ops.yaml"
    proc = plan_cli("+chip=cpu", "model=llama2_7b", "--probe", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = OmegaConf.load(out)
    assert list(table.unsupported_ops) == []
    assert table.probe[FUSED_ATTENTION].status == "native"


def test_chip_operator_tables_make_valid_mlflow_param_names():
    """Every config key becomes an MLflow param name (tracking.flatten): a `*` in a
    chip.decompositions key would make every trial on that chip fail to start its run."""
    import re

    for name in chips.preset_names():
        keys = tracking.flatten({"chip": OmegaConf.to_container(chips.load_preset(name))})
        bad = [k for k in keys if not re.fullmatch(r"[\w\-. :/]+", k)]
        assert bad == [], (name, bad)
