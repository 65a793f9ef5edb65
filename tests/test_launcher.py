"""``hydra/launcher=ray_trials`` is a Hydra launcher like any other: Hydra's own launcher test
suites run on it (as Hydra runs them on its plugins), a foreign app (tests/foreign_app: its own
``@hydra.main`` and config, no ``launch`` section) gets from it what it gets from the basic
launcher, and the ``ray`` alias never shadows Hydra's own Ray launcher.

The in-process tests share one local cluster of 2 CPUs, started by the launcher in the first of
them; Hydra's integration suite's apps join one `ray start --head` cluster; the other subprocess
tests start their own (~10 s on two cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from omegaconf import OmegaConf

from orchestrator import ray_sweep
from tests.cluster import head_node
from tests.conftest import ROOT, cli_env

pytestmark = pytest.mark.ray

FOREIGN = ROOT / "tests" / "foreign_app"
# a small local cluster; no dashboard (it would only slow the start)
CLUSTER = ["+hydra.launcher.init.num_cpus=2", "+hydra.launcher.init.include_dashboard=false"]


@pytest.fixture(scope="module", autouse=True)
def _local_cluster_only():
    """Every cluster here is a local one, and none outlives this module (the in-process tests'
    cluster lives as long as the process otherwise, as a multirun's does)."""
    saved = os.environ.pop("RAY_ADDRESS", None)
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if saved is not None:
        os.environ["RAY_ADDRESS"] = saved


def _hydra_ray_launcher_installed() -> bool:
    from hydra_plugins.ray_launcher.ray_launcher import _hydra_ray_launcher_installed

    return _hydra_ray_launcher_installed()


def test_discovery():
    """Hydra's plugin scan finds the launcher (the test Hydra runs on each launcher plugin)."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher

    found = {f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)}
    assert ray_sweep.LAUNCHER in found


@pytest.mark.parametrize("launcher_name, overrides", [("ray_trials", CLUSTER)])
class TestRayTrialsLauncher(LauncherTestSuite):
    """Hydra's launcher test suite, in this process: job returns, configs, output dirs."""

    @pytest.fixture(autouse=True)
    def _no_version_base_yet(self, hydra_restore_singletons):
        """The suite expects a process in which no app has chosen a ``version_base`` (its legacy
        defaults: a job runs in its own output dir). Hydra keeps that choice process-wide, and an
        earlier module's compose (``version_base="1.3"``: jobs stay in the launch dir) would hold."""
        from hydra.version import _UNSPECIFIED_, VersionBase

        VersionBase.instance().version_base = _UNSPECIFIED_  # as in a fresh process


@pytest.mark.slow
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        (
            {},
            [
                "-m",
                "hydra/launcher=ray_trials",
                "hydra/hydra_logging=hydra_debug",
                "hydra/job_logging=disabled",
            ],
        )
    ],
)
class TestRayTrialsLauncherIntegration(IntegrationTestSuite):
    """Hydra's integration suite: real apps in subprocesses (job names, sweep dirs, chdir,
    original cwd). Hydra finds the plugin through PYTHONPATH, as in a source checkout. The apps
    join one `ray start --head` cluster (RAY_ADDRESS) rather than each starting its own."""

    @pytest.fixture(autouse=True)
    def _plugin_on_path(self, monkeypatch, shared_head):
        monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])
        monkeypatch.setenv("RAY_ADDRESS", shared_head["address"])
        monkeypatch.setenv("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="module")
def shared_head(tmp_path_factory):
    """A 2-CPU head without a dashboard, for the integration suite's apps; it does not see this
    checkout (no PYTHONPATH): the code travels to its workers."""
    env = cli_env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    with head_node(tmp_path_factory.mktemp("ray_head"), env, cpus=2, dashboard=False) as head:
        yield head


def _names(launcher: str) -> dict:
    """hydra.launcher as the foreign app composes it with hydra/launcher=``launcher``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(FOREIGN / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg.hydra.launcher)


def test_the_launcher_config_and_its_defaults():
    conf = _names("ray_trials")
    assert conf == {
        "_target_": ray_sweep.LAUNCHER,
        "address": None,
        "init": {},
        "job_resources": {"num_cpus": None, "num_gpus": 0, "resources": {}},
        "same_node": True,
    }
    if not _hydra_ray_launcher_installed():
        assert _names("ray") == conf  # the alias, where the name is free


def test_the_alias_never_shadows_hydras_own_ray_launcher(tmp_path):
    """Where hydra-ray-launcher is installed, hydra/launcher=ray is its launcher, whichever plugin
    Hydra scans last; ray_trials is still this one. A stand-in package, first on the path (so
    scanned before this checkout's plugins), registers hydra/launcher=ray as Hydra's does."""
    plugin = tmp_path / "hydra_plugins" / "hydra_ray_launcher"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "from dataclasses import dataclass\n"
        "from hydra.core.config_store import ConfigStore\n\n\n"
        "@dataclass\n"
        "class Conf:\n"
        "    _target_: str = 'hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher'\n\n\n"
        "ConfigStore.instance().store(group='hydra/launcher', name='ray', node=Conf, provider='ray_launcher')\n"
    )
    env = cli_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]

    def target(name: str) -> str:
        proc = subprocess.run(
            [
                sys.executable,
                str(FOREIGN / "my_app.py"),
                f"hydra/launcher={name}",
                "--cfg",
                "hydra",
                "-p",
                "hydra.launcher",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return OmegaConf.create(proc.stdout)._target_

    assert target("ray") == "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    assert target("ray_trials") == ray_sweep.LAUNCHER


def _sweep(hydra_sweep_runner, launcher: str, overrides, sweep_dir: Path) -> list:
    """The foreign app's multirun in this process: per job, what the sweeper gets back and what
    the job left in its output dir, with paths relative to ``sweep_dir``."""
    from tests.foreign_app.my_app import my_app

    sweep = hydra_sweep_runner(
        calling_file=str(FOREIGN / "my_app.py"),
        calling_module=None,
        task_function=my_app.__wrapped__,  # the undecorated task function
        config_path="conf",
        config_name="config",
        overrides=[f"hydra/launcher={launcher}", *overrides],
        temp_dir=sweep_dir,
    )
    jobs = []
    with sweep:
        for ret in sweep.returns[0]:
            out = Path(ret.hydra_cfg.hydra.runtime.output_dir)
            jobs.append(
                {
                    "return_value": ret.return_value,
                    "status": ret.status.name,
                    "overrides": ret.overrides,
                    "cfg": OmegaConf.to_container(ret.cfg),
                    "task_name": ret.task_name,
                    "num": ret.hydra_cfg.hydra.job.num,
                    "id": str(ret.hydra_cfg.hydra.job.id),
                    "output_dir": os.path.relpath(out, sweep_dir),
                    "working_dir": os.path.relpath(ret.working_dir, sweep_dir),
                    "cwd": os.path.relpath((out / "where.txt").read_text(), sweep_dir),
                    "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
                    "config.yaml": (out / ".hydra" / "config.yaml").read_text(),
                    "overrides.yaml": (out / ".hydra" / "overrides.yaml").read_text(),
                }
            )
    return jobs


@pytest.mark.parametrize("chdir", ["true", "false"])
def test_a_foreign_app_gets_what_the_basic_launcher_gives(
    hydra_sweep_runner, hydra_restore_singletons, tmp_path, monkeypatch, chdir
):
    """Same job returns (return value, status, configs, job num and id), same output dirs
    (hydra.sweep.dir/hydra.sweep.subdir), same working dir under hydra.job.chdir, same files."""
    monkeypatch.chdir(tmp_path)
    overrides = ["x=1,2,3", f"hydra.job.chdir={chdir}", "hydra.sweep.subdir=job_${hydra.job.num}"]
    basic = _sweep(hydra_sweep_runner, "basic", overrides, tmp_path / "basic")
    on_ray = _sweep(hydra_sweep_runner, "ray_trials", [*overrides, *CLUSTER], tmp_path / "ray")
    assert [j["return_value"] for j in on_ray] == [10, 20, 30]
    assert on_ray == basic
    assert on_ray[1]["output_dir"] == "job_1"
    assert on_ray[1]["cwd"] == on_ray[1]["working_dir"] == ("job_1" if chdir == "true" else "..")
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "where.txt"} <= set(on_ray[1]["files"])


def _foreign_cli(tmp_path: Path, launcher_args, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(FOREIGN / "my_app.py"), "-m", *launcher_args, *overrides],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_foreign_apps_failing_job_fails_its_multirun_as_under_the_basic_launcher(tmp_path):
    """The real command line: every job runs, then the multirun raises the failed job's error
    (exit 1), as Hydra's basic launcher does; the other jobs' outputs are all there."""
    runs = {}
    for name, args in (("basic", ["hydra/launcher=basic"]), ("ray", ["hydra/launcher=ray_trials", *CLUSTER])):
        (tmp_path / name).mkdir()
        proc = _foreign_cli(tmp_path / name, args, "x=1,2,3", "fail_on=2", "hydra.sweep.dir=out")
        files = sorted(str(p.relative_to(tmp_path / name / "out")) for p in (tmp_path / name / "out").rglob("*"))
        runs[name] = (proc.returncode, "ValueError: x=2 was told to fail" in proc.stderr, files)
    assert runs["ray"][:2] == (1, True), runs
    assert runs["ray"] == runs["basic"]
    assert "0/where.txt" in runs["ray"][2] and "2/where.txt" in runs["ray"][2] and "1/where.txt" not in runs["ray"][2]


def test_this_applications_launch_ray_section_fills_what_the_launcher_leaves_unset():
    """Key by key: hydra.launcher.* wins, then the task config's launch.ray, then the default."""
    app = OmegaConf.create(
        {"launch": {"ray": {"address": None, "num_cpus": 4, "dashboard": False, "exclusive": False}}}
    )
    assert ray_sweep.cluster_settings({"address": None, "init": {}}, app) == (
        {"address": None, "num_cpus": 4, "dashboard": False},
        {},
    )
    init = {"num_cpus": 2, "include_dashboard": True, "runtime_env": {"env_vars": {"A": "1"}}}
    assert ray_sweep.cluster_settings({"address": "10.0.0.1:6379", "init": init}, app) == (
        {"address": "10.0.0.1:6379", "num_cpus": 2, "dashboard": True},
        {"runtime_env": {"env_vars": {"A": "1"}}},
    )
    joined = OmegaConf.create({"launch": {"ray": {"address": "head:6379", "num_cpus": None}}})
    assert ray_sweep.cluster_settings({}, joined)[0]["address"] == "head:6379"
    # Hydra's own Ray launcher spells the address init.address
    assert ray_sweep.cluster_settings({"init": {"address": "auto"}}, joined)[0]["address"] == "auto"
    foreign = OmegaConf.create({"x": 1})
    assert ray_sweep.cluster_settings({"init": {"num_cpus": 2}}, foreign) == (
        {"address": None, "num_cpus": 2, "dashboard": True},
        {},
    )


def test_what_each_job_holds():
    """This application's jobs hold no CPU (their trials' workers hold the devices); another
    app's hold one, as a Ray task does by default; hydra.launcher.job_resources wins."""
    app = OmegaConf.create({"launch": {"ray": {"num_cpus": 4}}})
    foreign = OmegaConf.create({"x": 1})
    unset = {"job_resources": {"num_cpus": None, "num_gpus": 0, "resources": {}}}
    assert ray_sweep.job_options(unset, app) == {"num_cpus": 0, "num_gpus": 0}
    assert ray_sweep.job_options(unset, foreign) == {"num_cpus": 1, "num_gpus": 0}
    held = {"job_resources": {"num_cpus": 0.5, "num_gpus": 1, "resources": {"NPU": 1}}}
    assert ray_sweep.job_options(held, app) == {"num_cpus": 0.5, "num_gpus": 1, "resources": {"NPU": 1}}


def test_a_job_knows_it_runs_under_this_launcher_whichever_name_chose_it():
    """orchestrator.app forces its trials onto Ray under this launcher (by its class, so under
    both names), not under Hydra's own Ray launcher or the basic one."""
    ours = OmegaConf.create({"launcher": {"_target_": ray_sweep.LAUNCHER}})
    hydras = OmegaConf.create({"launcher": {"_target_": "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"}})
    basic = OmegaConf.create({"launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}})
    assert ray_sweep.is_ray_job(ours) and not ray_sweep.is_ray_job(hydras) and not ray_sweep.is_ray_job(basic)
