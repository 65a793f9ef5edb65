"""A multirun with Hydra's basic launcher is a parent MLflow run too, its trials nested under it
(the sweep callback serves both launchers); a point that breaks a rule is recorded in the sweep.
The parent always ends (KILLED after Ctrl-C, FAILED after a crash), and a re-run sweep launches
only the points that have not finished yet."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cli_env, metric_history, run_cli, search_runs

SMOKE = ["+chip=cpu", "trainer=smoke", "trainer.steps=3", "data.num_workers=0"]

pytestmark = pytest.mark.distributed


def test_a_basic_multirun_nests_its_trials_under_a_parent_run(tmp_path):
    proc = run_cli(
        ["-m", "+chip=cpu", "trainer=smoke", "trainer.steps=3", "data.num_workers=0", "parallel.tp=1,3"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    runs = search_runs(uri)
    parent = next(r for r in runs if "sweep.status" in r.data.tags)
    assert "trial.status" not in parent.data.tags  # never mistaken for a trial
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.launcher"] == "basic"
    assert parent.data.params["sweep.parallel.tp"] == "1,3"
    children = {r.data.params["parallel.tp"]: r for r in runs if r is not parent}
    assert set(children) == {"1", "3"}
    for child in children.values():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["sweep"] == parent.data.tags["sweep"]
    assert children["1"].data.tags["trial.status"] == "finished"
    assert len(metric_history(uri, children["1"].info.run_id, "loss")) == 3
    assert children["3"].data.tags["trial.status"] == "infeasible"
    assert "parallel.tp=3" in children["3"].data.tags["trial.reason"]
    done = metric_history(uri, parent.info.run_id, "trials_done")
    failed = metric_history(uri, parent.info.run_id, "trials_failed")
    assert done[-1].value == 1 and failed[-1].value == 1


def test_a_sweeper_finds_its_sweep_through_hydra_s_context():
    """The sweep callback's parent run reaches the sweeper through the context Hydra hands both."""
    from hydra._internal.callbacks import Callbacks
    from hydra.types import HydraContext

    from orchestrator import sweep_parent

    callbacks = Callbacks()
    context = HydraContext(config_loader=None, callbacks=callbacks)
    assert sweep_parent.active(context) is None  # no sweep callback configured
    callback = sweep_parent.SweepCallback()
    callbacks.callbacks.append(callback)
    assert sweep_parent.active(context) is None  # tracking disabled: no parent run
    callback.sweep = {"id": "s1", "parent_run_id": "r1", "uri": "sqlite:///x.db", "experiment": "orchestrator"}
    assert sweep_parent.active(context) is callback.sweep


def _parent(runs, sweep_id=None):
    return next(
        r for r in runs if "sweep.status" in r.data.tags and (sweep_id is None or r.data.tags["sweep"] == sweep_id)
    )


def test_ctrl_c_ends_the_sweep_and_its_running_trial_killed(tmp_path):
    """SIGINT to the driver's process group (a terminal's Ctrl-C) while the first of two trials
    runs: the trial's run and the sweep's parent end KILLED, the second point never starts."""
    log = tmp_path / "driver.log"
    args = ["-m", "+chip=cpu", "trainer=smoke", "trainer.steps=100000", "data.num_workers=0", "trainer.seed=1,2"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args],
            cwd=tmp_path,
            env=cli_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a shell gives a foreground job
        )
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    try:
        deadline = time.monotonic() + 240
        run_id = None
        while time.monotonic() < deadline and proc.poll() is None:
            # the trial's run exists once the driver says so (the store is set up by then)
            if run_id is None:
                found = re.search(r"trial (\w{32}) on cpu", log.read_text())
                run_id = found.group(1) if found else None
            if run_id and metric_history(uri, run_id, "loss"):
                break
            time.sleep(0.5)
        assert run_id and proc.poll() is None, log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    runs = search_runs(uri)
    parent = _parent(runs)
    assert parent.info.status == "KILLED", log.read_text()[-3000:]
    assert parent.data.tags["sweep.status"] == "killed"
    trials = [r for r in runs if r is not parent]
    assert [r.info.run_id for r in trials] == [run_id]  # the second point never started
    assert trials[0].info.status == "KILLED"
    assert trials[0].data.tags["trial.status"] == "killed"
    assert metric_history(uri, parent.info.run_id, "trials_failed")[-1].value == 1


def test_a_re_run_sweep_launches_only_the_points_not_finished_yet(tmp_path):
    """A grid over two points, one of which finished in an earlier sweep, launches the other only,
    and the parent records the run it reused; tracking.skip_finished=false measures again."""
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    first = run_cli(["-m", *SMOKE, "trainer.seed=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (done,) = [r for r in search_runs(uri) if r.data.tags.get("trial.status") == "finished"]

    again = run_cli(["-m", *SMOKE, "trainer.seed=1,2"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    output = again.stdout + again.stderr  # Hydra logs to stdout
    assert f"already finished in run {done.info.run_id}: skipped" in output
    sweep_id = re.search(r"sweep (\S+): parent run", output).group(1)
    runs = search_runs(uri)
    parent = _parent(runs, sweep_id)
    launched = [r for r in runs if r.data.tags.get("sweep") == sweep_id and r is not parent]
    assert [r.data.params["trainer.seed"] for r in launched] == ["2"]
    assert parent.data.tags["sweep.reused.0"] == done.info.run_id
    assert parent.info.status == "FINISHED"
    assert metric_history(uri, parent.info.run_id, "trials_reused")[-1].value == 1
    assert metric_history(uri, parent.info.run_id, "trials_done")[-1].value == 1

    forced = run_cli(["-m", *SMOKE, "trainer.seed=1", "tracking.skip_finished=false"], cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert "skipped" not in forced.stdout + forced.stderr
    seed1 = [r for r in search_runs(uri) if r.data.params.get("trainer.seed") == "1"]
    assert len(seed1) == 2 and all(r.data.tags["trial.status"] == "finished" for r in seed1)


def test_a_crashed_driver_ends_the_parent_failed_and_its_orphaned_trials(mlflow_uri):
    """The exit hook's path: a driver that dies without on_multirun_end (a crash) ends the parent
    FAILED with the reason, and a trial still RUNNING (its job died with the driver) as crash."""
    from orchestrator import sweep_parent, tracking

    exp = tracking.experiment_id(mlflow_uri, "orchestrator")
    c = tracking.client(mlflow_uri)
    parent = c.create_run(exp, tags={"sweep": "s1", "sweep.status": "running"}).info.run_id
    orphan = c.create_run(exp, tags={"sweep": "s1", "trial.status": "running"}).info.run_id
    callback = sweep_parent.SweepCallback()
    callback.sweep = {
        "id": "s1",
        "parent_run_id": parent,
        "uri": mlflow_uri,
        "experiment": "orchestrator",
        "experiment_id": exp,
    }
    callback.abandon(RuntimeError("the sweeper broke"))
    run = c.get_run(parent)
    assert run.info.status == "FAILED" and run.data.tags["sweep.status"] == "failed"
    assert run.data.tags["sweep.reason"] == "RuntimeError: the sweeper broke"
    assert c.get_run(orphan).info.status == "FAILED"
    assert c.get_run(orphan).data.tags["trial.status"] == "crash"
    callback.abandon(None)  # once closed, never again
    assert c.get_run(parent).data.tags["sweep.status"] == "failed"


def test_an_interrupt_between_a_trial_s_tags_and_its_status_keeps_what_it_ended_as(mlflow_uri):
    """``tracking.end_run`` writes a trial's tags, then its run status; a sweep interrupted between
    the two found the run RUNNING and ended it ``killed``, over its ``finished`` (seen in a
    clean-clone CI run of tests/test_auto_sweep.py: its first finished trial came back killed).
    The end of such a run is completed as what it ended as; a trial with no end is killed."""
    from orchestrator import sweep_parent, tracking

    c = tracking.client(mlflow_uri)
    exp = tracking.experiment_id(mlflow_uri, "cut", None)
    parent = c.create_run(exp, tags={"sweep": "s1", "sweep.status": "running"}).info.run_id
    done = c.create_run(exp, tags={"sweep": "s1", "trial.status": "finished"}).info.run_id
    running = c.create_run(exp, tags={"sweep": "s1"}).info.run_id
    sweep = {"id": "s1", "parent_run_id": parent, "uri": mlflow_uri, "experiment": "cut", "experiment_id": exp}
    sweep_parent.end_sweep(sweep, "killed", "SIGTERM")
    got = {r.info.run_id: (r.info.status, r.data.tags.get("trial.status")) for r in search_runs(mlflow_uri, "cut")}
    assert got[done] == ("FINISHED", "finished")
    assert got[running] == ("KILLED", "killed")
    assert got[parent][0] == "KILLED"
