"""The ``auto`` Hydra sweeper: plan every point the trainer can run on ``launch.world_size``
devices, measure the few that can win, in the planner's order, until none left can. Hydra imports
this module at start-up, so it imports nothing heavy; the study is in ``sweeps.auto_study``."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from hydra_plugins.ovat_sweeper.ovat_sweeper import OvatSweeper


@dataclass
class AutoSpaceConf:
    """The values each knob of the space takes (None: every value the trainer runs)."""

    schedules: Optional[List[str]] = None  # gpipe, 1f1b, interleaved_1f1b, zbv
    activation_checkpointing: Optional[List[bool]] = None
    recompute_granularity: Optional[List[str]] = None  # full, selective (with checkpointing on)
    # with full recompute, the shares of each stage chunk's blocks that recompute besides all of
    # them (model.recompute_layers; None: a quarter, a half, three quarters; [] none: all or nothing)
    recompute_shares: Optional[List[float]] = None
    dp_shard: Optional[List[str]] = None  # ddp, zero1, fsdp (trainers.rules.DP_MODES)
    sequence_parallel: Optional[List[bool]] = None
    max_pp: int = 0  # 0: every pipeline depth that divides the layers
    # trainer.compile values (None: both on a GPU, whose auto backend Inductor fuses; the composed
    # value on the CPU and on Ascend, whose auto backend aot_eager does not fuse)
    compile: Optional[List[bool]] = None


@dataclass
class AutoSweeperConf:
    _target_: str = "hydra_plugins.auto_sweeper.auto_sweeper.AutoSweeper"
    batch: int = 0  # trials measured between two refits; 0: what the nodes hold at once, at least 2
    min_speedup: float = 1.03  # an unmeasured point must be predicted this much faster to be tried
    max_trials: int = 12  # budget: trials launched (at least 1)
    # runs the best point needs before the search may stop on the rule (1: its first run is
    # trusted; 2: it runs again, and a slower second run hands the lead on)
    confirm: int = 2
    max_trial_seconds: Optional[float] = None  # budget: summed trial wall time, seconds (None: none)
    max_device_hours: Optional[float] = None  # budget: trial wall time x launch.world_size, hours (None: none)
    dry_run: bool = False  # plan, print the shortlist and the measuring cost, launch nothing
    # measure every planned point, fastest predicted first, without the early stop (a grid over the
    # planned space, to judge the search and the planner by; the budgets still hold)
    exhaustive: bool = False
    shortlist: int = 10  # planned points logged (and printed by a dry run)
    # narrow the space, e.g. hydra.sweeper.space.schedules=[1f1b,zbv]
    space: AutoSpaceConf = field(default_factory=AutoSpaceConf)
    # stage 3: one variable at a time from the winner (override key -> values; the winner's own
    # value is the baseline), with the OVAT engine, after the budgets (which bound stage 2). A key
    # set to null or [] is left out (a dict override merges into the preset's)
    polish: Dict[str, Any] = field(default_factory=dict)
    polish_repeats: int = 1  # repeats a polish point (the winner's search trial is its first); 0: no polish


ConfigStore.instance().store(group="hydra/sweeper", name="auto", node=AutoSweeperConf, provider="chip-orchestrator")


class AutoSweeper(OvatSweeper):
    """The OVAT sweeper's set-up (the configured launcher), the automatic search's sweep."""

    def sweep(self, arguments: List[str]) -> Any:
        from sweeps.auto_study import run_auto

        return run_auto(self, arguments)
