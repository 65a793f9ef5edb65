"""The Ray launch path on real Ray clusters, with real gloo worker groups and a real MLflow store.

Two clusters (a Ray cluster takes ~5 s to start and each trial's workers ~10 s on two cores): a
sweep that queues on a local cluster started by the launcher itself, then a `ray start --head`
cluster of 2 CPUs shared by the other tests (warm groups that give way, a crashing sweep, warm
groups turned off, a `ray job submit`).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import RAY, head_node
from tests.conftest import ROOT, cli_env, metric_history, run_cli, search_runs

pytestmark = pytest.mark.ray

STEPS = 6
# 2-rank trials, one CPU per rank; log every step, so the loss timestamps trace when a trial ran
COMMON = [
    "+chip=cpu",
    "parallel=dp2",
    "trainer=smoke",
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "data.num_workers=0",
]


def _sweep(runs):
    parents = [r for r in runs if "sweep.status" in r.data.tags]
    assert len(parents) == 1, [r.data.tags for r in runs]
    parent = parents[0]
    children = [r for r in runs if r.info.run_id != parent.info.run_id]
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["sweep"] == parent.data.tags["sweep"]
    return parent, children


def test_a_sweep_queues_on_a_local_cluster_and_nests_its_runs(tmp_path):
    """3 trials of 2 ranks on a local cluster of 4 CPUs: two run at a time, the third queues."""
    proc = run_cli(
        ["-m", "hydra/launcher=ray", *COMMON, "trainer.seed=1,2,3", "launch.ray.num_cpus=4"], cwd=tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    parent, children = _sweep(search_runs(uri))
    assert len(children) == 3
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.status"] == "finished"
    assert parent.data.tags["sweep.launcher"] == "ray"
    assert parent.data.params["sweep.trainer.seed"] == "1,2,3"
    assert parent.data.metrics["trials_done"] == 3 and parent.data.metrics["trials_failed"] == 0
    spans = []
    for child in children:
        assert child.info.status == "FINISHED" and child.data.tags["trial.status"] == "finished"
        losses = metric_history(uri, child.info.run_id, "loss")
        assert [m.step for m in losses] == list(range(STEPS))  # per-step metrics, one per step
        spans.append((min(m.timestamp for m in losses), max(m.timestamp for m in losses)))
    assert sorted(c.data.params["trainer.seed"] for c in children) == ["1", "2", "3"]
    # never all three at once: some trial's steps all came before or after another's
    for a, b, c in itertools.combinations(spans, 3):
        assert max(a[0], b[0], c[0]) > min(a[1], b[1], c[1]), spans

    # warm worker groups (launch.ray.reuse_workers, on by default): two groups fill the cluster,
    # and the third trial ran in the processes of one that had finished, its process group and
    # model built anew: its losses are those of the same trial launched alone
    groups = {c.data.params["trainer.seed"]: c.data.tags["trial.worker_group"].split() for c in children}
    assert len({g[0] for g in groups.values()}) == 2, groups
    (seed,) = [s for s, g in groups.items() if g[1:] == ["(trial", "2)"]]
    alone = run_cli([*COMMON, f"trainer.seed={seed}", "tracking.uri=" + uri.replace(".db", "_alone.db")], tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    (reference,) = [r for r in search_runs(uri.replace(".db", "_alone.db")) if "trial.status" in r.data.tags]
    assert "trial.worker_group" not in reference.data.tags  # one trial on one node: not on Ray at all
    reused = next(c for c in children if c.data.params["trainer.seed"] == seed)
    got = [m.value for m in metric_history(uri, reused.info.run_id, "loss")]
    want = [m.value for m in metric_history(uri.replace(".db", "_alone.db"), reference.info.run_id, "loss")]
    assert got == pytest.approx(want, rel=1e-6), (got, want)


def test_warm_groups_of_another_shape_give_way(tmp_path, ray_head):
    """The head's 2 CPUs, a 1-rank and a 2-rank trial: whichever runs first leaves its group
    idle, holding CPUs the other waits for; the idle group is evicted and both finish (without
    that, the second trial would wait forever)."""
    common = [*(a for a in COMMON if not a.startswith("parallel=")), "parallel=single,dp2"]
    proc = run_cli(
        ["-m", "hydra/launcher=ray", *common],
        cwd=tmp_path,
        timeout=600,
        RAY_ADDRESS=ray_head["address"],
        RAY_AUTH_MODE="token",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, children = _sweep(search_runs("sqlite:///" + str(tmp_path / "mlruns.db")))
    assert sorted(c.data.tags["trial.status"] for c in children) == ["finished", "finished"]
    groups = [c.data.tags.get("trial.worker_group") for c in children]
    assert all(g and g.endswith("(trial 1)") for g in groups) and len(set(groups)) == 2, groups


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 with 2 CPUs (one 2-rank trial at a time: a sweep's trials
    queue) and its dashboard, stopped at the end. It does not see this checkout (no PYTHONPATH):
    the code must travel to its workers."""
    env = cli_env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("PYTHONPATH", None)
    # a submitted job's `python` is this environment's, activated or not
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    with head_node(tmp_path_factory.mktemp("ray_head"), env, cpus=2, dashboard=True) as head:
        yield head


def test_a_crashing_trial_fails_alone_and_the_sweep_goes_on(tmp_path, ray_head):
    """launch.max_failures=0: the killed trial is recorded crash with its reason; the other finishes.
    Joins the running cluster through RAY_ADDRESS."""
    proc = run_cli(
        [
            "-m",
            "hydra/launcher=ray",
            *COMMON,
            "launch.max_failures=0",
            "trainer.fault.kill_rank=-1,1",
            "trainer.fault.at_step=3",
        ],
        cwd=tmp_path,
        timeout=600,
        RAY_ADDRESS=ray_head["address"],
        RAY_AUTH_MODE="token",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    parent, children = _sweep(search_runs(uri))
    by_rank = {c.data.params["trainer.fault.kill_rank"]: c for c in children}
    assert set(by_rank) == {"-1", "1"}
    crashed, finished = by_rank["1"], by_rank["-1"]
    assert crashed.info.status == "FAILED" and crashed.data.tags["trial.status"] == "crash"
    assert crashed.data.tags["trial.reason"].startswith("rank 1: worker process died"), crashed.data.tags
    assert "fault" in crashed.data.tags
    assert finished.info.status == "FINISHED" and finished.data.tags["trial.status"] == "finished"
    assert [m.step for m in metric_history(uri, finished.info.run_id, "loss")] == list(range(STEPS))
    assert parent.data.metrics["trials_done"] == 1 and parent.data.metrics["trials_failed"] == 1


def test_warm_groups_can_be_turned_off(tmp_path, ray_head):
    """launch.ray.reuse_workers=false: a sweep's trial runs in a Ray Train group of its own,
    not in the multirun's pool of warm groups (whose runs carry trial.worker_group)."""
    proc = run_cli(
        ["-m", "hydra/launcher=ray", *COMMON, "launch.ray.reuse_workers=false"],
        cwd=tmp_path,
        timeout=600,
        RAY_ADDRESS=ray_head["address"],
        RAY_AUTH_MODE="token",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, (child,) = _sweep(search_runs("sqlite:///" + str(tmp_path / "mlruns.db")))
    assert child.data.tags["trial.status"] == "finished"
    assert "trial.worker_group" not in child.data.tags and "trial.nodes" in child.data.tags, child.data.tags


def test_ray_job_submit_runs_a_trial_on_the_cluster(tmp_path, ray_head):
    """The README's command: the checkout travels as the job's working dir; inside the job
    RAY_ADDRESS is set, so the trial goes to Ray."""
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    env = cli_env(RAY_AUTH_MODE="token")
    env.pop("PYTHONPATH", None)
    cmd = [RAY, "job", "submit", "--address", ray_head["dashboard"], "--working-dir", str(ROOT), "--"]
    cmd += ["python", "-m", "orchestrator", *COMMON, f"tracking.uri={uri}"]
    for _ in range(6):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        # the head's job agent registers after the dashboard answers; until then Ray refuses the
        # submission ("No available agent to submit job, please try again later") and nothing ran
        if proc.returncode == 0 or "No available agent to submit job" not in proc.stdout + proc.stderr:
            break
        time.sleep(5)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trial on Ray: 2 worker(s)" in proc.stdout + proc.stderr
    runs = search_runs(uri)
    assert len(runs) == 1 and runs[0].data.tags["trial.status"] == "finished"
    assert [m.step for m in metric_history(uri, runs[0].info.run_id, "loss")] == list(range(STEPS))
