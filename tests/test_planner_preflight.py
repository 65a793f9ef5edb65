"""The preflight plan a trial is launched on, the layouts of N devices, and calibration from
trials measured in MLflow.
"""

from __future__ import annotations

import json

import pytest

from orchestrator import planner, tracking, trial
from tests.planner_cases import MEMORY_KEYS

# --- preflight, layouts, calibration from MLflow -----------------------------------------------


def test_preflight_rejects_what_does_not_fit(compose_cfg):
    cfg = compose_cfg(
        [
            "+chip=ascend910b",
            "model=llama2_70b",
            "precision=bf16",
            "trainer.micro_batch=1",
            "trainer.global_batch=8",
            "trainer.seq_len=4096",
        ]
    )
    report = planner.preflight(cfg)
    json.dumps(report)
    assert not report["feasible"] and not report["fits"]
    assert report["reasons"][0].startswith("memory: ")
    assert "per rank exceeds ascend910b's 64 GB x 0.9 headroom" in report["reasons"][0]
    assert report["memory_gb"]["total"] > 64
    assert set(report["memory_gb"]) == MEMORY_KEYS


def test_planning_ignores_what_the_trainer_cannot_run_yet(compose_cfg):
    cfg = compose_cfg(
        [
            "+chip=ascend910b",
            "model=llama2_13b",
            "parallel=tp8pp4",
            "trainer.global_batch=64",
            "parallel.microbatches=16",
        ]
    )
    assert planner.planning_errors(cfg) == []  # 32 NPUs on 4 nodes: a plan, not a launch
    broken = compose_cfg(["+chip=ascend910b", "model=llama2_13b", "parallel.tp=3"])
    assert "parallel.tp=3 does not divide model.n_heads=40" in planner.planning_errors(broken)


def test_layouts_of_32_devices(compose_cfg):
    cfg = compose_cfg(["+chip=ascend910b", "model=llama2_13b"])
    got = planner.layouts(32, cfg.model, cfg.chip)
    assert all(dp * tp * pp == 32 for dp, tp, pp in got)
    assert {tp for _, tp, _ in got} == {1, 2, 4, 8}  # powers of two, within a node of 8
    assert {pp for _, _, pp in got} == {1, 2, 4, 8}  # divide 40 layers and 32 devices
    assert (1, 8, 4) in got and (32, 1, 1) in got


@pytest.mark.distributed
def test_calibration_from_measured_trials_in_mlflow_predicts_a_held_out_layout(compose_cfg, mlflow_uri, monkeypatch):
    """Real gpt_tiny trials launched by trial.run on this machine, one process and dp2, read back
    from MLflow with their configs rebuilt from the runs' params; the model is fitted to the
    single run and predicts the dp2 layout it did not see. The prediction is judged loosely, within
    a factor of 6 of the measurement (20% off on an idle 2-core machine; 3.5x once in a clean-clone
    CI run, the suite's other workers on the same two cores as dp2's two ranks): how far a shared
    machine is from the model varies from run to run, so the band catches a prediction off by an
    order of magnitude (a communication term in the wrong unit, bits for bytes), and the synthetic
    tests above judge held-out accuracy."""
    # one intra-op thread per worker, as torch's elastic launcher gives each of several workers:
    # a lone worker would otherwise take every core, and on a loaded host its threads contend
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = [
        "+chip=cpu",
        "trainer=smoke",
        "trainer.steps=6",
        "trainer.seq_len=32",
        "data=synthetic",
        "data.num_workers=0",
        f"tracking.uri={mlflow_uri}",
    ]
    cfg = compose_cfg(common)
    single = trial.run(cfg, [], progress=False)
    dp2 = trial.run(compose_cfg([*common, "parallel=dp2"]), ["parallel=dp2"], progress=False)
    assert single["status"] == dp2["status"] == "finished", (single.get("reason"), dp2.get("reason"))
    run_id, summary, uri = single["run_id"], single["summary"], tracking.resolve_uri(cfg.tracking)
    emulated = compose_cfg(["+chip=ascend910b", "chip.emulate=true", f"tracking.uri={mlflow_uri}"])
    uri2, other = tracking.start_run(emulated, [], trial.trial_tags(emulated))
    tracking.log_metrics(uri2, other, {"step_time_median_s": 1.0})
    tracking.end_run(uri2, other, "finished")

    trials = planner.measured_trials(uri, "orchestrator", chip="cpu")
    assert {t.run_id for t in trials} == {run_id, dp2["run_id"]}  # the emulated run measures the host, not the chip
    fit, held = planner.split_by_layout(trials, ["dp2tp1pp1"])
    assert [t.run_id for t in fit] == [run_id] and [t.run_id for t in held] == [dp2["run_id"]]
    rebuilt = fit[0].cfg
    assert rebuilt.model.name == "gpt_tiny" and rebuilt.trainer.seq_len == 32 and rebuilt.chip.name == "cpu"
    assert planner.layout_name(held[0].cfg) == "dp2tp1pp1" and held[0].cfg.trainer.steps == 6
    assert planner.config_from_params({"model.name": "x", "config_hash": "ab"}).model.name == "x"
    cal = planner.calibrate(fit, cfg.planner, held_out=held)
    assert cal.n_runs == 1 and cal.n_fitted == 1  # one process: nothing to fit communication to
    # one factor, one run: the fit reproduces it (a property of the fitter, not of the timing)
    assert cal.median_abs_rel_error < 0.02
    predicted = planner.combine(planner.trial_parts(rebuilt), cal.compute_efficiency, cal.comm_efficiency)
    assert predicted.step_time_s == pytest.approx(summary["step_time_median_s"], rel=0.02)
    h = cal.heldout
    assert h.n_runs == 1 and h.spearman_rho is None  # one held-out run: no ranking to judge
    (run,) = h.runs
    assert run["run_id"] == dp2["run_id"] and run["measured_s"] == pytest.approx(held[0].step_time_s)
    assert run["predicted_s"] == pytest.approx(planner.predict(cal, held[0].cfg)) and run["predicted_s"] > 0
    assert h.median_abs_rel_error == pytest.approx(abs(run["predicted_s"] - run["measured_s"]) / run["measured_s"])
    assert 1 / 6 < run["predicted_s"] / run["measured_s"] < 6, run
    print(
        f"\nheld-out dp2: measured {run['measured_s']:.4f} s, predicted {run['predicted_s']:.4f} s, "
        f"error {100 * run['rel_error']:.0f}%"
    )
