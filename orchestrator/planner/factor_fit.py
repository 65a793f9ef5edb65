"""Fitting the step-time model's factors to measured step times: the model of
:func:`orchestrator.planner.step_time.combine` over arrays of trials (:func:`array_model`), a
log-spaced grid search for the efficiencies and the latency (:func:`grid_fit`), and a
Levenberg-Marquardt polish of those and the host terms together (:func:`joint_fit`).
:mod:`orchestrator.planner.calibration` decides what is fitted and judges the result.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from orchestrator.planner.step_time import model

# the factors in the order the fit carries them; the host terms are fitted only where the trials
# can tell them (see ``calibration.calibrate``)
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

# a trial's step parts (``step_time.StepParts`` fields) that the model reads, one column each
COLUMNS = (
    "compute_s",
    "memory_s",
    "fsdp_host_s",
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
    "dp_gather_share",
    "gather_window_s",
    "reduce_window_s",
    "tp_layer_passes",
    "share",
    "tp_wait",
    "pp_wait",
    "dp_wait",
    "tp_lockstep",
    "dp_lockstep",
)


def array_model(c, ec, en, lat, layer, stage, hop, tp_layer):
    """:func:`step_time.model` over arrays of trials (and grids of factors): ``c`` maps each of
    ``COLUMNS`` to an array of the trials' step parts; (step times, predicted host_busy)."""
    import numpy as np

    with np.errstate(divide="ignore", invalid="ignore"):  # a factor driven to 0 by a step: refused by the fit
        r = model({**c, "host_async": c["host_async"] > 0}, ec, en, lat, layer, stage, hop, tp_layer, ops=np)
        return r["step"], r["host_busy"]


def log_residuals(c, y, busy, theta):
    """log(predicted / measured) of each trial's step time, then of its host_busy where measured
    (``busy`` NaN elsewhere): the fit weighs a trial's split between work and waiting as much as
    its time."""
    import numpy as np

    step, pred_busy = array_model(c, *theta)
    shape = np.broadcast_shapes(step.shape, np.shape(busy))
    known = np.isfinite(busy)
    r_busy = np.where(known, np.log(pred_busy / np.where(known, busy, 1.0)), 0.0)
    return np.log(step / y), np.broadcast_to(r_busy, shape)


def grid_fit(col, y, busy, host, configured, fit_comm: bool) -> Tuple[float, float, float]:
    """Compute efficiency, link efficiency and per-collective latency (s) by least squares on
    log(predicted / measured) of the step times and host_busy (:func:`log_residuals`) over a
    log-spaced grid, refined five times around its best point; the host terms held at ``host``.
    Without a communicating trial only the compute efficiency."""
    import numpy as np

    ec0, en0, lat0 = configured
    ranges = [(1e-4, 10.0, 81), (1e-4, 10.0, 25), (1e-7, 1e-1, 25)] if fit_comm else [(1e-4, 10.0, 161)]
    best = (ec0, en0, lat0)
    for _ in range(6):
        axes = [np.geomspace(lo, hi, n) for lo, hi, n in ranges]
        ec = axes[0][:, None, None]
        en = axes[1][None, :, None] if fit_comm else np.array(en0)
        lat = axes[2][None, None, :] if fit_comm else np.array(lat0)
        r_step, r_busy = log_residuals(col, y[:, None, None, None], busy[:, None, None, None], (ec, en, lat, *host))
        loss = (r_step**2).sum(axis=0) + (r_busy**2).sum(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        best = (float(axes[0][i]), float(axes[1][j]) if fit_comm else en0, float(axes[2][k]) if fit_comm else lat0)
        ranges = [
            (v / (hi / lo) ** (1 / (n - 1)), v * (hi / lo) ** (1 / (n - 1)), n) for v, (lo, hi, n) in zip(best, ranges)
        ]
    return best


def joint_fit(col, y, busy, value, names, host_fit, configured, prior_weight) -> Dict[str, float]:
    """``names`` polished together by Levenberg-Marquardt, each of ``host_fit`` held to its value in
    ``value`` by a weak prior (``prior_weight`` per unit of log ratio); the better of two starts."""
    import numpy as np

    flat = {k: v[:, 0, 0, 0] for k, v in col.items()}
    prior = np.array([math.log(value[k]) for k in host_fit])

    def residuals(*theta):
        v = {**value, **dict(zip(names, theta))}
        r_step, r_busy = log_residuals(flat, y, busy, tuple(v[k] for k in FACTORS))
        r = np.concatenate([r_step, r_busy[np.isfinite(busy)]])
        if not host_fit or prior_weight <= 0:
            return r
        own = np.log(np.array([v[k] for k in host_fit])) - prior
        return np.concatenate([r, prior_weight * own])

    # from the grid's best point and from the configured values: the grid fits the link terms with
    # the host terms at their defaults, so a large host term (TP's per layer) the grid had to
    # express as a slow link is found from the second start
    starts = [[value[k] for k in names], [configured.get(k, value[k]) for k in names]]
    polished = [polish(residuals, s0) for s0 in starts]
    best = min(polished, key=lambda t: float((residuals(*t) ** 2).sum()))
    # a factor the polish drove to its floor has no gradient left in log space to come back by,
    # though the fit may have passed its basin on the way (the step's max() of two bounds has
    # kinks): polished once more with those factors restarted at ten times their configured values
    floor = math.exp(-30.0)
    if any(v < floor for v in best):
        again = polish(residuals, [10 * configured.get(k, v) if v < floor else v for k, v in zip(names, best)])
        best = min((best, again), key=lambda t: float((residuals(*t) ** 2).sum()))
    return dict(zip(names, best))


def polish(residuals, start, iterations: int = 100):
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
