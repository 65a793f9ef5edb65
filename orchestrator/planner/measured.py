"""Measured trials read back from MLflow for the planner's calibration: each finished trial's
config rebuilt from its params onto the schema, with its measured median step time and the share
of its host's cores its ranks kept busy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator import statuses, tags


@dataclass
class MeasuredTrial:
    run_id: str
    cfg: DictConfig
    step_time_s: float
    peak_mem_gb: Optional[float] = None
    host_busy: Optional[float] = None  # share of the host's cores its ranks kept busy (trainers/clock.py)


def _parse_param(text: str) -> Any:
    if text in ("None", "null"):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def config_from_params(params: Dict[str, str], metrics: Optional[Dict[str, float]] = None) -> DictConfig:
    """The trial's config rebuilt from its MLflow params (the flattened resolved config, see
    tracking.flatten) onto the schema; its layout from the run's dp/tp/pp metrics."""
    from orchestrator.config import Config

    tree: Dict[str, Any] = {}
    sections = set(Config.__dataclass_fields__)
    for key, text in params.items():
        parts = key.split(".")
        if parts[0] not in sections or len(parts) < 2:
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_param(text)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), tree)
    metrics = metrics or {}
    if all(k in metrics for k in ("dp", "tp", "pp")):
        cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = (int(metrics[k]) for k in ("dp", "tp", "pp"))
        cfg.launch.world_size = int(metrics["dp"] * metrics["tp"] * metrics["pp"])
    return cfg


def measured_trials(uri: str, experiment: str, chip: Optional[str] = None) -> List[MeasuredTrial]:
    """Finished, not emulated trials (of ``chip``) with a measured ``step_time_median_s``."""
    from orchestrator import tracking

    c = tracking.client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    out = []
    for run in c.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{tags.TRIAL_STATUS}` = '{statuses.FINISHED}'", max_results=5000
    ):
        told, metrics = run.data.tags, run.data.metrics
        if told.get("emulated") == "true" or (chip and told.get("chip") != chip):
            continue
        if "step_time_median_s" not in metrics:
            continue
        try:
            cfg = config_from_params(run.data.params, metrics)
        except Exception:  # noqa: BLE001 - a run from an older schema: not usable for fitting
            continue
        out.append(
            MeasuredTrial(
                run.info.run_id,
                cfg,
                float(metrics["step_time_median_s"]),
                metrics.get("peak_mem_gb"),
                metrics.get("host_busy"),
            )
        )
    return out
