"""What a multi-node trial needs before it starts, checked without a cluster: the collectives'
interface, the environment its workers get on every node, where it may checkpoint, and
checkpoints at a URI (fsspec) rather than a path."""

from __future__ import annotations

import pytest
import torch

from orchestrator import chips, relay
from orchestrator.ray_cluster import launch_env, worker_env
from orchestrator.trial import ConfigError, resolve
from tests.conftest import cli_in_process
from trainers import checkpoint as ckpt

# 4 ranks on nodes of 2 devices: two nodes, so a Ray cluster address is needed
TWO_NODES = ["+chip=cpu", "chip.devices_per_node=2", "parallel=dp4", "trainer.micro_batch=2"]


def test_socket_ifname_pins_each_backend_to_the_exact_interface(compose_cfg):
    assert chips.socket_env(None, "nccl") == {}
    assert chips.socket_env("eth0", "gloo") == {"GLOO_SOCKET_IFNAME": "eth0"}
    # NCCL and HCCL read a bare name as a prefix; "=" makes it exact
    assert chips.socket_env("eth0,eth1", "nccl") == {
        "GLOO_SOCKET_IFNAME": "eth0,eth1",
        "NCCL_SOCKET_IFNAME": "=eth0,eth1",
    }
    assert chips.socket_env("ib0", "hccl")["HCCL_SOCKET_IFNAME"] == "=ib0"
    cfg = compose_cfg(["+chip=ascend910b", "chip.emulate=true", "comm.socket_ifname=enp1s0"])
    rt = chips.runtime(cfg.chip, cfg.comm, "fp32")
    assert rt.env["HCCL_SOCKET_IFNAME"] == "=enp1s0" and rt.env["GLOO_SOCKET_IFNAME"] == "enp1s0"


def test_workers_on_every_node_get_the_driver_s_exported_environment(monkeypatch):
    monkeypatch.setenv("HCCL_BUFFSIZE", "400")  # the user's word over the chip's default
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "t0ken")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")  # Ray's to set, per worker
    monkeypatch.setenv("HCCL_IF_IP", "10.0.0.1")  # the driver's own address
    monkeypatch.setenv("UNRELATED", "x")
    env = worker_env({"HCCL_BUFFSIZE": "200", "HCCL_CONNECT_TIMEOUT": "600"}, ["HCCL_", "NCCL_", "MLFLOW_", "ASCEND_"])
    assert env["HCCL_BUFFSIZE"] == "400" and env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert env["NCCL_DEBUG"] == "INFO" and env["MLFLOW_TRACKING_TOKEN"] == "t0ken"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env and "HCCL_IF_IP" not in env and "UNRELATED" not in env


def test_launch_env_prefixes_choose_which_exported_variables_travel(compose_cfg, monkeypatch):
    """launch.env_prefixes, from the launch section a trial hands its Ray launch path (and a
    sweep's job task reads from its config), to the environment of every worker."""
    from orchestrator import trial

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("ACME_LICENSE", "k")
    default = trial.resolve(compose_cfg(["+chip=cpu"])).launch_section()
    assert launch_env({}, default)["NCCL_DEBUG"] == "INFO" and "ACME_LICENSE" not in launch_env({}, default)
    own = compose_cfg(["+chip=cpu", "launch.env_prefixes=[ACME_]"])
    assert launch_env({}, trial.resolve(own).launch_section()) == {"ACME_LICENSE": "k"}
    assert launch_env({}, own.launch) == {"ACME_LICENSE": "k"}
    for foreign in (None, "local"):  # an application without a launch section, or with another key
        assert launch_env({"HCCL_BUFFSIZE": "200"}, foreign) == {"HCCL_BUFFSIZE": "200"}


@pytest.mark.parametrize(
    "chip,resource,asked",
    [("+chip=ascend910b", "NPU_CORES", "NPU_CORES"), ("+chip=a100", "GPU_X", "GPU_X"), ("+chip=cpu", "GPU_X", "CPU")],
)
def test_a_trial_s_ranks_ask_ray_for_the_chip_s_resource(compose_cfg, chip, resource, asked):
    """chip.ray_resource is what each rank asks Ray for (a cluster names its NPUs as it likes);
    a CPU trial, or one emulating a chip, asks for a CPU whatever it says."""
    from orchestrator.ray_trial import Placement

    cfg = compose_cfg([chip, f"chip.ray_resource={resource}"])
    assert Placement.of(cfg.chip, cfg.launch.ray, 1).resource == asked
    cfg.chip.emulate = True
    assert Placement.of(cfg.chip, cfg.launch.ray, 1).resource == "CPU"


def test_only_a_tracking_server_is_written_from_other_nodes():
    assert relay.needs_relay("sqlite:////tmp/mlruns.db")
    assert relay.needs_relay("file:///tmp/mlruns") and relay.needs_relay("/tmp/mlruns")
    assert not relay.needs_relay("http://mlflow:5000") and not relay.needs_relay("https://x/y")
    assert not relay.needs_relay("databricks")


@pytest.mark.parametrize(
    "extra, refused",
    [
        ([], "trainer.checkpoint_dir: unset"),
        (["trainer.checkpoint_dir=/data/ck"], "trainer.checkpoint_dir=/data/ck: node-local"),
        (["trainer.checkpoint_dir=file:///data/ck"], "node-local"),
        (["trainer.checkpoint_dir=/data/ck", "trainer.checkpoint_shared=true"], None),
        (["trainer.checkpoint_dir=s3://bucket/ck"], None),
        (["comm.socket_ifname=eth0 eth1", "trainer.checkpoint_dir=s3://b/ck"], "comm.socket_ifname=eth0 eth1"),
    ],
)
def test_a_multi_node_trial_checkpoints_only_where_every_node_reaches(compose_cfg, monkeypatch, extra, refused):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = compose_cfg([*TWO_NODES, "trainer.checkpoint_every=10", *extra])
    if refused is None:
        assert resolve(cfg).nodes == 2
        return
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert any(refused in e for e in err.value.errors), err.value.errors


def test_a_one_node_trial_may_restart_elsewhere_on_a_cluster(compose_cfg, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ConfigError, match="restarted on any node"):
        resolve(compose_cfg(["+chip=cpu", "trainer.checkpoint_every=5", "launch.max_failures=1"]))
    resolve(compose_cfg(["+chip=cpu", "trainer.checkpoint_every=5"]))  # no restart: its own node
    monkeypatch.delenv("RAY_ADDRESS")
    resolve(compose_cfg(["+chip=cpu", "trainer.checkpoint_every=5", "launch.max_failures=1"]))  # one machine


def test_the_refusal_exits_2_before_anything_runs(tmp_path, monkeypatch, capfd):
    args = [*TWO_NODES, "trainer.checkpoint_every=10"]
    code, _, err = cli_in_process(args, tmp_path, monkeypatch, capfd, RAY_ADDRESS="10.0.0.1:6379")
    assert code == 2, err[-2000:]
    assert "trainer.checkpoint_dir: unset" in err
    assert not (tmp_path / "mlruns.db").exists()


def test_a_checkpoint_at_a_uri_is_written_and_read_through_fsspec(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    root = (tmp_path / "ck").as_uri()  # file:///...
    assert root.startswith("file://")
    saved = ckpt.save(root, 7, [model], [opt], {"scaler": {"scale": 3.0}})
    assert saved == root + "/step_00000007"
    assert ckpt.latest(root) == (7, saved) and ckpt.is_complete(saved)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    extra = ckpt.load(saved, [fresh], [fresh_opt])
    assert extra["scaler"] == {"scale": 3.0}
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    # a torn write: the manifest's sizes no longer hold, the folder does not count
    shard = next(p for p in (tmp_path / "ck" / "step_00000007").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    assert ckpt.latest(root) is None
