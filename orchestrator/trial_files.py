"""Where a trial's files go: rank 0's journal of records not yet in MLflow, and the checkpoint
folder its ranks and restarted worker groups share."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from orchestrator import sweep_parent


def journal(run_id: str) -> str:
    """Where rank 0's reporter journals its records (``orchestrator.mlflow_reporter.MlflowReporter``):
    next to the trial's output, the job's Hydra output folder (else the working directory)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        base = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not a Hydra job (a test, a notebook), or one without an output dir (--cfg)
        base = Path.cwd()
    return str(base / f"mlflow_journal_{run_id}.jsonl")


def checkpoint_dir(cfg: DictConfig, run_id: str) -> str:
    """The trial's checkpoint folder, shared by its ranks and by its restarted worker groups.
    Unset: ``./checkpoints/<run id>``. Set, for one trial: that folder itself (the same command
    run again resumes from it). Set, in a sweep (a multirun, tracked or not): a root, each trial in
    ``<root>/<run id>`` (a random id without tracking), so that no trial resumes from another's
    checkpoints."""
    root = cfg.trainer.checkpoint_dir
    if not root:
        return str(Path("checkpoints").resolve() / run_id)
    if sweep_parent.current() is not None or in_multirun():
        return str(root).rstrip("/") + "/" + run_id
    return str(root)


def in_multirun() -> bool:
    """Is this a job of a Hydra multirun? Its own config says so (``hydra.mode``), with tracking
    on or off: a sweep's trials never share one checkpoint folder."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - not a Hydra job (a test, a notebook)
        return False
