"""Look at a store in the MLflow UI as a user would: a headless Chromium opens the experiment's
runs table, a trial's loss chart and the sweep's tuning report, and saves one PNG of each.

    python tools/ui_screenshots.py --out ui_screenshots                  # runs a small study first
    python tools/ui_screenshots.py --store DIR --out ui_screenshots      # DIR holds mlruns.db

Needs ``chromium`` (Debian: ``apt-get install chromium``). The study is the ``cpu_smoke`` preset
with one repeat a point and 6 steps a trial (about a minute on 2 cores). The UI is served by a
real ``mlflow server`` on the store, on 127.0.0.1 only, and stopped at the end; on port 5000 by
default, the address ``mlflow ui`` serves and the one a local store's report links its images to
(``mlflow_ui.ui_base``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from orchestrator.mlflow_ui import UI_VIEW, ui_page  # noqa: E402 - the checkout's, run as a script

STUDY = ["+sweep=cpu_smoke", "+chip=cpu", "hydra.sweeper.repeats=1", "trainer.steps=6"]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def run_study(store: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MLFLOW_TRACKING_URI", None)
    subprocess.run([sys.executable, "-m", "orchestrator", *STUDY], cwd=store, env=env, check=True)


def serve(store: Path, port: int, timeout_s: float = 180.0) -> subprocess.Popen:
    """``mlflow server`` on the store's sqlite file; returns once /health answers."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--backend-store-uri", f"sqlite:///{store / 'mlruns.db'}"]
    proc = subprocess.Popen(cmd, cwd=store, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"mlflow server did not answer on port {port} within {timeout_s:.0f} s")


def screenshot(url: str, path: Path, budget_ms: int = 20000, size: str = "1600,1000") -> None:
    """One page, after ``budget_ms`` of virtual time for the single-page app to fetch and draw."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    cmd += [f"--window-size={size}", f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    print(f"{path}  <- {url}")


def metric_page(base: str, experiment: str, run_id: str, key: str) -> str:
    """The UI's chart of one metric of one run (its ``#/metric`` page, as the run page links it)."""
    from urllib.parse import quote

    query = {"runs": [run_id], "metric": key, "experiments": [experiment], "plot_metric_keys": [key]}
    args = "&".join(f"{k}={quote(json.dumps(v, separators=(',', ':')))}" for k, v in query.items())
    return f"{base}/#/metric?{args}&x_axis=step&{UI_VIEW}"


def markdown_artifact(client, run_id: str, folder: str = "") -> Optional[str]:
    """The first markdown file among a run's artifacts (the tuning report)."""
    for item in client.list_artifacts(run_id, folder or None):
        if item.is_dir:
            found = markdown_artifact(client, run_id, item.path)
            if found:
                return found
        elif item.path.endswith(".md"):
            return item.path
    return None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, help="folder holding mlruns.db (default: run a small study in a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("ui_screenshots"))
    ap.add_argument("--experiment", default="orchestrator")
    ap.add_argument("--port", type=int, default=5000, help="the UI's port (the report's images link to 5000)")
    args = ap.parse_args(argv)
    if not port_free(args.port):
        print(f"error: --port={args.port}: in use on 127.0.0.1", file=sys.stderr)
        return 2
    store = args.store or Path(tempfile.mkdtemp(prefix="ui-store-"))
    if args.store is None:
        run_study(store)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store / 'mlruns.db'}")
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        print(f"error: --experiment={args.experiment}: no such experiment in {store / 'mlruns.db'}", file=sys.stderr)
        return 3
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    sweeps = [r for r in runs if "sweep.status" in r.data.tags]
    trials = [r for r in runs if r.data.tags.get("trial.status") == "finished"]
    if not trials:
        print(f"error: no finished trial in experiment {args.experiment}", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    server = serve(store, args.port)
    base, exp_id = f"http://127.0.0.1:{args.port}", exp.experiment_id
    try:
        screenshot(ui_page(base, exp_id), args.out / "runs_table.png")
        screenshot(metric_page(base, exp_id, trials[0].info.run_id, "loss"), args.out / "trial_loss_chart.png")
        if sweeps:
            parent = sweeps[0].info.run_id
            md = markdown_artifact(client, parent)
            page = ui_page(base, exp_id, parent, "artifacts" + (f"/{md}" if md else ""))
            screenshot(page, args.out / "sweep_report.png", budget_ms=30000, size="1600,1800")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
