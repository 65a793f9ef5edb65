"""The step-time model on a CPU host its workers share (orchestrator/planner/cpu_host.py and
step_time.combine): one TP group's waits idle the host's cores, two groups fill each other's, a
group with every worker in it idles them all; an accelerator is untouched; and the calibration
fits the trainer's measured host_busy beside the step time. Measured on the 2-core host
(bench/plan_calibration.py, gpt_mini, two runs): tp2 kept 79-81% of it busy at 0.80-0.88 s a
step, tp2pp2 89-90% at 0.73-0.77 s, tp4 76-77% at 1.62-1.75 s."""

from __future__ import annotations

import pytest
from planner_cases import DEFAULTS
from test_plan_calibration import TRUTH, cpu_config, planted

from orchestrator import chips, planner
from orchestrator.planner.calibration import HOST_FACTORS
from orchestrator.planner.step_time import HostCosts

HOST = HostCosts(*(TRUTH[k] * 1e-6 for k in HOST_FACTORS))
FACTORS = (TRUTH["compute_efficiency"], TRUTH["comm_efficiency"], TRUTH["collective_latency_us"] * 1e-6, HOST)


def _est(preset: str, chip: str = "cpu"):
    cfg = cpu_config(preset, {})
    cfg.chip = chips.load_preset(chip)
    parts = planner.trial_parts(cfg)
    return parts, planner.combine(parts, *FACTORS)


def _work(parts) -> float:
    """A rank's busy time on the CPU: its compute at its threads' speed and its host costs."""
    return (
        parts.compute_s / FACTORS[0] / parts.share
        + parts.layer_passes * HOST.layer_s
        + parts.tp_layer_passes * HOST.tp_layer_s
        + parts.stage_passes * HOST.stage_s
    )


def test_one_tp_group_leaves_the_host_idle_while_it_waits():
    parts, est = _est("tp2")  # two workers, a core each, both in the one TP group
    assert parts.share == 1.0 and parts.tp_wait == 1.0 and parts.tp_lockstep == 1.0
    assert est.step_time_s == pytest.approx(_work(parts) + est.tp_comm_s)
    assert est.host_busy == pytest.approx(_work(parts) / est.step_time_s) and est.host_busy < 0.9


def test_two_tp_groups_fill_each_other_s_waits():
    """tp2pp2: four single-thread workers on two cores, a TP group per stage. While one group
    waits on its all-reduce the other computes: the step is the cores' work (busy 100%), shorter
    than tp2's, as measured; the old rule (every worker's work and waits, u times) made it
    as slow as tp2 or slower."""
    parts, est = _est("tp2pp2")
    assert parts.share == 2.0 and parts.tp_wait == 1.0 and parts.tp_lockstep == 0.0
    assert est.step_time_s == pytest.approx(parts.share * _work(parts))
    assert est.host_busy == pytest.approx(1.0)
    assert est.step_time_s < parts.share * (_work(parts) + est.tp_comm_s + est.pp_comm_s)
    assert est.step_time_s < _est("tp2")[1].step_time_s


def test_a_group_of_every_worker_idles_the_host_while_it_waits():
    """tp4 on two cores: each collective waits for all four workers, scheduled two at a time, and
    no one is left to run meanwhile: the step is at least the cores' work plus the waits."""
    parts, est = _est("tp4")
    assert parts.share == 2.0 and parts.tp_wait == 2.0 and parts.tp_lockstep == 1.0
    assert est.step_time_s >= parts.share * _work(parts) + est.tp_comm_s / parts.tp_wait - 1e-12
    assert est.host_busy < 1.0


def test_an_accelerator_s_step_is_its_critical_path():
    """On an accelerator every factor is neutral: busy / (1 - bubble) plus the communication."""
    parts, est = _est("tp2pp2", "a100_80gb")
    assert (parts.share, parts.tp_wait, parts.pp_wait, parts.dp_wait) == (1.0, 1.0, 1.0, 1.0)
    assert parts.tp_lockstep == parts.dp_lockstep == 0.0
    comm = est.tp_comm_s + est.pp_comm_s + est.dp_exposed_s
    assert est.step_time_s == pytest.approx(est.compute_s + est.host_s + comm)


def test_the_fit_follows_the_measured_host_busy():
    """The same planted step times with their true host_busy give the planted factors back; with
    a host_busy that says the ranks worked 15% less (waited more), the fit moves the split: a
    longer collective latency, a shorter TP layer's work. So the measurement enters the fit."""
    trials = planted(0, 0.0)
    true = planner.calibrate(trials, DEFAULTS.planner, prior_weight=0.0, fit_host="all")
    assert true.collective_latency_us == pytest.approx(TRUTH["collective_latency_us"], rel=0.01)
    assert true.tp_layer_host_us == pytest.approx(TRUTH["tp_layer_host_us"], rel=0.01)
    for t in trials:
        t.host_busy *= 0.85
    idler = planner.calibrate(trials, DEFAULTS.planner, prior_weight=0.0, fit_host="all")
    assert idler.collective_latency_us > 1.2 * true.collective_latency_us
    assert idler.tp_layer_host_us < true.tp_layer_host_us
