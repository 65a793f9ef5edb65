"""Tuning reports: what each change did to the objective, as markdown and PNG plots.

``python -m orchestrator.report --experiment NAME [--sweep ID]`` writes the report of a sweep
(the newest one of the experiment by default). An OVAT sweep stored its report on its parent run
(``tuning_report.json``); it is rendered again from there. Any other sweep (a grid) is read from
its trials: points in launch order, the first one as the baseline, S of every point against it,
the effect of each variable alone (the points that differ from the baseline in that variable
only), the quality gate, and the best point with the command that reproduces it.

Files: ``tuning_report.md``, ``tuning_report.json``, ``objective_<variable>.png`` (the objective
per candidate value, each repeat a dot) and ``loss_curves.png`` (baseline and finalists).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator import auto_report, cli, exit_codes, results, tags
from orchestrator.grid_report import find_parent, from_trials
from orchestrator.report_render import REPORT, attach, render


def _stored(uri: str, run_id: str, name: str = f"{REPORT}.json") -> Optional[Dict[str, Any]]:
    try:
        return json.loads(results.artifact_text(uri, run_id, name))
    except Exception:  # noqa: BLE001 - no stored report: build it from the trials
        return None


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("orchestrator.report", __doc__.split("\n\n")[0])
    cli.add_tracking_args(ap)
    ap.add_argument("--sweep", help="sweep id or parent run id (default: the experiment's newest sweep)")
    cli.add_filter_arg(ap)
    ap.add_argument("--out", help="folder for the report (default: reports/<sweep id>)")
    ap.add_argument("--objective", default="step_time_median_s", help="for sweeps without a stored report")
    ap.add_argument("--direction", default="minimize", choices=results.DIRECTIONS)
    ap.add_argument("--min-speedup", type=float, default=1.02)
    ap.add_argument("--loss-band", type=float, default=0.05)
    cli.add_json_arg(ap, "the report (what tuning_report.json holds, and the files written)")
    cli.add_log_arg(ap, "the sweep's parent run")
    args = ap.parse_args(argv)
    uri = cli.tracking_uri(args.tracking_uri)
    why = cli.check_filter(args.filter) or cli.experiment_error(uri, args.experiment)
    if why:
        return cli.bad_input(why)
    parent = find_parent(uri, args.experiment, args.sweep)
    if parent is None:
        what = f"no sweep {args.sweep}" if args.sweep else "no sweep"
        return cli.no_match(f"--experiment={args.experiment}: {what} in {uri}")
    sweep_id = parent.data.tags[tags.SWEEP]
    auto = None if args.filter else _stored(uri, parent.info.run_id, auto_report.NAME + ".json")
    if auto is not None:  # an automatic search (+sweep=auto): its own report, rendered again
        return _emit(auto, auto_report.render(auto, Path(args.out or Path("reports") / sweep_id)), args.json)
    # a stored (OVAT) report is the study's own record; --filter asks for the matching trials instead
    data = None if args.filter else _stored(uri, parent.info.run_id)
    if data is None:
        try:
            data = from_trials(
                uri,
                args.experiment,
                sweep_id,
                args.objective,
                args.direction,
                args.min_speedup,
                args.loss_band,
                args.filter,
            )
        except LookupError as err:
            return cli.no_match(f"--sweep={sweep_id}: {err}" + (f" and --filter={args.filter}" if args.filter else ""))
    out = Path(args.out or Path("reports") / sweep_id)
    files = render(data, out)
    if args.log:
        attach(uri, parent.info.run_id, files, data)
    return _emit(data, files, args.json)


def _emit(data: Dict[str, Any], files: List[Path], as_json: bool) -> int:
    """Print a rendered report: its JSON and files, or its markdown and where it was written."""
    if as_json:
        print(json.dumps({**data, "files": [str(f) for f in files]}, indent=1, default=str))
    else:
        print(files[0].read_text())
        print(f"report: {files[0]} ({len(files) - 2} plot(s) beside it)")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
