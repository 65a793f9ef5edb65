"""The prepared device check passes its dry mode on the CPU: the script a lent GPU runs is sound."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_device_check_dry_mode_runs_every_row_and_fills_every_column(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device check: dry (CPU plumbing)" in proc.stdout and "dry-mode check" not in proc.stdout
    record = json.loads((tmp_path / "device_check.json").read_text())
    rows = {r["case"]: r for r in record["rows"]}
    assert set(rows) == {"bf16", "fp16", "bf16 x2", "fp16 x2"}
    for row in rows.values():
        assert row["status"] == "finished" and row["step_s"] > 0 and row["reserved_gb"] > 0
        assert row["planned_gb"] / row["reserved_gb"] == pytest.approx(row["plan_over_reserved"])
    for case in ("bf16", "bf16 x2"):  # the profiled rows: shares of one window
        assert 0 < rows[case]["compute_share"] and rows[case]["compute_share"] + rows[case]["comm_share"] <= 1
    assert rows["bf16 x2"]["comm_share"] > 0 and rows["bf16"]["comm_share"] == 0  # one process talks to none
    assert record["comm"]["status"] == "finished" and record["comm"]["backend"] == "gloo"
    assert (tmp_path / "device_check.md").read_text().count("| finished |") == 4
