"""How a warm worker group numbers its ranks (``orchestrator.ray_pool.ranks_by_node``): from where
Ray placed each actor, as torchrun and Ray Train number them. The groups themselves run in
``tests/test_ray.py`` on real clusters."""

from __future__ import annotations

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
