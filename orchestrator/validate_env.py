"""The rule of what the launching shell exports. A backend variable the config sets (the chip
preset's ``chip.env``, ``comm.buffsize_mb`` as ``HCCL_BUFFSIZE``, ``comm.nccl_buffsize_mb`` as
``NCCL_BUFFSIZE``, ``comm.socket_ifname``, ``comm.env``, ``trainer.deterministic``'s
``HCCL_DETERMINISTIC``) that the shell exports with another value would win in every worker
(``trainers.runtime.apply_env`` keeps an exported value; Ray's workers get the driver's,
``orchestrator.ray_cluster.worker_env``): the run would record one value and run with another, and
a sweep of that key would time identical runs. Ascend's environment scripts export several of
them. Refused, naming the key, both values and the way out. Part of ``orchestrator.validate``.

``HCCL_EXEC_TIMEOUT`` and ``HCCL_CONNECT_TIMEOUT`` are the exception, honoured on purpose: the
process group's timeout is raised to outlast an exported one (``trainers.rules.collective_timeout_s``).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional

from omegaconf import DictConfig

from trainers import rules

HONOURED = ("HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT")
# the variables comm.* derives, besides comm.env's and the chip preset's own
DERIVED = {
    "HCCL_BUFFSIZE": "comm.buffsize_mb",
    "NCCL_BUFFSIZE": "comm.nccl_buffsize_mb",
    "GLOO_SOCKET_IFNAME": "comm.socket_ifname",
    "NCCL_SOCKET_IFNAME": "comm.socket_ifname",
    "HCCL_SOCKET_IFNAME": "comm.socket_ifname",
}


def _key(var: str, cfg: DictConfig) -> str:
    """The config key that sets ``var``: comm.env's own word first, as the runtime applies it."""
    if var in (cfg.comm.get("env") or {}):
        return f"comm.env.{var}"
    if var in DERIVED:
        return DERIVED[var]
    return f"chip.env.{var}"


def _value(cfg, key: str):
    """The value at ``key`` (a DictConfig or the planner's plain sections)."""
    out = cfg
    for part in key.split("."):
        out = out[part]
    return out


def env_rules(cfg: DictConfig, err: Callable[[str], None], environ: Optional[Mapping[str, str]] = None) -> None:
    """One line for each variable the config sets that ``environ`` (the launching shell's)
    exports with another value."""
    environ = os.environ if environ is None else environ
    chip, comm = cfg.chip, cfg.comm
    device, deterministic = str(chip.device_type), bool(cfg.trainer.get("deterministic"))
    names = set(chip.env or {}) | set(comm.get("env") or {}) | set(DERIVED) | set(rules.determinism_env(device))
    if not names & set(environ):  # the common case, and the search's thousands of points: no work
        return
    from orchestrator.chips import runtime

    env = runtime(chip, comm, str(cfg.precision.compute_dtype)).env
    for var, want in sorted(rules.backend_env(env, device, deterministic).items()):
        have = environ.get(var)
        if have is None or var in HONOURED or str(have) == str(want):
            continue
        key = _key(var, cfg) if var in env else "trainer.deterministic"
        err(
            f"{key}={_value(cfg, key)} sets {var}={want}, but this shell exports "
            f"{var}={have}, which every worker would run with instead: unset {var}, or give {key} the "
            f"exported value"
        )
