"""The OVAT sweeper end to end on the CPU (real trials, real MLflow), how it reads its study, and
its refusal of a broken one (its decision rules: tests/test_ovat_rules.py; the presets:
tests/test_ovat_presets.py)."""

from __future__ import annotations

import json

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from orchestrator import report
from sweeps.ovat import StudyError, parse_study
from tests.conftest import run_cli, search_runs

# the shipped preset reshaped from the command line: micro-batches of 8 fixed, and as the first
# variable a straggler planted in the baseline (rank 0 2 s late to every step, trainer.fault.
# straggle_s) against none: a win no load on the machine can hide (micro-batch 1 against 8 lost
# to noise on a busy 2-core machine, and so did a 0.3 s straggler, where gpt_tiny's step times
# ranged from 0.3 to 3.4 s, and a 1 s one in a clean-clone run whose steps ranged 0.15 to 4.7 s);
# a learning rate that cannot reach the baseline's loss in
# 8 steps (the quality gate), a tensor-parallel size that does not divide the model (pruned before
# launch), and a fault drill that kills rank 0 at step 2 (a crash)
STUDY = [  # no -m: the preset sets multirun itself
    "+sweep=cpu_smoke",
    "+chip=cpu",
    "trainer.steps=8",
    "precision=fp32",
    "trainer.fault.kill_rank=0",
    "trainer.micro_batch=8",
    "trainer.fault.straggle_s=2,0",
    "trainer.lr=0.003,0.00001",
    "parallel.tp=1,3",
    "trainer.fault.at_step=-1,2",
]


def _parents(uri):
    return [r for r in search_runs(uri) if "sweep.status" in r.data.tags]


def _artifact(uri, run_id, path, tmp_path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).download_artifacts(run_id, path, str(tmp_path))


@pytest.mark.distributed
@pytest.mark.slow
def test_an_ovat_study_tunes_reports_and_resumes(tmp_path):
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    proc = run_cli(STUDY, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (parent,) = _parents(uri)
    tags = parent.data.tags
    assert tags["sweep.sweeper"] == "ovat" and tags["ovat.study"] == "cpu_smoke"
    assert parent.info.status == "FINISHED"
    assert "trainer.fault.straggle_s=0 " in tags["tuning.command"] and "trainer.lr=0.003" in tags["tuning.command"]

    data = json.loads(open(_artifact(uri, parent.info.run_id, "tuning_report.json", tmp_path)).read())
    assert [v["key"] for v in data["variables"]] == [
        "trainer.fault.straggle_s",
        "trainer.lr",
        "parallel.tp",
        "trainer.fault.at_step",
    ]
    assert data["final"]["assignment"] == {
        "trainer.fault.straggle_s": "0",
        "trainer.lr": "0.003",
        "parallel.tp": "1",
        "trainer.fault.at_step": "-1",
    }
    rows = {(r["variable"], r["value"]): r for r in data["rows"]}
    base = rows[("(baseline)", "trainer.fault.straggle_s=2 trainer.lr=0.003 parallel.tp=1 trainer.fault.at_step=-1")]
    assert base["n"] == 2 and base["decision"] == "baseline"
    unplanted = rows[("trainer.fault.straggle_s", "0")]
    assert unplanted["adopted"] and unplanted["decision"].startswith("adopted") and unplanted["n"] == 2
    # S = T_baseline / T, from the medians of the repeats
    assert unplanted["s_base"] == pytest.approx(base["objective"] / unplanted["objective"])
    slow_lr = rows[("trainer.lr", "1e-05")]
    assert not slow_lr["adopted"] and "quality gate" in slow_lr["decision"]
    tp3 = rows[("parallel.tp", "3")]
    assert tp3["status"] == "infeasible" and tp3["n"] == 0 and "parallel.tp=3" in tp3["decision"]
    crashed = rows[("trainer.fault.at_step", "2")]  # recorded with its status and reason; the study went on
    assert crashed["status"] == "crash" and crashed["decision"].startswith("crash: rank 0") and not crashed["adopted"]
    assert data["trials"] == {**data["trials"], "launched": 8, "reused": 0, "pruned": 1}
    assert data["trials"]["trial_seconds"] > 0

    md = open(_artifact(uri, parent.info.run_id, "tuning_report.md", tmp_path)).read()
    assert "## What helped" in md and "trainer.fault.straggle_s=0" in md and "python -m orchestrator" in md
    for name in ("objective_trainer.fault.straggle_s.png", "objective_trainer.lr.png", "loss_curves.png"):
        png = open(_artifact(uri, parent.info.run_id, f"plots/{name}", tmp_path), "rb").read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name

    trials = [r for r in search_runs(uri) if "trial.status" in r.data.tags]
    assert sorted(r.data.tags["trial.status"] for r in trials) == ["crash"] * 2 + ["finished"] * 6 + ["infeasible"]
    for r in trials:
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
    (pruned,) = [r for r in trials if r.data.tags["trial.status"] == "infeasible"]
    assert "loss" not in pruned.data.metrics  # recorded, never launched

    # the same study again: every finished point is reused from MLflow; only the crashed one runs again
    again = run_cli(STUDY, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    second = next(p for p in _parents(uri) if p.info.run_id != parent.info.run_id)
    data2 = json.loads(open(_artifact(uri, second.info.run_id, "tuning_report.json", tmp_path / "2")).read())
    assert data2["trials"]["launched"] == 2 and data2["trials"]["reused"] == 6
    assert data2["final"]["assignment"] == data["final"]["assignment"]
    finished = [r for r in search_runs(uri) if r.data.tags.get("trial.status") == "finished"]
    assert len(finished) == 6

    # orchestrator.report renders the stored report of a sweep again
    out = tmp_path / "report"
    assert (
        report.main(
            ["--experiment", "orchestrator", "--tracking-uri", uri, "--sweep", tags["sweep"], "--out", str(out)]
        )
        == 0
    )
    assert "trainer.fault.straggle_s" in (out / "tuning_report.md").read_text()
    assert (out / "loss_curves.png").is_file()


def test_the_search_space_is_read_from_params_as_hydra_s_sweepers_do_with_variables_its_alias():
    parser = OverridesParser.create()
    space = {"trainer.micro_batch": "2,8", "precision": ["fp32", "bf16"]}
    goal = {"objective": "final_loss", "direction": "minimize"}
    for key in ("params", "variables"):
        study = parse_study({key: space, **goal}, [], parser, "s")
        assert list(study.variables.items()) == [("trainer.micro_batch", ["2", "8"]), ("precision", ["fp32", "bf16"])]
        assert study.space == key
    same = parse_study({"params": space, "variables": dict(space), **goal}, [], parser, "s")
    assert list(same.variables) == ["trainer.micro_batch", "precision"]
    with pytest.raises(StudyError) as err:
        parse_study(
            {"params": space, "variables": {"precision": "fp32,bf16"}, "objective": "final_loss"}, [], parser, "s"
        )
    assert err.value.errors[0].startswith("hydra.sweeper.variables: an alias of hydra.sweeper.params")
    with pytest.raises(StudyError) as err:
        parse_study({"params": {"precision": "fp32"}, **goal}, [], parser, "s")
    assert err.value.errors[0].startswith("hydra.sweeper.params.precision: needs at least two candidates")


def test_the_best_command_of_a_study_runs_one_trial():
    from orchestrator.results import command

    # the preset sets multirun: the reproducing command turns it back into one run
    assert command(["+sweep=cpu_smoke", "trainer.micro_batch=8"]) == (
        "python -m orchestrator +sweep=cpu_smoke trainer.micro_batch=8 hydra.mode=RUN"
    )
    assert command(["trainer.micro_batch=8"]) == "python -m orchestrator trainer.micro_batch=8"


def test_the_study_takes_the_preset_then_the_command_line():
    parser = OverridesParser.create()
    spec = {
        "variables": {"trainer.micro_batch": [2, 8], "precision": "fp32,bf16", "comm.overlap": [True, False]},
        "objective": "tokens_per_s_median",
        "direction": "maximize",
        "repeats": 3,
        "min_speedup": 1.1,
        "loss_band": 0.02,
        "passes": 2,
        "resume": False,
    }
    study = parse_study(
        spec, ["+chip=cpu", "precision=bf16", "comm.bucket_mb=10,50", "trainer.micro_batch=4,8"], parser, "s"
    )
    # precision is fixed on the command line; micro_batch's candidates replaced in place; bucket_mb appended
    assert list(study.variables.items()) == [
        ("trainer.micro_batch", ["4", "8"]),
        ("comm.overlap", ["true", "false"]),
        ("comm.bucket_mb", ["10", "50"]),
    ]
    assert study.fixed == ["+chip=cpu", "precision=bf16"]
    assert (study.objective, study.direction, study.repeats, study.passes, study.resume) == (
        "tokens_per_s_median",
        "maximize",
        3,
        2,
        False,
    )
    assert study.overrides({"a": "1"}) == ["+chip=cpu", "precision=bf16", "a=1"]


def test_a_broken_study_names_every_key():
    parser = OverridesParser.create()
    with pytest.raises(StudyError) as err:
        parse_study(
            {
                "variables": {"precision": ["fp32"]},
                "objective": "",
                "direction": "down",
                "repeats": 0,
                "min_speedup": 0.5,
                "loss_band": 0,
                "passes": 0,
            },
            ["trainer.lr=interval(0,1)"],
            parser,
            "s",
        )
    text = "\n".join(err.value.errors)
    for key in (
        "hydra.sweeper.variables.precision",
        "hydra.sweeper.objective",
        "hydra.sweeper.direction=down",
        "hydra.sweeper.repeats=0",
        "hydra.sweeper.min_speedup=0.5",
        "hydra.sweeper.loss_band=0",
        "hydra.sweeper.passes=0",
        "trainer.lr=interval(0,1)",
    ):
        assert key in text, key


def test_a_broken_study_exits_2_and_leaves_no_run(tmp_path):
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    proc = run_cli(["-m", "+sweep=cpu_smoke", "precision=fp32,fp64"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "error: hydra.sweeper.params.precision: candidate 'fp64' does not compose" in proc.stderr
    assert search_runs(uri) == []  # the sweep's parent run is removed again; no trial was recorded
    proc = run_cli(["-m", "hydra/sweeper=ovat"], cwd=tmp_path)
    assert proc.returncode == 2 and "error: hydra.sweeper.params: the study has no variables" in proc.stderr
