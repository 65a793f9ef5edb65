"""The ``ovat`` Hydra sweeper: coordinate descent over the study's variables, one batch of
trials per variable through the configured launcher (basic or ray). Hydra imports this module at
start-up, so it imports nothing heavy; the study is in ``sweeps.ovat``."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper


@dataclass
class OvatSweeperConf:
    _target_: str = "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper"
    study: Optional[str] = None  # a name for the study; default: the +sweep preset's name
    # ordered variables, KEY: "a,b,c" (or [candidates...]); the first candidate is the baseline.
    # `params` is where Hydra's own sweepers read their search space; `variables` is its alias
    # (give one of them). Sweep overrides on the command line (KEY=a,b) add variables after
    # these, or replace them
    params: Dict[str, Any] = field(default_factory=dict)
    variables: Dict[str, Any] = field(default_factory=dict)
    objective: str = "step_time_median_s"  # any metric a trial logs to MLflow
    direction: str = "minimize"  # minimize | maximize
    repeats: int = 2  # trials per point; the baseline's repeats measure the run-to-run noise
    min_speedup: float = 1.02  # a change is adopted only if S >= max(min_speedup, 1 + noise)
    loss_band: float = 0.05  # quality gate: final loss within this fraction of the baseline's
    passes: int = 1  # passes over the variables; another pass runs only if the last adopted a change
    resume: bool = True  # reuse finished trials in MLflow with the same config hash
    # with a step-time objective: measure each variable's candidates in the planner's predicted order,
    # and skip one predicted slower than the incumbent by more than the planner's own measured error
    planner_skip: bool = True


ConfigStore.instance().store(group="hydra/sweeper", name="ovat", node=OvatSweeperConf, provider="chip-orchestrator")


class OvatSweeper(Sweeper):
    def __init__(self, **spec: Any) -> None:
        self.spec = spec
        self.config: Optional[Any] = None
        self.hydra_context: Optional[Any] = None
        self.launcher: Optional[Any] = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: List[str]) -> Any:
        from sweeps.ovat import run_study

        return run_study(self, arguments)
