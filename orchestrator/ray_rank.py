"""One rank of a trial on Ray, whichever worker group runs it: a Ray Train worker
(:mod:`orchestrator.ray_trial`) or a warm group's actor (:mod:`orchestrator.ray_pool`)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from orchestrator import tags


def rank_entry(config: Dict[str, Any], ranks: Dict[str, Any], store: Any = None) -> Optional[Dict[str, Any]]:
    """One rank of a trial on Ray, from either kind of worker group (Ray Train's, or a warm one of
    :mod:`orchestrator.ray_pool` with its rendezvous ``store``): the torchrun variables, where it
    runs (the roster, rank 0's tags, the board), then ``trainers.loop.worker_entry``."""
    import ray

    # the trainer picks its device and thread count from these, as under torchrun
    os.environ["LOCAL_RANK"] = str(ranks["local_rank"])
    for key, name in (
        ("RANK", "rank"),
        ("WORLD_SIZE", "world_size"),
        ("LOCAL_WORLD_SIZE", "local_world_size"),
        ("NODE_RANK", "node_rank"),
    ):
        # a warm worker runs one trial after another: each trial's own values
        if store is not None or key not in os.environ:
            os.environ[key] = str(ranks[name])
    # a restarted worker group knows it is one (the fault drills fire on the first attempt only)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(config["attempt"])
    rank, node_id, ip = int(ranks["rank"]), ranks["node_id"], ranks["ip"]
    if config.get("roster") is not None:
        ray.get(config["roster"].place.remote(config["attempt"], rank, node_id, ip))
    if rank == 0:
        if config["reporter"] is not None:
            config["reporter"].tag(tags.RANK0_NODE, node_id)
            config["reporter"].tag(tags.RANK0_IP, ip)
            config["reporter"].tag(tags.TRIAL_ATTEMPTS, str(config["attempt"] + 1))
        if config["board"] is not None:
            config["board"].place.remote(config["key"])
    if os.path.isdir(config["cwd"]):  # Ray Train starts workers in its own run folder
        os.chdir(config["cwd"])
    from trainers.loop import worker_entry

    return worker_entry(config["spec"], config["reporter"], store=store)
