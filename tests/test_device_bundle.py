"""bench/device_bundle.py, offline: the wheels the lent GPU machine lacks are resolved from
Requires-Dist against its package list, their tags and the size a device call carries checked,
on synthetic metadata and wheel files (no download)."""

from __future__ import annotations

import importlib.util
import zipfile

import pytest

from tests.conftest import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("bench_device_bundle", ROOT / "bench" / "device_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


db = _load()

# a small world: name -> (version, Requires-Dist)
META = {
    "app": ("1.0", ["lib-a>=2", "Machine_Pkg", "only-windows; sys_platform == 'win32'", "old; python_version < '3.9'"]),
    "lib-a": ("2.1", ["lib-b", "extra-only; extra == 'fancy'", "new-py; python_version >= '3.12'"]),
    "lib-b": ("0.3", ["lib-a"]),  # a cycle
    "new-py": ("5.0", []),
}


def meta(name):
    if name not in META:
        raise db.BundleError(f"{name} not installed")
    return META[name]


def test_resolution_follows_requires_dist_to_the_machine_list_with_markers_for_312():
    pins = db.resolve(["App"], have={"machine-pkg"}, meta=meta)
    # markers for CPython 3.12 on Linux: no windows-only, no < 3.9, no extra; the cycle once
    assert pins == {"app": "1.0", "lib-a": "2.1", "lib-b": "0.3", "new-py": "5.0"}
    # on 3.11 the >= 3.12 need drops out (the rehearsal's target)
    assert "new-py" not in db.resolve(["app"], have={"machine-pkg"}, meta=meta, python=(3, 11))
    # a package the machine has is not carried, nor followed
    assert db.resolve(["app"], have={"machine-pkg", "lib-a"}, meta=meta) == {"app": "1.0"}
    with pytest.raises(db.BundleError, match="machine-pkg"):
        db.resolve(["app"], have=set(), meta=meta)


def test_the_real_closure_carries_hydra_and_mlflow_and_nothing_the_machine_has():
    """Against this environment's installed metadata (offline): what device_check needs there."""
    for flavour in ("full", "skinny"):
        pins = db.choose(flavour)
        assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "sqlalchemy", "alembic"} <= set(pins)
        assert ("mlflow" in pins) == (flavour == "full") and "mlflow-skinny" in pins
        assert not set(pins) & db.MACHINE  # torch, numpy, pyyaml, requests... are there
        assert "ray" not in pins  # the device check never imports it
    assert set(db.choose("skinny")) < set(db.choose("full"))
    # --also: a package the machine has in a version that does not serve is carried too
    assert "typing-extensions" in db.choose("skinny", also=["typing_extensions"])
    # the machine list is KINDS.md's, normalised
    assert {"torch", "numpy", "pyyaml", "typing-extensions", "huggingface-hub"} <= db.MACHINE
    assert not {"hydra-core", "omegaconf", "mlflow", "ray", "sqlalchemy"} & db.MACHINE


@pytest.mark.parametrize(
    "tag,ok",
    [
        (("py3", "none", "any"), True),
        (("py2", "none", "any"), False),
        (("cp312", "cp312", "manylinux_2_17_x86_64"), True),
        (("cp312", "cp312", "manylinux2014_x86_64"), True),
        (("cp312", "cp312", "manylinux_2_28_x86_64"), True),
        (("cp312", "cp312", "manylinux_2_34_x86_64"), False),  # newer glibc than torch there needs
        (("cp311", "abi3", "manylinux_2_28_x86_64"), True),
        (("cp313", "abi3", "manylinux_2_28_x86_64"), False),
        (("cp311", "cp311", "manylinux_2_17_x86_64"), False),
        (("cp312", "cp312", "manylinux_2_17_aarch64"), False),
        (("cp312", "cp312", "musllinux_1_2_x86_64"), False),
        (("cp312", "cp312", "macosx_11_0_arm64"), False),
        (("cp312", "none", "any"), True),
    ],
)
def test_tags_the_machine_installs(tag, ok):
    assert db.tag_ok(*tag) is ok


def _wheel(folder, filename, requires=()):
    name, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as z:
        body = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        body += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", body)
    return path


def test_parse_wheel_expands_compressed_tag_sets():
    name, version, tags = db.parse_wheel("SQLAlchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert (name, version) == ("sqlalchemy", "2.1.9") and len(tags) == 2
    assert db.parse_wheel("graphene-3.4.3-py2.py3-none-any.whl")[2] == [("py2", "none", "any"), ("py3", "none", "any")]
    with pytest.raises(db.BundleError):
        db.parse_wheel("not-a-wheel.tar.gz")


def test_check_wheels_wants_one_installable_wheel_per_pin(tmp_path):
    pins = {"hydra-core": "1.3.8", "pydantic-core": "2.50.5", "omegaconf": "2.3.1"}
    _wheel(tmp_path, "hydra_core-1.3.8-py3-none-any.whl", ["omegaconf<2.4", "packaging"])
    _wheel(tmp_path, "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    _wheel(tmp_path, "omegaconf-2.3.1-py3-none-any.whl", ["antlr4-python3-runtime==4.9.*", "PyYAML>=5.1"])
    assert db.check_wheels(tmp_path, pins) == []
    # omegaconf needs antlr4, which neither the bundle nor the machine has; packaging/pyyaml are there
    assert db.unmet(tmp_path) == ["omegaconf-2.3.1-py3-none-any.whl needs antlr4-python3-runtime"]
    _wheel(tmp_path, "omegaconf-2.2.0-py3-none-any.whl")  # a second version
    _wheel(tmp_path, "stray-1.0-py3-none-any.whl")  # not in the bundle
    _wheel(tmp_path, "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl")  # wrong Python
    problems = "\n".join(db.check_wheels(tmp_path, {**pins, "sqlparse": "0.6.1"}))
    assert "omegaconf: 2 wheels" in problems and "version 2.2.0, pinned 2.3.1" in problems
    assert "stray is not in the bundle" in problems and "sqlparse==0.6.1: no wheel" in problems
    assert "cp311-cp311" in problems and "no tag for CPython 3.12" in problems
    # prune keeps only the installable wheels of the pinned versions of pinned projects
    assert sorted(db.prune(tmp_path, pins)) == [
        "omegaconf-2.2.0-py3-none-any.whl",
        "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl",
        "stray-1.0-py3-none-any.whl",
    ]
    assert db.check_wheels(tmp_path, pins) == []


def test_size_check_counts_the_wheels_and_the_repository_once(tmp_path):
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    (wheels / "big-1.0-py3-none-any.whl").write_bytes(b"x" * 3000)
    repo_file = tmp_path / "code.py"
    repo_file.write_bytes(b"y" * 1000)
    inside = wheels / "big-1.0-py3-none-any.whl"  # a wheel git does not ignore is listed by git too
    w, r, problem = db.size_report(wheels, [repo_file, inside], limit=5000)
    assert (w, r, problem) == (3000, 1000, None)
    w, r, problem = db.size_report(wheels, [repo_file], limit=3500)
    assert problem and "over the" in problem and "--mlflow skinny" in problem
    # the real repository's travelling files, as git lists them, are well under the limit
    files = db.travelling_files()
    assert files and sum(p.stat().st_size for p in files if p.is_file()) < db.LIMIT_BYTES / 4


def test_download_falls_back_to_building_a_pure_wheel_when_none_is_published(tmp_path, monkeypatch):
    calls = []

    class Done:
        def __init__(self, rc, err=""):
            self.returncode, self.stderr, self.stdout = rc, err, ""

    def fake_pip(args):
        calls.append(args)
        target = args[args.index("-d") + 1] if "-d" in args else args[args.index("-w") + 1]
        assert target == str(tmp_path)
        name, version = args[-1].split("==")
        if args[0] == "download" and name == "antlr4-python3-runtime":
            return Done(1, "ERROR: No matching distribution found for antlr4-python3-runtime==4.9.3")
        _wheel(tmp_path, f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
        return Done(0)

    monkeypatch.setattr(db, "_pip", fake_pip)
    pins = {"antlr4-python3-runtime": "4.9.3", "omegaconf": "2.3.1"}
    assert db.pip_download(pins, tmp_path) == ["antlr4-python3-runtime"]
    assert [c[0] for c in calls] == ["download", "wheel", "download"]
    download = calls[0]
    assert "--only-binary=:all:" in download and "--no-deps" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in download and "manylinux2014_x86_64" in download
    assert db.check_wheels(tmp_path, pins) == []
    calls.clear()
    assert db.pip_download(pins, tmp_path) == [] and calls == []  # already there: nothing fetched again


def test_list_mode_resolves_offline_and_the_command_installs_then_runs_the_check(capsys):
    assert db.main([str(ROOT / ".whl-test-unused"), "--list", "--mlflow", "skinny"]) == 0
    out = capsys.readouterr().out
    assert "hydra-core==" in out and "mlflow-skinny==" in out and "ray" not in out.split()
    assert not (ROOT / ".whl-test-unused").exists()
    cmd = db.remote_command(".whl")
    assert cmd.startswith("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade")
    assert "--target /tmp/site .whl/*.whl" in cmd and "PYTHONPATH=/tmp/site:$PWD" in cmd
    assert cmd.endswith("python3 bench/device_check.py --out $OUT")
