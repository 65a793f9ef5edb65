"""A tracking server that goes away during a trial and comes back: a real ``mlflow server``
(sqlite backend, artifacts served) killed and started again on the same port.

The trial goes on while the server is away (its rank 0 journals what it cannot deliver and
retries), ends finished, and every step's loss is in the store exactly once; a worker that dies
while the server is away loses nothing (its journal is delivered afterwards); the end of a run
waits out a brief outage. The tuning report's image links are fetched from the server as MLflow's
UI fetches them."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator import mlflow_journal, mlflow_reporter, mlflow_store, report_render, tracking
from orchestrator.launch import free_port
from tests.conftest import ROOT, TableRunner, cli_env, metric_history
from tests.test_tracking import SMOKE

pytestmark = pytest.mark.slow

READY_S = 180.0  # a bound on a server's start, not a measurement


class Server:
    """``mlflow server`` on a fixed port, in its own process group (it starts workers)."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = open(root / "server.log", "ab")

    def start(self) -> None:
        cmd = [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri",
            "sqlite:///" + str(self.root / "server.db"),
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + READY_S
        while mlflow_store.store_problem(self.uri, timeout_s=1.0) is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # gone at once, as a crashed server is
            self.proc.wait()
        self.proc = None

    @property
    def up(self) -> bool:
        return self.proc is not None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def running(server):
    """The module's server, up at the start and again at the end of the test."""
    if not server.up:
        server.start()
    yield server
    if not server.up:
        server.start()


def _steps(uri: str, run_id: str, key: str = "loss") -> list:
    return [m.step for m in metric_history(uri, run_id, key)]


def _wait(what: str, cond, proc: subprocess.Popen | None = None, bound_s: float = 600.0):
    """Poll ``cond`` until it holds; fail (not on a timing: on a process that ended) otherwise."""
    deadline = time.monotonic() + bound_s
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the trial ended before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"never: {what}")
        time.sleep(0.05)


def _journal_steps(path: Path) -> list:
    return [r["step"] for op in mlflow_journal.read_journal(str(path)) if op["op"] == "rows" for r in op["rows"]]


def test_a_trial_outlives_its_tracking_server_and_loses_no_step(running, tmp_path):
    steps = 60
    c = MlflowClient(running.uri)
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            *SMOKE,
            f"trainer.steps={steps}",
            "trainer.log_every=2",
            f"tracking.uri={running.uri}",
            "tracking.experiment=outage",
        ],
        cwd=tmp_path,
        env=cli_env(),
        stdout=out,
        stderr=err,
    )
    try:
        exp = _wait("the experiment exists", lambda: c.get_experiment_by_name("outage"), proc)
        run = _wait("the run exists", lambda: (c.search_runs([exp.experiment_id]) or [None])[0], proc)
        run_id = run.info.run_id
        _wait("4 steps are in the store", lambda: len(_steps(running.uri, run_id)) >= 4, proc)
        seen = max(_steps(running.uri, run_id))
        running.stop()
        (journal,) = _wait("the journal is there", lambda: list(tmp_path.rglob(f"mlflow_journal_{run_id}.jsonl")), proc)
        # the loop did not wait for the store: steps past what the store had pile up undelivered
        _wait(
            "steps beyond the store's wait in the journal",
            lambda: max(_journal_steps(journal), default=-1) >= seen + 10,
            proc,
        )
        waiting = _journal_steps(journal)
        running.start()
        assert proc.wait(timeout=900) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "err.txt").read_text()
    assert _steps(running.uri, run_id) == list(range(steps))  # each step once, none lost
    assert _steps(running.uri, run_id, "step_time_s") == list(range(steps))
    assert waiting and min(waiting) > seen  # what waited is what the store had not got
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["trial.status"] == "finished"
    assert "**finished**: final loss" in run.data.tags["mlflow.note.content"]
    assert "tracking.undelivered" not in run.data.tags and not journal.exists()
    # the outage is reported, and so is how it ended: rank 0's reporter saw the store back, or (the
    # store back only after rank 0's finish timeout, as on a loaded CI host) it left its journal,
    # which the driver delivered (the records above are all in the store either way)
    assert "the trial goes on" in log and ("is back after" in log or "not delivered to" in log), log[-3000:]
    stamps = [m.timestamp for m in metric_history(running.uri, run_id, "loss")]
    assert stamps == sorted(stamps)  # the steps' own times, also for those delivered late
    print(
        f"outage: store had steps 0..{seen} when killed; {len(waiting)} rows waited in the journal; "
        f"{steps - 1 - seen} steps delivered after the restart"
    )


WORKER = r"""
import pickle, sys, time, os
from tests.test_tracking import _rows
rep = pickle.loads(bytes.fromhex(sys.argv[1]))
rep.open()
rep.log_steps(_rows(range(0, 5), time.time() - 10))
rep.log_steps(_rows(range(5, 10), time.time() - 5))
rep.checkpoint(10, "/ckpt/step_10")
time.sleep(1.0)  # a few failed attempts
os._exit(1)  # dies, as a killed rank does: no finish, nothing flushed by Python
"""


def test_a_worker_that_dies_while_the_server_is_away_loses_nothing(running, tmp_path):
    c = MlflowClient(running.uri)
    run_id = c.create_run(tracking.experiment_id(running.uri, "outage_worker")).info.run_id
    journal = tmp_path / f"mlflow_journal_{run_id}.jsonl"
    rep = mlflow_reporter.MlflowReporter(running.uri, run_id, 10, False, str(journal))
    running.stop()
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, pickle.dumps(rep).hex()], cwd=ROOT, env=cli_env(), capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert _journal_steps(journal) == list(range(10))
    running.start()
    assert mlflow_reporter.deliver_journal(str(journal))  # what the driver does at the trial's end
    assert _steps(running.uri, run_id) == list(range(10))
    assert c.get_run(run_id).data.tags["checkpoint.step"] == "10" and not journal.exists()
    assert mlflow_reporter.deliver_journal(str(journal))  # nothing left: nothing delivered twice
    assert _steps(running.uri, run_id) == list(range(10))


def test_the_end_of_a_run_waits_out_a_brief_outage(running):
    c = MlflowClient(running.uri)
    run_id = c.create_run(tracking.experiment_id(running.uri, "outage_end")).info.run_id
    running.stop()
    errors: list = []
    ended = threading.Thread(
        target=lambda: _catch(errors, tracking.end_run, running.uri, run_id, "finished", summary={"final_loss": 1.0})
    )
    ended.start()
    time.sleep(1.0)  # the end is already retrying
    running.start()
    ended.join(timeout=600)
    assert not ended.is_alive() and errors == []
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["trial.status"] == "finished"


def _catch(errors, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the test reads it
        errors.append(err)


def test_the_report_s_image_links_are_served_as_mlflow_s_ui_fetches_them(running, tmp_path):
    from sweeps.ovat import Study, descend

    table = {(("a", "1"),): (1.0, 3.0), (("a", "2"),): (0.5, 3.0)}
    data = descend(Study(name="t", variables={"a": ["1", "2"]}, fixed=[]), TableRunner(table))
    data.update(sweep="s", experiment="outage_report", kind="ovat")
    files = report_render.render(data, tmp_path / "out")
    c = MlflowClient(running.uri)
    run_id = c.create_run(tracking.experiment_id(running.uri, "outage_report")).info.run_id
    report_render.attach(running.uri, run_id, files, data)
    md = Path(c.download_artifacts(run_id, "tuning_report.md", str(tmp_path))).read_text()
    links = [line.split("](", 1)[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert len(links) == 2 and all(link.startswith(f"{running.uri}/get-artifact?") for link in links)
    for link in links:  # the server's own address, which the UI's markdown view needs
        with urllib.request.urlopen(link, timeout=30) as resp:
            assert resp.read()[:4] == b"\x89PNG", link
    assert json.loads(Path(c.download_artifacts(run_id, "tuning_report.json", str(tmp_path))).read_text())["rows"]
