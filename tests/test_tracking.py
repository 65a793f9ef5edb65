"""MLflow conventions and tracker trouble, on a real sqlite store (and a real trial where marked):
the experiment's kind for MLflow 3's UI, the system tags and description of a run, the dataset
input, per-step timestamps, records that wait in the journal while the store is away, one value
per step, a store that cannot be used refusing the trial before any launch, the tuning report's
images linked for MLflow's UI, the UI hint. A store that goes away mid-trial, with a real
``mlflow server`` stopped and started again: tests/test_tracker_outage.py."""

from __future__ import annotations

import json
import pickle
import subprocess
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator import mlflow_journal, mlflow_reporter, mlflow_store, mlflow_ui, report_render, tracking, trial
from orchestrator.launch import free_port
from tests.conftest import ROOT, TableRunner, cli_in_process, metric_history, search_runs
from trainers.reporter import ROW_TIME

SMOKE = ["+chip=cpu", "trainer=smoke", "data.num_workers=0"]


def _run(uri: str) -> str:
    c = MlflowClient(uri)
    return c.create_run(tracking.experiment_id(uri, "orchestrator")).info.run_id


def _rows(steps, t0: float, loss0: float = 5.0):
    return [{"step": s, "loss": loss0 - 0.1 * s, "lr": 1e-3, ROW_TIME: t0 + s} for s in steps]


def _dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a port nothing listens on: connection refused


# --- experiments and runs ---------------------------------------------------------------------------


def test_our_experiments_open_in_mlflow_3s_model_training_view(mlflow_uri):
    c = MlflowClient(mlflow_uri)
    new = tracking.experiment_id(mlflow_uri, "fresh")
    assert c.get_experiment(new).tags["mlflow.experimentKind"] == "custom_model_development"
    old = c.create_experiment("from_before")  # an experiment of ours made before the tag
    assert "mlflow.experimentKind" not in c.get_experiment(old).tags
    assert tracking.experiment_id(mlflow_uri, "from_before") == old
    assert c.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    mine = c.create_experiment("a_users", tags={"mlflow.experimentKind": "genai_development"})
    tracking.experiment_id(mlflow_uri, "a_users")
    assert c.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"  # left alone


def test_a_run_has_mlflow_s_system_tags_its_command_and_at_the_end_its_result(compose_cfg, mlflow_uri):
    overrides = ["trainer.steps=3", "trainer.lr=3e-3", "+tag=a b"]
    cfg = trial.prepare(compose_cfg([*SMOKE, "trainer.steps=3", f"tracking.uri={mlflow_uri}"]))
    uri, run_id = tracking.start_run(cfg, overrides, {"chip": "cpu"})
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["mlflow.source.name"] == str(ROOT / "orchestrator" / "__main__.py")
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: MLflow's git context names its commit
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
    note = tags["mlflow.note.content"]
    assert "python -m orchestrator trainer.steps=3 trainer.lr=3e-3 '+tag=a b'" in note and "Result" not in note

    summary = {"final_loss": 2.34567, "step_time_median_s": 0.0123, "tokens_per_s_median": 41600.4, "peak_mem_gb": 0.5}
    tracking.end_run(uri, run_id, "finished", summary=summary)
    run = MlflowClient(uri).get_run(run_id)
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("Reproduce this trial") and "python -m orchestrator trainer.steps=3" in note
    assert "**finished**: final loss 2.3457, step time 0.0123 s (median), 41,600 tokens/s, peak memory 0.50 GB" in note
    tracking.end_run(uri, run_id, "crash", "rank 0: boom")  # a second end rewrites the result, once
    note = MlflowClient(uri).get_run(run_id).data.tags["mlflow.note.content"]
    assert note.count("**Result**") == 1 and "**crash**" in note and "rank 0: boom" in note
    assert run.info.status == "FINISHED"


def test_the_training_data_is_the_run_s_dataset_input(compose_cfg, mlflow_uri, tmp_path):
    def inputs(extra):
        cfg = trial.prepare(compose_cfg([*SMOKE, f"tracking.uri={mlflow_uri}", *extra]))
        _, run_id = tracking.start_run(cfg, [], {})
        (ds,) = MlflowClient(mlflow_uri).get_run(run_id).inputs.dataset_inputs
        return ds

    std = inputs([])
    assert std.dataset.name == "stdlib" and std.dataset.source_type == "local"
    assert json.loads(std.dataset.source)["uri"].startswith("file://")
    assert [(t.key, t.value) for t in std.tags] == [("mlflow.data.context", "train")]
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(range(200)) * 10)
    a = inputs(["data=memmap", f"data.path={tokens}"])
    assert a.dataset.name == "memmap" and json.loads(a.dataset.source) == {"uri": tokens.resolve().as_uri()}
    assert len(a.dataset.digest) == 8 and a.dataset.digest != std.dataset.digest
    tokens.write_bytes(bytes(range(100)) * 20)  # other tokens in the same file: another digest
    assert inputs(["data=memmap", f"data.path={tokens}"]).dataset.digest != a.dataset.digest


def test_the_ui_hint_names_the_store_and_the_run():
    hint = mlflow_ui.ui_hint("sqlite:////tmp/x y/mlruns.db", "3", "abc")
    assert hint == (
        "MLflow UI: mlflow ui --backend-store-uri 'sqlite:////tmp/x y/mlruns.db'  "
        "then open http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert (
        mlflow_ui.ui_hint("http://h:5000/", "3")
        == "MLflow UI: http://h:5000/#/experiments/3/runs?workflowType=machine_learning"
    )
    assert mlflow_ui.ui_hint("databricks", "3") == "MLflow UI: the workspace's experiment 3"
    server = "MLflow UI: http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert mlflow_ui.ui_hint("http://127.0.0.1:5000", "3") == server  # a server at mlflow ui's address


# --- rank 0's reporter --------------------------------------------------------------------------------


def test_each_step_s_metrics_carry_the_time_that_step_ended(mlflow_uri, tmp_path):
    run_id = _run(mlflow_uri)
    journal = tmp_path / "j.jsonl"
    rep = pickle.loads(pickle.dumps(mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 6, False, str(journal))))
    t0 = time.time() - 1000.0  # steps that ended long before they are delivered
    rep.open()
    rep.log_steps(_rows(range(3), t0))
    rep.log_steps(_rows(range(3, 6), t0))
    rep.finish({"final_loss": 4.5, "n_params": 10})
    loss = metric_history(mlflow_uri, run_id, "loss")
    assert [m.step for m in loss] == list(range(6))
    assert [m.timestamp for m in loss] == [int((t0 + s) * 1000) for s in range(6)]
    assert [m.timestamp for m in metric_history(mlflow_uri, run_id, "lr")] == [m.timestamp for m in loss]
    metrics = MlflowClient(mlflow_uri).get_run(run_id).data.metrics
    assert ROW_TIME not in metrics and metrics["final_loss"] == 4.5
    assert not journal.exists()  # all delivered: the journal is gone


def test_a_queued_artifact_keeps_its_name(mlflow_uri, tmp_path, monkeypatch):
    """An artifact logged while the store is away is staged beside the journal and delivered
    later, under the name it was given (the profile's trace_rank0.json, not a staged copy's name)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_id = _run(mlflow_uri)
    journal = tmp_path / "j.jsonl"
    away = mlflow_reporter.MlflowReporter(_dead_uri(), run_id, 3, False, str(journal), finish_timeout_s=1.0)
    trace = tmp_path / "trace_rank0.json"
    trace.write_text("{}")
    away.log_steps(_rows(range(3), time.time()))
    away.log_artifact(str(trace), "profile")
    trace.unlink()  # the caller may delete it once handed over (the Ray relay does)
    away.finish({})
    assert [op["op"] for op in mlflow_journal.read_journal(str(journal))] == ["rows", "artifact", "metrics"]
    back = mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 3, False, str(journal))
    back.finish({})
    files = {a.path for a in MlflowClient(mlflow_uri).list_artifacts(run_id, "profile")}
    assert files == {"profile/trace_rank0.json"}
    assert not journal.exists() and not Path(str(journal) + ".files").exists()


def test_a_restarted_worker_group_never_logs_a_step_twice(mlflow_uri, tmp_path):
    """A group restarted from a checkpoint recomputes steps the crashed one logged; at other times,
    so the store's own primary key (key, step, timestamp, value) would keep both."""
    run_id = _run(mlflow_uri)
    first = mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 15, False, str(tmp_path / "j.jsonl"))
    restarted = pickle.loads(pickle.dumps(first))
    first.log_steps(_rows(range(10), time.time() - 100))
    assert first.close(30.0)
    restarted.log_steps(_rows(range(5, 15), time.time(), loss0=9.0))
    restarted.finish({})
    loss = metric_history(mlflow_uri, run_id, "loss")
    assert [m.step for m in loss] == list(range(15))
    assert [m.value for m in loss[5:10]] == pytest.approx([5.0 - 0.1 * s for s in range(5, 10)])  # the first ones


def test_records_wait_in_the_journal_while_the_store_is_away(mlflow_uri, tmp_path, monkeypatch):
    """Nothing blocks or fails while nothing answers; what was not delivered stays in the journal,
    in order, and a later reporter of the same journal delivers it exactly once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the worker's setting (WORKER_HTTP_ENV)
    run_id = _run(mlflow_uri)
    journal = tmp_path / "j.jsonl"
    away = mlflow_reporter.MlflowReporter(_dead_uri(), run_id, 8, False, str(journal), finish_timeout_s=1.0)
    away.open()
    away.log_steps(_rows(range(4), time.time() - 50))
    away.checkpoint(4, "/ckpt/step_4")
    away.log_steps(_rows(range(4, 8), time.time() - 40))
    away.finish({"final_loss": 4.2})  # waits 1 s, then gives up and says where the records are
    assert away.failed_attempts >= 1 and away.rows_delivered == 0
    kept = mlflow_journal.read_journal(str(journal))
    assert [op["op"] for op in kept] == ["rows", "tags", "rows", "metrics"]
    assert [r["step"] for op in kept if op["op"] == "rows" for r in op["rows"]] == list(range(8))

    # the store is back (here: the same run in the sqlite store); a reporter of the journal delivers
    back = mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 8, False, str(journal))
    back.log_steps(_rows(range(6, 9), time.time()))  # steps 6, 7 again (a restarted group), then 8
    back.finish({})
    loss = metric_history(mlflow_uri, run_id, "loss")
    assert [m.step for m in loss] == list(range(9))
    run = MlflowClient(mlflow_uri).get_run(run_id)
    assert run.data.tags["checkpoint.step"] == "4" and run.data.metrics["final_loss"] == 4.2
    assert not journal.exists()


def test_a_reporter_that_gave_up_leaves_the_journal_to_the_one_that_takes_it_over(mlflow_uri, tmp_path, monkeypatch):
    """A reporter's finish gives up while a delivery hangs (the Ray relay under load); the journal
    is taken over (the driver, renumbering what is left) before that delivery returns. The late
    delivery must not mark anything done in the journal it no longer owns: every record left is
    still there for the next reader, and ends in the store."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_id = _run(mlflow_uri)
    journal = tmp_path / "j.jsonl"
    slow = mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 3, False, str(journal), finish_timeout_s=0.5)
    gate = threading.Event()
    client = slow._mlflow()
    log_text = client.log_text
    client.log_text = lambda *a, **k: (gate.wait(60), log_text(*a, **k))[1]  # a delivery that hangs
    slow.log_steps(_rows(range(3), time.time()))
    slow.log_table(1, "monitor", [{"layer": 0, "absmax": 1.0}])
    thread = slow._thread
    slow.finish({"final_loss": 4.2})  # gives up: the table's delivery still hangs
    taker = mlflow_reporter.MlflowReporter(_dead_uri(), run_id, 3, False, str(journal), finish_timeout_s=0.5)
    taker.open()  # takes over the table and the summary, numbered from 0
    gate.set()
    thread.join(30)
    assert not thread.is_alive()
    taker.close()
    # the summary, never delivered, is still in the journal (the table may be: this store's artifacts
    # are files the taker reaches without the server)
    assert "metrics" in [op["op"] for op in mlflow_journal.read_journal(str(journal))]
    back = mlflow_reporter.MlflowReporter(mlflow_uri, run_id, 3, False, str(journal))  # the store is back
    back.finish({})
    assert not journal.exists()
    run = MlflowClient(mlflow_uri).get_run(run_id)
    assert run.data.metrics["final_loss"] == 4.2
    assert [a.path for a in MlflowClient(mlflow_uri).list_artifacts(run_id, "monitor")] == ["monitor/step_000001.json"]


# --- a store that cannot be used --------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri,reason",
    [(None, "Connection refused"), ("sqlite:////proc/no/such/mlruns.db", "cannot create the directory /proc/no/such")],
)
def test_a_store_that_cannot_be_used_stops_the_trial_before_anything_starts(uri, reason, tmp_path, monkeypatch, capfd):
    uri = uri or _dead_uri()
    for multirun in ([], ["-m"]):
        code, out, err = cli_in_process(
            [*multirun, *SMOKE, "trainer.steps=1,2" if multirun else "trainer.steps=1", f"tracking.uri={uri}"],
            tmp_path,
            monkeypatch,
            capfd,
        )
        lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
        assert code == 2, err
        assert len(lines) == 1 and lines[0].startswith(f"error: tracking.uri={uri}") and reason in lines[0], err
        assert "trial " not in out + err and "Launching" not in out + err  # no worker, no job
    assert not list(tmp_path.rglob("*.jsonl")) and not list(tmp_path.rglob("mlruns.db"))


def test_store_problem_is_none_for_a_usable_store(mlflow_uri, tmp_path):
    assert mlflow_store.store_problem(mlflow_uri) is None
    assert mlflow_store.store_problem("sqlite:///" + str(tmp_path / "new" / "dir" / "mlruns.db")) is None
    assert "no answer" in mlflow_store.store_problem(_dead_uri())


# --- the tuning report in MLflow's UI ------------------------------------------------------------------


def test_the_tuning_report_s_images_are_linked_where_mlflow_s_ui_finds_them(mlflow_uri, tmp_path):
    from sweeps.ovat import Study, descend

    table = {(("a", "1"),): (1.0, 3.0), (("a", "2"),): (0.5, 3.0)}
    data = descend(Study(name="t", variables={"a": ["1", "2"]}, fixed=[]), TableRunner(table))
    data.update(sweep="s", experiment="orchestrator", kind="ovat")
    files = report_render.render(data, tmp_path / "out")
    run_id = _run(mlflow_uri)
    report_render.attach(mlflow_uri, run_id, files, data)
    c = MlflowClient(mlflow_uri)
    top = {a.path for a in c.list_artifacts(run_id)}
    assert {"tuning_report.md", "tuning_report.json", "plots"} <= top
    plots = {a.path for a in c.list_artifacts(run_id, "plots")}
    assert plots == {"plots/objective_a.png", "plots/loss_curves.png"}
    for p in plots:
        assert Path(c.download_artifacts(run_id, p, str(tmp_path))).read_bytes()[:4] == b"\x89PNG"
    md = Path(c.download_artifacts(run_id, "tuning_report.md", str(tmp_path))).read_text()
    link = f"http://127.0.0.1:5000/get-artifact?path=plots%2Fobjective_a.png&run_uuid={run_id}"
    assert f"![objective_a.png]({link})" in md  # absolute: the UI shows no image from a relative URL
    assert "](objective_a.png)" not in md and "## What helped" in md
    assert "![objective_a.png](objective_a.png)" in files[0].read_text()  # the local copy: siblings


# --- a real trial ------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_trial_records_step_times_its_result_and_says_where_to_look(compose_cfg, mlflow_uri, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="orchestrator")
    overrides = ["trainer.steps=6", "trainer.log_every=3"]
    cfg = compose_cfg([*SMOKE, *overrides, f"tracking.uri={mlflow_uri}"])
    before = time.time()
    result = trial.run(cfg, overrides, progress=False)
    assert result["status"] == "finished", result
    run_id = result["run_id"]
    loss = metric_history(mlflow_uri, run_id, "loss")
    stamps = [m.timestamp for m in loss]
    assert [m.step for m in loss] == list(range(6))
    assert stamps == sorted(stamps) and len(set(stamps)) == 6 and stamps[0] >= int(before * 1000)  # one per step
    (run,) = search_runs(mlflow_uri)
    assert "**finished**: final loss" in run.data.tags["mlflow.note.content"]
    assert "tracking.undelivered" not in run.data.tags
    assert not list(Path.cwd().glob(f"mlflow_journal_{run_id}*"))  # delivered: the journal is gone
    hints = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MLflow UI:")]
    assert hints == [
        f"MLflow UI: mlflow ui --backend-store-uri {mlflow_uri}  then open http://127.0.0.1:5000/"
        f"#/experiments/{run.info.experiment_id}/runs/{run_id}?workflowType=machine_learning"
    ]
