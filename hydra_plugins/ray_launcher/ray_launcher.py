"""The ``ray`` Hydra launcher: every trial of a multirun is submitted to Ray at once and runs
when its devices are free. Hydra imports this module at start-up, so it imports nothing heavy;
cluster options live in the trial config (``launch.ray.*``)."""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.ray_launcher.ray_launcher.RayLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RayLauncherConf, provider="chip-orchestrator")


class RayLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Optional[Any] = None
        self.hydra_context: Optional[Any] = None
        self.task_function: Optional[Any] = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from orchestrator.ray_sweep import launch_jobs

        return launch_jobs(self, job_overrides, initial_job_idx)
