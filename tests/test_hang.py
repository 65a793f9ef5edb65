"""The hang drill (``trainer.fault.inject=hang``): a rank stops taking part in collectives at a
step, alive; its peer's collective times out after ``comm.timeout_s`` and the trial ends
``timeout`` on both launch paths. And every process group, the device mesh's sub-groups
included, carries ``comm.timeout_s``, not torch's 30-minute default for new groups.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.trial import ConfigError, prepare
from tests.conftest import held_port, metric_history, run_cli, search_runs

TIMEOUT_S = 5
# How long after the hang the trial may end: comm.timeout_s, plus one step of gpt_tiny, the
# launcher noticing the failed rank and ending the hung one, and the run's end in MLflow. The
# docs/ray.md states the measured + 4 s; the bound here is looser, for a loaded CI machine. It is a correctness
# property (the configured timeout ended the trial, not torch's 30-minute default), not a
# performance figure.
MARGIN_S = 60
HANG = [
    "+chip=cpu",
    "parallel=dp2",
    "trainer=smoke",
    "trainer.steps=6",
    "trainer.log_every=1",
    "data.num_workers=0",
    f"comm.timeout_s={TIMEOUT_S}",
    "trainer.fault.inject=hang",
    "trainer.fault.at_step=2",
]


def _assert_ended_by_the_timeout(uri: str, run) -> None:
    """Steps 0 and 1 logged, then the hang at step 2; from rank 0's last log to the run's end
    took the timeout at least (less 1 s: rank 0 stamps its log after the step's all-reduce, when
    rank 1 may already be waiting) and at most the timeout plus the margin."""
    losses = metric_history(uri, run.info.run_id, "loss")
    took = (run.info.end_time - max(m.timestamp for m in losses)) / 1000
    detail = (run.data.tags.get("trial.reason"), [m.step for m in losses], took)
    assert [m.step for m in losses] == [0, 1], detail
    assert TIMEOUT_S - 1 <= took < TIMEOUT_S + MARGIN_S, detail


@pytest.mark.distributed
def test_a_hung_rank_ends_the_trial_timeout_on_the_local_launcher(tmp_path):
    """Rank 0 hangs: the lowest rank is the hung one, yet the reason is rank 1's timeout."""
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    proc = run_cli([*HANG, "trainer.fault.kill_rank=0"], cwd=tmp_path, MLFLOW_TRACKING_URI=uri)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = search_runs(uri)
    assert run.info.status == "FAILED", run.data.tags
    assert run.data.tags["trial.status"] == "timeout", run.data.tags.get("trial.reason")
    assert run.data.tags["trial.reason"].startswith("rank 1:"), run.data.tags["trial.reason"]
    assert "inject: hang" in run.data.tags["fault"]
    _assert_ended_by_the_timeout(uri, run)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.fault.inject=hang"], "trainer.fault.inject=hang needs trainer.fault.kill_rank"),
        (["trainer.fault.inject=hang", "trainer.fault.kill_rank=1"], "trainer.fault.at_step"),
        (
            ["trainer.fault.inject=hang", "trainer.fault.kill_rank=1", "trainer.fault.at_step=99"],
            "trainer.fault.at_step=99 is past trainer.steps",
        ),
        (
            [
                "trainer.fault.inject=hang",
                "trainer.fault.kill_rank=1",
                "trainer.fault.at_step=2",
                "trainer.fault.nan_layer=1",
                "trainer.fault.nan_at_step=2",
            ],
            "trainer.fault.nan_at_step=2 with trainer.fault.inject=hang",
        ),
        (["trainer.fault.inject=hang", "trainer.fault.kill_rank=2", "trainer.fault.at_step=2"], "kill_rank=2"),
        (
            ["parallel=single", "trainer.fault.inject=hang", "trainer.fault.kill_rank=0", "trainer.fault.at_step=2"],
            "trainer.fault.inject=hang needs at least 2 processes",
        ),
    ],
)
def test_inconsistent_hang_drills_are_refused_naming_the_key(compose_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        prepare(compose_cfg(["+chip=cpu", "parallel=dp2", "trainer=smoke", *overrides]))
    assert len(err.value.errors) == 1 and message in err.value.errors[0], err.value.errors


def test_a_hang_drill_passes_validation(compose_cfg):
    cfg = prepare(compose_cfg([*HANG, "trainer.fault.kill_rank=1"]))
    assert cfg.trainer.fault.inject == "hang"


GLOO_TIMEOUT = (
    "RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete\n\n"
    "At:\n  torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py(31): <lambda>\n\n"
)


def test_the_local_reason_names_the_timed_out_rank_not_the_hung_one(tmp_path):
    """The elastic launcher's failures: rank 0 (hung) ended by SIGTERM, rank 1's gloo timeout,
    whose message ends with pybind11's "At:" frames. The reason is rank 1's error line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from orchestrator.launch import _failure_reason, classify

    error_file = tmp_path / "rank1.json"
    error_file.write_text(json.dumps({"message": {"message": GLOO_TIMEOUT, "extraInfo": {"timestamp": "0"}}}))
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none.json")),
        1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(error_file)),
    }
    reason = _failure_reason(ChildFailedError("worker_entry", failures))
    assert reason.startswith("rank 1: RuntimeError:") and reason.endswith("for recv operation to complete")
    assert classify(reason) == "timeout"
    del failures[1]
    assert _failure_reason(ChildFailedError("worker_entry", failures)) == "rank 0: killed by SIGTERM"


def test_the_local_reason_is_the_cause_a_wrapper_was_raised_from(tmp_path):
    """torch's pipelining re-raises a stage's error as "[Stage 0] failed to run forward: args: ...
    kwargs: {}"; the reason is the error it chained (a DDP reducer's assert, seen on dp2pp2)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from orchestrator.launch import CHAINED, _failure_reason

    cause = "RuntimeError: params_.size() == rebuilt_param_indices_.size() INTERNAL ASSERT FAILED"
    stack = f"Traceback (most recent call last):\n  File ...\n{cause}\n\n{CHAINED}:\n\nTraceback ...\nRuntimeError: \n"
    wrapper = "RuntimeError: \n  [Stage 0] failed to run forward:\n  args: ('Tensor(...)',)\n  kwargs: {}\n"
    error_file = tmp_path / "rank0.json"
    info = {"py_callstack": stack, "timestamp": "0"}
    error_file.write_text(json.dumps({"message": {"message": wrapper, "extraInfo": info}}))
    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(error_file))}
    assert _failure_reason(ChildFailedError("worker_entry", failures)) == f"rank 0: {cause}"


def test_the_ray_reason_names_the_timed_out_rank_not_a_collateral_peer():
    """Ray Train's failures: rank 0's collateral connection reset, rank 1's gloo timeout."""
    from types import SimpleNamespace

    from orchestrator.launch import classify
    from orchestrator.ray_failures import failure_reason

    err = SimpleNamespace(
        worker_failures={0: RuntimeError("[gloo] Connection reset by peer"), 1: RuntimeError(GLOO_TIMEOUT)}
    )
    reason = failure_reason(err)
    assert reason.startswith("rank 1: RuntimeError:") and reason.endswith("for recv operation to complete")
    assert classify(reason) == "timeout"


MESH_TIMEOUT_S, LATE_S = 8, 10


def _mesh_timeouts(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of ``world`` gloo workers: join as a trial's worker does (timeout ``MESH_TIMEOUT_S``;
    the last rank ``LATE_S`` later than the others, as a loaded node's rank may), build the
    dp2 x pp1 x tp2 mesh, write the timeout of every process group this rank is in."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    from trainers.config import ParallelConfig, RuntimeConfig
    from trainers.parallel import build_mesh, group_timeout
    from trainers.runtime import init_process_group

    if rank == world - 1:
        time.sleep(LATE_S)
    init_process_group(RuntimeConfig(backend="gloo", timeout_s=MESH_TIMEOUT_S))
    try:
        mesh = build_mesh("cpu", ParallelConfig(dp=2, pp=1, tp=2))
        groups = {"world": dist.group.WORLD, **{d: mesh.group(d) for d in ("dp", "pp", "tp")}}
        seconds = {k: group_timeout(g, "cpu").total_seconds() for k, g in groups.items()}
        seconds["all"] = sorted({group_timeout(g, "cpu").total_seconds() for g in dist.distributed_c10d._world.pg_map})
        sizes = {d: dist.get_world_size(mesh.group(d)) for d in ("dp", "pp", "tp")}
        coord = (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"seconds": seconds, "sizes": sizes, "coord": coord}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_every_group_of_a_dp2tp2_mesh_has_the_configured_timeout(tmp_path):
    """4 gloo processes: the mesh's dp and tp groups (two ranks each, not the world) and its
    one-rank pp groups carry the world's timeout (comm.timeout_s), not new_group's 30-minute
    default, which init_device_mesh would give them. Consecutive ranks share a tp group. A rank
    that joins later than comm.timeout_s still joins (the join waits JOIN_TIMEOUT_FLOOR_S)."""
    import torch.multiprocessing as mp

    with held_port() as port:
        mp.spawn(_mesh_timeouts, args=(4, port, str(tmp_path)), nprocs=4)
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        t = float(MESH_TIMEOUT_S)
        assert got["seconds"] == {"world": t, "dp": t, "pp": t, "tp": t, "all": [t]}, (rank, got)
        assert got["sizes"] == {"dp": 2, "pp": 1, "tp": 2}
        assert got["coord"] == [rank // 2, 0, rank % 2]


@pytest.mark.ray
def test_a_hung_rank_ends_the_trial_timeout_on_ray_and_the_sweep_finishes(tmp_path):
    """The same drill through `hydra/launcher=ray` on the launcher's own local cluster."""
    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    proc = run_cli(
        ["-m", "hydra/launcher=ray", *HANG, "trainer.fault.kill_rank=0", "launch.ray.num_cpus=2"],
        cwd=tmp_path,
        timeout=600,
        MLFLOW_TRACKING_URI=uri,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = search_runs(uri)
    (parent,) = [r for r in runs if "sweep.status" in r.data.tags]
    (run,) = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert parent.data.tags["sweep.status"] == "finished" and parent.data.metrics["trials_failed"] == 1
    assert run.info.status == "FAILED", run.data.tags
    assert run.data.tags["trial.status"] == "timeout", run.data.tags.get("trial.reason")
    assert run.data.tags["trial.reason"].startswith("rank 1:"), run.data.tags["trial.reason"]
    _assert_ended_by_the_timeout(uri, run)


def test_the_ray_reason_is_the_cause_a_pipeline_wrapper_was_raised_from():
    """Ray Train returns a rank's exception with its traceback as text (its own
    UserExceptionWithTraceback, built here as its worker builds it); a pipeline stage's wrapper
    there is read past to the error it chained, a plain error is its traceback's last line."""
    from types import SimpleNamespace

    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    from orchestrator.ray_failures import failure_reason

    cause = "params_.size() == rebuilt_param_indices_.size() INTERNAL ASSERT FAILED"

    def raised(fn):
        try:
            fn()
        except Exception as e:  # as Ray Train's worker catches the training function's error
            return construct_user_exception_with_traceback(e)

    def stage():
        try:
            raise RuntimeError(cause)
        except RuntimeError as inner:
            wrapper = "\n  [Stage 0] failed to run forward:\n  args: ('Tensor(...)',)\n  kwargs: {}"
            raise RuntimeError(wrapper) from inner

    def plain():
        raise ValueError("the corpus ended")

    assert failure_reason(SimpleNamespace(worker_failures={0: raised(stage)})) == f"rank 0: RuntimeError: {cause}"
    assert failure_reason(SimpleNamespace(worker_failures={1: raised(plain)})) == "rank 1: ValueError: the corpus ended"
