"""Where a trial or sweep finds its Ray cluster: the address (``launch.ray.address``, else
``$RAY_ADDRESS``, else a local cluster started here), whether a trial goes to Ray at all, the
connection itself, the environment workers get on every node, and each live node's devices.
Ray is imported inside the functions: composing or validating a config never imports it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence


def cluster_address(ray_cfg: Any) -> Optional[str]:
    """``launch.ray.address``, else ``$RAY_ADDRESS``, else None (a local cluster is started)."""
    address = (ray_cfg.get("address") if ray_cfg is not None else None) or os.environ.get("RAY_ADDRESS")
    return str(address) if address else None


def goes_to_ray(nodes: int, ray_cfg: Any) -> bool:
    """A trial larger than one node, or any trial when a cluster address is set."""
    return nodes > 1 or cluster_address(ray_cfg) is not None


def launch_errors(chip: Any, launch: Any, world_size: int, nodes: int) -> List[str]:
    """Rules of where a trial of ``world_size`` processes on ``nodes`` nodes can run (the planner
    plans any node count; a launch cannot). ``chip`` and ``launch`` are those config sections."""
    if nodes == 1 or cluster_address(launch.ray) is not None:
        return []
    fix = "a multi-node trial runs on a Ray cluster: set launch.ray.address (or RAY_ADDRESS) to one"
    if int(launch.nnodes) > 1:
        return [f"launch.nnodes={launch.nnodes}: {fix}"]
    return [
        f"parallel: dp*tp*pp={world_size} needs {nodes} nodes of chip={chip.name} "
        f"(chip.devices_per_node={chip.devices_per_node}); {fix}"
    ]


@contextlib.contextmanager
def cluster(ray_cfg: Any, keep: bool = False, init: Optional[Dict[str, Any]] = None) -> Iterator[None]:
    """Connect to the cluster at :func:`cluster_address`, or start a local one (dashboard on
    127.0.0.1 only); a cluster started here stops on leaving, unless ``keep`` (then it stops when
    this process exits). ``init``: more ``ray.init`` keyword arguments, which win over these (a
    ``runtime_env`` is merged over the code's). Inside a Ray task or actor this is a no-op."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = cluster_address(ray_cfg)
    extra = dict(init or {})
    if address:
        runtime_env = {**(_code_runtime_env() or {}), **(extra.pop("runtime_env", None) or {})}
        try:
            ray.init(address=address, **{"log_to_driver": True, "runtime_env": runtime_env or None, **extra})
        except ConnectionError as err:
            raise ConnectionError(
                f"{err} (a cluster started by `ray start` expects a token: export "
                f"RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token)"
            ) from None
    else:
        # "local": a new cluster, even where `ray start` left one running on this machine
        local = {
            "num_cpus": ray_cfg["num_cpus"],
            "log_to_driver": True,
            "include_dashboard": bool(ray_cfg["dashboard"]),
            "dashboard_host": "127.0.0.1",
        }
        ray.init(address="local", **{**local, **extra})
    try:
        yield
    finally:
        if not address and not keep:
            ray.shutdown()


def _code_runtime_env() -> Optional[Dict[str, Any]]:
    """What a joined cluster's workers need to import this code: nothing when it is an installed
    package (install it on every node) or inside a submitted job (the job's runtime env rules);
    a source checkout travels as the job's working_dir (Ray uploads it, less what .gitignore lists)."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:
        return None
    root = Path(__file__).resolve().parents[1]
    return {"working_dir": str(root)} if (root / "pyproject.toml").is_file() else None


# variables whose value belongs to one host (HCCL_IF_IP: that host's own address) or to one
# rendezvous (NCCL_COMM_ID): never copied from the driver to the workers
NODE_OWN = ("HCCL_IF_IP", "NCCL_COMM_ID")


def worker_env(runtime_env: Dict[str, Any], prefixes: Sequence[str]) -> Dict[str, str]:
    """The environment a trial's workers get on every node (a Ray worker inherits its raylet's
    environment, not the driver's): the backend variables of the chip and ``comm`` sections,
    where a value the user exported on the driver wins (as ``trainers.runtime.apply_env`` lets it
    win on one node), and every driver variable whose name starts with one of ``prefixes``
    (``launch.env_prefixes``). Device visibility is Ray's to set per worker, never copied."""
    env = {k: os.environ.get(k, str(v)) for k, v in runtime_env.items()}
    env.update({k: v for k, v in os.environ.items() if k.startswith(tuple(prefixes))})
    return {k: v for k, v in env.items() if not k.endswith("_VISIBLE_DEVICES") and k not in NODE_OWN}


def launch_env(runtime_env: Dict[str, Any], launch: Any) -> Dict[str, str]:
    """:func:`worker_env` with the prefixes of a ``launch`` section (none where an application
    has no such section, or a ``launch`` key that is not one)."""
    prefixes = launch.get("env_prefixes") if hasattr(launch, "get") else None
    return worker_env(runtime_env, list(prefixes or ()))


def live_totals(resource: str) -> List[float]:
    """Each live node's total of ``resource``, as :meth:`Placement.units` takes them."""
    import ray

    return [float(n["Resources"].get(resource, 0.0)) for n in ray.nodes() if n.get("Alive")]
