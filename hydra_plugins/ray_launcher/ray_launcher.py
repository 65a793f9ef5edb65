"""The ``ray_trials`` Hydra launcher: every job of a multirun is submitted to Ray at once and runs
when what it holds is free; any Hydra app's task function runs under it as under the basic
launcher. Hydra imports this module at start-up, so it imports nothing heavy. The settings and
their precedence are in :func:`orchestrator.ray_sweep.launch_jobs`.

``hydra/launcher=ray`` is the same launcher, registered only where Hydra's own Ray launcher
(``hydra-ray-launcher``, which owns that name) is not installed: two plugins storing one name
would leave it to the order Hydra scans them in, and the last stored would win silently."""

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher


@dataclass
class JobResources:
    """What the Ray task running each job holds while it runs."""

    num_cpus: Optional[float] = None  # null: 0 for this application's jobs (their trials hold devices), else 1
    num_gpus: float = 0
    resources: Dict[str, float] = field(default_factory=dict)  # custom Ray resources, e.g. {NPU: 1}


@dataclass
class RayTrialsLauncherConf:
    _target_: str = "hydra_plugins.ray_launcher.ray_launcher.RayLauncher"
    address: Optional[str] = None  # join this cluster; null: launch.ray.address, else $RAY_ADDRESS, else a local one
    init: Dict[str, Any] = field(default_factory=dict)  # more ray.init keyword arguments (num_cpus, runtime_env, ...)
    job_resources: JobResources = field(default_factory=JobResources)
    # jobs run on the driver's node, beside the sweep dir; false: on any node with room (the
    # sweep dir must then be on storage every node shares)
    same_node: bool = True


def _hydra_ray_launcher_installed() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None
    except (ImportError, ValueError):
        return False


_store = ConfigStore.instance()
_store.store(group="hydra/launcher", name="ray_trials", node=RayTrialsLauncherConf, provider="chip-orchestrator")
if not _hydra_ray_launcher_installed():
    _store.store(group="hydra/launcher", name="ray", node=RayTrialsLauncherConf, provider="chip-orchestrator")


class RayLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings  # hydra.launcher, less _target_
        self.config: Optional[Any] = None
        self.hydra_context: Optional[Any] = None
        self.task_function: Optional[Any] = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from orchestrator.ray_sweep import launch_jobs

        return launch_jobs(self, job_overrides, initial_job_idx)
