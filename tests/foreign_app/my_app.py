"""A Hydra app that is not this project's: its own ``@hydra.main``, its own config (no ``launch``
section), a task function that returns a number. tests/test_launcher.py runs it under the
``ray_trials`` launcher and under Hydra's basic launcher, and compares what they give."""

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def my_app(cfg: DictConfig) -> float:
    if cfg.x == cfg.fail_on:
        raise ValueError(f"x={cfg.x} was told to fail")
    # where the job ran, in its own output dir (hydra.sweep.dir/hydra.sweep.subdir)
    with open(os.path.join(HydraConfig.get().runtime.output_dir, "where.txt"), "w") as f:
        f.write(os.getcwd())
    return cfg.x * cfg.scale


if __name__ == "__main__":
    my_app()
