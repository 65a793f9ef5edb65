"""Calibration: the step-time model's factors (compute efficiency, link efficiency, latency per
collective, and the host's fixed costs: per layer and micro-batch, per pipeline stage chunk and
micro-batch, per log2 step of a collective's group) fitted to measured trials, and judged on
trials it was not fitted to.

A fit's error on its own trials says little: with as many trials as factors it is ~0 by
construction. :func:`calibrate` therefore takes ``held_out`` trials too (other layouts, measured
the same way) and reports the fitted model's mean, median and largest relative error and the rank
correlation of its step times with the measured ones (Spearman's rho, Kendall's tau) on those
(:class:`HeldOut`); :func:`cross_validate` does the same leaving each layout out in turn.
``bench/plan_calibration.py`` prints both, ``tests/test_planner.py`` and
``tests/test_plan_calibration.py`` check them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig

from orchestrator.layout import layout
from orchestrator.planner.measured import MeasuredTrial
from orchestrator.planner.rank_stats import kendall_tau, spearman_rho
from orchestrator.planner.shapes import ModelShape, ParallelShape
from orchestrator.planner.step_time import HostCosts, StepParts, combine, step_parts


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


# the factors in the order the fit carries them; the host terms are fitted only where the trials
# can tell them (see calibrate)
FACTORS = (
    "compute_efficiency",
    "comm_efficiency",
    "collective_latency_us",
    "layer_host_us",
    "stage_host_us",
    "collective_hop_us",
    "tp_layer_host_us",
)
HOST_FACTORS = FACTORS[3:]  # in HostCosts' field order


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
    s = ParallelShape.of(cfg.parallel, cfg.trainer, layout(cfg))
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


def predict(cal: Calibration, cfg: DictConfig) -> float:
    """Step time of ``cfg`` with the calibrated factors."""
    return combine(trial_parts(cfg), *_factors(cal)).step_time_s


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

_COLUMNS = (
    "compute_s",
    "backward_s",
    "bubble",
    "tp_comm_s",
    "pp_comm_s",
    "dp_comm_s",
    "tp_calls",
    "pp_calls",
    "dp_calls",
    "tp_hops",
    "pp_hops",
    "dp_hops",
    "layer_passes",
    "stage_passes",
    "host_async",
    "overlap",
    "tp_layer_passes",
    "share",
)


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
    import numpy as np

    ec0, en0, lat0 = (
        float(planner.compute_efficiency),
        float(planner.comm_efficiency),
        float(planner.collective_latency_us) * 1e-6,
    )
    host0 = HostCosts.of(planner)
    host0_us = {k: float(planner[k]) for k in HOST_FACTORS}

    def result(ec, en, lat, host_us, fitted, n_runs, err, rho, runs):
        return Calibration(
            ec, en, lat * 1e6, len(fitted), n_runs, err, rho, runs, None, *(host_us[k] for k in HOST_FACTORS), fitted
        )

    if not trials:
        cal = result(ec0, en0, lat0, host0_us, [], 0, float("nan"), None, [])
        cal.heldout = evaluate(cal, held_out) if held_out else None
        return cal
    parts = [trial_parts(t.cfg) for t in trials]
    y = np.array([t.step_time_s for t in trials])
    col = {k: np.array([float(getattr(p, k)) for p in parts])[:, None, None, None] for k in _COLUMNS}
    fit_comm = bool((col["tp_calls"] + col["pp_calls"] + col["dp_calls"]).sum() > 0)
    h = (host0.layer_s, host0.stage_s, host0.hop_s, host0.tp_layer_s)
    best = _grid_fit(col, y, h, (ec0, en0, lat0), fit_comm)
    fitted = ["compute_efficiency"] + (["comm_efficiency", "collective_latency_us"] if fit_comm else [])
    host_fit = _host_terms(_host_shares(parts, *best, host0), host0_us, fit_comm, fit_host, len(trials) - len(fitted))
    value = dict(zip(FACTORS, (*best, *h)))
    if fit_comm or host_fit:
        configured = {"compute_efficiency": ec0, "comm_efficiency": en0, "collective_latency_us": lat0}
        fitted = fitted + host_fit
        value.update(_joint_fit(col, y, value, fitted, host_fit, configured, prior_weight))
    ec_b, en_b, lat_b = value["compute_efficiency"], value["comm_efficiency"], value["collective_latency_us"]
    host_us = {k: value[k] * 1e6 for k in HOST_FACTORS}
    host_b = HostCosts(*(value[k] for k in HOST_FACTORS))
    predicted = [combine(p, ec_b, en_b, lat_b, host_b).step_time_s for p in parts]
    errors, runs = _compare(trials, predicted)
    cal = result(
        ec_b,
        en_b,
        lat_b,
        host_us,
        [k for k in FACTORS if k in fitted],
        len(trials),
        statistics.median(errors),
        spearman_rho(predicted, [float(m) for m in y]),
        runs,
    )
    cal.heldout = evaluate(cal, held_out) if held_out else None
    return cal


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


def _array_model(c, ec, en, lat, layer, stage, hop, tp_layer):
    """``step_time.combine`` over arrays of trials (and grids of factors): ``c`` maps each of
    ``_COLUMNS`` to an array of the trials' step parts."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):  # a factor driven to 0 by a step: refused by the fit
        u = c["share"]
        compute = c["compute_s"] / ec / u
        layer_host = c["layer_passes"] * layer + c["tp_layer_passes"] * tp_layer
        busy = np.where(c["host_async"] > 0, np.maximum(compute, layer_host), compute + layer_host)
        pipeline = (busy + c["stage_passes"] * stage) * np.maximum(1.0 / (1.0 - c["bubble"]), u)
        wait = np.maximum(1.0, u)
        tp = wait * (c["tp_comm_s"] / en + c["tp_calls"] * lat + c["tp_hops"] * hop)
        pp = wait * (c["pp_comm_s"] / en + c["pp_calls"] * lat + c["pp_hops"] * hop)
        dp = wait * (c["dp_comm_s"] / en + c["dp_calls"] * lat + c["dp_hops"] * hop)
        exposed = dp - np.minimum(c["overlap"] * dp, c["backward_s"] / ec)
        return pipeline + tp + pp + exposed


def _grid_fit(col, y, host, configured, fit_comm: bool) -> Tuple[float, float, float]:
    """Compute efficiency, link efficiency and per-collective latency (s) by least squares on
    log(predicted / measured) over a log-spaced grid, refined five times around its best point;
    the host terms held at ``host``. Without a communicating trial only the compute efficiency."""
    import numpy as np

    ec0, en0, lat0 = configured
    ranges = [(1e-4, 10.0, 81), (1e-4, 10.0, 25), (1e-7, 1e-1, 25)] if fit_comm else [(1e-4, 10.0, 161)]
    best = (ec0, en0, lat0)
    for _ in range(6):
        axes = [np.geomspace(lo, hi, n) for lo, hi, n in ranges]
        ec = axes[0][:, None, None]
        en = axes[1][None, :, None] if fit_comm else np.array(en0)
        lat = axes[2][None, None, :] if fit_comm else np.array(lat0)
        loss = (np.log(_array_model(col, ec, en, lat, *host) / y[:, None, None, None]) ** 2).sum(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        best = (float(axes[0][i]), float(axes[1][j]) if fit_comm else en0, float(axes[2][k]) if fit_comm else lat0)
        ranges = [
            (v / (hi / lo) ** (1 / (n - 1)), v * (hi / lo) ** (1 / (n - 1)), n) for v, (lo, hi, n) in zip(best, ranges)
        ]
    return best


def _joint_fit(col, y, value, names, host_fit, configured, prior_weight) -> Dict[str, float]:
    """``names`` polished together by Levenberg-Marquardt, each of ``host_fit`` held to its value in
    ``value`` by a weak prior (``prior_weight`` per unit of log ratio); the better of two starts."""
    import numpy as np

    flat = {k: v[:, 0, 0, 0] for k, v in col.items()}
    prior = np.array([math.log(value[k]) for k in host_fit])

    def residuals(*theta):
        v = {**value, **dict(zip(names, theta))}
        r = np.log(_array_model(flat, *(v[k] for k in FACTORS)) / y)
        if not host_fit or prior_weight <= 0:
            return r
        own = np.log(np.array([v[k] for k in host_fit])) - prior
        return np.concatenate([r, prior_weight * own])

    # from the grid's best point and from the configured values: the grid fits the link terms with
    # the host terms at their defaults, so a large host term (TP's per layer) the grid had to
    # express as a slow link is found from the second start
    starts = [[value[k] for k in names], [configured.get(k, value[k]) for k in names]]
    polished = [_polish(residuals, s0) for s0 in starts]
    return dict(zip(names, min(polished, key=lambda t: float((residuals(*t) ** 2).sum()))))


def _polish(residuals, start, iterations: int = 100):
    """Levenberg-Marquardt steps in log-parameter space from the grid's best point: the grid
    finds the basin, these find its floor (a latency traded against a link efficiency along a
    shallow valley stays a few percent off on the grid alone)."""
    import numpy as np

    theta = np.log(np.array(start, dtype=float))

    def r(t):
        return residuals(*np.exp(t))

    cur, damping = r(theta), 1e-3
    for _ in range(iterations):
        h = 1e-6
        jac = np.stack([(r(theta + h * e) - r(theta - h * e)) / (2 * h) for e in np.eye(len(theta))], axis=1)
        grad, normal = jac.T @ cur, jac.T @ jac
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -grad)
        # a factor the trials do not constrain (a link no trial's time depends on) drifts along a
        # flat valley: held within e^-40 .. e^5, it stays a number
        nxt = np.clip(theta + step, -40.0, 5.0)
        trial = r(nxt)
        if np.isfinite(trial).all() and (trial**2).sum() < (cur**2).sum():
            theta, cur, damping = nxt, trial, max(damping / 10, 1e-12)
        else:
            damping *= 10
            if damping > 1e8:
                break
    return tuple(float(v) for v in np.exp(theta))


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
