"""Fitting the step-time model's factors to measured step times: the model of
:func:`orchestrator.planner.step_time.combine` over arrays of trials (:func:`array_model`), a
log-spaced grid search for the efficiencies and the latency (:func:`grid_fit`), and a
Levenberg-Marquardt polish of those and the host terms together (:func:`joint_fit`).
:mod:`orchestrator.planner.calibration` decides what is fitted and judges the result.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

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

# a trial's step parts (``step_time.StepParts`` fields) that the array model reads, one column each
COLUMNS = (
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


def array_model(c, ec, en, lat, layer, stage, hop, tp_layer):
    """``step_time.combine`` over arrays of trials (and grids of factors): ``c`` maps each of
    ``COLUMNS`` to an array of the trials' step parts."""
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


def grid_fit(col, y, host, configured, fit_comm: bool) -> Tuple[float, float, float]:
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
        loss = (np.log(array_model(col, ec, en, lat, *host) / y[:, None, None, None]) ** 2).sum(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        best = (float(axes[0][i]), float(axes[1][j]) if fit_comm else en0, float(axes[2][k]) if fit_comm else lat0)
        ranges = [
            (v / (hi / lo) ** (1 / (n - 1)), v * (hi / lo) ** (1 / (n - 1)), n) for v, (lo, hi, n) in zip(best, ranges)
        ]
    return best


def joint_fit(col, y, value, names, host_fit, configured, prior_weight) -> Dict[str, float]:
    """``names`` polished together by Levenberg-Marquardt, each of ``host_fit`` held to its value in
    ``value`` by a weak prior (``prior_weight`` per unit of log ratio); the better of two starts."""
    import numpy as np

    flat = {k: v[:, 0, 0, 0] for k, v in col.items()}
    prior = np.array([math.log(value[k]) for k in host_fit])

    def residuals(*theta):
        v = {**value, **dict(zip(names, theta))}
        r = np.log(array_model(flat, *(v[k] for k in FACTORS)) / y)
        if not host_fit or prior_weight <= 0:
            return r
        own = np.log(np.array([v[k] for k in host_fit])) - prior
        return np.concatenate([r, prior_weight * own])

    # from the grid's best point and from the configured values: the grid fits the link terms with
    # the host terms at their defaults, so a large host term (TP's per layer) the grid had to
    # express as a slow link is found from the second start
    starts = [[value[k] for k in names], [configured.get(k, value[k]) for k in names]]
    polished = [polish(residuals, s0) for s0 in starts]
    return dict(zip(names, min(polished, key=lambda t: float((residuals(*t) ** 2).sum()))))


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
