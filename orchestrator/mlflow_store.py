"""The MLflow store: where it is (``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite
file in the working directory, ``sqlite:///mlruns.db``, its artifacts in ``./mlartifacts`` beside
it), a client for it, and trouble with it: :func:`store_problem` says in a few seconds why a store
cannot be used (a trial refuses to start on it), :func:`retrying` rides out a store that is away
for a while. A new sqlite store is seeded from an empty one already migrated
(:func:`seed_sqlite_store`). MLflow is imported lazily.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, TypeVar
from urllib.parse import urlparse

from omegaconf import DictConfig

from orchestrator import cache

log = logging.getLogger("orchestrator")
T = TypeVar("T")

END_RUN_BUDGET_S = 60.0  # the run's end is retried this long
BACKOFF_S = (0.5, 5.0)  # a failed delivery is retried after 0.5 s, doubling up to 5 s


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


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def first_line(err: BaseException, limit: int = 300) -> str:
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
        return first_line(err)


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
    return first_line(box["err"]) if "err" in box else None


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


def transient(err: BaseException) -> bool:
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
            if not transient(err) or time.monotonic() + delay > deadline:
                raise
            if not warned:
                log.warning("%s: the MLflow store failed (%s); retrying for %.0f s", what, first_line(err), budget_s)
                warned = True
            time.sleep(delay)
            delay = min(2 * delay, BACKOFF_S[1])


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
