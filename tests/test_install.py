"""A plain (non-editable) install ships conf/ and runs from any directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_wheel_install_runs_from_another_directory(tmp_path):
    wheels, target, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(wheels)],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    wheel = next(wheels.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "orchestrator" / "conf" / "chip" / "ascend910b.yaml").is_file()
    assert (target / "hydra_plugins" / "ray_launcher" / "ray_launcher.py").is_file()
    assert (target / "hydra_plugins" / "ovat_sweeper" / "ovat_sweeper.py").is_file()
    assert (target / "orchestrator" / "conf" / "sweep" / "cpu_smoke.yaml").is_file()
    assert not (target / "hydra_plugins" / "__init__.py").exists()  # a namespace package, as Hydra expects
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = str(target)  # the installed copy only, not the repository
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+chip=cpu", "trainer=smoke", "trainer.steps=3"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished run" in proc.stdout
    assert (work / "mlruns.db").is_file()
    cfg = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+chip=ascend910b", "parallel=tp8pp4", "--cfg", "job"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cfg.returncode == 0 and "tp: 8" in cfg.stdout and "name: ascend910b" in cfg.stdout
    launcher = subprocess.run(
        [sys.executable, "-m", "orchestrator", "hydra/launcher=ray", "--cfg", "hydra", "--package", "hydra.launcher"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launcher.returncode == 0 and "hydra_plugins.ray_launcher.ray_launcher.RayLauncher" in launcher.stdout
    sweeper = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+sweep=cpu_smoke", "--cfg", "hydra", "--package", "hydra.sweeper"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sweeper.returncode == 0 and "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper" in sweeper.stdout
    assert "trainer.micro_batch" in sweeper.stdout


# what the code imports, and the release that brought it (the floors' reasons in pyproject.toml)
NEEDS = {
    "torch": [
        ("torch.distributed.fsdp", "fully_shard", "2.6"),
        ("torch.distributed.pipelining", "ScheduleZBVZeroBubble", "2.6"),
    ],
    "ray": [("ray.train.v2._internal.execution.callback", "WorkerGroupCallback", "2.51")],
}


def _floor(requirement: str) -> str:
    import re

    return re.search(r">=\s*([0-9.]+)", requirement).group(1)


@pytest.mark.parametrize("package", sorted(NEEDS))
def test_version_floors_cover_what_the_code_uses(package):
    """Each floor in pyproject.toml is no older than the release that brought an API the code
    imports, and the installed release has that API."""
    import importlib
    import tomllib

    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [d for d in deps if d.split(">=")[0].split("[")[0].strip() == package]
    for module, name, since in NEEDS[package]:
        assert Version(_floor(req)) >= Version(since), f"{package} floor {req} predates {module}.{name} ({since})"
        assert hasattr(importlib.import_module(module), name)
