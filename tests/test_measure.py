"""``trainer.measure=adaptive``: a timing trial stops once its median step time is known.

The interval is checked against its promise (coverage of a known median), the loop's stop against
the rule (it fires once the interval is narrow, not before the warm-up and six timed steps, never
under ``fixed``), every rank stops at the same step in a launched dp2 trial, and the OVAT quality
gate compares trials that ran different numbers of steps at their common step.
"""

from __future__ import annotations

import random

import pytest

from orchestrator import trial
from orchestrator.results import Point, quality_gate
from tests.test_knobs import ONE, _train
from trainers import measure


def test_the_median_interval_is_the_order_statistics_around_the_middle():
    assert measure.median_interval([5.0] * 5) is None  # under MIN_TIMED: not trusted
    # n=10: P(B <= 1) = 11/1024 <= 0.025 < P(B <= 2) = 56/1024, so j = 2: x_2 and x_9 (97.9%)
    assert measure.median_interval([float(x) for x in range(10, 0, -1)]) == (2.0, 5.5, 9.0)
    # n=6: P(B <= 0) = 1/64 <= 0.025 < P(B <= 1): the extremes (96.9%)
    assert measure.median_interval([float(x) for x in range(1, 7)]) == (1.0, 3.5, 6.0)
    # n=100: P(B <= 39) = 0.018 <= 0.025 < P(B <= 40) = 0.028: x_40 and x_61
    assert measure.median_interval([float(x) for x in range(1, 101)]) == (40.0, 50.5, 61.0)
    assert measure.relative_half_width([2.0] * 8) == 0.0
    assert measure.enough([2.0] * 8, 0.01) and not measure.enough([2.0] * 5, 0.01)


@pytest.mark.parametrize("n", [6, 8, 10, 20, 60])
def test_the_interval_holds_the_true_median_at_least_95_percent_of_the_time(n):
    """A long right tail, as step times have on a shared machine: lognormal, median exactly 1."""
    rng = random.Random(n)
    trials = 4000
    held = 0
    for _ in range(trials):
        low, _, high = measure.median_interval([rng.lognormvariate(0.0, 0.5) for _ in range(n)])
        held += low <= 1.0 <= high
    assert held / trials >= 0.94  # the order-statistic interval is conservative: >= 95% less sampling noise


@pytest.mark.parametrize("n", [8, 20, 60])
def test_the_median_standard_error_is_the_spread_of_medians_and_ignores_an_outlier(n):
    """median_rel_se against the spread of the median over repeated samples (normal steps, 5%
    sigma): within 20% of it; one step 40x slower moves it by under 30%, where the order-statistic
    interval's half-width, from 8 steps, grows to cover it."""
    import statistics

    rng = random.Random(n)
    samples = [[rng.gauss(1.0, 0.05) for _ in range(n)] for _ in range(3000)]
    true_se = statistics.pstdev([statistics.median(s) for s in samples])
    estimated = statistics.median(measure.median_rel_se(s) for s in samples)
    assert estimated == pytest.approx(true_se, rel=0.2)
    clean = samples[0]
    spoiled = clean[:-1] + [40.0]
    assert measure.median_rel_se(spoiled) == pytest.approx(measure.median_rel_se(clean), rel=0.3)
    if n == 8:
        assert measure.relative_half_width(spoiled) > 10 * measure.relative_half_width(clean)
    assert measure.median_rel_se(clean[:5]) is None  # under MIN_TIMED


def test_adaptive_stops_once_the_median_is_known_and_fixed_runs_every_step(compose_cfg):
    steps = ["trainer.steps=30", "trainer.warmup_steps=2", "trainer.log_every=4"]
    # any interval is narrow enough: the stop comes at the first check, after 2 warm-up + 6 timed steps
    loose, rows = _train(compose_cfg, [*steps, "trainer.measure=adaptive", "trainer.measure_tolerance=100"])
    assert loose["steps_run"] == 2 + measure.MIN_TIMED == len(rows) == len(loose["losses"])
    assert [r["step"] for r in rows] == list(range(8))  # the last partial batch was flushed
    assert loose["step_time_ci_rel"] == pytest.approx(measure.relative_half_width([r["step_time_s"] for r in rows[2:]]))
    assert loose["step_time_se_rel"] == pytest.approx(measure.median_rel_se([r["step_time_s"] for r in rows[2:]]))
    fixed, rows = _train(compose_cfg, [*steps, "trainer.measure_tolerance=100"])
    assert fixed["steps_run"] == 30 == len(rows)
    assert fixed["losses"][:8] == loose["losses"]  # stopping early changes nothing before the stop


def test_an_adaptive_stop_is_never_taken_before_the_interval_is_trusted(compose_cfg):
    s, rows = _train(compose_cfg, ["trainer.steps=7", "trainer.warmup_steps=2", "trainer.measure=adaptive"])
    assert s["steps_run"] == 7  # 5 timed steps: fewer than MIN_TIMED, so the trial runs to trainer.steps
    assert s["step_time_ci_rel"] is None


@pytest.mark.distributed
def test_every_rank_stops_at_rank_0_s_step(compose_cfg):
    overrides = [
        *ONE,
        "parallel=dp2",
        "trainer.steps=40",
        "trainer.warmup_steps=1",
        "trainer.measure=adaptive",
        "trainer.measure_tolerance=100",
    ]
    result = trial.run(compose_cfg(overrides), overrides, progress=False)
    assert result["status"] == "finished", result.get("reason")  # a rank that went on would hang its peer
    assert result["summary"]["steps_run"] == 1 + measure.MIN_TIMED


def test_the_quality_gate_compares_runs_of_different_lengths_at_their_common_step():
    def point(*histories):
        p = Point("h", status="finished", values=[1.0] * len(histories))
        p.losses = {f"r{i}": list(h) for i, h in enumerate(histories)}
        p.final_losses = [h[-1] for h in histories]
        return p

    baseline = point([5.0, 4.0, 3.0, 2.0, 1.0])  # ran longer, so its final loss is lower
    short = point([5.0, 4.0, 3.0])
    assert quality_gate(short, baseline, 0.05) is None  # 3.0 vs 3.0 at step 3, not 3.0 vs 1.0
    worse = point([5.0, 4.0, 3.5])
    assert quality_gate(worse, baseline, 0.05) == ("rejected by the quality gate: loss at step 3 3.5 outside 3 +/- 5%")
    same_length = point([5.0, 4.0, 3.0, 2.0, 1.2])
    assert "final loss 1.2 outside 1 +/- 5%" in quality_gate(same_length, baseline, 0.05)


def test_an_adaptive_study_measures_to_half_its_smallest_win():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from sweeps.ovat import parse_study

    parser = OverridesParser.create()
    spec = {"params": {"trainer.micro_batch": "2,8"}, "objective": "step_time_median_s", "min_speedup": 1.04}
    spec["direction"] = "minimize"
    adaptive = parse_study(spec, ["trainer.measure=adaptive"], parser, "s")
    assert adaptive.fixed == ["trainer.measure=adaptive", "trainer.measure_tolerance=0.02"]
    chosen = parse_study(spec, ["trainer.measure=adaptive", "trainer.measure_tolerance=0.1"], parser, "s")
    assert chosen.fixed == ["trainer.measure=adaptive", "trainer.measure_tolerance=0.1"]  # the user's own
    assert parse_study(spec, [], parser, "s").fixed == []  # fixed measuring: nothing added
    no_win = dict(spec, min_speedup=1.0)  # no smallest win to halve: the default tolerance holds
    assert parse_study(no_win, ["trainer.measure=adaptive"], parser, "s").fixed == ["trainer.measure=adaptive"]
    quoted = parse_study(spec, ["trainer.measure='adaptive'"], parser, "s")  # the parsed value, however spelled
    assert quoted.fixed == ["trainer.measure='adaptive'", "trainer.measure_tolerance=0.02"]
