"""``+sweep=auto`` end to end on this machine: the plan (dry run), bad input, and a real search
over a CPU space (real trials through Hydra's basic launcher, tracked in MLflow's sqlite store),
its report, and a second run that resumes from MLflow. The decision rules themselves are tested
on planted timings in tests/test_auto_search.py."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.conftest import cli_in_process, run_cli, search_runs

BASE = ["+sweep=auto", "+chip=cpu", "trainer.global_batch=8", "trainer.seq_len=32", "trainer.steps=8"]
# gpt_tiny on 2 CPU ranks, the space narrowed to what a test can afford: dp2, tp2 or pp2 (1F1B),
# with micro-batches 1-4, DDP or FSDP
SMALL = [
    *BASE,
    "model=gpt_tiny",
    "launch.world_size=2",
    "hydra.sweeper.space.schedules=[1f1b]",
    "hydra.sweeper.space.activation_checkpointing=[false]",
    "hydra.sweeper.space.sequence_parallel=[false]",
    "hydra.sweeper.max_trials=3",
    # stage 3 narrowed to one variable that acts on any winner (one more trial: bf16 against fp32)
    "hydra.sweeper.polish={precision:[bf16],comm.bucket_mb:null,comm.buffsize_mb:null,comm.overlap:null,"
    "comm.compression:null}",
]


def interrupted_after_first_trial(args, cwd, uri, timeout=600.0):
    """Start ``python -m orchestrator ARGS``, SIGTERM it once a trial has finished in the store;
    returns the trial runs it left."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import cli_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=cli_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        # polled in the store's own table, not through an MLflow client (which takes seconds on a
        # busy host, long enough for the whole search to end before the signal)
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            time.sleep(0.2)
            if _a_trial_finished(cwd / "mlruns.db"):
                proc.send_signal(signal.SIGTERM)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return _trial_runs(uri)


def _a_trial_finished(db) -> bool:
    import contextlib
    import sqlite3

    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)) as con:
            row = con.execute("SELECT 1 FROM tags WHERE key = 'trial.status' AND value = 'finished' LIMIT 1")
            return row.fetchone() is not None
    except sqlite3.Error:  # the store not created yet, or locked by a writer: the next poll
        return False


def _trial_runs(uri):
    return [r for r in search_runs(uri) if "sweep.status" not in r.data.tags]


def test_a_dry_run_plans_and_launches_nothing(tmp_path, monkeypatch, capfd):
    args = [*BASE, "model=llama_tiny", "launch.world_size=4", "hydra.sweeper.dry_run=true"]
    args.append("hydra.sweeper.space.recompute_shares=[0.5]")
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 0, err[-3000:]
    # recompute settings: none, full over all blocks, selective, and full over the first half of
    # each stage chunk's blocks where that is some but not all (chunks of 4 and 2 blocks: 4
    # settings; chunks of 1 block, interleaved and ZB-V on pp2 and every pp4: 3)
    # the space: dp4 2 micro-batches x 4 recompute settings x 3 DP modes; dp2pp2 3 pipeline
    # micro-batch counts x (2 schedules x 4 + 2 x 3) x 3; pp4 4 x 4 x 3; dp2tp2 3 x 4 x 3 x 2
    # sequence parallel; tp2pp2 4 x (2 x 4 + 2 x 3) x 2. 240 fit: short pipelines, ZB-V and GPipe
    # under overlapped replicas refused (each rule counts a half-recompute point wherever it
    # counts the same point recomputing all: 84 + 10 pipelines of one micro-batch)
    pipe = 2 * 4 + 2 * 3
    points = 2 * 4 * 3 + 3 * pipe * 3 + 4 * 4 * 3 + 3 * 4 * 3 * 2 + 4 * pipe * 2
    # what fits, from the rules (everything fits memory at this size): dp4 and dp2tp2 all; a
    # pipeline needs microbatches >= pp (m 2 and 4 on dp2pp2, 4 and 8 on pp4, 2-8 on tp2pp2),
    # interleaved 1F1B a multiple of pp, pp4's interleaved and ZB-V have 8 stages for 4 layers;
    # beside replicas with overlap ZB-V is refused, and under DDP GPipe, and 1F1B or interleaved
    # at pp <= m <= pp x min(stages a rank, 2) (1F1B m=2, interleaved m=2 and 4)
    dp2pp2 = 2 * (2 * 4) + (2 + 3) * 4 + 2 * (2 * 3)  # GPipe, 1F1B, interleaved, over m 2 and 4
    fit = 2 * 4 * 3 + 3 * 4 * 3 * 2 + dp2pp2 + 2 * (3 + 3) + 3 * pipe * 2
    short = 1 * pipe * 3 + 2 * 4 * 3 + 1 * pipe * 2  # m=1 on dp2pp2 and tp2pp2, m 1 and 2 on pp4
    assert f"auto (dry run): {points} points, {fit} fit" in out, out
    assert f"excluded {short:>6}  parallel.microbatches=N is below parallel.pp=N" in out
    assert "    1. dp4tp1pp1" in out and "measure: at most 12 trials in batches of 2" in out
    assert "polish from the winner, one at a time, at most 10 trials" in out
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    assert _trial_runs(uri) == []  # nothing launched, nothing recorded


@pytest.mark.parametrize(
    "extra,line",
    [
        ([], "launch.world_size: give the number of devices to search over"),
        (["launch.world_size=2", "hydra.sweeper.max_trials=0"], "hydra.sweeper.max_trials=0: must be at least 1"),
        (["launch.world_size=2", "hydra.sweeper.confirm=0"], "hydra.sweeper.confirm=0: must be at least 1"),
        (["launch.world_size=2", "hydra.sweeper.space.schedules=[fast]"], "hydra.sweeper.space.schedules: ['fast']"),
        (
            ["launch.world_size=2", "hydra.sweeper.space.recompute_shares=[0.5,1.0]"],
            "hydra.sweeper.space.recompute_shares: [0.5, 1.0]: each must be above 0 and below 1",
        ),
        (["launch.world_size=2", "chip.memory_gb=0.001"], "model=gpt_tiny: no point of 2 devices fits or runs"),
        (["launch.world_size=2", "hydra.sweeper.polish={comm.bucket_mb:[big]}"], "hydra.sweeper.polish.comm.bucket_mb"),
        (
            ["launch.world_size=2", "hydra.sweeper.max_device_hours=0"],
            "hydra.sweeper.max_device_hours=0.0: must be above",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_launched(tmp_path, monkeypatch, capfd, extra, line):
    code, out, err = cli_in_process([*BASE, "model=gpt_tiny", *extra], tmp_path, monkeypatch, capfd)
    assert code == 2, (out[-2000:], err[-2000:])
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and line in errors[0], err[-2000:]
    assert _trial_runs("sqlite:///" + str(tmp_path / "mlruns.db")) == []


@pytest.mark.distributed
def test_the_ray_cluster_gives_the_world_size_or_refuses_one_it_cannot_hold(tmp_path):
    ray = ["model=gpt_tiny", "hydra/launcher=ray", "launch.ray.num_cpus=4", "launch.ray.dashboard=false"]
    proc = run_cli([*BASE, *ray, "hydra.sweeper.dry_run=true"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto: launch.world_size from the Ray cluster: 4 CPU" in proc.stdout + proc.stderr
    assert "auto (dry run):" in proc.stdout and "on 4 x cpu" in proc.stdout + proc.stderr
    big = run_cli([*BASE, *ray, "launch.world_size=8"], cwd=tmp_path, timeout=300)
    assert big.returncode == 2, (big.stdout[-2000:], big.stderr[-2000:])
    errors = [x for x in big.stderr.splitlines() if x.startswith("error:")]
    assert errors == ["error: launch.world_size=8: the Ray cluster has 4 CPU"], big.stderr[-2000:]
    assert _trial_runs("sqlite:///" + str(tmp_path / "mlruns.db")) == []


@pytest.mark.distributed
@pytest.mark.slow
def test_an_auto_search_measures_reports_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    # interrupted (SIGTERM, as a scheduler stops a job) once its first trial has finished
    cut = interrupted_after_first_trial(SMALL, tmp_path, uri)
    first_done = {r.data.tags["trial.config_hash"] for r in cut if r.data.tags.get("trial.status") == "finished"}
    assert first_done, [r.data.tags.get("trial.status") for r in cut]
    proc = run_cli(SMALL, cwd=tmp_path, timeout=900)  # resumes: what finished is not run again
    assert proc.returncode == 0, proc.stderr[-4000:]
    parents = [r for r in search_runs(uri) if r.data.tags.get("sweep.status") == "finished"]
    assert len(parents) == 1
    parent = parents[0]
    data = json.loads(
        open(MlflowClient(uri).download_artifacts(parent.info.run_id, "auto_report.json", str(tmp_path))).read()
    )
    s = data["summary"]
    finished = [r for r in _trial_runs(uri) if r.data.tags.get("trial.status") == "finished"]
    trials = [r for r in finished if r.data.params.get("precision.name") != "bf16"]
    assert 2 <= s["trials"] <= 3 == data["budget"]["max_trials"]
    assert len(trials) == s["trials"]  # one run per trial of the search, each a real one
    # nothing that finished before the interrupt ran again: a config runs twice only as the
    # best's confirmation (hydra.sweeper.confirm=2), and that is the third trial of the budget
    hashes = [r.data.tags["trial.config_hash"] for r in trials]
    twice = {h for h in hashes if hashes.count(h) > 1}
    assert len(hashes) - len(set(hashes)) == len(twice) <= 1
    fates = {r["fate"] for r in data["candidates"]}
    assert fates <= {
        "measured",
        "pruned by a failure",
        "not measured: predicted out of reach",
        "not measured: budget spent",
    } | {f for f in fates if f.startswith("failed")}
    measured = [r for r in data["candidates"] if r["fate"] == "measured"]
    assert sum(r["runs"] for r in measured) == s["trials"]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in measured)
    best = min(measured, key=lambda r: r["measured_s"])
    assert s["best"] == best["candidate"] and s["best_s"] == best["measured_s"]
    if twice:  # the confirmed point's figure is the median of its two runs
        (again,) = [r for r in measured if r["runs"] == 2]
        got = sorted(r.data.metrics["step_time_median_s"] for r in trials if r.data.tags["trial.config_hash"] in twice)
        assert sorted(again["samples"]) == pytest.approx(got)
        assert again["measured_s"] == pytest.approx(statistics.median(got))
    assert "python -m orchestrator" in data["command"] and "parallel.dp=" in data["command"]
    assert parent.data.tags["tuning.command"] == data["command"]
    # stage 3 ran from the winner: its baseline is the winner's trial (reused), bf16 one more trial
    p = data["polish"]
    assert p["ran"] and [v["key"] for v in p["variables"]] == ["precision"], p
    assert p["variables"][0]["values"] == ["fp32", "bf16"] and p["trials"]["launched"] == 1
    assert p["trials"]["reused"] >= 1 and p["command"] == data["command"]
    assert s["planner_mean_abs_error"] is not None
    assert "max_trials=3" in data["stop"] or "can win" in data["stop"] or "every candidate" in data["stop"]

    # orchestrator.report renders the stored report again, with the predicted-versus-measured plot
    from orchestrator import best as best_mod
    from orchestrator import report

    out = tmp_path / "report"
    sweep_id = parent.data.tags["sweep"]
    assert report.main(["--tracking-uri", uri, "--sweep", sweep_id, "--out", str(out)]) == 0
    md = (out / "auto_report.md").read_text()
    assert "# Automatic search: gpt_tiny on 2 x cpu" in md and "Polish from the winner" in md
    assert (out / "auto_report_predicted_vs_measured.png").is_file()
    # and orchestrator.best picks from its trials: the fastest finished one (the search's best or,
    # if it won, a polish trial)
    ranked = best_mod.rank(uri, "orchestrator", "step_time_median_s")
    values = [r.data.metrics["step_time_median_s"] for r in finished]
    assert ranked["candidates"][0]["value"] == pytest.approx(min(values))
    assert min(values) <= s["best_s"] == pytest.approx(statistics.median(best["samples"]))

    again = run_cli(SMALL, cwd=tmp_path, timeout=900)  # resumes: every measured point is in MLflow
    assert again.returncode == 0, again.stderr[-4000:]
    now = [r for r in _trial_runs(uri) if r.data.tags.get("trial.status") == "finished"]
    assert len(now) == len(finished)  # the search's and the polish's trials, none run again
