"""Numerics: the layer where a NaN starts, an fp16 overflow's layer, comparing runs, profiling."""

from __future__ import annotations

import json

import pytest

from orchestrator import compare, trial
from tests.conftest import metric_history, search_runs

pytestmark = pytest.mark.distributed

BASE = ["+chip=cpu", "trainer=smoke", "trainer.global_batch=8", "trainer.micro_batch=2", "data.num_workers=0"]


def _run(compose_cfg, uri, overrides):
    return trial.run(compose_cfg([*BASE, *overrides, f"tracking.uri={uri}"]), overrides, progress=False)


@pytest.mark.parametrize("layout", ["single", "tp2pp2"])
def test_injected_nan_names_its_layer_and_step(compose_cfg, mlflow_uri, layout):
    result = _run(
        compose_cfg, mlflow_uri, [f"parallel={layout}", "trainer.fault.nan_layer=2", "trainer.fault.nan_at_step=3"]
    )
    assert result["status"] == "nonfinite"
    assert "at step 3" in result["reason"] and "first in layer 2" in result["reason"], result["reason"]


def test_fp16_overflow_shows_the_layer_whose_activations_overflowed(compose_cfg, mlflow_uri):
    result = _run(
        compose_cfg,
        mlflow_uri,
        [
            "precision=fp16",
            "precision.monitor=1",
            "trainer.fault.nan_layer=1",
            "trainer.fault.nan_at_step=2",
            "trainer.fault.inject=overflow",
        ],
    )
    assert result["status"] == "finished", result.get("reason")
    rid = result["run_id"]
    assert [m.value for m in metric_history(mlflow_uri, rid, "overflow_layer")] == [1]
    client = __import__("mlflow").tracking.MlflowClient(mlflow_uri)
    rows = json.loads(
        client.download_artifacts(rid, "monitor/step_000002.json", str(__import__("tempfile").mkdtemp()))
        and open(client.download_artifacts(rid, "monitor/step_000002.json")).read()
    )
    acts = {r["layer"]: r for r in rows if r["kind"] == "activation"}
    assert acts[0]["overflow_fp16"] == 0 and acts[1]["overflow_fp16"] > 0  # layer 1 overflowed, not 0
    assert [m.value for m in metric_history(mlflow_uri, rid, "skipped_steps")][2] == 1


def test_compare_fp32_and_bf16(compose_cfg, mlflow_uri, tmp_path):
    steps = ["trainer.steps=12", "precision.monitor=4", "trainer.log_every=4"]
    fp32 = _run(compose_cfg, mlflow_uri, [*steps])
    bf16 = _run(compose_cfg, mlflow_uri, [*steps, "precision=bf16"])
    thr = 1e-4  # bf16 vs fp32 on gpt_tiny: loss differences of 1e-5 to 3e-4 in the first steps
    out = compare.compare(mlflow_uri, fp32["run_id"], bf16["run_id"], threshold=thr)
    diffs = [r["rel_diff"] for r in out["per_step"]]
    first = out["first_divergence_step"]
    assert first is not None and diffs[first] > thr and all(d <= thr for d in diffs[:first])
    assert out["max_rel_loss_diff"] == pytest.approx(max(diffs))
    assert out["first_divergent_layer"] is not None and out["first_divergent_layer"].startswith("layers.")
    same = compare.compare(mlflow_uri, fp32["run_id"], fp32["run_id"], threshold=thr)
    assert same["first_divergence_step"] is None and same["first_divergent_layer"] is None
    assert same["max_rel_loss_diff"] == 0.0
    paths = compare.write_report(out, tmp_path)
    assert (tmp_path / "compare.md").read_text().startswith("# ") and (tmp_path / "compare_loss.png").stat().st_size > 0
    assert len(paths) == 2
    # the CLI: --json carries the contract's keys; --log attaches the report to RUN_B
    assert (
        compare.main(
            [
                fp32["run_id"],
                bf16["run_id"],
                "--tracking-uri",
                mlflow_uri,
                "--threshold",
                str(thr),
                "--json",
                "--out",
                str(tmp_path / "cli"),
                "--log",
            ]
        )
        == 0
    )
    client = __import__("mlflow").tracking.MlflowClient(mlflow_uri)
    assert {a.path for a in client.list_artifacts(bf16["run_id"], "compare")} == {
        "compare/compare.md",
        "compare/compare_loss.png",
    }
    assert compare.main(["nope", bf16["run_id"], "--uri", mlflow_uri]) == 2  # --uri: the old spelling


@pytest.mark.parametrize("layout,expect_comm", [("single", False), ("dp2", True)])
def test_profile_records_trace_and_comm_share(compose_cfg, mlflow_uri, tmp_path, layout, expect_comm):
    result = _run(
        compose_cfg,
        mlflow_uri,
        [
            f"parallel={layout}",
            "trainer.steps=6",
            "trainer.profile=true",
            "trainer.profile_start=2",
            "trainer.profile_steps=2",
            f"trainer.profile_dir={tmp_path}",
        ],
    )
    assert result["status"] == "finished", result.get("reason")
    run = next(r for r in search_runs(mlflow_uri) if r.info.run_id == result["run_id"])
    m = run.data.metrics
    share = m["comm_share"]  # exposed communication, the most waiting rank's
    assert (share > 0) if expect_comm else (share == 0)
    assert (m["profile_comm_s"] > 0) if expect_comm else (m["profile_comm_s"] == 0)
    # one rank's whole split (the most waiting one's: its compute with its own communication, not rank 0's
    # compute with another rank's comm): each interval counted once, so the shares fit in the window
    assert m["profile_rank"] in ((0, 1) if expect_comm else (0,))
    assert m["compute_share"] + m["comm_share"] <= 1 + 1e-9
    assert m["profile_compute_s"] > 0 and 0 <= m["profile_overlap_s"] <= m["profile_comm_s"]
    assert m["profile_compute_s"] + m["profile_comm_s"] - m["profile_overlap_s"] <= m["profile_wall_s"] * (1 + 1e-9)
    client = __import__("mlflow").tracking.MlflowClient(mlflow_uri)
    files = {a.path for a in client.list_artifacts(result["run_id"], "profile")}
    assert "profile/trace_rank0.json" in files and "profile/top_ops.txt" in files
