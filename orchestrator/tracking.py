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

The store itself (where, a client, its trouble) is :mod:`orchestrator.mlflow_store`; rank 0's reporter
during a trial :mod:`orchestrator.mlflow_reporter`; links into the UI :mod:`orchestrator.mlflow_ui`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shlex
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, TypeVar

from omegaconf import DictConfig, OmegaConf

from orchestrator import statuses, tags
from orchestrator.mlflow_store import (
    client,
    default_artifact_location,
    first_line,
    resolve_uri,
    retrying,
    seed_sqlite_store,
)

log = logging.getLogger("orchestrator")
T = TypeVar("T")

# sections that define what a trial computes; tracking and launch details do not change it
HASHED_SECTIONS = ("chip", "parallel", "precision", "comm", "model", "data", "trainer")

EXPERIMENT_KIND = "custom_model_development"  # the model-training view (tags.EXPERIMENT_KIND)
RESULT_HEADING = "\n\n**Result**: "  # the note's part that the run's end writes (and rewrites)
MAX_TAG_VALUE = 8000  # MLflow's limit on a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


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


# ----------------------------------------------------------------------------- experiments and runs


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
                tags={tags.EXPERIMENT_KIND: EXPERIMENT_KIND},
            )
        except Exception:  # another process created it first
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    if tags.EXPERIMENT_KIND not in (exp.tags or {}):
        c.set_experiment_tag(exp.experiment_id, tags.EXPERIMENT_KIND, EXPERIMENT_KIND)
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


def start_run(cfg: DictConfig, overrides: Iterable[str], run_tags: Dict[str, str]) -> tuple[str, str]:
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
        tags.NOTE: run_note(overrides)[:MAX_TAG_VALUE],
        tags.TRIAL_STATUS: statuses.RUNNING,
        tags.CONFIG_HASH: chash,
        tags.RUN_NAME: name[:250],
        **run_tags,
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
            log.warning("run %s: dataset input not recorded: %s", rid, first_line(err))
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
    run_tags: Optional[Dict[str, str]] = None,
) -> None:
    """Record how the trial ended: ``trial.status`` (and ``trial.reason``), the result in the run's
    description, MLflow's run status. Retried while the store is briefly away."""
    from mlflow.entities import RunTag

    def _end() -> None:
        c = client(uri)
        note = c.get_run(run_id).data.tags.get(tags.NOTE, "")
        batch = {tags.TRIAL_STATUS: status, tags.NOTE: with_result(note, result_note(status, reason, summary))}
        if reason:
            batch[tags.TRIAL_REASON] = reason[:5000]
        batch.update(run_tags or {})
        c.log_batch(run_id, tags=[RunTag(k, v) for k, v in batch.items()])
        c.set_terminated(run_id, statuses.run_status(status))

    retrying(_end, f"run {run_id}: its end")
