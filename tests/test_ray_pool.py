"""How a warm worker group numbers its ranks (``orchestrator.ray_pool.ranks_by_node``): from where
Ray placed each actor, as torchrun and Ray Train number them. The groups themselves run in
``tests/test_ray.py`` on real clusters."""

from __future__ import annotations

import time

import pytest

from orchestrator.ray_pool import ranks_by_node, shape_key


def test_a_nodes_ranks_are_consecutive_in_the_order_its_first_bundle_comes():
    # bundles 0 and 2 on node A, 1 and 3 on node B: A's actors take ranks 0 and 1
    where = [("A", "10.0.0.1", [], 11), ("B", "10.0.0.2", [], 12), ("A", "10.0.0.1", [], 13), ("B", "10.0.0.2", [], 14)]
    got = ranks_by_node(where)
    assert [g["rank"] for g in got] == [0, 2, 1, 3]
    assert [g["local_rank"] for g in got] == [0, 0, 1, 1]
    assert [g["node_rank"] for g in got] == [0, 1, 0, 1]
    assert {g["local_world_size"] for g in got} == {2}
    assert [g["visible"] for g in got] == [None] * 4  # CPU workers: no device to make visible


def test_a_node_shares_its_devices_and_local_rank_indexes_its_own():
    # Ray gave each actor one GPU; the node's ranks see all of them, as under torchrun
    where = [("A", "h", ["3"], 1), ("A", "h", ["10"], 2), ("A", "h", ["1"], 3)]
    got = ranks_by_node(where)
    assert [g["visible"] for g in got] == ["1,3,10"] * 3
    assert [g["local_rank"] for g in got] == [1, 2, 0]
    assert [g["rank"] for g in got] == [0, 1, 2]


def test_a_shape_is_its_size_resources_placement_and_environment():
    base = shape_key(4, "GPU", 1, "PACK", {"NCCL_BUFFSIZE": "4194304"})
    assert base == shape_key(4, "GPU", 1, "PACK", {"NCCL_BUFFSIZE": "4194304"})
    # NCCL reads some variables once per process: another value is another group
    assert base != shape_key(4, "GPU", 1, "PACK", {"NCCL_BUFFSIZE": "8388608"})
    assert base != shape_key(2, "GPU", 1, "PACK", {"NCCL_BUFFSIZE": "4194304"})
    assert base != shape_key(4, "GPU", 2, "PACK", {"NCCL_BUFFSIZE": "4194304"})
    assert base != shape_key(4, "GPU", 1, "STRICT_PACK", {"NCCL_BUFFSIZE": "4194304"})


def test_a_deterministic_trial_gets_groups_of_its_own():
    """The trainer sets the determinism variables in its process and never unsets them: a group
    that ran a deterministic trial must not take a non-deterministic one."""
    from types import SimpleNamespace

    from orchestrator.ray_trial import _group_env

    def spec(deterministic):
        return SimpleNamespace(
            trainer=SimpleNamespace(deterministic=deterministic), runtime=SimpleNamespace(device_type="npu")
        )

    env = {"HCCL_BUFFSIZE": "200"}
    fast, exact = _group_env(spec(False), env), _group_env(spec(True), env)
    assert fast == env and exact == {"HCCL_DETERMINISTIC": "true", "HCCL_BUFFSIZE": "200"}
    assert shape_key(8, "NPU", 1, "PACK", fast) != shape_key(8, "NPU", 1, "PACK", exact)
    # a value the user exported on the driver wins, as on one node
    assert _group_env(spec(True), {"HCCL_DETERMINISTIC": "false"}) == {"HCCL_DETERMINISTIC": "false"}


@pytest.mark.ray
def test_the_pool_reuses_evicts_and_replaces_a_group_that_died_idle():
    """A real local Ray cluster of 2 CPUs and the pool actor: a released group is handed out again
    (the same processes); a group of another shape waiting for the CPUs evicts the idle one; an
    idle group whose worker died is replaced by a new group, not charged to the trial."""
    import ray

    from orchestrator import ray_pool

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        pool = ray.remote(num_cpus=0, max_concurrency=8)(ray_pool.Pool).remote()
        group, where = ray_pool.live_group(pool, 2, "CPU", 1, "STRICT_PACK", {})
        pids = sorted(w[3] for w in where)
        assert len(set(pids)) == 2 and group.trials == 0
        ray.get(pool.release.remote(group))
        again, where = ray_pool.live_group(pool, 2, "CPU", 1, "STRICT_PACK", {})
        assert again.id == group.id and again.trials == 1 and sorted(w[3] for w in where) == pids
        ray.get(pool.release.remote(again))
        # one worker of another shape: the idle 2-CPU group holds every CPU until evicted
        other, _ = ray_pool.live_group(pool, 1, "CPU", 1, "STRICT_PACK", {"X": "1"})
        assert other.id != group.id
        assert ray.get(pool.stats.remote()) == {"created": 2, "alive": 1, "idle": 0}
        ray.get(pool.release.remote(other))
        # the idle group's worker dies; the next trial of its shape gets a new group
        ray.kill(other.actors[0], no_restart=True)
        time.sleep(1)
        fresh, where = ray_pool.live_group(pool, 1, "CPU", 1, "STRICT_PACK", {"X": "1"})
        assert fresh.id != other.id and fresh.trials == 0 and len(where) == 1
        ray.get(pool.close.remote())
        assert ray.get(pool.stats.remote())["alive"] == 0
    finally:
        ray.shutdown()
