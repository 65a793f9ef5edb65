"""End to end: a composed config trains through the elastic launcher and MLflow records it.

These start real torch.distributed (gloo) worker processes and a real MLflow sqlite store.
"""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from orchestrator import trial
from tests.conftest import cli_in_process, metric_history, run_cli, search_runs
from trainers.loop import train

pytestmark = pytest.mark.distributed

STEPS = 12
COMMON = [
    "trainer=smoke",
    f"trainer.steps={STEPS}",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "trainer.log_every=5",
    "data.num_workers=1",
]


def _run(compose_cfg, mlflow_uri, overrides):
    chip = [] if any(o.startswith("+chip=") for o in overrides) else ["+chip=cpu"]
    cfg = compose_cfg([*COMMON, *chip, *overrides, f"tracking.uri={mlflow_uri}"])
    return cfg, trial.run(cfg, overrides, progress=False)


def test_dp2_matches_the_single_process_reference(compose_cfg, mlflow_uri):
    """Same seed, data and global batch: DDP over 2 gloo processes reproduces one process.

    Tolerance: 1e-5 relative per step in fp32 (the all-reduce sums the two halves of the
    batch in another order than the single process; measured differences are ~1e-7)."""
    cfg = trial.prepare(compose_cfg([*COMMON, "+chip=cpu", "parallel=single"]))
    reference = train(trial.build_spec(cfg))["losses"]  # in this process, no process group
    assert len(reference) == STEPS and reference[-1] < reference[0]

    for preset in ("single", "dp2"):
        cfg, result = _run(compose_cfg, mlflow_uri, [f"parallel={preset}"])
        assert result["status"] == "finished", result
        logged = [m.value for m in metric_history(mlflow_uri, result["run_id"], "loss")]
        assert [m.step for m in metric_history(mlflow_uri, result["run_id"], "loss")] == list(range(STEPS))
        assert logged == pytest.approx(reference, rel=1e-5), preset
        assert result["summary"]["world_size"] == (2 if preset == "dp2" else 1)


def test_cli_trains_and_mlflow_records_the_run(tmp_path):
    """The README's run command, in a fresh directory: sqlite store created there by default."""
    proc = run_cli(["trainer.steps=30", "trainer.log_every=10"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    runs = search_runs(uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["trial.status"] == "finished" and tags["chip"] == "cpu" and tags["emulated"] == "false"
    assert len(tags["trial.config_hash"]) == 16 and run.data.params["config_hash"] == tags["trial.config_hash"]
    assert run.data.params["model.name"] == "gpt_tiny" and run.data.params["parallel.dp"] == "1"
    losses = [m.value for m in metric_history(uri, run.info.run_id, "loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    for key in ("step_time_s", "tokens_per_s", "grad_norm", "lr"):
        assert len(metric_history(uri, run.info.run_id, key)) == 30, key
    m = run.data.metrics
    for key in ("step_time_median_s", "tokens_per_s_median", "final_loss", "peak_mem_gb", "n_params", "mfu"):
        assert key in m and m[key] > 0, key
    assert m["final_loss"] == pytest.approx(losses[-1])
    # one process with the host's cores: never busier than its cores allow. How far below 1 it is
    # depends on what else the host runs (the suite's other workers share these cores), so the
    # figure's meaning is tested on controlled work in test_step_clock.py
    assert 0 < m["host_cpu_s"] and 0 < m["host_busy"] <= 1.05
    assert (tmp_path / "mlartifacts").is_dir()
    from mlflow.tracking import MlflowClient

    files = {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert {"config.yaml", "overrides.txt"} <= files
    config = OmegaConf.create(
        MlflowClient(uri).download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
        and (tmp_path / "config.yaml").read_text()
    )
    assert config.chip.name == "cpu" and config.trainer.steps == 30


def test_the_chip_s_vendor_is_a_tag_of_the_run(compose_cfg):
    assert trial.trial_tags(compose_cfg(["+chip=ascend910b"]))["chip.vendor"] == "huawei"
    assert trial.trial_tags(compose_cfg(["+chip=cpu", "chip.vendor=acme"]))["chip.vendor"] == "acme"


def test_emulated_chip_runs_on_cpu_and_is_tagged(compose_cfg, mlflow_uri):
    cfg, result = _run(compose_cfg, mlflow_uri, ["+chip=ascend910b", "chip.emulate=true", "parallel=dp2"])
    assert result["status"] == "finished"
    run = search_runs(mlflow_uri)[0]
    assert run.data.tags["emulated"] == "true" and run.data.tags["chip"] == "ascend910b"
    assert run.data.params["chip.dist_backend"] == "hccl"  # the plan is the chip's
    assert "mfu" not in run.data.metrics  # no meaningful peak to divide by on a CPU


def test_a_crashing_trial_is_recorded_failed_with_its_reason(tmp_path, monkeypatch, capfd):
    uri = "sqlite:///" + str(tmp_path / "runs.db")
    args = [*COMMON, "parallel=dp2", "trainer.fault.kill_rank=1", "trainer.fault.at_step=3"]
    code, _, err = cli_in_process(args, tmp_path, monkeypatch, capfd, MLFLOW_TRACKING_URI=uri)
    assert code == 1, err[-2000:]
    run = search_runs(uri)[0]
    assert run.info.status == "FAILED"
    assert run.data.tags["trial.status"] == "crash"
    assert "rank 1" in run.data.tags["trial.reason"] and "SIGKILL" in run.data.tags["trial.reason"]
    assert "fault" in run.data.tags


def test_nan_in_fp32_ends_the_trial_nonfinite(compose_cfg, mlflow_uri):
    cfg, result = _run(compose_cfg, mlflow_uri, ["trainer.fault.nan_layer=1", "trainer.fault.nan_at_step=4"])
    assert result["status"] == "nonfinite"
    assert "step 4" in result["reason"]
    run = search_runs(mlflow_uri)[0]
    assert run.data.tags["trial.status"] == "nonfinite" and run.info.status == "FAILED"
    # the steps before the fault were logged, all finite
    assert all(math.isfinite(m.value) for m in metric_history(mlflow_uri, run.info.run_id, "loss"))


def test_preflight_is_recorded_beside_the_measurement(compose_cfg, mlflow_uri):
    cfg, result = _run(compose_cfg, mlflow_uri, [])
    assert result["status"] == "finished"
    run = search_runs(mlflow_uri)[0]
    m = run.data.metrics
    assert m["planned_mem_gb"] > 0 and m["peak_mem_gb"] > 0 and 0 < m["op_coverage"] <= 1
    from mlflow.tracking import MlflowClient

    files = {a.path for a in MlflowClient(mlflow_uri).list_artifacts(run.info.run_id)}
    assert "preflight.json" in files


def test_an_infeasible_trial_is_recorded_and_not_launched(tmp_path, monkeypatch, capfd):
    """llama2_70b on one emulated 910B: the planner refuses it before any process starts."""
    uri = "sqlite:///" + str(tmp_path / "runs.db")
    args = ["+chip=ascend910b", "chip.emulate=true", "model=llama2_70b", "trainer.seq_len=256"]
    code, out, _ = cli_in_process(args, tmp_path, monkeypatch, capfd, MLFLOW_TRACKING_URI=uri)
    assert code == 1
    run = search_runs(uri)[0]
    assert run.data.tags["trial.status"] == "infeasible"
    assert "exceeds ascend910b's 64 GB" in run.data.tags["trial.reason"]
    assert "trial " not in out  # the launch line never came: no worker was started
    assert run.data.params["model.attn_impl"] == "npu_fused"  # planned with the mapped attention


def test_a_chip_without_fused_attention_runs_the_decomposition(compose_cfg, mlflow_uri):
    cfg = compose_cfg([*COMMON, "+chip=cpu", f"tracking.uri={mlflow_uri}"])
    cfg.chip.unsupported_ops = ["aten::_scaled_dot_product_flash_attention*"]
    cfg.chip.decompositions = {"aten::_scaled_dot_product_": "model.attn_impl=decomposed"}
    result = trial.run(cfg, [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    run = search_runs(mlflow_uri)[0]
    assert run.data.params["model.attn_impl"] == "decomposed"
    assert run.data.metrics["op_replacement_rate"] > 0
