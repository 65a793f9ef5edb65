"""The best config in MLflow, and the command that reproduces it.

``python -m orchestrator.best --experiment NAME`` ranks the configs of an experiment by an
objective (median step time after warm-up by default), among finished runs whose loss did not
diverge (non-finite, or ending above where it started). Repeats of one config (one
``trial.config_hash``) count as one candidate, valued by the median of their runs. Filters:
``--sweep``, ``--chip``, ``--model``, ``--status``, and ``--filter EXPR`` (any MLflow search
filter, e.g. ``"metrics.final_loss < 5 and params.`trainer.lr` = '0.003'"``), all of which a run
must match. ``--json`` prints the best as JSON (keys ``run_id``, ``objective``, ``value``,
``overrides``, ``command`` and more); ``--write PATH`` saves its resolved config as a Hydra
config: put it at ``DIR/experiment/NAME.yaml`` and run
``python -m orchestrator --config-dir DIR +experiment=NAME``. Exit codes: :mod:`orchestrator.cli`
(3: no run matched).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator import cli, results, statuses, tags, tracking
from orchestrator.results import fmt


def rank(
    uri: str,
    experiment: str,
    objective: str = "step_time_median_s",
    direction: str = "minimize",
    sweep: Optional[str] = None,
    chip: Optional[str] = None,
    model: Optional[str] = None,
    status: str = statuses.FINISHED,
    filter_string: Optional[str] = None,
) -> Dict[str, Any]:
    """Candidates (configs) best first, and what was left out and why; ``filter_string`` is an
    MLflow filter the runs must match besides the tag filters."""
    runs = results.search(
        uri,
        experiment,
        cli.build_filter(filter_string, {tags.SWEEP: sweep, "chip": chip, "model": model, tags.TRIAL_STATUS: status}),
    )
    excluded: List[Dict[str, str]] = []
    groups: Dict[str, List[Any]] = {}
    for run in runs:
        v = results.value(run, objective)
        if v is None:
            excluded.append({"run_id": run.info.run_id, "reason": f"no {objective}"})
            continue
        losses = results.loss_history(uri, run.info.run_id)
        why = results.diverged(losses, run.data.metrics.get("final_loss"))
        if why:
            excluded.append({"run_id": run.info.run_id, "reason": f"diverged: {why}"})
            continue
        groups.setdefault(run.data.tags.get(tags.CONFIG_HASH) or run.info.run_id, []).append(run)
    candidates = []
    for chash, members in groups.items():
        values = [results.value(r, objective) for r in members]
        med = statistics.median(values)
        # the run that stands for the config: the one nearest its median (the newest on a tie)
        rep = min(members, key=lambda r: (abs(results.value(r, objective) - med), -r.info.start_time))
        candidates.append(
            {
                "config_hash": chash,
                "value": med,
                "runs": [r.info.run_id for r in members],
                "spread": results.spread(values),
                "run": rep,
            }
        )
    candidates.sort(key=lambda c: c["value"], reverse=direction == "maximize")
    return {"candidates": candidates, "excluded": excluded, "considered": len(runs)}


def describe(uri: str, objective: str, direction: str, cand: Dict[str, Any], experiment: str) -> Dict[str, Any]:
    run = cand["run"]
    overrides = results.overrides_of(uri, run)
    tags = run.data.tags
    return {
        "run_id": run.info.run_id,
        "objective": objective,
        "value": cand["value"],
        "overrides": overrides,
        "command": results.command(overrides),
        "direction": direction,
        "experiment": experiment,
        "config_hash": cand["config_hash"],
        "runs": cand["runs"],
        "spread": cand["spread"],
        "final_loss": run.data.metrics.get("final_loss"),
        "chip": tags.get("chip"),
        "model": tags.get("model"),
        "layout": tags.get("layout"),
        "precision": tags.get("precision"),
        "sweep": tags.get("sweep"),
    }


def table(uri: str, objective: str, candidates: List[Dict[str, Any]], top: int) -> str:
    header = [
        "rank",
        objective,
        "runs",
        "spread",
        "final_loss",
        "chip",
        "model",
        "layout",
        "precision",
        "run_id",
        "overrides",
    ]
    rows = []
    for i, c in enumerate(candidates[:top], 1):
        run = c["run"]
        t = run.data.tags
        name = t.get(tags.RUN_NAME, "")
        rows.append(
            [
                str(i),
                fmt(c["value"]),
                str(len(c["runs"])),
                f"{100 * c['spread']:.1f}%",
                fmt(run.data.metrics.get("final_loss")),
                t.get("chip", ""),
                t.get("model", ""),
                t.get("layout", ""),
                t.get("precision", ""),
                run.info.run_id[:12],
                "" if name == "default" else name,
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return "\n".join(lines)


def experiment_yaml(uri: str, best: Dict[str, Any], stem: str) -> str:
    """The best run's resolved config (the sections that define the trial) as a global package."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.create(results.artifact_text(uri, best["run_id"], "config.yaml"))
    body = OmegaConf.create({k: resolved[k] for k in tracking.HASHED_SECTIONS if k in resolved})
    head = (
        f"# @package _global_\n"
        f"# The best config of experiment {best['experiment']} by {best['objective']} ({best['direction']}): "
        f"{fmt(best['value'])}, run {best['run_id']}\n"
        f"# (config hash {best['config_hash']}); written by python -m orchestrator.best.\n"
        f"# Run it: python -m orchestrator --config-dir DIR +experiment={stem}"
        f"  (this file: DIR/experiment/{stem}.yaml)\n"
    )
    return head + OmegaConf.to_yaml(body)


def _parser() -> Any:
    ap = cli.parser("orchestrator.best", __doc__.split("\n\n")[0])
    cli.add_tracking_args(ap)
    ap.add_argument("--objective", default="step_time_median_s", help="any metric the runs log")
    ap.add_argument("--direction", default="minimize", choices=results.DIRECTIONS)
    ap.add_argument("--sweep", help="only this sweep's trials (its id, the sweep tag)")
    ap.add_argument("--chip", help="only trials on this chip (tag chip)")
    ap.add_argument("--model", help="only trials of this model (tag model)")
    ap.add_argument(
        "--status", default=statuses.FINISHED, help="trial.status of the runs considered (default finished)"
    )
    cli.add_filter_arg(ap)
    ap.add_argument("--top", type=int, default=10, help="rows in the table (default 10)")
    cli.add_json_arg(ap, "the best")
    ap.add_argument("--write", metavar="PATH", help="save the best config as a Hydra config (DIR/experiment/NAME.yaml)")
    return ap


def _print_best(uri: str, args: Any, ranked: Dict[str, Any], best: Dict[str, Any]) -> None:
    """The ranked table, the best run and the command that reproduces it, as text."""
    cands = ranked["candidates"]
    n_div = sum(e["reason"].startswith("diverged") for e in ranked["excluded"])
    print(
        f"{len(cands)} config(s) from {ranked['considered']} {args.status} run(s) in experiment "
        f"{args.experiment}, by {args.objective} ({args.direction}); {n_div} diverged run(s) left out"
    )
    print(table(uri, args.objective, cands, args.top))
    print(
        f"\nbest: run {best['run_id']}, {args.objective}={fmt(best['value'])} "
        f"(median of {len(best['runs'])} run(s)), final_loss={fmt(best['final_loss'])}"
    )
    print(best["command"])


def _write(uri: str, best: Dict[str, Any], path: Path, to_stderr: bool) -> None:
    """Save the best config as a Hydra experiment config and say how to run it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(experiment_yaml(uri, best, path.stem))
    best["written"] = str(path)
    hint = (
        f"python -m orchestrator --config-dir {path.parent.parent} +experiment={path.stem}"
        if path.parent.name == "experiment"
        else f"(Hydra loads +experiment={path.stem} from a folder named experiment/: "
        f"write it to DIR/experiment/{path.stem}.yaml)"
    )
    print(f"wrote {path}; run it: {hint}", file=sys.stderr if to_stderr else sys.stdout)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.top < 1:
        return cli.bad_input(f"--top={args.top}: must be positive")
    why = cli.check_filter(args.filter)
    uri = cli.tracking_uri(args.tracking_uri)
    why = why or cli.experiment_error(uri, args.experiment)
    if why:
        return cli.bad_input(why)
    tags = {"sweep": args.sweep, "chip": args.chip, "model": args.model, "status": args.status}
    ranked = rank(uri, args.experiment, args.objective, args.direction, filter_string=args.filter, **tags)
    cands = ranked["candidates"]
    if not cands:
        filters = ", ".join(f"{k}={v}" for k, v in {**tags, "filter": args.filter}.items() if v)
        return cli.no_match(
            f"--experiment={args.experiment}: no run with {args.objective} ({filters}) among "
            f"{ranked['considered']} matching run(s); {len(ranked['excluded'])} excluded",
            [f"{e['run_id']}: {e['reason']}" for e in ranked["excluded"][:10]],
        )
    best = describe(uri, args.objective, args.direction, cands[0], args.experiment)
    if args.json:
        if args.write:
            _write(uri, best, Path(args.write), to_stderr=True)
        best["excluded"] = ranked["excluded"]
        print(json.dumps(best, indent=1, default=str))
    else:
        _print_best(uri, args, ranked, best)
        if args.write:
            _write(uri, best, Path(args.write), to_stderr=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
