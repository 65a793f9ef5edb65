"""Does the calibrated step-time model rank parallel presets in the order measured here?

    python bench/plan_calibration.py [--presets single,dp2,tp2,pp2] [--model gpt_mini] [--steps 20]

Runs one real trial per parallel preset on this machine (``+chip=cpu``, gloo processes, tracked in
a private MLflow sqlite store), fits the planner's efficiency factors to the measured median step
times (``orchestrator.planner.calibrate``), and prints per preset the measured and predicted step
time, the planned and measured peak memory, the fit's median relative error and Spearman's rho
between predicted and measured step times. A preset the trainer cannot run is reported and left
out of the fit. On the CPU the measured peak is the process's resident set (Python and torch
included) and the plan includes ``planner.runtime_overhead_gb``: the memory columns show the
comparison, not an accuracy claim.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from orchestrator import conf_dir, planner, trial  # noqa: E402
from orchestrator.config import register_configs  # noqa: E402


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="single,dp2,tp2,pp2")
    ap.add_argument("--model", default="gpt_mini")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    register_configs()
    store = tempfile.mkdtemp(prefix="plan-calibration-")
    uri = f"sqlite:///{store}/mlruns.db"
    common = ["+chip=cpu", f"model={args.model}", "model.tie_embeddings=false", f"trainer.steps={args.steps}",
              "trainer.global_batch=16", "trainer.micro_batch=4", "trainer.seq_len=128", "trainer.log_every=10",
              "parallel.microbatches=4", f"tracking.uri={uri}", "tracking.experiment=calibration"]
    planned = {}
    for preset in args.presets.split(","):
        overrides = [f"parallel={preset}", *common]
        cfg = _compose(overrides)
        try:
            result = trial.run(cfg, overrides, progress=False)
        except trial.ConfigError as err:
            print(f"{preset}: not run: {'; '.join(err.errors)}")
            continue
        if result["status"] != "finished":
            print(f"{preset}: {result['status']}: {result.get('reason', '')[:200]}")
            continue
        planned[result["run_id"]] = (preset, planner.preflight(cfg)["planned_mem_gb"])
    trials = planner.measured_trials(uri, "calibration", chip="cpu")
    if len(trials) < 2:
        print("fewer than two finished trials: nothing to rank")
        return
    cal = planner.calibrate(trials, _compose(common).planner)
    peaks = {t.run_id: t.peak_mem_gb for t in trials}
    print(f"model={args.model} steps={args.steps} global_batch=16 seq_len=128; fitted compute_efficiency="
          f"{cal.compute_efficiency:.4g} comm_efficiency={cal.comm_efficiency:.4g} "
          f"collective_latency_us={cal.collective_latency_us:.4g}")
    print(f"{'preset':<10}{'measured_s':>12}{'predicted_s':>13}{'planned_gb':>12}{'peak_gb':>10}")
    for run in sorted(cal.runs, key=lambda r: r["measured_s"]):
        preset, plan_gb = planned.get(run["run_id"], ("?", float("nan")))
        print(f"{preset:<10}{run['measured_s']:>12.4f}{run['predicted_s']:>13.4f}{plan_gb:>12.2f}"
              f"{peaks.get(run['run_id']) or float('nan'):>10.2f}")
    rho = "n/a" if cal.spearman_rho is None else f"{cal.spearman_rho:.2f}"
    print(f"median |relative error| {100 * cal.median_abs_rel_error:.1f}%, Spearman rho {rho} over {cal.n_runs} runs "
          f"({cal.n_fitted} factors fitted)")
    print(f"MLflow store: {uri}")


if __name__ == "__main__":
    main()
