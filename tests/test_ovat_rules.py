"""OVAT's decision rules on planted points, never on what a loaded machine measures: a win must
beat the threshold and both points' noise, one repeat counts its own median interval, one outlying
step cannot inflate the noise, the quality gate, the coordinate descent's order and passes, and a
variable that cannot act on the incumbent skipped, not measured.
"""

from __future__ import annotations

import math

import pytest

from orchestrator.results import Point
from sweeps.ovat import Study, judge
from tests.conftest import TableRunner


def _study(**kw) -> Study:
    return Study(name="t", variables={"a": ["1", "2"]}, fixed=[], **kw)


def _point(values, final_losses, losses=(5.0, 3.0), status="finished") -> Point:
    p = Point("h", status=status)
    p.values, p.final_losses = list(values), list(final_losses)
    from orchestrator.results import diverged

    p.diverged = diverged(list(losses), final_losses[0] if final_losses else None)
    return p


def test_a_win_must_beat_the_threshold_and_both_points_noise():
    study = _study(min_speedup=1.05)
    base = _point([1.0, 1.0], [3.0, 3.0])
    assert judge(_point([0.90, 0.90], [3.0, 3.0]), base, base, study, 1.05)[0]  # S = 1.11
    assert not judge(_point([0.97, 0.97], [3.0, 3.0]), base, base, study, 1.05)[0]  # S = 1.03 < 1.05
    # S = 1.11, but the candidate's own repeats spread by 20%: not a measured win
    ok, why = judge(_point([0.8, 1.0], [3.0, 3.0]), base, base, study, 1.05)
    assert not ok and "no win" in why
    # maximize: S = value / value_incumbent
    up = _study(direction="maximize", min_speedup=1.05)
    assert judge(_point([1.2, 1.2], [3.0, 3.0]), base, base, up, 1.05)[0]
    assert not judge(_point([0.9, 0.9], [3.0, 3.0]), base, base, up, 1.05)[0]


def test_one_repeat_counts_its_own_median_interval_as_its_noise():
    """repeats=1: no spread of repeats to read; a run that recorded its median step time's 95%
    interval (step_time_ci_rel) brings that interval's width as the point's noise."""
    study = _study(min_speedup=1.05)
    base = _point([1.0], [3.0])
    assert base.spread == 0.0  # nothing recorded: no noise known, min_speedup alone
    candidate = _point([0.90], [3.0])  # S = 1.11
    assert judge(candidate, base, base, study, 1.05)[0]
    candidate.ci_rel = [0.08]  # its median known to +-8%: a 16% spread
    assert candidate.spread == pytest.approx(0.16)
    ok, why = judge(candidate, base, base, study, 1.05)
    assert not ok and "below 1.160" in why
    candidate.values.append(0.90)  # two repeats: their own spread again
    assert candidate.spread == 0.0


def _steps(median: float, n: int = 8, seed: int = 0, outliers=(4.7,)) -> list:
    """Planted step times: ``n`` steps around ``median`` (5% jitter), the last ones replaced by
    ``outliers`` seconds (a flush, a collection: one step of a short run on a loaded machine)."""
    import random

    rng = random.Random(seed)
    times = [median * (1 + rng.uniform(-0.05, 0.05)) for _ in range(n)]
    return times[: n - len(outliers)] + list(outliers)


def _run(times) -> Point:
    """A point of one finished run whose steps took ``times``, with what the trainer records."""
    import statistics

    from trainers import measure

    p = _point([statistics.median(times)], [3.0])
    p.ci_rel = [measure.relative_half_width(times)]
    p.se_rel = [measure.median_rel_se(times)]
    return p


@pytest.mark.parametrize("repeats", [1, 2, 3])
def test_one_outlying_step_cannot_inflate_the_noise(repeats):
    """Planted step times, each run with one 4.7 s step among 0.1-0.2 s ones: a true 2x change is
    adopted, a 1% one is not, with one repeat a point and with several. Before, the noise of one
    run was its median interval's width, which from 6-8 steps runs from the smallest step to the
    largest: a 1 s-scale outlier set the threshold to about 40x and no change could win."""
    study = _study(min_speedup=1.0)

    def point(median, seed):
        runs = [_run(_steps(median, seed=seed + 10 * r)) for r in range(repeats)]
        p = runs[0]
        for r in runs[1:]:
            p.values += r.values
            p.final_losses += r.final_losses
            p.se_rel += r.se_rel
            p.ci_rel += r.ci_rel
        return p

    base = point(0.2, 1)
    threshold = max(study.min_speedup, 1.0 + base.spread)
    assert threshold < 1.10, base.spread  # the outlier is not the noise, the jitter is
    twice = point(0.1, 2)
    ok, why = judge(twice, base, base, study, threshold)
    assert ok, why
    near = point(0.2 / 1.01, 3)
    ok, why = judge(near, base, base, study, threshold)
    assert not ok and "no win" in why, why
    if repeats == 1:  # the old rule, the interval's width, would have refused the 2x change
        old = 1.0 + 2.0 * max(base.ci_rel)
        assert old > 2.0, old


def test_the_quality_gate_rejects_fast_points_that_lose_quality():
    study = _study(loss_band=0.05)
    base = _point([1.0, 1.0], [3.0, 3.0])
    ok, why = judge(_point([0.5, 0.5], [3.3, 3.3]), base, base, study, 1.02)  # 10% worse loss
    assert not ok and "quality gate" in why
    ok, why = judge(_point([0.5, 0.5], [6.0, 6.0], losses=(5.0, 6.0)), base, base, study, 1.02)
    assert not ok and "diverged" in why
    ok, why = judge(_point([0.5, 0.5], [math.nan, math.nan], losses=(5.0, math.nan)), base, base, study, 1.02)
    assert not ok and "diverged" in why
    failed = _point([], [], status="oom")
    failed.reason = "CUDA out of memory"
    assert judge(failed, base, base, study, 1.02) == (False, "oom: CUDA out of memory")


def _table(**entries):
    return {tuple(sorted(dict(kv.split("=") for kv in k.split("__")).items())): v for k, v in entries.items()}


def test_coordinate_descent_adopts_winners_in_order_and_makes_another_pass():
    from sweeps.ovat import descend

    # b=2 only pays off once a=2 is adopted: the second pass finds it
    table = _table(
        **{
            "a=1__b=1": (1.0, 3.0),
            "a=2__b=1": (0.5, 3.0),
            "a=3__b=1": "infeasible",
            "a=2__b=2": (0.25, 3.0),
            "a=1__b=2": (1.5, 3.0),
            "a=3__b=2": (9.0, 3.0),
        }
    )
    study = Study(name="t", variables={"b": ["1", "2"], "a": ["1", "2", "3"]}, fixed=["+x=y"], passes=3)
    # b first: b=2 loses against a=1 (1.5 > 1.0); then a=2 wins; the second pass tries b=2 again
    runner = TableRunner(table)
    data = descend(study, runner)
    assert runner.batches[0] == [{"b": "1", "a": "1"}, {"b": "2", "a": "1"}]  # baseline + first variable
    assert data["final"]["assignment"] == {"b": "2", "a": "2"}
    assert data["final"]["overrides"] == ["+x=y", "b=2", "a=2"]
    assert data["final"]["s_total"] == pytest.approx(4.0)
    decisions = [(r["pass"], r["variable"], r["value"], r["adopted"]) for r in data["rows"]]
    assert decisions == [
        (0, "(baseline)", "b=1 a=1", False),
        (1, "b", "2", False),
        (1, "a", "2", True),
        (1, "a", "3", False),
        (2, "b", "2", True),
        (2, "a", "1", False),
        (2, "a", "3", False),
        (3, "b", "1", False),
        (3, "a", "1", False),
        (3, "a", "3", False),
    ]
    assert data["rows"][3]["decision"].startswith("infeasible")
    assert len(data["helped"]) == 2 and list(data["curves"]) == ["baseline", "a=2", "b=2"]


def test_a_failed_baseline_ends_the_study_with_nothing_adopted():
    from sweeps.ovat import descend

    runner = TableRunner(_table(**{"a=1": "oom", "a=2": (0.5, 3.0)}))
    data = descend(Study(name="t", variables={"a": ["1", "2"]}, fixed=[]), runner)
    assert data["outcome"] == "baseline_failed" and data["final"]["assignment"] == {"a": "1"}
    assert len(data["rows"]) == 1 and data["rows"][0]["decision"].startswith("oom")


def test_a_variable_without_effect_on_the_incumbent_is_skipped_not_measured():
    from sweeps.ovat import descend

    # "bucket" acts only once "dp" is 2 (DDP buckets need replicas): skipped on the baseline, so
    # never launched there; after dp=2 is adopted, the second pass measures it
    table = _table(
        **{
            "dp=1__bucket=25": (1.0, 3.0),
            "dp=2__bucket=25": (0.5, 3.0),
            "dp=2__bucket=100": (0.25, 3.0),
            "dp=1__bucket=100": (1.0, 3.0),
        }
    )
    inert = {"bucket": lambda cur: "no DDP buckets" if cur["dp"] == "1" else None}
    runner = TableRunner(table, inert)
    data = descend(Study(name="t", variables={"bucket": ["25", "100"], "dp": ["1", "2"]}, fixed=[], passes=2), runner)
    assert runner.batches[0] == [{"bucket": "25", "dp": "1"}]  # the baseline alone: bucket was inert
    skipped = [r for r in data["rows"] if r["status"] == "skipped"]
    assert [(r["pass"], r["variable"]) for r in skipped] == [(1, "bucket")]
    assert "no DDP buckets" in skipped[0]["decision"] and data["skipped"] == ["bucket: no DDP buckets"]
    assert data["final"]["assignment"] == {"bucket": "100", "dp": "2"}
    assert runner.batches[1] == [{"bucket": "25", "dp": "2"}]  # pass 1: dp only
