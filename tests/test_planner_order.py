"""The OVAT study's use of the planner (sweeps/ovat.py): each variable's candidates in the predicted order, and a
candidate skipped, never launched, when the planner predicts it slower than the incumbent by more than its own error
on what was measured so far. A decision rule: tested on a study whose measurements and predictions are planted
(differences no noise can hide), not on real speed."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Tuple

import pytest

from orchestrator.results import Point
from sweeps import ovat


class PlantedRunner:
    """The part of ovat.Runner that descend uses, over a table: assignment -> (predicted, measured) step time."""

    def __init__(self, table: Dict[Tuple[str, ...], Tuple[float, float]]):
        self.table = table
        self.points: Dict[Tuple[Tuple[str, str], ...], Point] = {}
        self.info = {"id": "s1"}
        self.experiment = "orchestrator"
        self.launched = self.reused = self.pruned = 0
        self.measured: List[Tuple[str, ...]] = []  # launch order

    def _values(self, assignment):
        return tuple(assignment.values())

    def point(self, assignment):
        key = tuple(assignment.items())
        if key not in self.points:
            p = Point(str(key), [f"{k}={v}" for k, v in assignment.items()])
            p.labels = dict(assignment)
            p.predicted_step_s = self.table[self._values(assignment)][0]
            self.points[key] = p
        return self.points[key]

    def no_effect(self, current, key):
        return None

    def measure(self, points):
        for p in points:
            if p.status != "pending":
                continue
            t = self.table[tuple(p.labels.values())][1]
            p.status, p.values, p.final_losses, p.run_ids = "finished", [t, t], [1.0, 1.0], ["r1", "r2"]
            self.launched += 2
            self.measured.append(tuple(p.labels.values()))


def _study(**kw) -> ovat.Study:
    variables = OrderedDict([("a", ["a0", "a1"]), ("b", ["b0", "b1", "b2", "b3"])])
    return ovat.Study(name="t", variables=variables, fixed=[], min_speedup=1.02, **kw)


# the planner's times are 10x the machine's (a constant factor it need not know) and right in ratio on the
# first batch (a0, a1); b1 is predicted 2x slower than the incumbent, b2 1.5x faster, b3 the same
TABLE = {
    ("a0", "b0"): (10.0, 1.0),
    ("a1", "b0"): (8.0, 0.8),  # a win: adopted, the incumbent
    ("a1", "b1"): (16.0, 1.6),
    ("a1", "b2"): (16 / 3, 0.55),
    ("a1", "b3"): (8.0, 0.8),
}


def test_a_candidate_predicted_slower_is_skipped_and_the_rest_run_fastest_first():
    runner = PlantedRunner(TABLE)
    data = ovat.descend(_study(), runner)
    assert ("a1", "b1") not in runner.measured  # never launched
    assert runner.measured == [("a0", "b0"), ("a1", "b0"), ("a1", "b2"), ("a1", "b3")]  # b2 (predicted best) first
    (skip,) = [r for r in data["rows"] if r["value"] == "b1"]
    assert skip["status"] == "skipped" and skip["decision"].startswith(
        "skipped, predicted slower: the planner's S=0.500"
    )
    assert data["trials"]["predicted_skips"] == 1 and any(
        s.startswith("b=b1: skipped, predicted") for s in data["skipped"]
    )
    assert data["final"]["assignment"] == {"a": "a1", "b": "b2"}
    assert data["planner_error"] == pytest.approx(
        10 / (16 / 3 / 0.55) - 1, rel=1e-9
    )  # b2's ratio is 3% off, the largest


def test_with_planner_skip_off_every_candidate_runs():
    runner = PlantedRunner(TABLE)
    data = ovat.descend(_study(planner_skip=False), runner)
    assert ("a1", "b1") in runner.measured and data["trials"]["predicted_skips"] == 0
    assert data["final"]["assignment"] == {"a": "a1", "b": "b2"}


def test_a_planner_that_was_wrong_on_the_measured_points_skips_nothing():
    table = dict(TABLE)
    table[("a1", "b0")] = (8.0, 2.4)  # predicted faster, measured 2.4x slower: the planner's error is 200%
    # the incumbent stays a0/b0; b1 is predicted 1.6x slower than it, within the planner's 3x error
    table.update({("a0", "b1"): (16.0, 1.6), ("a0", "b2"): (16 / 3, 0.6), ("a0", "b3"): (10.0, 1.0)})
    runner = PlantedRunner(table)
    data = ovat.descend(_study(), runner)
    assert ("a0", "b1") in runner.measured and data["trials"]["predicted_skips"] == 0
    assert ovat.model_error(list(runner.points.values())[:2], "step_time_median_s") == pytest.approx(2.0)
    assert data["final"]["assignment"] == {"a": "a0", "b": "b2"}


def _pt(pred, meas):
    p = Point("h")
    p.predicted_step_s, p.status, p.values = pred, "finished", [meas]
    return p


def test_the_planner_error_is_that_of_its_predicted_ratios():
    err = ovat.model_error
    assert err([_pt(1, 5)], "step_time_median_s") is None  # one point: no ratio yet
    assert err([_pt(1, 5), _pt(2, 10)], "step_time_median_s") == pytest.approx(0)  # a constant factor is no error
    assert err([_pt(1, 1), _pt(2, 1)], "step_time_median_s") == pytest.approx(1.0)
    assert err([_pt(None, 1), _pt(2, 1)], "step_time_median_s") is None  # not predicted
    assert err([_pt(1, 1), _pt(2, 1)], "final_loss") is None  # an objective the planner does not predict
    # tokens/s: the planner's rate is 1 / its step time
    rate = [_pt(1, 100.0), _pt(2, 50.0)]
    assert err(rate, "tokens_per_s_median") == pytest.approx(0)
    study = ovat.Study(
        name="t", variables=OrderedDict(), fixed=[], objective="tokens_per_s_median", direction="maximize"
    )
    s_pred, why = ovat.planner_verdict(_pt(4, 1), _pt(1, 1), study, 0.1)
    assert s_pred == pytest.approx(0.25) and why.startswith("skipped, predicted slower")


def test_a_candidate_measured_with_the_baseline_is_judged_on_its_measurement():
    table = dict(TABLE)
    # in the first batch: measured 1.6x slower, and predicted 4x slower (past the planner's error then):
    # its row is its measurement, a loss, not a skip
    table[("a1", "b0")] = (40.0, 1.6)
    table.update({("a0", "b1"): (16.0, 1.6), ("a0", "b2"): (16 / 3, 0.6), ("a0", "b3"): (10.0, 1.0)})
    runner = PlantedRunner(table)
    data = ovat.descend(_study(), runner)
    (row,) = [r for r in data["rows"] if r["variable"] == "a"]
    assert row["status"] == "finished" and row["decision"].startswith("no win") and row["n"] == 2
