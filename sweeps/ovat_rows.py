"""The rows of an OVAT tuning report: one per measured candidate, skipped variable or candidate
the planner ruled out (``orchestrator.report`` renders them)."""

from __future__ import annotations

from typing import Any, Dict

from orchestrator import results
from orchestrator.results import Point
from sweeps.ovat_spec import Study


def _row(
    step: int,
    pass_: int,
    variable: str,
    value: str,
    p: Point,
    baseline: Point,
    incumbent: Point,
    study: Study,
    decision: str,
    adopted: bool,
) -> Dict[str, Any]:
    return {
        "step": step,
        "pass": pass_,
        "variable": variable,
        "value": value,
        "status": p.status,
        "n": len(p.values),
        "objective": p.value,
        "values": list(p.values),
        "spread": p.spread,
        "s_base": results.speedup(baseline.value, p.value, study.direction),
        "s_prev": results.speedup(incumbent.value, p.value, study.direction),
        "reference": incumbent.value,
        "reference_values": list(incumbent.values),
        "reference_label": incumbent.labels.get(variable),
        "final_loss": p.final_loss,
        "decision": decision,
        "adopted": adopted,
        "run_ids": list(p.run_ids),
        "config_hash": p.config_hash,
        "overrides": list(p.overrides),
    }


def _skip_row(step: int, pass_: int, variable: str, why: str) -> Dict[str, Any]:
    return {
        "step": step,
        "pass": pass_,
        "variable": variable,
        "value": "(every candidate)",
        "status": "skipped",
        "n": 0,
        "objective": None,
        "values": [],
        "spread": 0.0,
        "s_base": None,
        "s_prev": None,
        "reference": None,
        "reference_values": [],
        "reference_label": None,
        "final_loss": None,
        "decision": f"skipped, no effect on the incumbent: {why}",
        "adopted": False,
        "run_ids": [],
        "config_hash": None,
        "overrides": [],
    }


def _planned_row(step: int, pass_: int, variable: str, value: str, p: Point, study: Study, why: str) -> Dict[str, Any]:
    """A candidate the planner ruled out, never launched."""
    row = _skip_row(step, pass_, variable, why)
    row.update(value=value, decision=why, config_hash=p.config_hash, overrides=list(p.overrides))
    return row
