"""Which launch path a trial takes, and how its workers ask Ray for devices (no cluster started)."""
from __future__ import annotations

import pytest

from orchestrator import ray_launch
from orchestrator.launch import TrialFailed, launch_local
from orchestrator.trial import ConfigError, launch_path, prepare


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_a_trial_on_one_node_keeps_the_local_launcher(compose_cfg):
    cfg = prepare(compose_cfg(["+chip=cpu", "parallel=dp2"]))
    assert not ray_launch.goes_to_ray(cfg)
    assert launch_path(cfg) is launch_local
    assert launch_path(cfg, "ray").func is ray_launch.launch_trial  # hydra/launcher=ray


def test_a_cluster_address_sends_every_trial_to_ray(compose_cfg, monkeypatch):
    cfg = prepare(compose_cfg(["+chip=cpu", "launch.ray.address=10.0.0.1:6379"]))
    assert ray_launch.goes_to_ray(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = prepare(compose_cfg(["+chip=cpu"]))
    assert launch_path(cfg) is not launch_local


@pytest.mark.parametrize("overrides,key", [
    (["launch.nnodes=2"], "launch.nnodes=2"),
    (["parallel=dp8", "trainer.micro_batch=2", "chip.devices_per_node=4"], "needs 2 nodes of chip=cpu"),
])
def test_a_multi_node_trial_needs_a_cluster(compose_cfg, monkeypatch, overrides, key):
    cfg = compose_cfg(["+chip=cpu", *overrides])
    with pytest.raises(ConfigError) as info:
        prepare(cfg)
    assert len(info.value.errors) == 1 and key in info.value.errors[0] and "RAY_ADDRESS" in info.value.errors[0]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = prepare(compose_cfg(["+chip=cpu", *overrides]))
    assert ray_launch.goes_to_ray(cfg) and ray_launch.Placement.of(cfg).nodes == 2


def test_an_emulated_chip_asks_for_cpus_a_real_one_for_its_devices(compose_cfg, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = prepare(compose_cfg(["+chip=ascend910b", "chip.emulate=true", "parallel=tp8pp4", "model=gpt_mini"]))
    placement = ray_launch.Placement.of(cfg)
    assert (placement.resource, placement.nodes) == ("CPU", 4)  # 32 ranks on 8-device nodes
    cfg.chip.emulate = False
    assert ray_launch.Placement.of(cfg).resource == "NPU"


def test_whole_devices_per_worker_and_whole_nodes_when_exclusive():
    shared = ray_launch.Placement("GPU", nodes=1, exclusive=False)
    assert shared.units(2, [8.0, 8.0]) == 1
    whole = ray_launch.Placement("GPU", nodes=1, exclusive=True)
    assert whole.units(2, [8.0, 8.0]) == 4  # the trial's 2 workers hold all 8 GPUs of a node
    assert whole.units(3, [8.0]) == 2  # 2 left over: less than any exclusive trial needs on a node
    assert ray_launch.Placement("NPU", nodes=2, exclusive=True).units(16, [8.0, 8.0]) == 1
    with pytest.raises(TrialFailed) as info:  # would wait in Ray's queue forever
        shared.units(4, [2.0, 2.0])
    assert info.value.status == "infeasible" and "one node" in info.value.reason
    with pytest.raises(TrialFailed):
        ray_launch.Placement("GPU", nodes=2, exclusive=False).units(16, [8.0])
    with pytest.raises(TrialFailed):
        shared.units(1, [])


def test_npu_workers_share_their_node_s_devices_like_gpu_workers():
    """Ray Train shares CUDA_VISIBLE_DEVICES among a node's workers, not ASCEND_RT_VISIBLE_DEVICES:
    NPU trials add a callback that does (checked here against this Ray's internals; no NPU)."""
    (callback,) = ray_launch._accelerator_callbacks("NPU")
    assert callable(callback.before_init_train_context)
    assert ray_launch._accelerator_callbacks("GPU") is None


def test_a_failed_worker_group_is_explained_by_its_first_real_error():
    from ray.train import WorkerGroupError

    class NonFiniteError(RuntimeError):
        pass

    err = WorkerGroupError("2 workers failed", {
        0: RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer."),
        1: NonFiniteError("Traceback ...\nnon-finite gradient norm at step 4"),
    })
    reason = ray_launch.failure_reason(err)
    assert reason == "rank 1: NonFiniteError: non-finite gradient norm at step 4"
    from orchestrator.launch import classify

    assert classify(reason) == "nonfinite"
