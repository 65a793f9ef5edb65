"""Calibration: the step-time model's factors (compute efficiency, link efficiency, latency per
collective, and the host's fixed costs: per layer and micro-batch, per pipeline stage chunk and
micro-batch, per log2 step of a collective's group) fitted to measured trials, and judged on
trials it was not fitted to.

A fit's error on its own trials says little: with as many trials as factors it is ~0 by
construction. :func:`calibrate` therefore takes ``held_out`` trials too (other layouts, measured
the same way) and reports the fitted model's mean, median and largest relative error and the rank
correlation of its step times with the measured ones (Spearman's rho, Kendall's tau) on those
(:class:`HeldOut`); :func:`cross_validate` does the same leaving each layout out in turn.
``bench/plan_calibration.py`` prints both, ``tests/test_planner_step_time.py`` and
``tests/test_plan_calibration.py`` check them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig

from orchestrator.layout import layout
from orchestrator.planner import factor_fit
from orchestrator.planner.factor_fit import FACTORS, HOST_FACTORS
from orchestrator.planner.measured import MeasuredTrial
from orchestrator.planner.rank_stats import kendall_tau, spearman_rho
from orchestrator.planner.shapes import ModelShape, ParallelShape
from orchestrator.planner.step_time import HostCosts, StepEstimate, StepParts, combine, step_parts


@dataclass
class HeldOut:
    """The fitted model against trials it was not fitted to."""

    n_runs: int
    median_abs_rel_error: float
    max_abs_rel_error: float
    spearman_rho: Optional[float]  # None below two runs
    runs: List[Dict[str, Any]] = field(default_factory=list)
    mean_abs_rel_error: float = float("nan")
    kendall_tau: Optional[float] = None  # tau-b; None below two runs


@dataclass
class Calibration:
    compute_efficiency: float
    comm_efficiency: float
    collective_latency_us: float
    n_fitted: int  # factors fitted (the rest kept as configured)
    n_runs: int  # trials fitted to
    median_abs_rel_error: float  # on the trials fitted to (in-sample: optimistic)
    spearman_rho: Optional[float]  # on the trials fitted to
    runs: List[Dict[str, Any]] = field(default_factory=list)
    heldout: Optional[HeldOut] = None  # on the held-out trials, when some were given
    layer_host_us: float = 0.0
    stage_host_us: float = 0.0
    collective_hop_us: float = 0.0
    tp_layer_host_us: float = 0.0
    fitted: List[str] = field(default_factory=list)  # names (FACTORS) of the fitted factors

    def values(self) -> Dict[str, float]:
        """The planner keys this calibration sets, ``planner.KEY -> value``."""
        return {k: float(getattr(self, k)) for k in FACTORS}

    def apply(self, planner: DictConfig) -> None:
        """Write every factor into a planner section (what ``--calibrate`` plans with)."""
        for key, value in self.values().items():
            setattr(planner, key, value)


def layout_name(cfg: DictConfig) -> str:
    return layout(cfg).name


def trial_parts(cfg: DictConfig) -> StepParts:
    m = ModelShape.of(cfg.model)
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg), str(cfg.chip.device_type))
    return step_parts(m, s, cfg.precision, cfg.comm, cfg.chip, cfg.planner)


def _factors(cal: Calibration) -> Tuple[float, float, float, HostCosts]:
    host = HostCosts(*(getattr(cal, k) * 1e-6 for k in HOST_FACTORS))
    return cal.compute_efficiency, cal.comm_efficiency, cal.collective_latency_us * 1e-6, host


def _compare(trials: Sequence[MeasuredTrial], predicted: Sequence[float]) -> Tuple[List[float], List[Dict[str, Any]]]:
    errors = [abs(p - t.step_time_s) / t.step_time_s for t, p in zip(trials, predicted)]
    runs = [
        {
            "run_id": t.run_id,
            "layout": layout_name(t.cfg),
            "measured_s": float(t.step_time_s),
            "predicted_s": float(p),
            "rel_error": float(e),
        }
        for t, p, e in zip(trials, predicted, errors)
    ]
    return errors, runs


def estimate(cal: Calibration, cfg: DictConfig) -> StepEstimate:
    """The step-time model's estimate of ``cfg`` with the calibrated factors."""
    return combine(trial_parts(cfg), *_factors(cal))


def predict(cal: Calibration, cfg: DictConfig) -> float:
    """Step time of ``cfg`` with the calibrated factors."""
    return estimate(cal, cfg).step_time_s


def _held_out(trials: Sequence[MeasuredTrial], predicted: List[float]) -> HeldOut:
    """Mean, median and largest relative error, Spearman's rho and Kendall's tau of ``predicted``
    against ``trials``."""
    if not trials:
        return HeldOut(0, float("nan"), float("nan"), None)
    errors, runs = _compare(trials, predicted)
    measured = [t.step_time_s for t in trials]
    return HeldOut(
        len(trials),
        statistics.median(errors),
        max(errors),
        spearman_rho(predicted, measured),
        runs,
        statistics.fmean(errors),
        kendall_tau(predicted, measured),
    )


def evaluate(cal: Calibration, trials: Sequence[MeasuredTrial]) -> HeldOut:
    """Mean, median and largest relative error, Spearman's rho and Kendall's tau of ``cal``'s
    predictions on ``trials``."""
    return _held_out(trials, [predict(cal, t.cfg) for t in trials])


def split_by_layout(
    trials: Sequence[MeasuredTrial], held_out: Sequence[str]
) -> Tuple[List[MeasuredTrial], List[MeasuredTrial]]:
    """(trials to fit, trials to hold out): those whose ``dpXtpYppZ`` layout is in ``held_out``."""
    names = set(held_out)
    return ([t for t in trials if layout_name(t.cfg) not in names], [t for t in trials if layout_name(t.cfg) in names])


# the host terms' prior: residual weight per unit of log(value / configured value), so a term the
# trials barely constrain stays near its documented assumption (a factor of 10 away costs as much
# as a ~11% misfit of one trial at 0.05)
PRIOR_WEIGHT = 0.05
# a host term is fitted when, at its configured value, it makes at least this share of some
# trial's predicted step time (and there are more trials than factors); below, it keeps its value
HOST_SHARE = 0.02


def _host_shares(parts: Sequence[StepParts], ec: float, en: float, lat: float, host: HostCosts) -> Dict[str, float]:
    """The largest share of a trial's predicted step time each host term makes at these values."""
    from dataclasses import replace

    out = {}
    for key, off in (
        ("layer_host_us", replace(host, layer_s=0.0)),
        ("stage_host_us", replace(host, stage_s=0.0)),
        ("collective_hop_us", replace(host, hop_s=0.0)),
        ("tp_layer_host_us", replace(host, tp_layer_s=0.0)),
    ):
        share = 0.0
        for p in parts:
            full = combine(p, ec, en, lat, host).step_time_s
            if full > 0:
                share = max(share, (full - combine(p, ec, en, lat, off).step_time_s) / full)
        out[key] = share
    return out


def calibrate(
    trials: Sequence[MeasuredTrial],
    planner: DictConfig,
    held_out: Sequence[MeasuredTrial] = (),
    prior_weight: float = PRIOR_WEIGHT,
    fit_host: Union[bool, str] = True,
) -> Calibration:
    """Fit the step-time model's factors to measured step times: the compute efficiency, the link
    efficiency and the per-collective latency by least squares on log(predicted / measured) over
    a log-spaced grid, refined five times; then, with the host's fixed costs (per layer and
    micro-batch, per stage chunk and micro-batch, per log2 step of a collective) that the trials
    can tell, all of them polished together by Levenberg-Marquardt, each host term held to its
    configured value by a weak prior (``prior_weight`` per unit of log ratio). Reports the fitted
    model's median absolute relative error and Spearman's rho on the same trials and, apart, on
    the ``held_out`` ones (:func:`evaluate`).

    What the trials cannot tell keeps its configured value: without any communicating run, only
    the compute efficiency is fitted; a host term only when it makes at least ``HOST_SHARE`` of
    some trial's predicted time at its configured value and there are more trials than factors
    (``fit_host=False``: never; ``fit_host="all"``: each one some trial has a count of, whatever
    its share at the configured value, for trial sets made to vary them, as
    ``bench/plan_calibration.py``'s). With as many trials as fitted factors the in-sample error is
    near zero by construction: judge the model on the held-out figures."""
    if not trials:
        raise ValueError("calibrate: no measured trial to fit to")
    parts = [trial_parts(t.cfg) for t in trials]
    measured = [float(t.step_time_s) for t in trials]
    # a CPU trial's measured host_busy tells its work from its waits; an accelerator's host runs
    # ahead of its device, so there the figure says nothing the model predicts
    busy = [float(t.host_busy) if t.host_busy and not p.host_async else float("nan") for t, p in zip(trials, parts)]
    value, fitted = _fit(parts, measured, busy, planner, fit_host, prior_weight)
    cal = Calibration(
        value["compute_efficiency"],
        value["comm_efficiency"],
        value["collective_latency_us"] * 1e6,
        len(fitted),
        len(trials),
        float("nan"),
        None,
        fitted=[k for k in FACTORS if k in fitted],
        **{k: value[k] * 1e6 for k in HOST_FACTORS},
    )
    host = HostCosts(*(value[k] for k in HOST_FACTORS))
    fitted_factors = (value["compute_efficiency"], value["comm_efficiency"], value["collective_latency_us"], host)
    predicted = [combine(p, *fitted_factors).step_time_s for p in parts]
    errors, cal.runs = _compare(trials, predicted)
    cal.median_abs_rel_error = statistics.median(errors)
    cal.spearman_rho = spearman_rho(predicted, measured)
    cal.heldout = evaluate(cal, held_out) if held_out else None
    return cal


def _configured(planner: DictConfig, latency_s: float) -> Dict[str, float]:
    """The factors as ``planner`` configures them, by name (FACTORS), the latency and the host
    terms in seconds; ``latency_s`` the trials' own (the chip's, where the planner sets none)."""
    from dataclasses import astuple

    configured = (float(planner.compute_efficiency), float(planner.comm_efficiency))
    return dict(zip(FACTORS, (*configured, latency_s, *astuple(HostCosts.of(planner)))))


def _fit(
    parts: Sequence[StepParts],
    measured: Sequence[float],
    busy: Sequence[float],
    planner: DictConfig,
    fit_host: Union[bool, str],
    prior_weight: float,
) -> Tuple[Dict[str, float], List[str]]:
    """The factors fitted to the ``measured`` step times of trials with step parts ``parts`` (by
    name, the latency and host terms in seconds; the rest as configured) and the names of those
    fitted: the grid first, then the Levenberg-Marquardt polish where there is more to fit."""
    import numpy as np

    configured = _configured(planner, parts[0].latency_s)
    y, b = np.array(measured), np.array(busy)
    col = {k: np.array([float(getattr(p, k)) for p in parts])[:, None, None, None] for k in factor_fit.COLUMNS}
    fit_comm = bool((col["tp_calls"] + col["pp_calls"] + col["dp_calls"]).sum() > 0)
    host = tuple(configured[k] for k in HOST_FACTORS)
    best = factor_fit.grid_fit(col, y, b, host, tuple(configured[k] for k in FACTORS[:3]), fit_comm)
    fitted = ["compute_efficiency"] + (["comm_efficiency", "collective_latency_us"] if fit_comm else [])
    shares = _host_shares(parts, *best, HostCosts(*host))
    host_us = {k: configured[k] * 1e6 for k in HOST_FACTORS}
    host_fit = _host_terms(shares, host_us, fit_comm, fit_host, len(parts) - len(fitted))
    value = dict(zip(FACTORS, (*best, *host)))
    if fit_comm or host_fit:
        fitted += host_fit
        value.update(factor_fit.joint_fit(col, y, b, value, fitted, host_fit, configured, prior_weight))
    return value, fitted


def _host_terms(
    shares: Dict[str, float], host0_us: Dict[str, float], fit_comm: bool, fit_host: Union[bool, str], room: int
) -> List[str]:
    """The host terms :func:`calibrate` fits: those configured non-zero that make at least
    ``HOST_SHARE`` of some trial's time (any share with ``fit_host="all"``), the heaviest first,
    as many as ``room`` (trials less factors already fitted) leaves beside one degree of freedom."""
    if not fit_host:
        return []
    if not fit_comm:  # no collective at all: the hop term has nothing to act on
        shares = {**shares, "collective_hop_us": 0.0}
    floor = 0.0 if fit_host == "all" else HOST_SHARE
    candidates = [k for k in HOST_FACTORS if host0_us[k] > 0 and shares[k] > 0 and shares[k] >= floor]
    keep = len(HOST_FACTORS) if fit_host == "all" else max(0, room - 1)
    return sorted(candidates, key=lambda k: -shares[k])[:keep]


def cross_validate(trials: Sequence[MeasuredTrial], planner: DictConfig, **fit: Any) -> HeldOut:
    """Leave one layout out: for each layout among ``trials``, fit to the trials of the other
    layouts and predict its own; the errors and the ranking of all those predictions. What
    ``python -m orchestrator.plan --calibrate`` reports beside the fit's in-sample error."""
    names = sorted({layout_name(t.cfg) for t in trials})
    if len(names) < 2:
        return HeldOut(0, float("nan"), float("nan"), None)
    held_all: List[MeasuredTrial] = []
    predicted: List[float] = []
    for name in names:
        fit_set, held = split_by_layout(trials, [name])
        cal = calibrate(fit_set, planner, **fit)
        held_all += held
        predicted += [predict(cal, t.cfg) for t in held]
    return _held_out(held_all, predicted)
