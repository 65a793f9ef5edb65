"""MLflow: one run per trial, its resolved config, per-step metrics in batches, status tags.

The tracking URI is ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite file in the
working directory (``sqlite:///mlruns.db``) whose experiments keep their artifacts in
``./mlartifacts`` beside it. MLflow is imported lazily: composing or validating a config never
touches it, so a rejected config leaves no run behind.

What a run carries besides params and metrics, by MLflow's own conventions:

- its experiment is tagged ``mlflow.experimentKind=custom_model_development``, the kind MLflow 3's
  UI opens in the model-training view (runs table, charts) rather than the GenAI one where its
  workflow switch is off; the pages we print carry the switch's own query (:data:`UI_VIEW`);
- the system tags MLflow's ``start_run`` sets (``mlflow.user``, ``mlflow.source.*``, git commit),
  resolved by MLflow's run-context registry for the program that makes our runs;
- a description (``mlflow.note.content``): the command that reproduces the trial, and at its end
  the result (status, final loss, step time, tokens/s, peak memory);
- the training data as a run input (``mlflow.data``: name, source, digest).

Trouble with the store: :func:`store_problem` says in a few seconds why a store cannot be used
(a trial refuses to start on it); during a trial, rank 0's :class:`MlflowReporter` never waits on
the store: it journals every record to a local file, delivers in the background, retries with
backoff while the store is away, and never delivers a step twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, TypeVar
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from orchestrator import cache

log = logging.getLogger("orchestrator")
T = TypeVar("T")

# sections that define what a trial computes; tracking and launch details do not change it
HASHED_SECTIONS = ("chip", "parallel", "precision", "comm", "model", "data", "trainer")
STATUS_OK = "finished"
STATUS_KILLED = "killed"  # the driver was interrupted (Ctrl-C, SIGTERM) while the trial ran
FAILED_STATUSES = ("infeasible", "oom", "nonfinite", "timeout", "crash", "node_lost", "unsupported_op", STATUS_KILLED)
# MLflow's own run status for a trial status: KILLED for an interrupt, FAILED for any other failure
RUN_STATUS = {STATUS_OK: "FINISHED", STATUS_KILLED: "KILLED"}

# MLflow 3's UI picks an experiment's view from this tag (EXPERIMENT_KIND_TAG_KEY in
# mlflow/server/js/src/experiment-tracking/utils/ExperimentKindUtils.ts); the model-training
# kind is ExperimentKind.CUSTOM_MODEL_DEVELOPMENT in .../experiment-tracking/constants.ts
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # mlflow.utils.mlflow_tags.MLFLOW_RUN_NOTE: the run's Description
RESULT_HEADING = "\n\n**Result**: "  # the note's part that the run's end writes (and rewrites)
UNDELIVERED_TAG = "tracking.undelivered"  # the journal of records the store never got
MAX_TAG_VALUE = 8000  # MLflow's limit on a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)

# a step row's wall-clock time (seconds since the epoch, when the step ended): the timestamp of
# its metrics, never a metric itself (keys starting with "_" are not metrics; trainers/report.py)
ROW_TIME = "_time"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit (mlflow.utils.validation.MAX_METRICS_PER_BATCH)
FINISH_TIMEOUT_S = 60.0  # rank 0 waits this long at the end for the store to take what is queued
LEFTOVER_TIMEOUT_S = 30.0  # the driver's own try with what a worker left undelivered
END_RUN_BUDGET_S = 60.0  # the run's end is retried this long
BACKOFF_S = (0.5, 5.0)  # a failed delivery is retried after 0.5 s, doubling up to 5 s
# a worker's MLflow HTTP client fails fast and leaves retrying to the reporter: by default it
# retries 7 times with backoff and waits 120 s per request (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
# MLFLOW_HTTP_REQUEST_TIMEOUT in mlflow/environment_variables.py, read per request by
# mlflow.utils.rest_utils.http_request); set only in worker processes, and never over a user's
WORKER_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class StoreUnreachable(ValueError):
    """The tracking store cannot be used; the message is one line naming ``tracking.uri``."""


def resolve_uri(tracking: DictConfig | Dict[str, Any]) -> str:
    uri = tracking.get("uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return str(uri)
    return "sqlite:///" + str(Path("mlruns.db").resolve())


def sqlite_file(uri: str) -> Optional[Path]:
    """The file of a ``sqlite:///PATH`` store (its query string dropped); None for any other
    store and for an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?")[0]
    return None if path in ("", ":memory:") else Path(path)


def default_artifact_location(uri: str) -> Optional[str]:
    """``mlartifacts/`` next to a sqlite file; servers and file stores choose their own."""
    path = sqlite_file(uri)
    if path is not None:
        return (path.parent / "mlartifacts").resolve().as_uri()
    return None


def config_hash(cfg: DictConfig) -> str:
    body = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in HASHED_SECTIONS if cfg.get(k) is not None}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ----------------------------------------------------------------------------- a store's trouble


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    # MLflow's HTTP errors put the cause (``Connection refused``) at the end of a long line
    return line if len(line) <= limit else line[: limit // 2 - 3] + " ... " + line[-(limit // 2 - 2) :]


def store_problem(uri: str, timeout_s: float = 5.0) -> Optional[str]:
    """Why the store at ``uri`` cannot be used, in a few words; None when it can. Fast, so a
    trial can refuse to start: one request with a short timeout to a server (MLflow's client
    would retry for minutes), a look at the directory of a sqlite file or file store."""
    scheme = urlparse(uri).scheme.lower()
    try:
        if scheme in ("http", "https"):
            return _http_problem(uri, timeout_s)
        if scheme == "sqlite":
            path = sqlite_file(uri)
            return None if path is None else _path_problem(path, is_dir=False)
        if scheme in ("", "file"):
            return _path_problem(Path(urlparse(uri).path if scheme else uri), is_dir=True)
        return _client_problem(uri, max(timeout_s, 30.0))  # databricks, postgresql, ...: ask MLflow
    except Exception as err:  # noqa: BLE001 - any failure to look is the reason
        return _first_line(err)


def _http_problem(uri: str, timeout_s: float) -> Optional[str]:
    import urllib.error
    import urllib.request

    # the tracking server's liveness route (``/health`` in mlflow/server/__init__.py); any HTTP
    # answer, even an error, means a server is there (MLflow's own errors then say more)
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as err:
        reason = err.reason
        return f"no answer ({getattr(reason, 'strerror', None) or reason})"
    except OSError as err:  # a timeout, a reset connection
        return f"no answer ({getattr(err, 'strerror', None) or err or type(err).__name__})"


def _path_problem(path: Path, is_dir: bool) -> Optional[str]:
    """A local store: its directory must exist or be creatable, and be writable."""
    folder = path if is_dir else path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create the directory {folder} ({err.strerror or err})"
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    return None


def _client_problem(uri: str, timeout_s: float) -> Optional[str]:
    """Any other store: one search, in a thread that is given ``timeout_s`` to answer."""
    box: Dict[str, BaseException] = {}

    def probe() -> None:
        try:
            client(uri).search_experiments(max_results=1)
        except Exception as err:  # noqa: BLE001 - the reason is reported
            box["err"] = err

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return f"no answer in {timeout_s:g} s"
    return _first_line(box["err"]) if "err" in box else None


def check_store(tracking: DictConfig | Dict[str, Any]) -> str:
    """The store's URI; raises StoreUnreachable (one line naming ``tracking.uri``) when it cannot
    be used."""
    uri = resolve_uri(tracking)
    why = store_problem(uri)
    if why:
        from_env = not tracking.get("uri") and "MLFLOW_TRACKING_URI" in os.environ
        source = " (from $MLFLOW_TRACKING_URI)" if from_env else ""
        raise StoreUnreachable(f"tracking.uri={uri}{source}: the MLflow store cannot be used: {why}")
    return uri


def _transient(err: BaseException) -> bool:
    """Worth retrying: the store did not answer or failed inside; not a request it refused (HTTP
    4xx but 429, or an inactive run), which would fail the same way again."""
    status = getattr(err, "get_http_status_code", None)
    code = getattr(err, "error_code", "")
    if status is None:
        return True
    http = status()
    return not ((400 <= http < 500 and http != 429) or code == "INVALID_STATE")


def retrying(fn: Callable[[], T], what: str, budget_s: float = END_RUN_BUDGET_S) -> T:
    """``fn()``, retried with backoff for up to ``budget_s`` while the store is away (the store's
    refusals are raised at once)."""
    delay, deadline, warned = BACKOFF_S[0], time.monotonic() + budget_s, False
    while True:
        try:
            return fn()
        except Exception as err:
            if not _transient(err) or time.monotonic() + delay > deadline:
                raise
            if not warned:
                log.warning("%s: the MLflow store failed (%s); retrying for %.0f s", what, _first_line(err), budget_s)
                warned = True
            time.sleep(delay)
            delay = min(2 * delay, BACKOFF_S[1])


# ----------------------------------------------------------------------------- experiments and runs


def _store_template(cache_dir: Path) -> Optional[Path]:
    """An empty sqlite store migrated to the installed MLflow's schema, made once per MLflow
    version under ``cache_dir``; None when it cannot be made there."""
    import mlflow

    template = cache_dir / f"mlflow-{mlflow.__version__}-empty.db"
    if template.is_file():
        return template
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache.tmp_name(template)
        client("sqlite:///" + str(tmp)).search_experiments()  # MLflow creates and migrates it
        os.replace(tmp, template)  # whole or not at all, for a process making it at the same time
    except Exception as err:  # noqa: BLE001 - a cache: the store is then made by MLflow in place
        log.debug("no MLflow store template in %s: %s", cache_dir, err)
        return None
    return template


def seed_sqlite_store(uri: str) -> bool:
    """Make a new sqlite store by copying an empty one already migrated, not by MLflow's ~50
    schema migrations (about 4 s on a 2-core machine, on every trial's critical path when each
    trial of a study or test writes a store of its own). The copy then holds what MLflow would
    have written: its Default experiment, whose artifacts go to ``./mlruns/0`` of the working
    directory. A file already there is left alone (also one another process made meanwhile: the
    copy is linked in without replacing). True when the store was seeded. The template is kept in
    :func:`orchestrator.cache.root`."""
    path = sqlite_file(uri)
    if path is None or path.exists():
        return False
    template = _store_template(cache.root())
    if template is None:
        return False
    import sqlite3

    tmp = cache.tmp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, tmp)
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(tmp)) as db, db:
            db.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                (str(Path.cwd() / "mlruns" / "0"), now, now),
            )
        os.link(tmp, path)  # fails if the store appeared meanwhile: that one is kept
        return True
    except OSError as err:
        log.debug("sqlite store %s not seeded: %s", path, err)
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def experiment_id(uri: str, name: str, artifact_location: Optional[str] = None) -> str:
    """The experiment ``name`` (created when missing), tagged as a model-training experiment for
    MLflow 3's UI; an experiment of ours from before the tag gets it now (a kind a user set is
    left alone). A sqlite store that does not exist yet is seeded (:func:`seed_sqlite_store`)."""
    seed_sqlite_store(uri)
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is None:
        try:
            return c.create_experiment(
                name,
                artifact_location=artifact_location or default_artifact_location(uri),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        except Exception:  # another process created it first
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
        c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


@functools.lru_cache(maxsize=1)
def source_tags() -> Dict[str, str]:
    """The system tags MLflow's own ``start_run`` gives a run (``mlflow.user``,
    ``mlflow.source.type``/``name``, ``mlflow.source.git.*``): MLflow's run-context registry
    (``mlflow.tracking.context.registry.resolve_tags``, as ``mlflow.tracking.fluent.start_run``
    calls it) resolves them from ``sys.argv[0]``; the source named is the program that makes our
    runs, ``orchestrator/__main__.py``, whatever process hosts it (pytest, a Ray worker), and
    the git tags are that file's repository's. Cached for the process (``cache_clear``)."""
    from mlflow.tracking.context import registry
    from mlflow.utils import mlflow_tags
    from mlflow.utils.git_utils import get_git_branch, get_git_commit, get_git_repo_url

    tags = dict(registry.resolve_tags())
    entry = str(Path(__file__).resolve().with_name("__main__.py"))
    if tags.get(mlflow_tags.MLFLOW_SOURCE_NAME) != entry:
        tags[mlflow_tags.MLFLOW_SOURCE_NAME] = entry
        git = {
            mlflow_tags.MLFLOW_GIT_COMMIT: get_git_commit(entry),
            mlflow_tags.MLFLOW_GIT_BRANCH: get_git_branch(entry),
            mlflow_tags.MLFLOW_GIT_REPO_URL: get_git_repo_url(entry),
        }
        for key, value in git.items():
            tags.pop(key, None)
            if value:
                tags[key] = value
    return {k: str(v) for k, v in tags.items()}


def command(overrides: Iterable[str], multirun: bool = False) -> str:
    """The command line that runs these overrides again, quoted for a POSIX shell."""
    args = (["-m"] if multirun else []) + list(overrides)
    return " ".join(["python", "-m", "orchestrator", *map(shlex.quote, args)])


def run_note(overrides: Iterable[str], what: str = "this trial", multirun: bool = False) -> str:
    """A run's description (markdown): the command that reproduces it."""
    return f"Reproduce {what}:\n\n```\n{command(overrides, multirun)}\n```"


# the figures of a trial's result in its description: summary key, how it reads
RESULT_FIGURES = (
    ("final_loss", "final loss {:.4f}"),
    ("step_time_median_s", "step time {:.4f} s (median)"),
    ("tokens_per_s_median", "{:,.0f} tokens/s"),
    ("peak_mem_gb", "peak memory {:.2f} GB"),
)


def result_note(status: str, reason: str = "", summary: Optional[Dict[str, Any]] = None) -> str:
    """The end of a run's description: its status, and for a trial that trained its headline
    figures (final loss, median step time, tokens/s, peak memory)."""
    s = summary or {}
    numbers = {k: s.get(k) for k, _ in RESULT_FIGURES}
    figures = ", ".join(
        form.format(numbers[k])
        for k, form in RESULT_FIGURES
        if isinstance(numbers[k], (int, float)) and not isinstance(numbers[k], bool)
    )
    text = f"**{status}**"
    if figures:
        text += f": {figures}"
    if reason:
        text += f"\n\n{reason}"
    return text


def with_result(note: str, result: str) -> str:
    """``note`` with its result part (re)written; within MLflow's tag length."""
    head = (note or "").split(RESULT_HEADING)[0]
    return (head + RESULT_HEADING + result)[:MAX_TAG_VALUE]


def dataset_input(data: DictConfig | Dict[str, Any]) -> Any:
    """The trial's training data as an MLflow dataset input (``mlflow.entities.DatasetInput``, the
    entity ``mlflow.log_input`` logs; context tag ``mlflow.data.context=train``): name
    ``data.name``, its source as MLflow's dataset sources write theirs (``{"uri": ...}`` of a local
    file or folder, as ``mlflow.data.artifact_dataset_sources``' local source; ``{"tags": ...}`` for
    data made by code, as ``mlflow.data.code_dataset_source``), and a digest of what defines the
    tokens (for a token file, its size and first MiB too), 8 hex digits as MLflow's own digests
    (``mlflow.data.digest_utils``)."""
    import sysconfig

    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    name = str(data.get("name"))
    defining = {k: data.get(k) for k in ("name", "path", "max_corpus_mb", "val_fraction")}
    if name == "memmap" and data.get("path"):
        path = Path(str(data.get("path"))).expanduser().resolve()
        source_type, source = "local", {"uri": path.as_uri()}
        if path.is_file():
            with open(path, "rb") as f:
                defining["head_sha256"] = hashlib.sha256(f.read(1 << 20)).hexdigest()
            defining["bytes"] = path.stat().st_size
    elif name == "stdlib":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        source_type, source = "local", {"uri": stdlib.as_uri()}
        defining["python"] = sysconfig.get_python_version()
    else:
        source_type, source = "code", {"tags": {"generator": f"trainers.data ({name})"}}
    digest = hashlib.sha256(json.dumps(defining, sort_keys=True, default=str).encode()).hexdigest()[:8]
    profile = {k: v for k, v in defining.items() if k not in ("name", "path") and v is not None}
    ds = Dataset(name, digest, source_type, json.dumps(source), profile=json.dumps(profile))
    return DatasetInput(ds, tags=[InputTag(MLFLOW_DATASET_CONTEXT, "train")])


def start_run(cfg: DictConfig, overrides: Iterable[str], tags: Dict[str, str]) -> tuple[str, str]:
    """Create the trial's run with params, tags, its description, its dataset and config
    artifacts; return (uri, run_id)."""
    from mlflow.entities import Param

    uri = resolve_uri(cfg.tracking)
    exp = experiment_id(uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
    c = client(uri)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    chash = config_hash(cfg)
    overrides = list(overrides)
    name = " ".join(overrides) or "default"
    all_tags = {
        **source_tags(),
        NOTE_TAG: run_note(overrides)[:MAX_TAG_VALUE],
        "trial.status": "running",
        "trial.config_hash": chash,
        "mlflow.runName": name[:250],
        **tags,
    }
    run = c.create_run(exp, run_name=name[:250], tags=all_tags)
    rid = run.info.run_id
    params = flatten(resolved)
    params["config_hash"] = chash
    items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(rid, params=items[i : i + 100])
    c.log_text(rid, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
    c.log_text(rid, "\n".join(overrides) + "\n", "overrides.txt")
    if cfg.get("data") is not None:
        try:
            c.log_inputs(rid, datasets=[dataset_input(cfg.data)])
        except Exception as err:  # noqa: BLE001 - the dataset is a record of the run, not its work
            log.warning("run %s: dataset input not recorded: %s", rid, _first_line(err))
    return uri, rid


def log_metrics(uri: str, run_id: str, values: Dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
    if metrics:
        client(uri).log_batch(run_id, metrics=metrics)


def end_run(
    uri: str,
    run_id: str,
    status: str,
    reason: str = "",
    summary: Optional[Dict[str, Any]] = None,
    tags: Optional[Dict[str, str]] = None,
) -> None:
    """Record how the trial ended: ``trial.status`` (and ``trial.reason``), the result in the run's
    description, MLflow's run status. Retried while the store is briefly away."""
    from mlflow.entities import RunTag

    def _end() -> None:
        c = client(uri)
        note = c.get_run(run_id).data.tags.get(NOTE_TAG, "")
        batch = {"trial.status": status, NOTE_TAG: with_result(note, result_note(status, reason, summary))}
        if reason:
            batch["trial.reason"] = reason[:5000]
        batch.update(tags or {})
        c.log_batch(run_id, tags=[RunTag(k, v) for k, v in batch.items()])
        c.set_terminated(run_id, RUN_STATUS.get(status, "FAILED"))

    retrying(_end, f"run {run_id}: its end")


LOCAL_UI = "http://127.0.0.1:5000"  # where ``mlflow ui`` serves a local store by default
# MLflow 3's UI (3.17's bundle, mlflow/server/js) picks the experiment page's view from its global
# workflow switch: the page's ``workflowType`` query parameter, else the browser's stored choice,
# else "genai"; the experiment's ``mlflow.experimentKind`` tag is read only where that switch is
# off. A link with this query opens on the model-training view (runs table, charts) in any browser.
UI_VIEW = "workflowType=machine_learning"


def ui_base(uri: str) -> Optional[str]:
    """The root URL of the UI showing the store at ``uri``: the tracking server itself, or for a
    local store what ``mlflow ui`` serves by default; None for a Databricks workspace."""
    scheme = urlparse(uri).scheme.lower()
    if scheme in ("http", "https"):
        return uri.rstrip("/")
    if uri.lower().startswith("databricks"):  # "databricks", "databricks://PROFILE", "databricks-uc"
        return None
    return LOCAL_UI


def ui_page(base: str, experiment: str, run_id: Optional[str] = None, tab: str = "") -> str:
    """The UI's page of an experiment, or of one of its runs (``tab``: "model-metrics", "artifacts/PATH"...)."""
    # the runs table is the experiment's "/runs" page: the bare experiment page only redirects to it
    page = f"#/experiments/{experiment}/runs" + (f"/{run_id}" if run_id else "") + (f"/{tab}" if tab else "")
    return f"{base}/{page}?{UI_VIEW}"


def ui_hint(uri: str, experiment: str, run_id: Optional[str] = None) -> str:
    """How to look at a run (or a whole experiment) in MLflow's UI: the server's page, or for a
    local store the ``mlflow ui`` command that serves it and the page it then has."""
    base = ui_base(uri)
    if base is None:
        return f"MLflow UI: the workspace's experiment {experiment}" + (f", run {run_id}" if run_id else "")
    if urlparse(uri).scheme.lower() in ("http", "https"):  # a server (even one at LOCAL_UI's address)
        return f"MLflow UI: {ui_page(base, experiment, run_id)}"
    return f"MLflow UI: mlflow ui --backend-store-uri {shlex.quote(uri)}  then open {ui_page(base, experiment, run_id)}"


def show_ui(uri: str, run_id: str, experiment: Optional[str] = None) -> None:
    """Log :func:`ui_hint` of a run (``experiment``: its experiment's id, else read from the
    store), for a local store: for a tracking server MLflow's client prints the run's page itself
    when the run ends (``TrackingServiceClient._log_url``, for a ``RestStore``)."""
    if urlparse(uri).scheme.lower() in ("http", "https") or uri.startswith("databricks"):
        return
    try:
        experiment = experiment or client(uri).get_run(run_id).info.experiment_id
    except Exception:  # noqa: BLE001 - a hint only
        return
    log.info("%s", ui_hint(uri, experiment, run_id))


# ----------------------------------------------------------------------------- rank 0's reporter


def _row_metrics(row: Dict[str, Any], fallback_ms: int) -> List[Any]:
    from mlflow.entities import Metric

    t = row.get(ROW_TIME)
    ts = int(float(t) * 1000) if isinstance(t, (int, float)) else fallback_ms
    step = int(row["step"])
    return [
        Metric(k, float(v), ts, step)
        for k, v in row.items()
        if k != "step" and not k.startswith("_") and isinstance(v, (int, float))
    ]


class MlflowReporter:
    """The trainer's reporter on rank 0 (picklable: the client and the delivery thread start in
    the worker). No call waits on the store: each record (a batch of step rows, a table, a tag,
    a file, the summary) is appended to a local journal (``journal``, a JSON-lines file next to the
    trial's output) and queued; a background thread connects (``open``, before the first step)
    and delivers the queue in order, step rows as few ``log_batch`` calls as MLflow's limit allows,
    each metric stamped with the time its step ended.

    While the store is away, delivery is retried with backoff (0.5 s doubling to 5 s) and the
    trial goes on. Nothing is logged twice: step rows at or below the highest step the store holds
    (read again after any failure, and first thing in a worker group restarted from a checkpoint)
    are dropped. ``finish`` waits up to ``finish_timeout_s`` for the queue to drain; what is still
    undelivered then stays in the journal, which a restarted worker group and the driver's end of
    the trial (:func:`deliver_journal`) deliver; a drained journal is deleted."""

    def __init__(
        self,
        uri: str,
        run_id: str,
        total_steps: int,
        progress: Optional[bool] = None,
        journal: Optional[str] = None,
        finish_timeout_s: float = FINISH_TIMEOUT_S,
    ):
        self.uri, self.run_id, self.total_steps = uri, run_id, total_steps
        self.progress = progress
        self.journal = str(journal) if journal else None
        self.finish_timeout_s = finish_timeout_s
        self._owner_pid = os.getpid()  # the driver: a worker's copy sets WORKER_HTTP_ENV
        self._reset()

    _KEEP = ("uri", "run_id", "total_steps", "progress", "journal", "finish_timeout_s", "_owner_pid")

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._bar: Any = None
        self._last: Dict[str, Any] = {}
        self._ops: Deque[Dict[str, Any]] = deque()
        self._seq = 0
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._abandon = threading.Event()
        self._journal_file: Any = None
        self._logged_up_to: Optional[int] = None  # highest step in the store; None: not read yet
        self._resync = True  # read it (again) before the next rows: first, and after a failure
        self.failures = 0  # failed delivery attempts in a row
        self.failed_attempts = 0  # in all
        self.rows_delivered = 0

    def __getstate__(self):
        return {k: self.__dict__[k] for k in self._KEEP}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    # -- the trainer's interface (trainers/report.py)

    def open(self) -> None:
        """Start the delivery thread: it connects to the store (importing MLflow and opening the
        client take seconds) while the model is built. Takes over what an earlier worker group of
        the trial left undelivered in the journal. Idempotent; any record opens it too."""
        with self._cond:
            if self._thread is not None:
                return
            self._closing = False
            self._abandon = threading.Event()
            self._take_over_journal()
            self._thread = threading.Thread(target=self._deliver_loop, name="mlflow-reporter", daemon=True)
            self._thread.start()

    def on_step(self, step: int, step_time_s: float) -> None:
        if self._thread is None:
            self.open()
        show = sys.stderr.isatty() if self.progress is None else self.progress
        if not show:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, unit="step", dynamic_ncols=True, file=sys.stderr)
        self._bar.update(1)
        post = {"step_s": f"{step_time_s:.3f}"}
        if "loss" in self._last:
            post["loss"] = f"{self._last['loss']:.4f}"
        self._bar.set_postfix(post, refresh=False)

    def log_steps(self, rows: List[Dict[str, Any]]) -> None:
        now = time.time()
        rows = [{ROW_TIME: now, **r} for r in rows]  # a row without its own time: when it came
        if rows:
            self._last = rows[-1]
            self._put({"op": "rows", "rows": rows})

    def log_table(self, step: int, name: str, rows: List[Dict[str, Any]]) -> None:
        """One JSON artifact per sampled step (not thousands of metric keys)."""
        self._put({"op": "text", "text": json.dumps(rows), "path": f"{name}/step_{step:06d}.json"})

    def log_artifact(self, path: str, folder: str = "") -> None:
        """A file, uploaded now while the store answers (the caller may delete it afterwards, as
        the Ray relay does); else a copy of it joins the queue."""
        if not self.failures and not self._ops:
            try:
                self._mlflow().log_artifact(self.run_id, path, folder or None)
                return
            except Exception as err:  # noqa: BLE001 - queued instead
                log.warning("run %s: artifact %s queued: %s", self.run_id, path, _first_line(err))
        self._put({"op": "artifact", "path": self._stage(path), "folder": folder, "staged": True})

    def tag(self, key: str, value: str) -> None:
        """A tag of the trial's run, set from a worker (where rank 0 runs, its restarts)."""
        self._put({"op": "tags", "tags": {key: str(value)}})

    def checkpoint(self, step: int, path: str) -> None:
        """The newest complete checkpoint, by reference (checkpoints of large models do not
        belong in an artifact store)."""
        self._put({"op": "tags", "tags": {"checkpoint.latest": path, "checkpoint.step": str(step)}})

    def finish(self, summary: Dict[str, Any]) -> None:
        """The summary metrics, then wait (``finish_timeout_s`` at most) for the queue to drain."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        values = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
        self._put({"op": "metrics", "values": values, "time": int(time.time() * 1000)})
        self.close(self.finish_timeout_s)

    # -- delivery

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` (default ``finish_timeout_s``) for every queued record to reach
        the store, then stop the thread. True when all did (the journal is deleted); else they stay
        in the journal, and a warning says where."""
        timeout_s = self.finish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._ops and self._thread is not None and deadline - time.monotonic() > 0:
                self._cond.wait(deadline - time.monotonic())
            drained, left = not self._ops, len(self._ops)
            self._closing = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if not drained:
            self._abandon.set()
            log.warning(
                "run %s: %d record(s) not delivered to %s within %.0f s; kept in %s",
                self.run_id,
                left,
                self.uri,
                timeout_s,
                self.journal or "memory (no journal: lost)",
            )
        if thread is not None:
            thread.join(timeout=1.0 if not drained else None)
        with self._cond:
            if self._journal_file is not None:
                self._journal_file.close()
                self._journal_file = None
            if drained and self.journal:
                Path(self.journal).unlink(missing_ok=True)
                shutil.rmtree(self.journal + ".files", ignore_errors=True)
        return drained

    def _mlflow(self):
        with self._client_lock:
            if self._client is None:
                self._client = client(self.uri)
            return self._client

    def _put(self, op: Dict[str, Any]) -> None:
        if self._thread is None:
            self.open()
        with self._cond:
            op["seq"] = self._seq
            self._seq += 1
            self._journal_write(op)
            self._ops.append(op)
            self._cond.notify_all()

    def _deliver_loop(self) -> None:
        if os.getpid() != self._owner_pid:
            for key, value in WORKER_HTTP_ENV.items():
                os.environ.setdefault(key, value)
        self._connect()
        delay = BACKOFF_S[0]
        while True:
            with self._cond:
                while not self._ops and not self._closing:
                    self._cond.wait()
                if not self._ops or self._abandon.is_set():
                    return
                batch = self._head()
            try:
                self._deliver(batch)
            except Exception as err:  # noqa: BLE001 - the store is away: keep, retry later
                if not _transient(err):
                    log.warning("run %s: the store refused a record (%s); dropped", self.run_id, _first_line(err))
                    self._done(batch)
                    continue
                self.failures += 1
                self.failed_attempts += 1
                self._resync = True
                if self.failures == 1:
                    log.warning(
                        "run %s: the MLflow store %s failed (%s); the trial goes on, records wait in %s",
                        self.run_id,
                        self.uri,
                        _first_line(err),
                        self.journal or "memory",
                    )
                if self._abandon.wait(delay):
                    return
                delay = min(2 * delay, BACKOFF_S[1])
                continue
            if self.failures:  # a warning as the failure was: a worker shows only warnings
                log.warning("run %s: the MLflow store is back after %d failed attempt(s)", self.run_id, self.failures)
            self.failures, delay = 0, BACKOFF_S[0]
            self._done(batch)

    def _head(self) -> List[Dict[str, Any]]:
        """The next records to deliver: all step rows at the head of the queue together, else one."""
        if self._ops[0]["op"] != "rows":
            return [self._ops[0]]
        out = []
        for op in self._ops:
            if op["op"] != "rows":
                break
            out.append(op)
        return out

    def _done(self, batch: List[Dict[str, Any]]) -> None:
        with self._cond:
            for _ in batch:
                self._ops.popleft()
            self._journal_write({"done": [op["seq"] for op in batch]})
            self._cond.notify_all()

    def _read_logged_up_to(self, c: Any) -> None:
        """The highest step the store holds (delivery thread only)."""
        stored = max((m.step for m in c.get_metric_history(self.run_id, "loss")), default=-1)
        self._logged_up_to = max(stored, -1 if self._logged_up_to is None else self._logged_up_to)
        self._resync = False

    def _connect(self) -> None:
        """Import MLflow, open the client and read what the store holds, before the first record
        comes (``open`` is called before the model is built): done at the first delivery instead,
        these seconds of the Python interpreter's time land in a timed step of rank 0. A store
        that does not answer now is tried again by the first delivery."""
        try:
            self._read_logged_up_to(self._mlflow())
        except Exception as err:  # noqa: BLE001 - the first delivery retries, with backoff
            self._resync = True
            log.debug("run %s: the store did not answer yet (%s)", self.run_id, _first_line(err))

    def _deliver(self, batch: List[Dict[str, Any]]) -> None:
        from mlflow.entities import Metric, RunTag

        c = self._mlflow()
        op = batch[0]
        if op["op"] == "rows":
            self._deliver_rows(c, [r for o in batch for r in o["rows"]])
        elif op["op"] == "tags":
            c.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()])
        elif op["op"] == "text":
            c.log_text(self.run_id, op["text"], op["path"])
        elif op["op"] == "metrics":
            metrics = [Metric(k, float(v), op["time"], 0) for k, v in op["values"].items()]
            for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                c.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])
        elif op["op"] == "artifact":
            if not os.path.exists(op["path"]):
                log.warning("run %s: artifact %s is gone; not logged", self.run_id, op["path"])
                return
            c.log_artifact(self.run_id, op["path"], op["folder"] or None)
            if op.get("staged"):
                os.unlink(op["path"])
                with contextlib.suppress(OSError):  # its own folder, now empty
                    os.rmdir(os.path.dirname(op["path"]))

    def _deliver_rows(self, c: Any, rows: List[Dict[str, Any]]) -> None:
        """Rows in step order, each step once: none at or below the highest step of ``loss`` in the
        store (one ``log_batch`` is one transaction in MLflow's SQL store, so a failed call leaves
        nothing of itself; the store is read again after any failure); then in as few calls as
        MLflow's per-call limit allows, whole rows per call."""
        if self._resync or self._logged_up_to is None:
            self._read_logged_up_to(c)
        top, kept = self._logged_up_to, []
        for r in rows:  # in the order they came: a step re-run after a restart keeps its first value
            if int(r["step"]) > top:
                kept.append(r)
                top = int(r["step"])
        now = int(time.time() * 1000)
        chunk: List[Any] = []
        rows_in_chunk, last = 0, -1

        def send() -> None:
            for j in range(0, len(chunk), MAX_METRICS_PER_BATCH):  # one row above the limit: split
                c.log_batch(self.run_id, metrics=chunk[j : j + MAX_METRICS_PER_BATCH])
            self._logged_up_to = last
            self.rows_delivered += rows_in_chunk

        for r in kept:
            metrics = _row_metrics(r, now)
            if chunk and len(chunk) + len(metrics) > MAX_METRICS_PER_BATCH:
                send()
                chunk, rows_in_chunk = [], 0
            chunk.extend(metrics)
            rows_in_chunk, last = rows_in_chunk + 1, int(r["step"])
        if chunk:
            send()

    # -- the journal

    def _journal_write(self, entry: Dict[str, Any]) -> None:
        """Append one entry (under the lock): a record, or the sequence numbers delivered."""
        if not self.journal:
            return
        try:
            if self._journal_file is None:
                path = Path(self.journal)
                path.parent.mkdir(parents=True, exist_ok=True)
                fresh = not path.exists() or path.stat().st_size == 0
                self._journal_file = open(path, "a", encoding="utf-8")
                if fresh:
                    self._journal_file.write(json.dumps({"uri": self.uri, "run_id": self.run_id}) + "\n")
            self._journal_file.write(json.dumps(entry) + "\n")
            self._journal_file.flush()  # in the OS's hands: a killed process loses nothing
        except OSError as err:
            log.warning("run %s: journal %s unusable (%s); records kept in memory only", self.run_id, self.journal, err)
            self.journal, self._journal_file = None, None

    def _take_over_journal(self) -> None:
        """Queue what the journal holds undelivered (an earlier process of this trial died or gave
        up), and rewrite it with just that, numbered from 0 (under the lock)."""
        pending = read_journal(self.journal) if self.journal else []
        if not pending:
            return
        log.info("run %s: %d undelivered record(s) taken over from %s", self.run_id, len(pending), self.journal)
        path = Path(self.journal)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"uri": self.uri, "run_id": self.run_id}) + "\n")
            for op in pending:
                op["seq"] = self._seq
                self._seq += 1
                f.write(json.dumps(op) + "\n")
        os.replace(tmp, path)
        self._ops.extendleft(reversed(pending))

    def _stage(self, path: str) -> str:
        """A copy of ``path`` beside the journal, kept until it is delivered: in a folder of its
        own, under its own name (the name MLflow gives the artifact)."""
        if not self.journal:
            return path
        folder = Path(self.journal + ".files") / f"{self._seq:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / Path(path).name
        shutil.copyfile(path, staged)
        return str(staged)


def read_journal(path: str) -> List[Dict[str, Any]]:
    """The records of a reporter's journal not yet delivered, in order ([] when there is none)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    ops: Dict[int, Dict[str, Any]] = {}
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if "done" in entry:
            for seq in entry["done"]:
                ops.pop(seq, None)
        elif "op" in entry:
            ops[entry["seq"]] = entry
    return [ops[k] for k in sorted(ops)]


def deliver_journal(path: str, timeout_s: float = LEFTOVER_TIMEOUT_S) -> bool:
    """Deliver what a reporter's journal holds undelivered (its store and run are in its first
    line), waiting up to ``timeout_s``; True when nothing is left (the journal is then deleted)."""
    try:
        head = json.loads(Path(path).read_text(encoding="utf-8").splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return True
    reporter = MlflowReporter(head["uri"], head["run_id"], 0, progress=False, journal=path)
    reporter.open()
    return reporter.close(timeout_s)
