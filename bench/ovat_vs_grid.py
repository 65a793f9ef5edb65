"""One-variable-at-a-time (with pruning) against the full grid over the same values.

    python bench/ovat_vs_grid.py [--steps 12] [--repeats 2] [--remeasure 3] [--measure fixed|adaptive]
                                 [--keep DIR]

The study (gpt_tiny on the CPU, ``trainer=smoke``, global batch 8): ``trainer.micro_batch`` 1,
2, 4, 8, 16 (16 exceeds the global batch: infeasible; 8 with dp=2 too), ``precision`` fp32, bf16,
``parallel.dp`` 1, 2, ``parallel.tp`` 1, 2, 3 (3 does not divide the model: infeasible). The first
value of each is the baseline. Both searches run as a user runs them, ``python -m orchestrator -m ...`` with Hydra's
basic launcher, each in its own MLflow experiment of one store:

- grid: the basic sweeper, every combination once (the infeasible ones are recorded, not run);
- ovat: ``hydra/sweeper=ovat`` with ``--repeats`` per point, ``resume=false``.

``--measure`` is ``trainer.measure`` in both searches alike (``adaptive``: a trial stops once its
median step time is known, README "Trials that stop when the step time is known"). Figures:
trials launched, trial-seconds (the sum of the trials' run durations in MLflow, the
device time each search spent) and the search's wall time; the best config each found and its
objective as measured inside the search. Then the two winners are measured again side by side
(``--remeasure`` interleaved runs each, medians), so the comparison of what they found does not
hinge on one lucky sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIABLES = [
    ("trainer.micro_batch", "1,2,4,8,16"),
    ("precision", "fp32,bf16"),
    ("parallel.dp", "1,2"),
    ("parallel.tp", "1,2,3"),
]
OBJECTIVE = "step_time_median_s"


def cli(args, cwd, log):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    Path(log).write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): python -m orchestrator {' '.join(args)}; see {log}")
    return wall


def trial_seconds(uri, experiment):
    from orchestrator import results

    runs = results.search(uri, experiment)
    launched = [r for r in runs if r.data.tags.get("trial.status") not in ("infeasible", "unsupported_op")]
    return len(launched), len(runs) - len(launched), results.run_seconds(launched)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="OVAT repeats per point")
    ap.add_argument("--remeasure", type=int, default=3, help="side-by-side runs of each winner")
    ap.add_argument("--measure", choices=("fixed", "adaptive"), default="fixed", help="trainer.measure, both searches")
    ap.add_argument("--keep", help="work in this folder (default: a temporary one)")
    args = ap.parse_args()
    from orchestrator import best, results
    from orchestrator import report as report_mod

    work = Path(args.keep or tempfile.mkdtemp(prefix="ovat_vs_grid_"))
    work.mkdir(parents=True, exist_ok=True)
    uri = "sqlite:///" + str(work / "mlruns.db")
    base = ["+chip=cpu", "trainer=smoke", f"trainer.steps={args.steps}", "data.num_workers=0"]
    base.append(f"trainer.measure={args.measure}")
    sweep_args = [f"{k}={v}" for k, v in VARIABLES]

    grid_wall = cli(["-m", *base, "tracking.experiment=grid", *sweep_args], work, work / "grid.log")
    ovat_wall = cli(
        [
            "-m",
            "hydra/sweeper=ovat",
            *base,
            "tracking.experiment=ovat",
            f"hydra.sweeper.repeats={args.repeats}",
            "hydra.sweeper.resume=false",
            *sweep_args,
        ],
        work,
        work / "ovat.log",
    )

    ranked = best.rank(uri, "grid", OBJECTIVE)
    grid_best = best.describe(uri, OBJECTIVE, "minimize", ranked["candidates"][0], "grid")
    parent = report_mod.find_parent(uri, "ovat", None)
    report = json.loads(results.artifact_text(uri, parent.info.run_id, "tuning_report.json"))
    final = report["final"]

    def label(overrides):
        return " ".join(o for o in overrides if o.split("=")[0] in dict(VARIABLES))

    # the two winners again, side by side: interleaved runs, medians
    winners = {"grid": grid_best["overrides"], "ovat": [*base, *(f"{k}={v}" for k, v in final["assignment"].items())]}
    measured = {k: [] for k in winners}
    for i in range(args.remeasure):
        for name, overrides in winners.items():
            plain = [o for o in overrides if not o.startswith("tracking.experiment=")]
            cli([*plain, "tracking.experiment=remeasure"], work, work / f"remeasure_{name}_{i}.log")
            newest = results.search(uri, "remeasure")[0]
            measured[name].append(newest.data.metrics[OBJECTIVE])

    rows = []
    for name, experiment, wall in (("grid", "grid", grid_wall), ("ovat", "ovat", ovat_wall)):
        launched, pruned, secs = trial_seconds(uri, experiment)
        found = grid_best if name == "grid" else {"value": final["objective"], "overrides": winners["ovat"]}
        rows.append(
            (
                name,
                launched,
                pruned,
                secs,
                wall,
                found["value"],
                statistics.median(measured[name]),
                label(found["overrides"]),
            )
        )
    print(
        f"gpt_tiny on the CPU, {args.steps} steps a trial; variables: "
        + "; ".join(f"{k}={v}" for k, v in VARIABLES)
        + f"; OVAT repeats {args.repeats}; trainer.measure={args.measure}"
    )
    print(
        f"{'search':6}  {'trials':>6}  {'pruned':>6}  {'trial-s':>8}  {'wall-s':>7}  {'best in search':>14}  "
        f"{'remeasured':>10}  best config"
    )
    for name, launched, pruned, secs, wall, found, again, cfg in rows:
        print(
            f"{name:6}  {launched:>6}  {pruned:>6}  {secs:>8.1f}  {wall:>7.1f}  {found:>14.5f}  {again:>10.5f}  {cfg}"
        )
    g, o = rows
    print(
        f"OVAT spent {o[3] / g[3]:.2f}x the grid's trial-seconds; its winner's remeasured step time is "
        f"{o[6] / g[6]:.3f}x the grid winner's (median of {args.remeasure} interleaved runs each)"
    )
    print(
        "OVAT decisions: "
        + "; ".join(f"{r['variable']}={r['value']}: {r['decision'].split(' (')[0]}" for r in report["rows"][1:])
    )
    print(f"work folder: {work}")


if __name__ == "__main__":
    main()
