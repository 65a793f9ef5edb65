"""The OVAT sweeper end to end on the CPU (real trials, real MLflow), its decision rules, and its
refusal of a broken study."""

from __future__ import annotations

import json
import math

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from orchestrator import report
from orchestrator.results import Point
from sweeps.ovat import Study, StudyError, judge, parse_study
from tests.conftest import ROOT, TableRunner, run_cli, search_runs

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


def _study(**kw) -> Study:
    return Study(name="t", variables={"a": ["1", "2"]}, fixed=[], **kw)


def _point(values, final_losses, losses=(5.0, 3.0), status="finished") -> Point:
    p = Point("h", status=status)
    p.values, p.final_losses = list(values), list(final_losses)
    from orchestrator.results import diverged

    p.diverged = diverged(list(losses), final_losses[0] if final_losses else None)
    return p


def test_a_win_must_beat_the_threshold_and_both_points_noise():
    study = _study(min_speedup=1.05)
    base = _point([1.0, 1.0], [3.0, 3.0])
    assert judge(_point([0.90, 0.90], [3.0, 3.0]), base, base, study, 1.05)[0]  # S = 1.11
    assert not judge(_point([0.97, 0.97], [3.0, 3.0]), base, base, study, 1.05)[0]  # S = 1.03 < 1.05
    # S = 1.11, but the candidate's own repeats spread by 20%: not a measured win
    ok, why = judge(_point([0.8, 1.0], [3.0, 3.0]), base, base, study, 1.05)
    assert not ok and "no win" in why
    # maximize: S = value / value_incumbent
    up = _study(direction="maximize", min_speedup=1.05)
    assert judge(_point([1.2, 1.2], [3.0, 3.0]), base, base, up, 1.05)[0]
    assert not judge(_point([0.9, 0.9], [3.0, 3.0]), base, base, up, 1.05)[0]


def test_one_repeat_counts_its_own_median_interval_as_its_noise():
    """repeats=1: no spread of repeats to read; a run that recorded its median step time's 95%
    interval (step_time_ci_rel) brings that interval's width as the point's noise."""
    study = _study(min_speedup=1.05)
    base = _point([1.0], [3.0])
    assert base.spread == 0.0  # nothing recorded: no noise known, min_speedup alone
    candidate = _point([0.90], [3.0])  # S = 1.11
    assert judge(candidate, base, base, study, 1.05)[0]
    candidate.ci_rel = [0.08]  # its median known to +-8%: a 16% spread
    assert candidate.spread == pytest.approx(0.16)
    ok, why = judge(candidate, base, base, study, 1.05)
    assert not ok and "below 1.160" in why
    candidate.values.append(0.90)  # two repeats: their own spread again
    assert candidate.spread == 0.0


def _steps(median: float, n: int = 8, seed: int = 0, outliers=(4.7,)) -> list:
    """Planted step times: ``n`` steps around ``median`` (5% jitter), the last ones replaced by
    ``outliers`` seconds (a flush, a collection: one step of a short run on a loaded machine)."""
    import random

    rng = random.Random(seed)
    times = [median * (1 + rng.uniform(-0.05, 0.05)) for _ in range(n)]
    return times[: n - len(outliers)] + list(outliers)


def _run(times) -> Point:
    """A point of one finished run whose steps took ``times``, with what the trainer records."""
    import statistics

    from trainers import measure

    p = _point([statistics.median(times)], [3.0])
    p.ci_rel = [measure.relative_half_width(times)]
    p.se_rel = [measure.median_rel_se(times)]
    return p


@pytest.mark.parametrize("repeats", [1, 2, 3])
def test_one_outlying_step_cannot_inflate_the_noise(repeats):
    """Planted step times, each run with one 4.7 s step among 0.1-0.2 s ones: a true 2x change is
    adopted, a 1% one is not, with one repeat a point and with several. Before, the noise of one
    run was its median interval's width, which from 6-8 steps runs from the smallest step to the
    largest: a 1 s-scale outlier set the threshold to about 40x and no change could win."""
    study = _study(min_speedup=1.0)

    def point(median, seed):
        runs = [_run(_steps(median, seed=seed + 10 * r)) for r in range(repeats)]
        p = runs[0]
        for r in runs[1:]:
            p.values += r.values
            p.final_losses += r.final_losses
            p.se_rel += r.se_rel
            p.ci_rel += r.ci_rel
        return p

    base = point(0.2, 1)
    threshold = max(study.min_speedup, 1.0 + base.spread)
    assert threshold < 1.10, base.spread  # the outlier is not the noise, the jitter is
    twice = point(0.1, 2)
    ok, why = judge(twice, base, base, study, threshold)
    assert ok, why
    near = point(0.2 / 1.01, 3)
    ok, why = judge(near, base, base, study, threshold)
    assert not ok and "no win" in why, why
    if repeats == 1:  # the old rule, the interval's width, would have refused the 2x change
        old = 1.0 + 2.0 * max(base.ci_rel)
        assert old > 2.0, old


def test_the_quality_gate_rejects_fast_points_that_lose_quality():
    study = _study(loss_band=0.05)
    base = _point([1.0, 1.0], [3.0, 3.0])
    ok, why = judge(_point([0.5, 0.5], [3.3, 3.3]), base, base, study, 1.02)  # 10% worse loss
    assert not ok and "quality gate" in why
    ok, why = judge(_point([0.5, 0.5], [6.0, 6.0], losses=(5.0, 6.0)), base, base, study, 1.02)
    assert not ok and "diverged" in why
    ok, why = judge(_point([0.5, 0.5], [math.nan, math.nan], losses=(5.0, math.nan)), base, base, study, 1.02)
    assert not ok and "diverged" in why
    failed = _point([], [], status="oom")
    failed.reason = "CUDA out of memory"
    assert judge(failed, base, base, study, 1.02) == (False, "oom: CUDA out of memory")


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


def _table(**entries):
    return {tuple(sorted(dict(kv.split("=") for kv in k.split("__")).items())): v for k, v in entries.items()}


def test_coordinate_descent_adopts_winners_in_order_and_makes_another_pass():
    from sweeps.ovat import descend

    # b=2 only pays off once a=2 is adopted: the second pass finds it
    table = _table(
        **{
            "a=1__b=1": (1.0, 3.0),
            "a=2__b=1": (0.5, 3.0),
            "a=3__b=1": "infeasible",
            "a=2__b=2": (0.25, 3.0),
            "a=1__b=2": (1.5, 3.0),
            "a=3__b=2": (9.0, 3.0),
        }
    )
    study = Study(name="t", variables={"b": ["1", "2"], "a": ["1", "2", "3"]}, fixed=["+x=y"], passes=3)
    # b first: b=2 loses against a=1 (1.5 > 1.0); then a=2 wins; the second pass tries b=2 again
    runner = TableRunner(table)
    data = descend(study, runner)
    assert runner.batches[0] == [{"b": "1", "a": "1"}, {"b": "2", "a": "1"}]  # baseline + first variable
    assert data["final"]["assignment"] == {"b": "2", "a": "2"}
    assert data["final"]["overrides"] == ["+x=y", "b=2", "a=2"]
    assert data["final"]["s_total"] == pytest.approx(4.0)
    decisions = [(r["pass"], r["variable"], r["value"], r["adopted"]) for r in data["rows"]]
    assert decisions == [
        (0, "(baseline)", "b=1 a=1", False),
        (1, "b", "2", False),
        (1, "a", "2", True),
        (1, "a", "3", False),
        (2, "b", "2", True),
        (2, "a", "1", False),
        (2, "a", "3", False),
        (3, "b", "1", False),
        (3, "a", "1", False),
        (3, "a", "3", False),
    ]
    assert data["rows"][3]["decision"].startswith("infeasible")
    assert len(data["helped"]) == 2 and list(data["curves"]) == ["baseline", "a=2", "b=2"]


def test_a_failed_baseline_ends_the_study_with_nothing_adopted():
    from sweeps.ovat import descend

    runner = TableRunner(_table(**{"a=1": "oom", "a=2": (0.5, 3.0)}))
    data = descend(Study(name="t", variables={"a": ["1", "2"]}, fixed=[]), runner)
    assert data["outcome"] == "baseline_failed" and data["final"]["assignment"] == {"a": "1"}
    assert len(data["rows"]) == 1 and data["rows"][0]["decision"].startswith("oom")


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml") if p.stem != "auto"))
def test_every_sweep_preset_selects_ovat_and_each_candidate_composes(preset):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from orchestrator import conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=[f"+sweep={preset}"], return_hydra_config=True)
            sweeper = cfg.hydra.sweeper
            assert sweeper._target_ == "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper"
            assert len(sweeper.params) >= 2 and sweeper.repeats >= 2 and not sweeper.variables
            assert cfg.hydra.mode == RunMode.MULTIRUN  # a study needs no -m
            for key, values in sweeper.params.items():
                assert len(values) >= 2, key
                for v in values:
                    compose("config", overrides=[f"+sweep={preset}", f"{key}={v}"])
    finally:
        GlobalHydra.instance().clear()


def test_a_variable_without_effect_on_the_incumbent_is_skipped_not_measured():
    from sweeps.ovat import descend

    # "bucket" acts only once "dp" is 2 (DDP buckets need replicas): skipped on the baseline, so
    # never launched there; after dp=2 is adopted, the second pass measures it
    table = _table(
        **{
            "dp=1__bucket=25": (1.0, 3.0),
            "dp=2__bucket=25": (0.5, 3.0),
            "dp=2__bucket=100": (0.25, 3.0),
            "dp=1__bucket=100": (1.0, 3.0),
        }
    )
    inert = {"bucket": lambda cur: "no DDP buckets" if cur["dp"] == "1" else None}
    runner = TableRunner(table, inert)
    data = descend(Study(name="t", variables={"bucket": ["25", "100"], "dp": ["1", "2"]}, fixed=[], passes=2), runner)
    assert runner.batches[0] == [{"bucket": "25", "dp": "1"}]  # the baseline alone: bucket was inert
    skipped = [r for r in data["rows"] if r["status"] == "skipped"]
    assert [(r["pass"], r["variable"]) for r in skipped] == [(1, "bucket")]
    assert "no DDP buckets" in skipped[0]["decision"] and data["skipped"] == ["bucket: no DDP buckets"]
    assert data["final"]["assignment"] == {"bucket": "100", "dp": "2"}
    assert runner.batches[1] == [{"bucket": "25", "dp": "2"}]  # pass 1: dp only


def _compose_preset(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import chips, conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            variables = {k: list(v) for k, v in cfg.hydra.sweeper.params.items()}
            base = {k: str(v[0]).lower() if isinstance(v[0], bool) else str(v[0]) for k, v in variables.items()}
            out = {}
            for key, values in variables.items():
                cands = []
                for v in values:
                    v = str(v).lower() if isinstance(v, bool) else str(v)
                    c = compose("config", overrides=[*overrides, *(f"{k}={x}" for k, x in {**base, key: v}.items())])
                    cands.append(chips.resolve(c))
                out[key] = cands
            return out
    finally:
        GlobalHydra.instance().clear()


def test_the_layout_preset_varies_only_knobs_that_act_on_its_layouts():
    """The dry run of conf/sweep/layout.yaml as its header runs it: every variable changes what
    the baseline trial computes (no variable measures noise)."""
    from orchestrator import effects

    for key, cfgs in _compose_preset(["+sweep=layout", "+chip=ascend910b", "model=llama2_13b"]).items():
        assert effects.no_effect(cfgs, key) is None, (key, effects.no_effect(cfgs, key))
        assert effects.differing(cfgs), key


def test_the_shared_rules_find_a_no_op_variable(compose_cfg):
    """The check the sweeper runs: the DDP bucket does nothing on tp8pp4 (dp=1); HCCL_BUFFSIZE
    does nothing on a CUDA chip; both act where the layout has what they configure."""
    from orchestrator import chips, effects

    base = ["+sweep=layout", "+chip=ascend910b", "model=llama2_13b", "parallel=tp8pp4"]
    cfgs = [chips.resolve(compose_cfg([*base, f"comm.bucket_mb={v}"])) for v in (25, 100)]
    assert "DDP" in effects.no_effect(cfgs, "comm.bucket_mb")
    cfgs = _compose_preset(["+sweep=layout", "+chip=h100", "model=llama2_13b"])
    assert "HCCL" in effects.no_effect(cfgs["comm.buffsize_mb"], "comm.buffsize_mb")


def test_ddp_buckets_act_only_where_the_trainer_builds_ddp(compose_cfg):
    from orchestrator import chips, effects

    def cands(*overrides):
        return [chips.resolve(compose_cfg(["+chip=cpu", *overrides, f"comm.bucket_mb={v}"])) for v in (25, 100)]

    assert effects.no_effect(cands("parallel=dp2"), "comm.bucket_mb") is None
    # with tp > 1 the replicas are FSDP (rules.dp_wrapping), whatever parallel.dp_shard says
    assert "DDP" in effects.no_effect(cands("parallel=dp2tp2", "parallel.dp_shard=ddp"), "comm.bucket_mb")
    assert "DDP" in effects.no_effect(cands("parallel=dp2", "parallel.dp_shard=fsdp"), "comm.bucket_mb")
    assert "DDP" in effects.no_effect(cands("parallel=single"), "comm.bucket_mb")
