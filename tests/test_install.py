"""A plain install ships conf/ and runs from any directory; an editable one (`pip install -e .`)
shows Hydra its plugins from any directory too; the console scripts are installed and exit as the
`python -m` tools do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

RAY_LAUNCHER = "hydra_plugins.ray_launcher.ray_launcher.RayLauncher"
OVAT_SWEEPER = "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper"


def _elsewhere_env() -> dict:
    """The environment of a user outside the repository: nothing on PYTHONPATH, no MLflow URI."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}


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

    def orchestrator(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "orchestrator", *args]
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    proc = orchestrator("+chip=cpu", "trainer=smoke", "trainer.steps=3", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished run" in proc.stdout
    assert (work / "mlruns.db").is_file()
    cfg = orchestrator("+chip=ascend910b", "parallel=tp8pp4", "--cfg", "job")
    assert cfg.returncode == 0 and "tp: 8" in cfg.stdout and "name: ascend910b" in cfg.stdout
    for name in ("ray_trials", "ray"):  # ray: the alias, where Hydra's own Ray launcher is not installed
        launcher = orchestrator(f"hydra/launcher={name}", "--cfg", "hydra", "-p", "hydra.launcher")
        assert launcher.returncode == 0 and "hydra_plugins.ray_launcher.ray_launcher.RayLauncher" in launcher.stdout
    sweeper = orchestrator("+sweep=cpu_smoke", "--cfg", "hydra", "--package", "hydra.sweeper")
    assert sweeper.returncode == 0 and "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper" in sweeper.stdout
    assert "trainer.micro_batch" in sweeper.stdout


def test_the_installed_package_finds_its_hydra_plugins_from_another_directory(tmp_path):
    """Hydra lists `hydra_plugins.__path__` to find plugins: with the venv's install (editable in
    CI and per the README) that must hold the plugins' folder, not only setuptools' placeholder."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "hydra/launcher=ray", "hydra/sweeper=ovat", "--cfg", "hydra"],
        cwd=tmp_path,
        env=_elsewhere_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n(a stale install? pip install -e .)"
    assert RAY_LAUNCHER in proc.stdout and OVAT_SWEEPER in proc.stdout


_DISCOVER = """
import site, sys
site.addsitedir(sys.argv[2])  # the fresh editable install, as pip unpacks it (its finder first)
sys.path.append(sys.argv[1])  # then the venv's packages (torch, hydra, ...), not its .pth files
import orchestrator
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
assert orchestrator.__file__.startswith(sys.argv[3]), orchestrator.__file__
for kind in (Launcher, Sweeper):
    for c in Plugins.instance().discover(kind):
        print(c.__module__ + "." + c.__name__)
"""


def test_a_fresh_editable_install_shows_hydra_its_plugins(tmp_path):
    """`pip install -e .` of this pyproject.toml, built by setuptools' PEP 660 hook (what pip calls)
    from a copy of the sources and unpacked into a site folder of its own, lists both plugins in a
    `python -S` process that sees neither the repository nor the venv's own editable install."""
    src, wheels, site_dir, work = (tmp_path / d for d in ("src", "wheels", "site", "work"))
    for d in ("orchestrator", "conf", "trainers", "sweeps", "hydra_plugins"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    build = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; print(b.build_editable(sys.argv[1]))", wheels],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    with zipfile.ZipFile(wheels / build.stdout.split()[-1]) as whl:
        whl.extractall(site_dir)
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _DISCOVER, sysconfig.get_path("purelib"), str(site_dir), str(src)],
        cwd=work,
        env=_elsewhere_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = proc.stdout.split()
    assert RAY_LAUNCHER in found and OVAT_SWEEPER in found, found


def _script(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(sysconfig.get_path("scripts"), name), *args],
        cwd=cwd,
        env=_elsewhere_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_console_scripts_run_from_another_directory(tmp_path):
    from importlib.metadata import distributions

    from mlflow.tracking import MlflowClient

    from orchestrator.config import TrackingConfig

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (dist,) = [d for d in distributions(path=[sysconfig.get_path("purelib")]) if d.name == "chip-orchestrator"]
    installed = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert installed == declared, "the venv's install predates pyproject.toml: pip install -e ."
    for name in declared:
        assert os.path.isfile(os.path.join(sysconfig.get_path("scripts"), name)), name
    for name in ("orchestrator-best", "orchestrator-report", "orchestrator-compare", "orchestrator-plan"):
        proc = _script(name, "--help", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {name} "), proc.stdout[:300] + proc.stderr
        assert "--tracking-uri" in proc.stdout and "--json" in proc.stdout and "3  nothing matched" in proc.stdout

    uri = "sqlite:///" + str(tmp_path / "mlruns.db")
    MlflowClient(uri).create_experiment(TrackingConfig.experiment)  # a store with no runs
    cases = [
        ("orchestrator-best", ["--tracking-uri", uri], 3, "error: --experiment="),
        ("orchestrator-report", ["--tracking-uri", uri, "--log"], 3, "no sweep"),
        ("orchestrator-compare", ["abcd", "efgh", "--uri", uri], 2, "error: run_a=abcd: no such run"),
        ("orchestrator-best", ["--tracking-uri", "sqlite:///typo.db"], 2, "error: --tracking-uri=sqlite:///typo.db"),
        ("orchestrator-plan", ["parallel.tpp=2"], 2, "error: "),
        ("orchestrator", ["parallel.tpp=2"], 2, "parallel.tpp"),
        ("orchestrator-data", ["--inspect", "nope"], 2, "error: nope.idx: no such file"),
    ]
    for name, args, code, needle in cases:
        proc = _script(name, *args, cwd=tmp_path)
        assert proc.returncode == code and needle in proc.stderr, (name, args, proc.returncode, proc.stderr[-2000:])
        assert proc.stdout == "" or name == "orchestrator", proc.stdout[:500]
    assert not (tmp_path / "typo.db").exists()
    job = _script("orchestrator", "+chip=ascend910b", "parallel=tp8pp4", "--cfg", "job", cwd=tmp_path)
    assert job.returncode == 0 and "tp: 8" in job.stdout, job.stderr[-2000:]
