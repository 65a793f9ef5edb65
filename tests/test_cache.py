"""The orchestrator's caches (orchestrator/cache.py): made once, read back by their key only, never an error,
and what they stand for is what MLflow or the planner would have made in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from orchestrator import cache, mlflow_store, tracking
from orchestrator.planner import operators


def test_an_entry_is_made_once_per_key_and_a_broken_one_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CHIP_ORCHESTRATOR_CACHE", str(tmp_path / "c"))
    made = []

    def make(v):
        return lambda: made.append(v) or {"v": v}

    assert cache.json_entry("k", {"a": 1}, make(1)) == {"v": 1}
    assert cache.json_entry("k", {"a": 1}, make(2)) == {"v": 1}  # read back, not made
    assert cache.json_entry("k", {"a": 2}, make(3)) == {"v": 3}  # another key
    assert made == [1, 3]
    (entry,) = [p for p in (tmp_path / "c" / "k").iterdir() if '"a": 1' in p.read_text()]
    entry.write_text("{half a fi")
    assert cache.json_entry("k", {"a": 1}, make(4)) == {"v": 4} and made[-1] == 4
    assert not [p for p in (tmp_path / "c" / "k").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_an_unwritable_cache_still_gives_the_value(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CHIP_ORCHESTRATOR_CACHE", str(blocker / "c"))
    assert cache.json_entry("k", 1, lambda: [1, 2]) == [1, 2]
    assert mlflow_store.seed_sqlite_store("sqlite:///" + str(tmp_path / "m.db")) is False  # MLflow makes it then


def test_the_operator_capture_is_read_from_disk_and_keyed_by_the_trainer_source(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("CHIP_ORCHESTRATOR_CACHE", str(tmp_path))
    cfg = compose_cfg(["+chip=cpu", "trainer=smoke"])
    operators._captured.cache_clear()
    first = operators.captured_ops(cfg.model, cfg.trainer.seq_len, "bf16")
    assert first and len(list((tmp_path / "ops").glob("*.json"))) == 1

    def no_capture(*a, **k):
        raise AssertionError("captured again")

    import trainers.ops

    monkeypatch.setattr(trainers.ops, "capture_ops", no_capture)
    operators._captured.cache_clear()  # a new process: only the disk has it
    assert operators.captured_ops(cfg.model, cfg.trainer.seq_len, "bf16") == first
    monkeypatch.setattr(cache, "trainer_source_digest", lambda: "another trainer")
    operators._captured.cache_clear()
    with pytest.raises(AssertionError, match="captured again"):  # a changed trainer is traced anew
        operators.captured_ops(cfg.model, cfg.trainer.seq_len, "bf16")
    operators._captured.cache_clear()


def _schema(db: Path):
    with sqlite3.connect(db) as c:
        tables = sorted(r[0] for r in c.execute("select name from sqlite_master where type='table'"))
        return tables, list(c.execute("select version_num from alembic_version"))


def test_a_seeded_store_is_the_store_mlflow_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("CHIP_ORCHESTRATOR_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    own = tmp_path / "own.db"
    tracking.client("sqlite:///" + str(own)).search_experiments()  # made by MLflow, migrations and all
    uri = "sqlite:///" + str(tmp_path / "new" / "seeded.db")
    assert mlflow_store.seed_sqlite_store(uri) is True
    assert _schema(tmp_path / "new" / "seeded.db") == _schema(own)
    c = tracking.client(uri)
    (default,) = c.search_experiments()
    assert default.name == "Default" and default.artifact_location == str(work / "mlruns" / "0")  # not the template's
    exp = tracking.experiment_id(uri, "orchestrator")
    run = c.create_run(exp)
    c.log_metric(run.info.run_id, "loss", 1.5, step=0)
    assert c.get_metric_history(run.info.run_id, "loss")[0].value == 1.5
    before = (tmp_path / "new" / "seeded.db").read_bytes()
    assert mlflow_store.seed_sqlite_store(uri) is False  # a store already there is left alone
    assert (tmp_path / "new" / "seeded.db").read_bytes() == before
    assert not mlflow_store.seed_sqlite_store("http://127.0.0.1:1") and not mlflow_store.seed_sqlite_store("sqlite://")
    assert not [p for p in (tmp_path / "new").iterdir() if p.name.startswith(".")]


def test_every_module_the_forkserver_preloads_imports():
    """The server skips a preload name that fails to import without a word, and every worker of
    every trial then imports it again: each name must import."""
    import importlib

    from orchestrator.launch import FORKSERVER_PRELOAD

    for name in FORKSERVER_PRELOAD:
        assert importlib.import_module(name).__name__ == name


def test_workers_start_early_from_one_forkserver():
    import multiprocessing
    from multiprocessing import forkserver

    from orchestrator.launch import FORKSERVER_PRELOAD, start_workers_early

    assert start_workers_early({"start_method": "spawn"}) == "spawn"
    assert start_workers_early({"start_method": "forkserver"}) == "forkserver"
    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None and forkserver._forkserver._preload_modules == list(FORKSERVER_PRELOAD)
    start_workers_early({"start_method": "forkserver"})  # the launch's own call finds it running
    assert forkserver._forkserver._forkserver_pid == pid
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=int)
    p.start()
    p.join(60)
    assert p.exitcode == 0


def test_the_local_launcher_meets_at_the_configured_address_and_port(compose_cfg):
    """launch.master_addr and launch.master_port are where torch's elastic agent holds the
    rendezvous (a port the kernel gives when 0, bound by the store the launcher holds);
    launch.max_failures its restarts. From the composed config, through the section the trial
    hands its launch path."""
    from orchestrator import trial
    from orchestrator.launch import free_port, launch_config, rendezvous_store

    port = free_port()
    overrides = ["+chip=cpu", "parallel=dp2", "launch.master_addr=127.0.0.2", f"launch.master_port={port}"]
    resolved = trial.resolve(compose_cfg([*overrides, "launch.max_failures=2"]))
    store = rendezvous_store(resolved.launch_section())
    assert store.port == port
    config = launch_config(2, resolved.launch_section(), "spawn", store.port)
    assert config.rdzv_endpoint == f"127.0.0.2:{port}" and config.nproc_per_node == 2
    assert config.max_restarts == 2 and config.start_method == "spawn"
    assert config.rdzv_configs["is_host"] is True  # never a client of a store another job holds
    unset = rendezvous_store(trial.resolve(compose_cfg(["+chip=cpu"])).launch_section())
    assert unset.port > 0 and unset.port != port


def test_a_trial_whose_port_another_trial_holds_fails_by_name_and_starts_nothing(compose_cfg):
    """Two trials on one node at the same launch.master_port: the second is refused with the key
    named. Before the launcher bound its store itself, the second trial's agent joined the first's
    store as a client and the two trials' workers shared rendezvous keys (one gloo rank meeting
    another trial's peer: a hang or a corrupted heap, seen in CI as a SIGABRT in
    ``malloc(): unaligned tcache chunk``), and a port picked free was open to that race too."""
    from torch.distributed import TCPStore

    from orchestrator import trial

    # the first trial's store (another process's: not a multi-tenant server this process may share)
    held = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    overrides = ["+chip=cpu", "parallel=dp2", f"launch.master_port={held.port}", "tracking.enabled=false"]
    result = trial.run(compose_cfg(overrides), overrides, progress=False)
    assert result["status"] == "crash"
    assert f"launch.master_port={held.port}" in result["reason"] and "leave launch.master_port at 0" in result["reason"]
    assert "losses" not in result  # no worker ran


def test_a_port_an_earlier_store_of_this_process_used_is_bound_again_where_the_agent_finds_it(monkeypatch):
    """torch keeps a dead multi-tenant server's entry under its port, and a server started on
    port 0 is not entered where an entry is: when the kernel hands out an earlier trial's port,
    the elastic agent finds the dead entry, tries to bind the port itself and fails (EADDRINUSE:
    a clean-clone CI run's test_resume, the second trial of one process). The launcher checks its
    store as the agent will ask for it and binds the port again where that fails."""
    import datetime

    from torch.distributed import TCPStore

    from orchestrator import launch

    host, t = "127.0.0.1", datetime.timedelta(seconds=10)
    first = TCPStore(host, 0, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=t)
    port = first.port
    del first  # its entry stays, dead
    calls = []
    real = launch._store

    def kernel_hands_out_the_old_port(h, p):
        calls.append(p)
        if len(calls) == 1:  # the port-0 bind landing on the old port, not entered in the table
            return TCPStore(h, port, is_master=True, multi_tenant=False, wait_for_workers=False, timeout=t)
        return real(h, p)

    monkeypatch.setattr(launch, "_store", kernel_hands_out_the_old_port)
    held = launch.rendezvous_store({"master_addr": host, "master_port": 0})
    assert held.port == port and launch._agent_finds(host, held)
    assert calls[0] == 0 and port in calls[1:]  # checked, then bound again on its own port
