"""The automatic search's decisions (``sweeps/auto.py``) on planted timings: the stop rule, the
pruning a failure implies, and the refit that re-ranks what is left. No machine's timings: each
"measurement" is a planted step time, so the rules are tested, not which config a loaded machine
happens to run faster. The candidates are real points of the planner's space
(``orchestrator.planner.plan_space``), where one is needed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from orchestrator.planner.space import Candidate
from sweeps.auto import Entry, Search, implied_by_oom, mean_abs_error, ratio_refit, summary


def cand(dp=1, tp=1, pp=1, mb=1, m=1, schedule="1f1b", v=1, ckpt=False, shard="ddp", sp=False) -> Candidate:
    return Candidate(dp, tp, pp, mb, m, schedule, v, ckpt, shard, sp)


def planted(n: int = 12, bias: float = 2.0):
    """n candidates whose true step times are 1.0, 1.1, 1.2, ... s, predicted ``bias`` times too
    fast, in a slightly wrong order (each neighbouring pair swapped by the planner)."""
    truth = {}
    ranked = []
    for i in range(n):
        c = cand(dp=1, tp=1, pp=1, mb=i + 1)
        truth[c] = 1.0 + 0.1 * i
        j = i ^ 1  # swap neighbours: 1, 0, 3, 2, ...
        ranked.append((c, (1.0 + 0.1 * j) / bias))
    ranked.sort(key=lambda x: x[1])
    return ranked, truth


def measure_with(search: Search, truth, cost=10.0):
    """A runner for ``search``: each entry's planted step time, at ``cost`` trial-seconds."""

    def measure(batch):
        for e in batch:
            search.record(e, truth[e.candidate], trial_s=cost)

    return measure


def test_ths_finds_the_best_and_stops_before_measuring_everything():
    ranked, truth = planted(12)
    s = Search.of(ranked, batch=2, threshold=1.03)
    reason = s.run(measure_with(s, truth))
    best = s.best()
    assert best.measured_s == pytest.approx(1.0)  # the true best, though the planner ranked it second
    assert s.trials() < 12 / 2, s.log  # it stopped early
    assert "no unmeasured candidate can win" in reason
    # the refit learned the planner's 2x bias: what is left is predicted near its truth
    for e in s.pending():
        assert e.corrected_s == pytest.approx(truth[e.candidate], rel=0.15)


def test_a_planner_that_measures_badly_is_not_trusted_to_stop():
    """The same space twice: once the planner's ratio to the truth is steady, once it is off by
    up to 2x on the points measured. The first stops after a batch or two; the second, crediting
    every unmeasured candidate with its large measured error, keeps measuring."""
    ranked, truth = planted(12)
    steady = Search.of(ranked, batch=2, threshold=1.03)
    steady.run(measure_with(steady, truth))
    noisy_truth = {c: t * (2.0 if i % 3 == 1 else 1.0) for i, (c, t) in enumerate(truth.items())}
    noisy = Search.of(ranked, batch=2, threshold=1.03)
    noisy.run(measure_with(noisy, noisy_truth))
    assert noisy.error > steady.error
    assert noisy.trials() > steady.trials(), (noisy.log, steady.log)


def test_without_a_second_measurement_the_error_is_unknown_and_it_does_not_stop():
    ranked, truth = planted(4)
    s = Search.of(ranked, batch=1)
    s.update()
    batch = s.next_batch()
    s.record(batch[0], truth[batch[0].candidate])
    s.update()
    assert s.error == math.inf and s.stop_reason() is None  # one point says nothing of the error
    assert len(s.next_batch()) == 1


def test_budgets_stop_ths():
    ranked, truth = planted(12)
    s = Search.of(ranked, batch=4, max_trials=5, threshold=1e-6)  # the rule never stops it
    reason = s.run(measure_with(s, truth))
    assert s.trials() == 5 and "max_trials=5" in reason
    s = Search.of(ranked, batch=2, max_trial_seconds=35.0, threshold=1e-6)
    reason = s.run(measure_with(s, truth, cost=10.0))
    assert s.trial_seconds() == 40.0 and "max_trial_seconds" in reason


def test_an_out_of_memory_trial_prunes_what_needs_more():
    base = cand(dp=2, tp=2, pp=1, mb=2)
    assert implied_by_oom(base, replace(base, micro_batch=4))  # larger micro-batch
    assert implied_by_oom(base, base)
    assert not implied_by_oom(base, replace(base, micro_batch=1))  # smaller: may fit
    assert not implied_by_oom(base, replace(base, activation_checkpointing=True))  # recomputes
    assert not implied_by_oom(base, replace(base, dp_shard="fsdp"))  # shards the replicas
    assert not implied_by_oom(base, replace(base, sequence_parallel=True))  # shards activations
    assert not implied_by_oom(base, replace(base, tp=4, dp=1))  # another layout
    ckpt_fsdp = replace(base, activation_checkpointing=True, dp_shard="fsdp", sequence_parallel=True)
    assert implied_by_oom(ckpt_fsdp, base)  # the one that kept more than the failed one
    # pipelines: GPipe keeps the whole replica batch whatever the split; 1F1B p - rank microbatches
    gp = cand(dp=1, tp=1, pp=2, mb=2, m=4, schedule="gpipe")
    assert not implied_by_oom(gp, replace(gp, micro_batch=4, microbatches=2))
    fb = cand(dp=1, tp=1, pp=2, mb=2, m=8)
    assert implied_by_oom(fb, replace(fb, micro_batch=4, microbatches=4))
    assert not implied_by_oom(fb, replace(fb, micro_batch=16, microbatches=1))  # no longer fills it

    s = Search.of([(base, 1.0), (replace(base, micro_batch=4), 0.9), (replace(base, micro_batch=1), 1.2)])
    s.update()
    first = s.next_batch()[0]
    assert first.candidate.micro_batch == 4
    s.record(first, None, status="oom", reason="CUDA out of memory")
    pruned = [e for e in s.entries if e.status == "pruned"]
    assert [e.candidate.micro_batch for e in pruned] == [] and first.status == "oom"
    # the mb=2 point fails too: nothing with mb >= 2 is left, mb=1 still is
    s.record(s.entries[0], None, status="oom")
    assert [e.candidate.micro_batch for e in s.pending()] == [1]
    # a crash rules out that point only
    s2 = Search.of([(base, 1.0), (replace(base, micro_batch=4), 0.9)])
    s2.record(s2.entries[0], None, status="crash", reason="segfault")
    assert [e.status for e in s2.entries] == ["crash", "pending"]


def test_an_oom_prunes_the_larger_pending_points():
    base = cand(dp=2, tp=2, pp=1, mb=2)
    entries = [(replace(base, micro_batch=b), 1.0 / b) for b in (1, 2, 4, 8)]
    s = Search.of(entries)
    s.record(s.entries[1], None, status="oom")  # mb=2 ran out of memory
    assert {e.candidate.micro_batch: e.status for e in s.entries} == {1: "pending", 2: "oom", 4: "pruned", 8: "pruned"}
    assert any("pruned" in line for line in s.log)


def test_the_refit_reranks_by_what_was_measured():
    """Two families the planner gets wrong in opposite directions: a refit that only scales
    cannot fix that, but the error it measures keeps the search going until the truly best is
    measured; with the ratio refit, the corrected predictions of the family measured follow it."""
    a = [entry(cand(tp=2, mb=b), predicted=1.0 + 0.01 * b) for b in (1, 2, 3)]
    measured = []
    for e, t in zip(a, (2.0, 2.02, 2.04)):
        e.status, e.measured_s = "finished", t
        measured.append(e)
    predict, error = ratio_refit(measured)
    assert predict(entry(cand(tp=2, mb=8), predicted=1.5)) == pytest.approx(3.0, rel=0.02)
    assert error == pytest.approx(0.05)  # consistent points: the floor
    measured[1].measured_s = 4.0  # one point 2x off the others
    _, error = ratio_refit(measured)
    assert error > 0.6


def entry(c, predicted):
    return Entry(c, predicted)


def test_the_planner_error_and_summary():
    ranked, truth = planted(6, bias=1.0)
    s = Search.of(ranked, batch=3)
    s.run(measure_with(s, truth))
    out = summary(s)
    assert out["best_s"] == pytest.approx(1.0) and out["trials"] == s.trials()
    # neighbours swapped: predictions 0.1 s off a 1.0-1.5 s truth
    assert mean_abs_error(s.entries) == pytest.approx(
        sum(abs(e.predicted_s - e.measured_s) / e.measured_s for e in s.measured()) / len(s.measured())
    )
    assert out["planner_kendall_tau"] is not None and out["planner_kendall_tau"] < 1.0


def test_candidates_come_from_the_planner(compose_cfg):
    """A real space: llama_tiny on 4 CPU ranks, every point the trainer can run, fastest first."""
    from orchestrator.planner import plan_space

    cfg = compose_cfg(["+chip=cpu", "model=llama_tiny", "trainer.global_batch=8", "trainer.seq_len=64"])
    res = plan_space(cfg, 4)
    s = Search.of([(p.candidate, p.step.step_time_s) for p in res.plans], batch=4)
    s.update()
    batch = s.next_batch()
    assert len(batch) == 4 and len({e.candidate.layout for e in s.entries}) >= 4
    assert [e.predicted_s for e in batch] == sorted(e.predicted_s for e in batch)
    assert batch[0].predicted_s == res.plans[0].step.step_time_s


def test_a_device_hours_budget_counts_the_devices_each_trial_holds():
    ranked, truth = planted(8)
    # 32 devices x 10 trial-seconds a trial = 0.0889 device-hours a trial: 0.2 allows three
    s = Search.of(ranked, batch=1, max_device_hours=0.2, devices=32, threshold=1e-6)
    stop = s.run(measure_with(s, truth, cost=10.0))
    assert s.trials() == 3 and stop.startswith("budget:") and "device-hours" in stop
    assert summary(s)["device_hours"] == pytest.approx(3 * 10 * 32 / 3600)


def test_an_oom_corrects_the_memory_model_across_layouts():
    """A point planned at 50 GiB that ran out of a 64 GiB device: the planner's memory is at least
    1.28x short, so every candidate planned at 50 GiB or more goes, whatever its layout, and one
    planned at 40 GiB (51 GiB corrected) stays."""
    failed = cand(dp=2, tp=2, mb=2)
    other_big = cand(dp=1, tp=4, mb=1)  # another layout: not implied structurally
    other_small = cand(dp=4, tp=1, mb=1)
    s = Search.of([(failed, 1.0), (other_big, 1.1), (other_small, 1.2)], planned_gb=[50.0, 52.0, 40.0], memory_gb=64.0)
    assert not implied_by_oom(failed, other_big)
    s.record(s.entries[0], None, status="oom", reason="out of memory")
    assert s.memory_scale == pytest.approx(64.0 / 50.0)
    assert {e.name: e.status for e in s.entries} == {
        failed.name: "oom",
        other_big.name: "pruned",
        other_small.name: "pending",
    }
    assert "memory corrected" in s.entries[1].reason and any("memory model corrected" in x for x in s.log)
    # without the device's memory (or the plan's), an OOM prunes only what it implies
    s2 = Search.of([(failed, 1.0), (other_big, 1.1)], planned_gb=[50.0, 52.0])
    s2.record(s2.entries[0], None, status="oom")
    assert s2.entries[1].status == "pending" and s2.memory_scale == 1.0


def runs_of(search: Search, sequences, cost=10.0):
    """A runner whose every candidate has a planted step time per run (its list, in turn)."""
    left = {c: list(v) for c, v in sequences.items()}

    def measure(batch):
        for e in batch:
            search.record(e, left[e.candidate].pop(0), trial_s=cost)

    return measure


def test_a_lucky_first_run_is_run_again_before_it_ends_the_search():
    """The planner's favourite measures 0.8 s once (a lucky run) and 1.6 s the next: truly the
    slowest. Without confirmation the search stops on the lucky figure; with ``confirm=2`` the
    second run hands the lead to the truly fastest point, which is then confirmed in its turn."""
    lucky, steady, slow = cand(mb=1), cand(mb=2), cand(mb=4)
    ranked = [(lucky, 0.5), (steady, 0.55), (slow, 2.0)]
    runs = {lucky: [0.8, 1.6], steady: [1.0, 1.02], slow: [4.0]}
    once = Search.of(ranked, batch=2)
    once.run(runs_of(once, runs))
    assert once.best().candidate == lucky and once.best().runs == 1
    twice = Search.of(ranked, batch=2, confirm=2)
    stop = twice.run(runs_of(twice, runs))
    best = twice.best()
    assert best.candidate == steady and best.samples == [1.0, 1.02] and best.measured_s == pytest.approx(1.01)
    lucky_entry = next(e for e in twice.entries if e.candidate == lucky)
    assert lucky_entry.samples == [0.8, 1.6] and lucky_entry.measured_s == pytest.approx(1.2)
    # slow is out of reach from the first batch on: each confirmation runs alone, and slow never
    assert twice.trials() == 4 and "no unmeasured candidate can win" in stop
    assert [line.split(";")[0] for line in twice.log[:3]] == [
        f"measured {lucky.name}, {steady.name}",
        f"measured again {lucky.name}",
        f"measured again {steady.name}",
    ], twice.log
    assert summary(twice)["best_runs"] == [1.0, 1.02]


def test_a_batch_of_several_confirms_the_best_in_one_of_its_slots():
    """While candidates can still win, the best's confirmation rides in the next batch beside the
    next candidate instead of costing a batch of its own at the end."""
    points = [cand(mb=b) for b in (1, 2, 3, 4, 5)]
    truth = dict(zip(points, (1.0, 2.0, 1.5, 1.1, 1.2)))  # the planner's ratio varies 2x: wide error
    s = Search.of([(c, 1.0 + 0.01 * i) for i, c in enumerate(points)], batch=3, confirm=2)
    s.update()
    for e in s.next_batch():
        s.record(e, truth[e.candidate])
    s.update()
    second = s.next_batch()
    assert [e.candidate for e in second] == [points[0], points[3], points[4]]  # the best, then the next two
    s.run(measure_with(s, truth))
    assert s.best().candidate == points[0] and s.best().runs == 2 and s.trials() == 6


def test_a_confirmation_is_a_trial_of_the_budget_and_a_failed_one_keeps_the_figure():
    a, b = cand(mb=1), cand(mb=2)
    ranked = [(a, 0.5), (b, 0.52)]
    s = Search.of(ranked, batch=2, confirm=2, max_trials=2)
    s.run(runs_of(s, {a: [1.0, 1.0], b: [1.5]}))
    assert s.trials() == 2 and s.best().runs == 1  # the budget ends it before any confirmation
    s = Search.of(ranked, batch=2, confirm=2)
    s.update()
    for e, t in zip(s.next_batch(), (1.0, 1.5)):
        s.record(e, t, trial_s=5.0)
    s.update()
    again = s.next_batch()
    assert [e.candidate for e in again] == [a]
    s.record(again[0], None, status="crash", reason="segfault", trial_s=2.0)
    s.update()
    assert s.best().candidate == a and s.best().measured_s == 1.0 and s.best().status == "finished"
    assert s.trials() == 3 and s.trial_seconds() == 12.0 and "did not finish" in s.log[-1]
    assert s.next_batch() == [] and s.stop_reason() == "every candidate measured or ruled out"


def test_a_grid_measures_each_point_once():
    ranked, truth = planted(4)
    s = Search.of(ranked, batch=2, exhaustive=True, confirm=3)
    s.run(measure_with(s, truth))
    assert s.trials() == 4 and all(e.runs == 1 for e in s.entries)
