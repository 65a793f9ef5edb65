"""A backend variable the shell exports with another value than the config sets is refused by
name, before anything runs (``orchestrator/validate_env.py``). Before this rule, an exported
``HCCL_BUFFSIZE=400`` ran every worker at 400 MB while the run recorded ``comm.buffsize_mb=200``
(seen on that code: the CLI below exited 0 and trained)."""

from __future__ import annotations

import pytest

from orchestrator.planner import planning_errors
from tests.conftest import cli_in_process, search_runs

ASCEND = ["+chip=ascend910b", "chip.emulate=true", "trainer=smoke"]


@pytest.mark.parametrize(
    "overrides,var,exported,line",
    [
        (
            [],
            "HCCL_BUFFSIZE",
            "400",
            "comm.buffsize_mb=200 sets HCCL_BUFFSIZE=200, but this shell exports HCCL_BUFFSIZE=400",
        ),
        (
            ["+comm.env={HCCL_INTRA_ROCE_ENABLE:1}"],
            "HCCL_INTRA_ROCE_ENABLE",
            "0",
            "comm.env.HCCL_INTRA_ROCE_ENABLE=1 sets HCCL_INTRA_ROCE_ENABLE=1, but this shell exports",
        ),
        (
            ["trainer.deterministic=true"],
            "HCCL_DETERMINISTIC",
            "false",
            "trainer.deterministic=True sets HCCL_DETERMINISTIC=true, but this shell exports HCCL_DETERMINISTIC=false",
        ),
        (
            ["comm.socket_ifname=eth0"],
            "HCCL_SOCKET_IFNAME",
            "=eth1",
            "comm.socket_ifname=eth0 sets HCCL_SOCKET_IFNAME==eth0",
        ),
    ],
)
def test_an_exported_variable_that_would_win_is_refused_by_name(
    compose_cfg, monkeypatch, overrides, var, exported, line
):
    cfg = compose_cfg([*ASCEND, *overrides])
    assert not [e for e in planning_errors(cfg) if var in e]
    monkeypatch.setenv(var, exported)
    errors = [e for e in planning_errors(cfg) if var in e]
    assert len(errors) == 1 and line in errors[0], errors
    monkeypatch.setenv(var, errors[0].split(f"sets {var}=")[1].split(",")[0])  # the same value: fine
    assert not [e for e in planning_errors(cfg) if var in e]


def test_the_exported_timeouts_are_honoured_not_refused(compose_cfg, monkeypatch):
    """HCCL's two timeouts may be exported: the process group's timeout outlasts them instead."""
    cfg = compose_cfg(ASCEND)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1800")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "600")
    assert not [e for e in planning_errors(cfg) if "TIMEOUT" in e]


def test_the_cli_refuses_with_exit_2_and_runs_nothing(tmp_path, monkeypatch, capfd):
    args = [*ASCEND, "comm.buffsize_mb=300"]
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd, HCCL_BUFFSIZE="400")
    assert code == 2, (out, err[-2000:])
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, err
    assert "comm.buffsize_mb=300 sets HCCL_BUFFSIZE=300, but this shell exports HCCL_BUFFSIZE=400" in errors[0]
    assert "unset HCCL_BUFFSIZE, or give comm.buffsize_mb the exported value" in errors[0]
    db = tmp_path / "mlruns.db"
    assert not db.exists() or search_runs(f"sqlite:///{db}") == []


def test_the_run_records_the_variables_its_ranks_ran_with(compose_cfg, mlflow_uri, monkeypatch):
    """Each variable the config sets is a tag ``env.NAME`` of the run, as rank 0 read it after the
    backend environment was applied; an honoured exported timeout shows as exported."""
    from orchestrator import trial

    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1800")
    over = [*ASCEND, "trainer.steps=2", "+comm.env={MY_BACKEND_FLAG:on}", f"tracking.uri={mlflow_uri}"]
    result = trial.run(compose_cfg(over), over, progress=False)
    assert result["status"] == "finished", result.get("reason")
    tags = search_runs(mlflow_uri)[0].data.tags
    assert tags["env.MY_BACKEND_FLAG"] == "on" and tags["env.HCCL_BUFFSIZE"] == "200"
    assert tags["env.HCCL_EXEC_TIMEOUT"] == "1800"  # exported, honoured, recorded
