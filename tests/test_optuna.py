"""Hydra's Optuna sweeper drives real trials: each job returns ``optimized_metric`` as a float,
a point the planner rejects is recorded infeasible without launching and returns the worst value
(+inf when minimizing), and ``orchestrator.best`` picks the same trial the study did."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from orchestrator import best
from tests.conftest import metric_history, run_cli, search_runs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

optuna = pytest.importorskip("optuna")  # the `test` extra installs hydra-optuna-sweeper

BASE = ["+chip=cpu", "trainer=smoke", "trainer.steps=3", "data.num_workers=0"]


def test_an_optuna_study_over_two_variables_runs_real_trials_and_best_agrees(tmp_path, capsys):
    proc = run_cli(
        [
            "-m",
            "hydra/sweeper=optuna",
            "hydra/sweeper/sampler=grid",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=2",
            "hydra.sweeper.direction=minimize",
            "optimized_metric=step_time_median_s",
            *BASE,
            "trainer.micro_batch=choice(2,4)",
            "parallel.tp=choice(1,3)",  # tp=3 divides neither n_heads=4 nor d_ff: infeasible
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    runs = search_runs(uri)
    parent = next(r for r in runs if "sweep.status" in r.data.tags)
    assert parent.data.tags["sweep.sweeper"] == "optuna"
    trials = [r for r in runs if "trial.status" in r.data.tags]
    assert len(trials) == 4 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in trials)
    infeasible = [r for r in trials if r.data.tags["trial.status"] == "infeasible"]
    finished = [r for r in trials if r.data.tags["trial.status"] == "finished"]
    assert {r.data.params["parallel.tp"] for r in infeasible} == {"3"} and len(infeasible) == 2
    for r in infeasible:  # pruned before launch: no step ever ran
        assert "parallel.tp=3" in r.data.tags["trial.reason"]
        assert metric_history(uri, r.info.run_id, "loss") == []
    assert sorted(r.data.params["trainer.micro_batch"] for r in finished) == ["2", "4"]

    # the study was told every trial's value (no "Failed experiment": +inf is a value) and chose
    # the measured fastest; its result file is what Hydra's Optuna sweeper writes
    assert "Failed experiment" not in proc.stderr
    (result,) = tmp_path.glob("multirun/*/*/optimization_results.yaml")
    study = OmegaConf.load(result)
    fastest = min(finished, key=lambda r: r.data.metrics["step_time_median_s"])
    assert dict(study.best_params) == {
        "trainer.micro_batch": int(fastest.data.params["trainer.micro_batch"]),
        "parallel.tp": 1,
    }
    assert study.best_value == pytest.approx(fastest.data.metrics["step_time_median_s"])

    # orchestrator.best reads the study's result back from MLflow
    capsys.readouterr()
    assert best.main(["--tracking-uri", uri, "--sweep", parent.data.tags["sweep"], "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["run_id"] == fastest.info.run_id
    assert got["value"] == pytest.approx(study.best_value)


def test_a_job_returns_the_worst_value_of_the_sweeper_s_direction_for_a_trial_that_did_not_finish():
    from orchestrator.app import maximizes, objective

    cfg = OmegaConf.create({"optimized_metric": "tokens_per_s_median"})
    done = {"status": "finished", "summary": {"tokens_per_s_median": 812.5, "final_loss": 4.1}}
    assert objective(cfg, done) == 812.5
    up = OmegaConf.create({"direction": "maximize"})  # Optuna's
    for failed in ({"status": "infeasible"}, {"status": "oom", "summary": {}}, {"status": "finished", "summary": {}}):
        assert objective(cfg, failed) == math.inf
        assert objective(cfg, failed, up) == -math.inf
    assert objective(OmegaConf.create({"optimized_metric": None}), done) is done  # a dict, as before
    assert maximizes(OmegaConf.create({"direction": ["MAXIMIZE"]}))
    assert maximizes(OmegaConf.create({"optim": {"maximize": True}}))  # Nevergrad's
    assert maximizes(OmegaConf.create({"ax_config": {"experiment": {"minimize": False}}}))  # Ax's
    assert not maximizes(OmegaConf.create({"direction": "minimize"})) and not maximizes(None)
