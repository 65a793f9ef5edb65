"""Which launch path a trial takes, and how its workers ask Ray for devices (no cluster started)."""

from __future__ import annotations

import pytest

from orchestrator import ray_cluster, ray_failures, ray_trial
from orchestrator.launch import TrialFailed, launch_local
from orchestrator.trial import ConfigError, launch_path, prepare, resolve


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_a_trial_on_one_node_keeps_the_local_launcher(compose_cfg):
    trial = resolve(compose_cfg(["+chip=cpu", "parallel=dp2"]))
    assert (trial.path, trial.nodes, trial.layout.world_size) == ("local", 1, 2)
    assert not ray_cluster.goes_to_ray(trial.nodes, trial.cfg.launch.ray)
    assert launch_path(trial) is launch_local
    forced = resolve(compose_cfg(["+chip=cpu", "parallel=dp2"]), launcher="ray")  # hydra/launcher=ray
    assert forced.path == "ray" and launch_path(forced).func is ray_trial.launch_trial
    slot = ray_trial.BoardSlot("sweep-board-x", 3)  # a Ray sweep's job: its trial marks its key when placed
    assert launch_path(forced, slot).keywords == {"placement": forced.placement, "slot": slot}


def test_a_cluster_address_sends_every_trial_to_ray(compose_cfg, monkeypatch):
    trial = resolve(compose_cfg(["+chip=cpu", "launch.ray.address=10.0.0.1:6379"]))
    assert trial.path == "ray" and ray_cluster.goes_to_ray(trial.nodes, trial.cfg.launch.ray)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    trial = resolve(compose_cfg(["+chip=cpu"]))
    assert launch_path(trial) is not launch_local
    assert resolve(compose_cfg(["+chip=cpu"]), launcher="local").path == "local"


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["launch.nnodes=2"], "launch.nnodes=2"),
        (["parallel=dp8", "trainer.micro_batch=2", "chip.devices_per_node=4"], "needs 2 nodes of chip=cpu"),
    ],
)
def test_a_multi_node_trial_needs_a_cluster(compose_cfg, monkeypatch, overrides, key):
    cfg = compose_cfg(["+chip=cpu", *overrides])
    with pytest.raises(ConfigError) as info:
        prepare(cfg)
    assert len(info.value.errors) == 1 and key in info.value.errors[0] and "RAY_ADDRESS" in info.value.errors[0]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    trial = resolve(compose_cfg(["+chip=cpu", *overrides]))
    assert trial.path == "ray" and trial.nodes == 2 and trial.placement.nodes == 2


def test_an_emulated_chip_asks_for_cpus_a_real_one_for_its_devices(compose_cfg, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    trial = resolve(compose_cfg(["+chip=ascend910b", "chip.emulate=true", "parallel=tp8pp4", "model=gpt_mini"]))
    assert (trial.placement.resource, trial.placement.nodes) == ("CPU", 4)  # 32 ranks on 8-device nodes
    trial.cfg.chip.emulate = False
    assert ray_trial.Placement.of(trial.cfg.chip, trial.cfg.launch.ray, trial.nodes).resource == "NPU"


def test_whole_devices_per_worker_and_whole_nodes_when_exclusive():
    shared = ray_trial.Placement("GPU", nodes=1, exclusive=False)
    assert shared.units(2, [8.0, 8.0]) == 1
    whole = ray_trial.Placement("GPU", nodes=1, exclusive=True)
    assert whole.units(2, [8.0, 8.0]) == 4  # the trial's 2 workers hold all 8 GPUs of a node
    assert whole.units(3, [8.0]) == 2  # 2 left over: less than any exclusive trial needs on a node
    assert ray_trial.Placement("NPU", nodes=2, exclusive=True).units(16, [8.0, 8.0]) == 1
    with pytest.raises(TrialFailed) as info:  # would wait in Ray's queue forever
        shared.units(4, [2.0, 2.0])
    assert info.value.status == "infeasible" and "one node" in info.value.reason
    with pytest.raises(TrialFailed):
        ray_trial.Placement("GPU", nodes=2, exclusive=False).units(16, [8.0])
    with pytest.raises(TrialFailed):
        shared.units(1, [])


def test_npu_workers_share_their_node_s_devices_like_gpu_workers():
    """Ray Train shares CUDA_VISIBLE_DEVICES among a node's workers, not ASCEND_RT_VISIBLE_DEVICES:
    NPU trials add a callback that does (checked here against this Ray's internals; no NPU)."""
    (callback,) = ray_trial._accelerator_callbacks("NPU")
    assert callable(callback.before_init_train_context)
    assert ray_trial._accelerator_callbacks("GPU") is None


def test_a_failed_worker_group_is_explained_by_its_first_real_error():
    from ray.train import WorkerGroupError

    class NonFiniteError(RuntimeError):
        pass

    err = WorkerGroupError(
        "2 workers failed",
        {
            0: RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer."),
            1: NonFiniteError("Traceback ...\nnon-finite gradient norm at step 4"),
        },
    )
    reason = ray_failures.failure_reason(err)
    assert reason == "rank 1: NonFiniteError: non-finite gradient norm at step 4"
    from orchestrator.launch import classify

    assert classify(reason) == "nonfinite"


def test_a_ray_sweep_job_finds_its_board_slot_in_its_hydra_config():
    """The Ray launcher writes its progress board's name into each job's Hydra config; the job's
    key on it is hydra.job.num. A job of another launcher has no slot."""
    from omegaconf import OmegaConf

    from orchestrator import ray_sweep

    hc = OmegaConf.create(
        {"launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, "job": {"num": 4}}
    )
    OmegaConf.set_struct(hc, True)
    assert ray_sweep.board_slot(hc) is None
    hc = OmegaConf.create({"launcher": {"_target_": "x", "board": "sweep-board-1"}, "job": {"num": 4}})
    assert ray_sweep.board_slot(hc) == ray_trial.BoardSlot("sweep-board-1", 4)


def test_the_ray_launcher_tells_the_task_that_composition_is_over():
    """cli() turns Hydra's exit 1 into exit 2 (bad command line) only before any job started; the
    Ray launcher runs the jobs elsewhere, so it tells the task function itself, first thing."""
    from types import SimpleNamespace

    from orchestrator import ray_sweep
    from orchestrator.app import Task

    task = Task()
    assert not task.started
    broken = SimpleNamespace(task_function=task, config=None, hydra_context=None)  # fails right after
    with pytest.raises(AttributeError):
        ray_sweep.launch_jobs(broken, [["trainer.seed=1"]], 0)
    assert task.started
