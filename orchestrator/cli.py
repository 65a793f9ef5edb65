"""What the result tools share on the command line (``best``, ``report``, ``compare``, ``plan``).

Every tool takes ``--tracking-uri`` (default ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlruns.db``
in the working directory), ``--experiment`` (default :attr:`TrackingConfig.experiment`) and
``--json``, and ends with one of four exit codes:

    0  done
    1  failed: something broke (the traceback says what)
    2  bad input: a flag, argument or override is wrong; one ``error:`` line names it and why
    3  nothing matched: the input is sound, but no run, sweep or trial fits it

Old spellings still work, with a warning on stderr: ``--uri`` for ``--tracking-uri`` and
``--attach`` for ``--log``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from orchestrator import exit_codes


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line (exit 2), as the tools' own errors are."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(exit_codes.BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


def parser(module: str, description: str) -> Parser:
    """The tool's parser (the description and the exit codes as written); its ``prog`` is the
    console script when run as one, else ``python -m MODULE``."""
    script = module.replace(".", "-")
    prog = script if Path(sys.argv[0]).name == script else f"python -m {module}"
    return Parser(
        prog=prog, description=description, epilog=exit_codes.HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )


class _OldSpelling(argparse.Action):
    """A flag's former name: sets what the new name sets, and says so on stderr."""

    def __init__(self, option_strings, dest, new: str, flag: bool = False, **kwargs):
        super().__init__(option_strings, dest, nargs=0 if flag else None, default=argparse.SUPPRESS, **kwargs)
        self.new, self.flag = new, flag

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, True if self.flag else values)


def default_experiment() -> str:
    from orchestrator.config import TrackingConfig

    return TrackingConfig.experiment


def add_tracking_args(ap: argparse.ArgumentParser, defaults: bool = True) -> None:
    """``--tracking-uri`` (old spelling ``--uri``) and ``--experiment``. With ``defaults=False``
    both stay None when not given (``plan``: its config's ``tracking.*`` supplies them)."""
    exp = default_experiment()
    where = "" if defaults else "tracking.experiment, "
    ap.add_argument(
        "--tracking-uri",
        metavar="URI",
        help=f"MLflow tracking URI (default: {'' if defaults else 'tracking.uri, else '}$MLFLOW_TRACKING_URI, "
        "else sqlite:///mlruns.db here; old spelling --uri)",
    )
    ap.add_argument("--uri", dest="tracking_uri", action=_OldSpelling, new="--tracking-uri", help=argparse.SUPPRESS)
    ap.add_argument(
        "--experiment",
        metavar="NAME",
        default=exp if defaults else None,
        help=f"MLflow experiment (default: {where}{exp})",
    )


def add_json_arg(ap: argparse.ArgumentParser, what: str) -> None:
    ap.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


def add_log_arg(ap: argparse.ArgumentParser, where: str) -> None:
    """``--log`` (old spelling ``--attach``): log the tool's files to MLflow as artifacts."""
    ap.add_argument("--log", action="store_true", help=f"log the report's files to MLflow, on {where} (old: --attach)")
    ap.add_argument("--attach", dest="log", action=_OldSpelling, new="--log", flag=True, help=argparse.SUPPRESS)


def add_filter_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--filter",
        metavar="EXPR",
        help="an MLflow search filter the runs must match too, e.g. \"metrics.final_loss < 5 and tags.chip = 'cpu'\"",
    )


def tracking_uri(given: Optional[str]) -> str:
    from orchestrator import tracking

    return tracking.resolve_uri({"uri": given})


def bad_input(line: str) -> int:
    """Print one ``error:`` line (it names the flag and the reason); the bad-input exit code."""
    print(f"error: {line}", file=sys.stderr)
    return exit_codes.BAD_INPUT


def no_match(line: str, details: Sequence[str] = ()) -> int:
    """Print the ``error:`` line saying what matched nothing (and why, indented); exit code 3."""
    print(f"error: {line}", file=sys.stderr)
    for d in details:
        print(f"  {d}", file=sys.stderr)
    return exit_codes.NO_MATCH


def store_error(uri: str, flag: str = "--tracking-uri") -> Optional[str]:
    """Why ``uri`` names no store to read: a sqlite file that does not exist (reading it would
    create an empty one); None otherwise."""
    from orchestrator.mlflow_store import sqlite_file

    path = sqlite_file(uri)
    if path is not None and not path.is_file():
        return f"{flag}={uri}: no such sqlite file ({os.path.abspath(path)})"
    return None


def experiment_error(
    uri: str, experiment: str, flags: Sequence[str] = ("--tracking-uri", "--experiment")
) -> Optional[str]:
    """Why the tool cannot read ``experiment`` from ``uri``: no store there, or no such experiment
    (the line names ``flags``: the tool's names for the two)."""
    from orchestrator import tracking

    why = store_error(uri, flags[0])
    if why is None and tracking.client(uri).get_experiment_by_name(experiment) is None:
        why = f"{flags[1]}={experiment}: no such experiment in {uri}"
    return why


def check_filter(expr: Optional[str]) -> Optional[str]:
    """Why ``expr`` is not an MLflow filter string (the error line for ``--filter``), or None."""
    if not expr:
        return None
    try:
        from mlflow.utils.search_utils import SearchUtils
    except ImportError:  # an MLflow without it: search_runs itself rejects a bad filter
        return None
    try:
        SearchUtils.parse_search_filter(expr)
    except Exception as err:  # noqa: BLE001 - MlflowException: its first line is the reason
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"--filter={expr}: {reason}"
    return None


def build_filter(user: Optional[str] = None, wanted: Optional[Dict[str, Any]] = None) -> str:
    """The MLflow filter string of the tool's own tag filters (tag name to value, ``None`` left
    out) and the user's ``--filter``, all of which a run must match."""
    from orchestrator import results

    return " and ".join(p for p in (results.tag_filter(wanted or {}), (user or "").strip()) if p)
