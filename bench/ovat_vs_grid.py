"""One-variable-at-a-time (with pruning) against the full grid over the same values.

    python bench/ovat_vs_grid.py [--steps 12] [--repeats 2 [1 ...]] [--runs 1] [--remeasure 3]
                                 [--measure fixed|adaptive] [--keep DIR]

The study (gpt_tiny on the CPU, ``trainer=smoke``, global batch 8): ``trainer.micro_batch`` 1,
2, 4, 8, 16 (16 exceeds the global batch: infeasible; 8 with dp=2 too), ``precision`` fp32, bf16,
``parallel.dp`` 1, 2, ``parallel.tp`` 1, 2, 3 (3 does not divide the model: infeasible). The first
value of each is the baseline. Both searches run as a user runs them, ``python -m orchestrator -m ...`` with Hydra's
basic launcher, each in its own MLflow experiment of one store:

- grid: the basic sweeper, every combination once (the infeasible ones are recorded, not run);
- ovat: ``hydra/sweeper=ovat`` with ``--repeats`` per point, ``resume=false``; ``--runs`` studies
  for each repeats value given, each in its own experiment (the grid runs once).

``--measure`` is ``trainer.measure`` in both searches alike (``adaptive``: a trial stops once its
median step time is known, docs/trials.md, "Trials that stop when the step time is known"). Figures:
trials launched, trial-seconds (the sum of the trials' run durations in MLflow, the
device time each search spent) and the search's wall time; the best config each found and its
objective as measured inside the search. Then the two winners are measured again side by side
(``--remeasure`` interleaved runs each, medians), so the comparison of what they found does not
hinge on one lucky sample; a study's winner is *within noise* of the grid's when it is the same
config or its remeasured median is within the spread of the grid winner's own remeasured runs.
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


def winner_label(overrides):
    return " ".join(o for o in overrides if o.split("=")[0] in dict(VARIABLES))


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, nargs="+", default=[2], help="OVAT repeats per point (several: each)")
    ap.add_argument("--runs", type=int, default=1, help="OVAT studies per repeats value (the grid runs once)")
    ap.add_argument("--remeasure", type=int, default=3, help="side-by-side runs of each winner")
    ap.add_argument("--measure", choices=("fixed", "adaptive"), default="fixed", help="trainer.measure, both searches")
    ap.add_argument("--keep", help="work in this folder (default: a temporary one); searches done there are reused")
    return ap


def run_searches(args, work, base):
    """The grid, then each OVAT study, in ``work``; (the searches' wall times by name, the studies
    as [(name, repeats)]). A search already finished there (its wall time in walls.json) is not
    run again."""
    sweep_args = [f"{k}={v}" for k, v in VARIABLES]
    walls_file = work / "walls.json"
    walls = json.loads(walls_file.read_text()) if walls_file.is_file() else {}

    def search(name, cmd):
        if name not in walls:
            walls[name] = cli(cmd, work, work / f"{name}.log")
            walls_file.write_text(json.dumps(walls))

    search("grid", ["-m", *base, "tracking.experiment=grid", *sweep_args])
    studies = [(f"ovat_r{r}_{i + 1}", r) for r in args.repeats for i in range(args.runs)]
    for name, repeats in studies:
        search(
            name,
            [
                "-m",
                "hydra/sweeper=ovat",
                *base,
                f"tracking.experiment={name}",
                f"hydra.sweeper.repeats={repeats}",
                "hydra.sweeper.resume=false",
                *sweep_args,
            ],
        )
    return walls, studies


def remeasure(winners, count, work, uri):
    """Every distinct winner (label -> overrides) again, side by side: ``count`` interleaved runs
    of each; {label: [objective of each run]}."""
    from orchestrator import results

    measured = {k: [] for k in winners}
    for i in range(count):
        for j, (label, overrides) in enumerate(winners.items()):
            plain = [o for o in overrides if not o.startswith("tracking.experiment=")]
            cli([*plain, "tracking.experiment=remeasure"], work, work / f"remeasure_{j}_{i}.log")
            newest = results.search(uri, "remeasure")[0]
            measured[label].append(newest.data.metrics[OBJECTIVE])
    return measured


def print_comparison(args, uri, base, studies, walls, reports, grid_best, measured, work):
    """The table: per search its trials, pruned points, trial-seconds, wall time, best objective
    in the search and remeasured, against the grid's; then how many OVAT runs came within noise."""
    grid_label = winner_label(grid_best["overrides"])
    g_med = statistics.median(measured[grid_label])
    # one config's run-to-run noise: the spread of the grid winner's own remeasured runs
    noise = (max(measured[grid_label]) - min(measured[grid_label])) / g_med

    print(
        f"gpt_tiny on the CPU, {args.steps} steps a trial; variables: "
        + "; ".join(f"{k}={v}" for k, v in VARIABLES)
        + f"; OVAT repeats {' and '.join(map(str, args.repeats))}, {args.runs} run(s) each; "
        f"trainer.measure={args.measure}"
    )
    print(
        f"{'search':10}  {'trials':>6}  {'pruned':>6}  {'trial-s':>8}  {'wall-s':>7}  {'best in search':>14}  "
        f"{'remeasured':>10}  {'x grid':>6}  {'within noise':>12}  best config"
    )
    g_launched, g_pruned, g_secs = trial_seconds(uri, "grid")
    print(
        f"{'grid':10}  {g_launched:>6}  {g_pruned:>6}  {g_secs:>8.1f}  {walls['grid']:>7.1f}  "
        f"{grid_best['value']:>14.5f}  {g_med:>10.5f}  {1.0:>6.3f}  {'-':>12}  {grid_label}"
    )
    held = {r: 0 for r in args.repeats}
    for name, repeats in studies:
        launched, pruned, secs = trial_seconds(uri, name)
        final = reports[name]["final"]
        label = winner_label([*base, *(f"{k}={v}" for k, v in final["assignment"].items())])
        again = statistics.median(measured[label])
        ok = label == grid_label or again <= g_med * (1.0 + noise)
        held[repeats] += ok
        print(
            f"{name:10}  {launched:>6}  {pruned:>6}  {secs:>8.1f}  {walls[name]:>7.1f}  {final['objective']:>14.5f}  "
            f"{again:>10.5f}  {again / g_med:>6.3f}  {'yes' if ok else 'no':>12}  {label}"
        )
        print(f"{'':10}  {secs / g_secs:.2f}x the grid's trial-seconds; decisions: " + "; ".join(
            f"{r['variable']}={r['value']}: {r['decision'].split(' (')[0]}" for r in reports[name]["rows"][1:]
            if r["status"] != "infeasible"
        ))  # fmt: skip
    print(
        f"within noise: the same config as the grid's winner, or a remeasured median at most {1 + noise:.3f}x its "
        f"(the spread of its own {args.remeasure} remeasured runs); medians of {args.remeasure} interleaved runs each"
    )
    for r in args.repeats:
        print(f"repeats {r}: {held[r]} of {args.runs} OVAT run(s) reached the grid's best within noise")
    print(f"work folder: {work}")


def main():
    args = _parser().parse_args()
    from orchestrator import best, results
    from orchestrator import grid_report as report_mod

    work = Path(args.keep or tempfile.mkdtemp(prefix="ovat_vs_grid_"))
    work.mkdir(parents=True, exist_ok=True)
    uri = "sqlite:///" + str(work / "mlruns.db")
    base = ["+chip=cpu", "trainer=smoke", f"trainer.steps={args.steps}", "data.num_workers=0"]
    base.append(f"trainer.measure={args.measure}")
    walls, studies = run_searches(args, work, base)

    ranked = best.rank(uri, "grid", OBJECTIVE)
    grid_best = best.describe(uri, OBJECTIVE, "minimize", ranked["candidates"][0], "grid")
    reports = {}
    for name, _ in studies:
        parent = report_mod.find_parent(uri, name, None)
        reports[name] = json.loads(results.artifact_text(uri, parent.info.run_id, "tuning_report.json"))

    # every distinct winner again, side by side: interleaved runs, medians
    winners = {winner_label(grid_best["overrides"]): grid_best["overrides"]}
    for name, _ in studies:
        final = reports[name]["final"]
        overrides = [*base, *(f"{k}={v}" for k, v in final["assignment"].items())]
        winners.setdefault(winner_label(overrides), overrides)
    measured = remeasure(winners, args.remeasure, work, uri)
    print_comparison(args, uri, base, studies, walls, reports, grid_best, measured, work)


if __name__ == "__main__":
    main()
