"""The tuning report of any sweep, read from its trial runs: points in launch order, the first
one the baseline, S of every point against it, the effect of each variable alone (the points that
differ from the baseline in that variable only), the quality gate, and the best point with the
command that reproduces it (rendered by ``orchestrator.report_render``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional

from orchestrator import cli, results, statuses, tags
from orchestrator.results import Point, fmt


def parent_runs(uri: str, experiment: str) -> List[Any]:
    """Sweep parent runs of an experiment, newest first."""
    return [r for r in results.search(uri, experiment, trials_only=False) if tags.SWEEP_STATUS in r.data.tags]


def find_parent(uri: str, experiment: str, sweep_id: Optional[str]) -> Any:
    parents = parent_runs(uri, experiment)
    if sweep_id:
        parents = [r for r in parents if sweep_id in (r.data.tags.get(tags.SWEEP), r.info.run_id)]
    return parents[0] if parents else None


def _assignment(overrides: List[str]) -> "OrderedDict[str, str]":
    out: "OrderedDict[str, str]" = OrderedDict()
    for o in overrides:
        key, _, value = o.partition("=")
        out[key] = value
    return out


def _points(uri: str, runs: List[Any], objective: str) -> List[Point]:
    """One point per config (its trials grouped by config hash), in launch order; a point with no
    finished trial carries the last one's status and reason."""
    groups: "OrderedDict[str, List[Any]]" = OrderedDict()
    for r in runs:
        groups.setdefault(r.data.tags.get(tags.CONFIG_HASH) or r.info.run_id, []).append(r)
    points: List[Point] = []
    for chash, members in groups.items():
        p = Point(chash, results.overrides_of(uri, members[0]))
        finished = [r for r in members if results.status(r) == statuses.FINISHED]
        p.fill(uri, finished, objective)
        if not p.values:
            last = members[-1]
            p.status = results.status(last) if results.status(last) != statuses.FINISHED else statuses.FAILED
            p.reason = last.data.tags.get(tags.TRIAL_REASON, "") or (
                f"objective {objective} not logged" if finished else ""
            )
            p.run_ids = [r.info.run_id for r in members]
        p.labels = dict(_assignment(p.overrides))
        points.append(p)
    return points


def _varied(points: List[Point]) -> List[str]:
    """The keys whose value differs between points, in the order they first appear."""
    keys: List[str] = []
    for p in points:
        for k in p.labels:
            if k not in keys and len({q.labels.get(k) for q in points}) > 1:
                keys.append(k)
    return keys


def _row(i: int, p: Point, changed: List[str], keys: List[str], s_base, decision: str, best) -> Dict[str, Any]:
    return {
        "step": i,
        "pass": "",
        "variable": "(baseline)" if i == 0 else ", ".join(changed) or "(same)",
        "value": " ".join(f"{k}={p.labels.get(k, '')}" for k in (keys if i == 0 else changed)),
        "status": p.status,
        "n": len(p.values),
        "objective": p.value,
        "values": list(p.values),
        "spread": p.spread,
        "s_base": s_base,
        "s_prev": None,
        "reference": None,
        "final_loss": p.final_loss,
        "decision": decision,
        "adopted": p is best,
        "run_ids": list(p.run_ids),
        "config_hash": p.config_hash,
        "overrides": list(p.overrides),
        "labels": dict(p.labels),
    }


def _rows(points: List[Point], keys: List[str], gates, best, threshold: float, direction: str):
    """The report's rows, and what each variable did alone from the baseline (helped, did not)."""
    baseline = points[0]
    rows, helped, did_not = [], [], []
    for i, p in enumerate(points):
        changed = [k for k in keys if p.labels.get(k) != baseline.labels.get(k)]
        s_base = results.speedup(baseline.value, p.value, direction)
        why = gates[id(p)]
        if why:
            decision = why
        else:
            decision = "baseline" if i == 0 else "best" if p is best else ""
        if i > 0 and len(changed) == 1 and why is None:  # this variable alone, from the baseline
            text = f"{changed[0]}={p.labels[changed[0]]}: S={fmt(s_base, 3)} over the baseline"
            (helped if s_base is not None and s_base >= threshold else did_not).append(text)
        elif i > 0 and len(changed) == 1:
            did_not.append(f"{changed[0]}={p.labels[changed[0]]}: {why}")
        rows.append(_row(i, p, changed, keys, s_base, decision, best))
    return rows, helped, did_not


def _variable_rows(keys: List[str], rows: List[Dict[str, Any]], points: List[Point]) -> List[Dict[str, Any]]:
    """Per-variable plots want one row per value: the points that change only this variable."""
    return [
        {**r, "variable": key, "value": p.labels.get(key, ""), "adopted": r["adopted"] and r["step"] != 0}
        for key in keys
        for r, p in zip(rows, points)
        if r["step"] == 0 or r["variable"] == key
    ]


def from_trials(
    uri: str,
    experiment: str,
    sweep_id: str,
    objective: str,
    direction: str,
    min_speedup: float,
    loss_band: float,
    filter_string: Optional[str] = None,
) -> Dict[str, Any]:
    """The report of any sweep, read from its trial runs (launch order; the first is the baseline);
    only the trials that match ``filter_string`` (an MLflow filter) too, when given."""
    runs = results.search(uri, experiment, cli.build_filter(filter_string, {tags.SWEEP: sweep_id}))
    runs.sort(key=lambda r: r.info.start_time)
    points = _points(uri, runs, objective)
    if not points:
        raise LookupError(f"sweep {sweep_id} has no trials in experiment {experiment}")
    keys = _varied(points)
    baseline = points[0]
    noise = baseline.spread
    threshold = max(min_speedup, 1.0 + noise)
    gates = {id(p): results.quality_gate(p, baseline, loss_band) for p in points}
    best = None
    for p in points:
        if gates[id(p)] is None and (best is None or results.better(p.value, best.value, direction)):
            best = p
    rows, helped, did_not = _rows(points, keys, gates, best, threshold, direction)
    pruned = sum(results.status(r) in statuses.REFUSED for r in runs)
    return {
        "kind": "grid",
        "study": None,
        "sweep": sweep_id,
        "experiment": experiment,
        "objective": objective,
        "direction": direction,
        "repeats": max((len(p.values) for p in points), default=1),
        "min_speedup": min_speedup,
        "loss_band": loss_band,
        "noise": noise,
        "threshold": threshold,
        "outcome": statuses.FINISHED if best is not None else "no_eligible_point",
        "variables": [
            {"key": k, "values": list(OrderedDict.fromkeys(p.labels.get(k, "") for p in points))} for k in keys
        ],
        "fixed": [f"{k}={v}" for k, v in baseline.labels.items() if k not in keys],
        "rows": rows,
        "variable_rows": _variable_rows(keys, rows, points),
        "final": _final(best or baseline, baseline, keys, direction),
        "helped": helped,
        "did_not_help": did_not,
        "curves": _curves(baseline, best, keys),
        "trials": {
            "launched": len(runs) - pruned,
            "reused": 0,
            "pruned": pruned,
            "trial_seconds": results.run_seconds(runs),
        },
    }


def _final(final: Any, baseline: Any, keys: List[str], direction: str) -> Dict[str, Any]:
    """The report's final point (the best, else the baseline): its values, command and speedup."""
    return {
        "assignment": {k: final.labels.get(k, "") for k in keys},
        "overrides": final.overrides,
        "command": results.command(final.overrides),
        "objective": final.value,
        "s_total": results.speedup(baseline.value, final.value, direction),
        "run_ids": list(final.run_ids),
        "config_hash": final.config_hash,
    }


def _curves(baseline: Any, best: Any, keys: List[str]) -> "OrderedDict[str, List[Any]]":
    """The loss curves plotted: the baseline's first run and, where another point won, the best's."""
    curves = OrderedDict([("baseline", baseline.losses.get(baseline.run_ids[0], []) if baseline.values else [])])
    if best is not None and best is not baseline:
        curves["best: " + " ".join(f"{k}={best.labels.get(k)}" for k in keys)] = best.losses.get(best.run_ids[0], [])
    return curves
