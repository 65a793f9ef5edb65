"""Checkpoints (DCP) and resume: a killed rank restarts its worker group from the last complete
checkpoint and the loss curve is the uninterrupted one; a damaged newest checkpoint is skipped."""

from __future__ import annotations

import shutil

import pytest

from orchestrator import trial, trial_files
from tests.conftest import metric_history, search_runs
from trainers import checkpoint as ckpt

pytestmark = pytest.mark.distributed

BASE = [
    "+chip=cpu",
    "trainer=smoke",
    "trainer.steps=12",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "trainer.log_every=2",
    "trainer.checkpoint_every=4",
    "data.num_workers=0",
    "parallel=dp2",
]


def _losses(uri, run_id):
    history = metric_history(uri, run_id, "loss")
    return [m.step for m in history], [m.value for m in history]


def test_killed_rank_resumes_from_the_last_checkpoint_with_the_same_losses(compose_cfg, tmp_path, mlflow_uri):
    ref = trial.run(
        compose_cfg([*BASE, f"tracking.uri={mlflow_uri}", f"trainer.checkpoint_dir={tmp_path / 'a'}"]),
        ["uninterrupted"],
        progress=False,
    )
    assert ref["status"] == "finished"
    chaos = [
        *BASE,
        f"tracking.uri={mlflow_uri}",
        f"trainer.checkpoint_dir={tmp_path / 'b'}",
        "trainer.fault.kill_rank=1",
        "trainer.fault.at_step=6",
        "launch.max_failures=1",
    ]
    res = trial.run(compose_cfg(chaos), ["chaos"], progress=False)
    assert res["status"] == "finished", res.get("reason")
    assert res["summary"]["resumed_from_step"] == 4  # checkpoints at 4 and 8; killed at step 6
    steps, losses = _losses(mlflow_uri, res["run_id"])
    assert steps == list(range(12))  # exactly one value per step, the re-run steps not doubled
    assert losses == pytest.approx(_losses(mlflow_uri, ref["run_id"])[1], rel=1e-6, abs=0)
    run = next(r for r in search_runs(mlflow_uri) if r.info.run_id == res["run_id"])
    assert run.data.tags["checkpoint.step"] == "12" and run.data.tags["checkpoint.latest"].endswith("step_00000012")


def test_a_truncated_newest_checkpoint_is_skipped(compose_cfg, tmp_path):
    root = tmp_path / "ck"
    first = trial.run(
        compose_cfg([*BASE, "tracking.enabled=false", f"trainer.checkpoint_dir={root}"]), [], progress=False
    )
    assert first["status"] == "finished"
    assert ckpt.latest(str(root))[0] == 12
    newest = root / "step_00000012"
    shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write
    assert not ckpt.is_complete(newest)
    assert ckpt.latest(str(root))[0] == 8
    again = trial.run(
        compose_cfg([*BASE, "tracking.enabled=false", f"trainer.checkpoint_dir={root}"]), [], progress=False
    )
    assert again["status"] == "finished", again.get("reason")
    assert again["summary"]["resumed_from_step"] == 8
    assert again["summary"]["losses"] == pytest.approx(first["summary"]["losses"][8:], rel=1e-6, abs=0)


def test_a_checkpoint_reshards_into_another_layout(compose_cfg, tmp_path):
    """Saved by dp2 (DDP), resumed by tp2pp2: DCP maps the whole model's names onto the shards."""
    root = tmp_path / "ck"
    common = [
        "+chip=cpu",
        "trainer=smoke",
        "trainer.global_batch=8",
        "trainer.micro_batch=2",
        "data.num_workers=0",
        "tracking.enabled=false",
        "trainer.checkpoint_every=4",
    ]
    ref = trial.run(
        compose_cfg([*common, "trainer.steps=8", "parallel=single", "trainer.checkpoint_every=0"]), [], progress=False
    )
    common.append(f"trainer.checkpoint_dir={root}")
    trial.run(compose_cfg([*common, "trainer.steps=8", "parallel=dp2"]), [], progress=False)
    shutil.rmtree(root / "step_00000008")  # as if dp2 had stopped after its step-4 checkpoint
    moved = trial.run(compose_cfg([*common, "trainer.steps=8", "parallel=tp2pp2"]), [], progress=False)
    assert moved["status"] == "finished", moved.get("reason")
    assert moved["summary"]["resumed_from_step"] == 4
    assert moved["summary"]["losses"] == pytest.approx(ref["summary"]["losses"][4:], rel=1e-5)


@pytest.mark.parametrize("mode", ["RUN", "MULTIRUN"])
def test_a_multirun_gives_each_trial_its_own_folder_under_checkpoint_dir(tmp_path, mode):
    """One trial checkpoints into ``trainer.checkpoint_dir`` itself (a rerun resumes from it); a job
    of a multirun, tracked or not, into ``<checkpoint_dir>/<run id>``, so that no trial of a sweep
    resumes from another's checkpoints."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from orchestrator import conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    overrides = [f"trainer.checkpoint_dir={tmp_path}", "tracking.enabled=false", f"hydra.mode={mode}"]
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        folder = trial_files.checkpoint_dir(cfg, "r1")
    finally:
        HydraConfig.instance().cfg = None
        GlobalHydra.instance().clear()
    assert folder == (f"{tmp_path}/r1" if mode == "MULTIRUN" else str(tmp_path))
