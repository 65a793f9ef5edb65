"""Links into MLflow's UI: the page of an experiment or a run, for a tracking server or for a local
store (the ``mlflow ui`` command that serves it), logged at a trial's and a sweep's end."""

from __future__ import annotations

import logging
import shlex
from typing import Optional
from urllib.parse import urlparse

from orchestrator.mlflow_store import client

log = logging.getLogger("orchestrator")

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
