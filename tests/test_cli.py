"""One command-line surface for `orchestrator.best`, `.report`, `.compare` and `.plan`: the same
tracking flags and defaults, `--json`, `--filter`, the old spellings, and one set of exit codes
(0 done, 1 failed, 2 bad input, 3 nothing matched), on a real sqlite MLflow store."""

from __future__ import annotations

import json

import pytest

from orchestrator import best, cli, compare, exit_codes, plan, report
from orchestrator.config import TrackingConfig

EXP = TrackingConfig.experiment
# name, chip, step_time_median_s, per-step loss (the last is final_loss)
TRIALS = [
    ("+chip=cpu trainer.micro_batch=1", "cpu", 1.0, [4.0, 3.0, 2.0, 1.50]),
    ("+chip=cpu trainer.micro_batch=8", "cpu", 0.5, [4.0, 3.0, 2.0, 1.60]),
    ("+chip=cuda trainer.micro_batch=1", "cuda", 0.1, [4.0, 3.1, 2.1, 1.40]),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A grid sweep `s1` of the three TRIALS (a parent run and its trial runs), and one run that
    logged no loss. Returns (uri, {name: run_id}, parent run id)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("cli")
    uri = "sqlite:///" + str(root / "mlruns.db")
    c = MlflowClient(uri)
    exp = c.create_experiment(EXP, artifact_location=(root / "mlartifacts").as_uri())
    parent = c.create_run(exp, start_time=1000, tags={"sweep": "s1", "sweep.status": "finished"})
    ids = {}
    for i, (name, chip, step_s, losses) in enumerate(TRIALS):
        tags = {
            "mlflow.runName": name,
            "sweep": "s1",
            "trial.status": "finished",
            "trial.config_hash": f"hash{i}",
            "chip": chip,
            "model": "gpt_mini",
        }
        run = c.create_run(exp, start_time=2000 + i, tags=tags)
        rid = run.info.run_id
        for step, loss in enumerate(losses):
            c.log_metric(rid, "loss", loss, step=step)
        c.log_metric(rid, "final_loss", losses[-1])
        c.log_metric(rid, "step_time_median_s", step_s)
        c.set_terminated(rid, end_time=3000 + i)
        ids[name] = rid
    silent = c.create_run(exp, start_time=5000, tags={"mlflow.runName": "silent"})
    ids["silent"] = silent.info.run_id
    return uri, ids, parent.info.run_id


def _call(capsys, main, *args):
    """main(args) -> (exit code, stdout, stderr); a usage error (argparse exits) counts too."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_one_set_of_exit_codes_and_one_default_experiment():
    assert (exit_codes.OK, exit_codes.FAILED, exit_codes.BAD_INPUT, exit_codes.NO_MATCH) == (0, 1, 2, 3)
    assert "  2  bad input" in exit_codes.HELP and "  3  nothing matched" in exit_codes.HELP
    assert cli.default_experiment() == EXP


def test_build_filter_joins_the_tools_tags_and_the_users_filter():
    assert cli.build_filter(None, {"sweep": None}) == ""
    assert cli.build_filter(" metrics.final_loss < 5 ") == "metrics.final_loss < 5"
    assert (
        cli.build_filter("metrics.final_loss < 5", {"sweep": "s'1", "trial.status": "finished"})
        == "tags.`sweep` = 's\\'1' and tags.`trial.status` = 'finished' and metrics.final_loss < 5"
    )
    assert cli.check_filter("metrics.final_loss < 5 and tags.chip = 'cpu'") is None
    assert cli.check_filter("metrics.final_loss <").startswith("--filter=metrics.final_loss <: ")


def test_best_on_defaults_and_with_filters(store, capsys, monkeypatch):
    uri, ids, _ = store
    # --experiment defaults to TrackingConfig.experiment, --tracking-uri to $MLFLOW_TRACKING_URI
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, out, _ = _call(capsys, best.main, "--json")
    assert code == 0 and json.loads(out)["run_id"] == ids[TRIALS[2][0]]
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    # --filter goes to MLflow as it is, together with the tool's own filters
    code, out, _ = _call(capsys, best.main, "--tracking-uri", uri, "--filter", "tags.chip = 'cpu'", "--json")
    assert code == 0 and json.loads(out)["run_id"] == ids[TRIALS[1][0]]
    f = "metrics.final_loss < 1.55 and tags.chip = 'cpu'"
    code, out, _ = _call(capsys, best.main, "--tracking-uri", uri, "--filter", f, "--json")
    assert code == 0 and json.loads(out)["run_id"] == ids[TRIALS[0][0]]
    # sound input that matches nothing: 3, the reason on stderr, nothing on stdout
    code, out, err = _call(capsys, best.main, "--tracking-uri", uri, "--chip", "cuda", "--filter", "tags.chip = 'cpu'")
    assert code == exit_codes.NO_MATCH and out == "" and "error: --experiment=" in err and "0 matching run(s)" in err
    code, out, err = _call(capsys, best.main, "--tracking-uri", uri, "--model", "llama2_7b", "--json")
    assert code == exit_codes.NO_MATCH and out == ""


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--filter", "metrics.final_loss <"], "--filter=metrics.final_loss <"),
        (["--filter", "nonsense = 1"], "--filter=nonsense = 1"),
        (["--experiment", "nope"], "--experiment=nope: no such experiment"),
        (["--top", "0"], "--top=0: must be positive"),
        (["--top", "many"], "argument --top: invalid int value"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_best_bad_input_is_one_error_line_naming_the_flag(store, capsys, args, needle):
    uri, _, _ = store
    code, out, err = _call(capsys, best.main, "--tracking-uri", uri, *args)
    assert code == exit_codes.BAD_INPUT and out == ""
    _one_error(err, needle)


def test_a_missing_sqlite_store_is_bad_input_and_stays_missing(tmp_path, capsys):
    db = tmp_path / "typo.db"
    for main, args in ((best.main, []), (report.main, []), (compare.main, ["abcd", "efgh"])):
        code, out, err = _call(capsys, main, *args, "--tracking-uri", f"sqlite:///{db}")
        assert code == exit_codes.BAD_INPUT and out == ""
        _one_error(err, f"--tracking-uri=sqlite:///{db}: no such sqlite file")
    assert not db.exists()


def test_report_json_filter_and_log(store, capsys, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, ids, parent = store
    code, out, _ = _call(capsys, report.main, "--tracking-uri", uri, "--out", str(tmp_path / "all"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["sweep"] == "s1" and len(data["rows"]) == 3 and data["files"][0].endswith("tuning_report.md")
    # --filter: the report of the matching trials only
    cpu = ["--filter", "tags.chip = 'cpu'", "--out", str(tmp_path / "cpu"), "--json"]
    code, out, _ = _call(capsys, report.main, "--tracking-uri", uri, *cpu)
    data = json.loads(out)
    assert code == 0 and [r["run_ids"] for r in data["rows"]] == [[ids[TRIALS[0][0]]], [ids[TRIALS[1][0]]]]
    # nothing matched: no such sweep, or no trial passes the filter
    code, out, err = _call(capsys, report.main, "--tracking-uri", uri, "--sweep", "s2")
    assert code == exit_codes.NO_MATCH and out == "" and "no sweep s2" in err
    code, out, err = _call(capsys, report.main, "--tracking-uri", uri, "--filter", "tags.chip = 'tpu'")
    assert code == exit_codes.NO_MATCH and out == "" and "--filter=tags.chip = 'tpu'" in err
    # --log puts the report on the sweep's parent run; --attach is its old spelling
    code, _, err = _call(capsys, report.main, "--tracking-uri", uri, "--out", str(tmp_path / "a"), "--attach")
    assert code == 0 and "warning: --attach is deprecated, use --log" in err
    names = {a.path for a in MlflowClient(uri).list_artifacts(parent)}
    assert "tuning_report.md" in names and "tuning_report.json" in names


def test_compare_takes_run_id_prefixes_in_the_experiment_and_the_old_uri_flag(store, capsys, tmp_path):
    uri, ids, _ = store
    a, b = ids[TRIALS[0][0]], ids[TRIALS[2][0]]
    out_dir = ["--out", str(tmp_path / "cmp")]
    code, out, err = _call(capsys, compare.main, a[:12], b, "--uri", uri, "--json", *out_dir)
    assert code == 0 and "warning: --uri is deprecated, use --tracking-uri" in err
    got = json.loads(out)
    assert got["run_a"] == a and got["steps_compared"] == 4 and got["first_divergence_step"] == 1
    # the prefix is looked up in --experiment only
    code, out, err = _call(capsys, compare.main, a[:12], b, "--tracking-uri", uri, "--experiment", "other", *out_dir)
    assert code == exit_codes.BAD_INPUT and out == ""
    _one_error(err, f"run_a={a[:12]}: no such run")
    # two real runs without a loss step in common: nothing matched
    code, out, err = _call(capsys, compare.main, a, ids["silent"], "--tracking-uri", uri, *out_dir)
    assert code == exit_codes.NO_MATCH and out == "" and "no step whose loss both runs logged" in err


def test_plan_tracking_flags_map_onto_tracking_overrides(store, capsys):
    """--calibrate reads tracking.uri/tracking.experiment; the flags set them, over the overrides."""
    uri, _, _ = store
    # the store has no trial of this chip: nothing matched
    code, out, err = _call(capsys, plan.main, "+chip=ascend910b", "--calibrate", "--tracking-uri", uri)
    assert code == exit_codes.NO_MATCH and out == "" and f"in experiment {EXP} ({uri})" in err
    # the Hydra overrides still work ...
    code, out, err = _call(
        capsys, plan.main, "+chip=ascend910b", f"tracking.uri={uri}", "tracking.experiment=nope", "--calibrate"
    )
    assert code == exit_codes.BAD_INPUT and out == ""
    _one_error(err, "tracking.experiment=nope: no such experiment")
    # ... and the flags win over them
    code, out, err = _call(
        capsys,
        plan.main,
        "+chip=ascend910b",
        "tracking.experiment=nope",
        "--calibrate",
        "--tracking-uri",
        uri,
        "--experiment",
        EXP,
    )
    assert code == exit_codes.NO_MATCH, err
    # without --calibrate the store is not read at all
    code, out, _ = _call(capsys, plan.main, "+chip=cpu", "--tracking-uri", "sqlite:///nowhere.db", "--json")
    assert code == 0 and json.loads(out)[0]["dp"] == 1
