"""The automatic search against the grid of the same planned space.

    python bench/auto_vs_grid.py [--model llama_tiny] [--devices 4] [--steps 12] [--remeasure 3]
                                 [--max-trials 12] [--confirm 2] [--space-schedules 1f1b] [--keep DIR]

Both run as a user runs them, ``python -m orchestrator +sweep=auto ...`` with Hydra's basic
launcher, on ``--devices`` CPU ranks, each in its own MLflow experiment of one store:

- grid: ``hydra.sweeper.exhaustive=true``: every planned point that fits, measured once;
- auto: the search (``sweeps/auto.py``): the planner's order, refit after each batch, stopped when
  no unmeasured point credited with the planner's measured error can win.

The space is narrowed by ``--space-*`` so the grid is affordable here (each trial launches
``--devices`` gloo processes on this machine). Printed: trials, trial-seconds and wall time of
each, the best each found (in the search, and remeasured: ``--remeasure`` interleaved runs of
both winners, medians), the planner's mean error and Kendall's tau on the points each measured,
and the auto search's stop reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ovat_vs_grid import cli  # noqa: E402  (bench/ is this script's folder on sys.path)


def report(uri: str, experiment: str) -> dict:
    from orchestrator import grid_report as report_mod
    from orchestrator import results

    parent = report_mod.find_parent(uri, experiment, None)
    return json.loads(results.artifact_text(uri, parent.info.run_id, "auto_report.json"))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama_tiny")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--remeasure", type=int, default=3)
    ap.add_argument("--max-trials", type=int, default=12)
    ap.add_argument("--confirm", type=int, default=2, help="runs the search's best needs before it may stop")
    ap.add_argument("--space-schedules", default="1f1b")
    ap.add_argument("--space-checkpointing", default="false")
    ap.add_argument("--space-sequence-parallel", default="false")
    ap.add_argument("--space-dp-shard", default="ddp,fsdp")
    ap.add_argument("--keep", help="work in this folder (default: a temporary one)")
    return ap


def remeasure(reports: dict, count: int, work: Path, uri: str) -> dict:
    """Both winners (the command each search's report gives) again, side by side: ``count``
    interleaved runs of each, outside any sweep; {search: [step time of each run]}."""
    from orchestrator import results

    winners = {k: r["command"].split(" -m orchestrator ", 1)[1].split() for k, r in reports.items()}
    measured = {k: [] for k in winners}
    for i in range(count):
        for name, overrides in winners.items():
            plain = [o for o in overrides if not o.startswith(("tracking.experiment=", "+sweep=", "hydra."))]
            cli([*plain, "tracking.experiment=remeasure"], work, work / f"remeasure_{name}_{i}.log")
            measured[name].append(results.search(uri, "remeasure")[0].data.metrics["step_time_median_s"])
    return measured


def print_comparison(args: argparse.Namespace, reports: dict, walls: dict, measured: dict, work: Path) -> None:
    from orchestrator import results

    """The table (per search: trials, trial-seconds, wall time, best in the search and remeasured,
    the planner's error and tau), then the auto search against the grid: its share of the
    trial-seconds, its winner's remeasured step time and place among the grid's, its stop reason."""
    g = reports["grid"]
    print(
        f"{args.model} on {args.devices} CPU ranks, {args.steps} steps a trial; space: {g['points']} points, "
        f"{g['fit']} fit (schedules {args.space_schedules}, checkpointing {args.space_checkpointing}, "
        f"sequence parallel {args.space_sequence_parallel}, dp_shard {args.space_dp_shard})"
    )
    print(
        f"{'search':6}  {'trials':>6}  {'trial-s':>8}  {'wall-s':>7}  {'best in search':>14}  {'remeasured':>10}  "
        f"{'planner err':>11}  {'tau':>5}  best"
    )
    for name in ("grid", "auto"):
        s = reports[name]["summary"]
        err = s["planner_mean_abs_error"]
        tau = s["planner_kendall_tau"]
        print(
            f"{name:6}  {s['trials']:>6}  {s['trial_seconds']:>8.1f}  {walls[name]:>7.1f}  {s['best_s']:>14.5f}  "
            f"{statistics.median(measured[name]):>10.5f}  {100 * err if err is not None else float('nan'):>10.0f}%  "
            f"{tau if tau is not None else float('nan'):>5.2f}  {s['best']}"
        )
    a, gs = reports["auto"]["summary"], g["summary"]
    ratio = statistics.median(measured["auto"]) / statistics.median(measured["grid"])
    # the noise of a remeasured median: the larger spread ((max - min) / median) of the two
    # winners' interleaved runs; the same config when both searches chose it
    noise = max(results.spread(measured["auto"]), results.spread(measured["grid"]))
    same = a["best"] == gs["best"]
    verdict = "the same point" if same else ("within noise" if ratio <= 1 + noise else "NOT within noise")
    print(
        f"auto spent {a['trial_seconds'] / gs['trial_seconds']:.2f}x the grid's trial-seconds ({a['trials']} of "
        f"{gs['trials']} trials); its winner's remeasured step time is {ratio:.3f}x the grid winner's (median of "
        f"{args.remeasure} interleaved runs each; their spread {100 * noise:.0f}%): {verdict}"
    )
    grid_rank = sorted((r for r in g["candidates"] if r["measured_s"]), key=lambda r: r["measured_s"])
    place = next((i + 1 for i, r in enumerate(grid_rank) if r["candidate"] == a["best"]), None)
    print(f"auto's winner is number {place} of the grid's {len(grid_rank)} measured points (by the grid's own runs)")
    print(f"auto stopped: {reports['auto']['stop']}")
    print(f"work folder: {work}")


def main() -> None:
    args = _parser().parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="auto_vs_grid_"))
    work.mkdir(parents=True, exist_ok=True)
    uri = "sqlite:///" + str(work / "mlruns.db")
    base = [
        "+chip=cpu",
        f"model={args.model}",
        f"trainer.steps={args.steps}",
        f"trainer.global_batch={args.global_batch}",
        "trainer.seq_len=64",
        "data.num_workers=0",
        f"launch.world_size={args.devices}",
    ]
    space = [
        f"hydra.sweeper.space.schedules=[{args.space_schedules}]",
        f"hydra.sweeper.space.activation_checkpointing=[{args.space_checkpointing}]",
        f"hydra.sweeper.space.sequence_parallel=[{args.space_sequence_parallel}]",
        f"hydra.sweeper.space.dp_shard=[{args.space_dp_shard}]",
    ]
    # the layout search alone on both sides: stage 3 (polish) is not part of the grid
    search = ["+sweep=auto", *base, *space, "hydra.sweeper.polish_repeats=0"]
    grid_wall = cli(
        [*search, "tracking.experiment=grid", "hydra.sweeper.exhaustive=true", "hydra.sweeper.max_trials=1000"],
        work,
        work / "grid.log",
    )
    auto_wall = cli(
        [*search, "tracking.experiment=auto", f"hydra.sweeper.max_trials={args.max_trials}",
         f"hydra.sweeper.confirm={args.confirm}"], work, work / "auto.log",
    )  # fmt: skip
    reports = {"grid": report(uri, "grid"), "auto": report(uri, "auto")}
    walls = {"grid": grid_wall, "auto": auto_wall}
    measured = remeasure(reports, args.remeasure, work, uri)
    print_comparison(args, reports, walls, measured, work)


if __name__ == "__main__":
    main()
