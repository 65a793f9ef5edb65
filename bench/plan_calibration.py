"""Does the calibrated step-time model predict layouts it was not fitted to?

    python bench/plan_calibration.py [--presets single,dp2,tp2,pp2,tp2pp2] [--held-out pp2,tp2pp2]
                                     [--model gpt_mini] [--steps 20] [--threads 0] [--repeats 1]
                                     [--store DIR]

A preset may carry overrides of its own after colons, so one layout runs with several batch splits
or schedules: ``pp2:parallel.microbatches=8``, ``single:trainer.micro_batch=1``,
``pp2:parallel.schedule=interleaved_1f1b:parallel.virtual_stages=3`` (the host terms of the
step-time model, per micro-batch and per stage, are fitted only where such points vary them).
``--repeats N`` runs every preset N times, round by round, and fits and judges each preset's
median run (on a shared host one preset's step time moves by up to a quarter between runs).
``--store DIR`` keeps the MLflow store (and which preset each run was) in DIR; given a DIR that
already holds a run of every preset asked for, nothing is run again and the fit is made on the
measured runs there (to compare model variants on the same measurements).

Runs one real trial per parallel preset on this machine (``+chip=cpu``, gloo processes, tracked in
a private MLflow sqlite store), fits the planner's efficiency factors to the measured median step
times of the presets not held out (``orchestrator.planner.calibrate``), and prints per preset the
measured and predicted step time, the planned and measured peak memory, and the verdicts: the
fit's median relative error and Spearman's rho on the presets it was fitted to (optimistic: with
as many presets as factors it is ~0 by construction), and the mean, median and largest relative
error, Spearman's rho and Kendall's tau on the held-out presets, the figures to judge the model
by (beside them the same fit with the host terms held at their defaults); then every preset
predicted by a fit to the runs of all the other layouts (leave one layout out,
``orchestrator.planner.cross_validate``), so the ranking is judged over every layout that ran.
A preset the trainer cannot run is reported and left out.

``--threads 0`` (the default) leaves each worker's intra-op threads to the trainer, as a trial
runs: the host's cores split among a node's workers (``trainers.runtime.select_device``), so every
layout has the whole host, which is what the planner's CPU chip models (one host peak shared by
all its workers). ``--threads N`` sets ``OMP_NUM_THREADS=N`` for every worker instead: with 1, a
one-process trial uses one core of the host and a two-process one two, which the model does not
describe (measured: ``single`` then runs 1.8x slower than ``dp2`` and is the fit's worst point). On
the CPU the measured peak is the process's resident set
(Python and torch included) and the plan includes ``planner.runtime_overhead_gb``: the memory
columns show the comparison, not an accuracy claim.
"""

from __future__ import annotations

import argparse
import json
import os
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


def _rho(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="single,dp2,tp2,pp2,tp2pp2")
    ap.add_argument("--held-out", default="pp2,tp2pp2", help="presets predicted, not fitted to")
    ap.add_argument("--model", default="gpt_mini")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per worker (OMP_NUM_THREADS); 0: the trainer's choice"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each preset; the fit takes each one's median run")
    ap.add_argument("--store", default=None, help="keep (or reuse) the MLflow store and the preset of each run here")
    return ap


def _run_presets(presets: list, common: list, base: dict, planned: dict, index: Path, repeats: int = 1) -> None:
    """Trials of each preset until it has ``repeats`` runs in ``planned`` (run id -> (preset,
    planned GB), kept in ``index`` after each run), the presets in turn, round by round (a busy
    spell of the host falls on several presets, not on all the repeats of one): a preset's own
    overrides on top of ``base`` and ``common``. A preset the trainer cannot run, or whose trial
    does not finish, is reported and left out."""
    for round_ in range(repeats):
        for preset in presets:
            if sum(p == preset for p, _ in planned.values()) <= round_:
                _run_one(preset, common, base, planned, index)


def _median_runs(trials: list, planned: dict) -> list:
    """Each preset's run of the median step time (the lower middle of an even count)."""
    by: dict = {}
    for t in trials:
        by.setdefault(planned[t.run_id][0], []).append(t)
    out = []
    for runs in by.values():
        runs.sort(key=lambda t: t.step_time_s)
        out.append(runs[(len(runs) - 1) // 2])
    return out


def _run_one(preset: str, common: list, base: dict, planned: dict, index: Path) -> None:
    name, *own = preset.split(":")
    mine = dict(o.split("=", 1) for o in own)
    overrides = [f"parallel={name}", *common, *(f"{k}={v}" for k, v in {**base, **mine}.items())]
    cfg = _compose(overrides)
    try:
        result = trial.run(cfg, overrides, progress=False)
    except trial.ConfigError as err:
        print(f"{preset}: not run: {'; '.join(err.errors)}")
        return
    if result["status"] != "finished":
        print(f"{preset}: {result['status']}: {result.get('reason', '')[:200]}")
        return
    planned[result["run_id"]] = (preset, planner.preflight(cfg)["planned_mem_gb"])
    index.write_text(json.dumps(planned))


def _print_table(args: argparse.Namespace, cal, presets: list, planned: dict, trials: list) -> None:
    """The fit's factors, then per run (fastest first) its preset, role, measured and predicted
    step time, error, measured and predicted host_busy (the share of the host's cores the ranks
    kept busy) and planned and peak memory, then the in-sample verdict."""
    by_id = {t.run_id: t for t in trials}
    factors = ", ".join(f"{k}={v:.4g}" + ("" if k in cal.fitted else " (kept)") for k, v in cal.values().items())
    print(
        f"model={args.model} steps={args.steps} global_batch=16 seq_len=128 "
        f"threads/worker={args.threads or 'cores/workers'}; {factors}"
    )
    width = max([10] + [len(p) + 2 for p in presets])
    print(
        f"{'preset':<{width}}{'role':<10}{'measured_s':>12}{'predicted_s':>13}{'error':>8}{'busy':>6}{'pred':>6}"
        f"{'planned_gb':>12}{'peak_gb':>10}"
    )
    rows = [("fitted", r) for r in cal.runs] + [("held-out", r) for r in (cal.heldout.runs if cal.heldout else [])]
    for role, run in sorted(rows, key=lambda x: x[1]["measured_s"]):
        preset, plan_gb = planned.get(run["run_id"], ("?", float("nan")))
        t = by_id[run["run_id"]]
        busy = (t.host_busy or float("nan"), planner.estimate(cal, t.cfg).host_busy)
        print(
            f"{preset:<{width}}{role:<10}{run['measured_s']:>12.4f}{run['predicted_s']:>13.4f}"
            f"{100 * run['rel_error']:>7.0f}%{busy[0]:>6.2f}{busy[1]:>6.2f}{plan_gb:>12.2f}"
            f"{t.peak_mem_gb or float('nan'):>10.2f}"
        )
    print(
        f"fitted:   median |relative error| {100 * cal.median_abs_rel_error:.1f}%, Spearman rho "
        f"{_rho(cal.spearman_rho)} over {cal.n_runs} runs ({cal.n_fitted} factors fitted; in-sample)"
    )


def _verdict(h) -> str:
    return (
        f"mean |relative error| {100 * h.mean_abs_rel_error:.1f}%, median {100 * h.median_abs_rel_error:.1f}%, "
        f"largest {100 * h.max_abs_rel_error:.1f}%, Spearman rho {_rho(h.spearman_rho)}, Kendall tau "
        f"{_rho(h.kendall_tau)} over {h.n_runs} runs"
    )


def _print_out_of_sample(cal, fit: list, held: list, trials: list, planner_cfg) -> None:
    """The verdicts to judge the model by: on the held-out presets (and the same with the host
    terms kept at their defaults), then on every layout left out of a fit to the others."""
    if cal.heldout and cal.heldout.n_runs:
        print(f"held-out: {_verdict(cal.heldout)} of presets not fitted to")
        base = planner.calibrate(fit, planner_cfg, held_out=held, fit_host=False).heldout
        print(f"held-out, host terms kept at their defaults (the model without them fitted): {_verdict(base)}")
    else:
        print("held-out: none (give --held-out presets that ran)")
    # every layout predicted by a fit to the others (leave one layout out): as many held-out
    # layouts as ran, so rho ranks all of them, not the two or three of one split
    loo = planner.cross_validate(trials, planner_cfg, fit_host="all")
    if loo.n_runs:
        n_layouts = len({planner.layout_name(t.cfg) for t in trials})
        print(
            f"leave one layout out: {_verdict(loo)} of {n_layouts} layouts, each predicted by a fit to the others' runs"
        )


def main() -> None:
    args = _parser().parse_args()
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the spawned workers read it when torch loads
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    register_configs()
    store = args.store or tempfile.mkdtemp(prefix="plan-calibration-")
    os.makedirs(store, exist_ok=True)
    uri = f"sqlite:///{os.path.abspath(store)}/mlruns.db"
    index = Path(store) / "presets.json"  # run id -> [preset, planned GB]
    planned = {k: tuple(v) for k, v in json.loads(index.read_text()).items()} if index.exists() else {}
    base = {
        "trainer.steps": str(args.steps),
        "trainer.global_batch": "16",
        "trainer.micro_batch": "4",
        "trainer.seq_len": "128",
        "trainer.log_every": "10",
    }
    common = [
        "+chip=cpu",
        f"model={args.model}",
        "model.tie_embeddings=false",
        f"tracking.uri={uri}",
        "tracking.experiment=calibration",
    ]
    presets = args.presets.split(",")
    held_names = {p for p in args.held_out.split(",") if p}
    unknown = held_names - set(presets)
    if unknown:
        sys.exit(f"--held-out {','.join(sorted(unknown))}: not among --presets")
    _run_presets(presets, common, base, planned, index, args.repeats)
    wanted = set(presets)
    ran = planner.measured_trials(uri, "calibration", chip="cpu")
    trials = _median_runs([t for t in ran if planned.get(t.run_id, ("",))[0] in wanted], planned)
    common = [*common, *(f"{k}={v}" for k, v in base.items())]
    held = [t for t in trials if planned.get(t.run_id, ("",))[0] in held_names]
    fit = [t for t in trials if t.run_id not in {h.run_id for h in held}]
    if not fit:
        print("no finished trial to fit to")
        return
    planner_cfg = _compose(common).planner  # the factors' starting values, for both fits below
    cal = planner.calibrate(fit, planner_cfg, held_out=held, fit_host="all")
    _print_table(args, cal, presets, planned, trials)
    _print_out_of_sample(cal, fit, held, trials, planner_cfg)
    print(f"MLflow store: {uri}")


if __name__ == "__main__":
    main()
