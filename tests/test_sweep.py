"""A multirun with Hydra's basic launcher is a parent MLflow run too, its trials nested under it
(the sweep callback serves both launchers); a point that breaks a rule is recorded in the sweep."""

from __future__ import annotations

import pytest

from tests.conftest import metric_history, run_cli, search_runs

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

    from orchestrator import sweep

    callbacks = Callbacks()
    context = HydraContext(config_loader=None, callbacks=callbacks)
    assert sweep.active(context) is None  # no sweep callback configured
    callback = sweep.SweepCallback()
    callbacks.callbacks.append(callback)
    assert sweep.active(context) is None  # tracking disabled: no parent run
    callback.sweep = {"id": "s1", "parent_run_id": "r1", "uri": "sqlite:///x.db", "experiment": "default"}
    assert sweep.active(context) is callback.sweep
