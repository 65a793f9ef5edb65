"""A job resolves its trial once: the config filled (chip, Hugging Face folder), validated and
preflighted one time each, whichever way the job goes (a sweep's finished-before check, then the
start and the launch; a point the planner refuses; a point that breaks a rule). Before, a sweep
job filled its config four times, validated it twice and planned it twice (issue 45)."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator import filled, planner, trial
from tests.conftest import cli_in_process

pytestmark = pytest.mark.distributed


def test_a_sweep_job_fills_validates_and_plans_its_trial_once(tmp_path, monkeypatch, capfd):
    calls: Counter = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    # the trial's own fill, and the one a plan of a config not filled yet makes (planner.preflight)
    monkeypatch.setattr(trial, "fill", counted("fill", trial.fill))
    monkeypatch.setattr(filled, "fill", counted("fill", filled.fill))
    monkeypatch.setattr(trial, "validate", counted("validate", trial.validate))
    monkeypatch.setattr(planner, "preflight", counted("preflight", planner.preflight))

    # three jobs: one trains, one the planner refuses (a 70B in this host's memory), one breaks a
    # rule (3 TP ranks of 4 heads); with skip_finished (the default) each job first asks whether
    # its point finished before, which needs the resolved config's hash
    def sweep(points: str) -> Counter:
        calls.clear()
        code, _, err = cli_in_process(
            ["-m", "+chip=cpu", "trainer=smoke", "trainer.steps=2", "data.num_workers=0", points],
            tmp_path,
            monkeypatch,
            capfd,
        )
        assert code == 0, err[-3000:]
        return calls

    assert sweep("model=gpt_tiny,llama2_70b") == {"fill": 2, "validate": 2, "preflight": 2}, calls
    assert sweep("parallel.tp=3") == {"fill": 1, "validate": 1}, calls  # refused by a rule: never planned
