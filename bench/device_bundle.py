"""The wheels the lent GPU machine lacks to run ``bench/device_check.py``, in one folder.

    python bench/device_bundle.py .whl            # download them (here, where pip reaches PyPI)
    python bench/device_bundle.py .whl --list     # resolve only: what would be downloaded, no network
    python bench/device_bundle.py .whl --mlflow skinny --also typing-extensions   # see below

The lent ``nvidia-h200`` machine (the device tool's KINDS.md) runs Python 3.12 with torch, numpy,
pyyaml, requests and a long list of other packages, reaches no package registry, and takes 64 MiB
of working tree per call. The device check needs Hydra (``hydra-core``, ``omegaconf``, their
``antlr4-python3-runtime``) and MLflow with a sqlite tracking store; Ray it never imports (the
trial runs through torch's elastic launcher). This script:

1. pins each root to the version installed in this environment (``importlib.metadata``) and
   follows its ``Requires-Dist`` (markers evaluated for CPython 3.12 on x86-64 Linux, extras
   skipped) down to what the machine already has (:data:`MACHINE_PACKAGES`, copied from KINDS.md;
   a package there is taken as it is, its own needs with it);
2. downloads exactly those wheels (``pip download --no-deps --only-binary=:all:`` for cp312,
   manylinux x86-64; pure-Python wheels match too), removes any other version of them from DIR
   (two versions of one package stop the whole install there), and checks every wheel's tags;
3. checks that the wheels plus the repository's own travelling files (tracked and
   untracked-not-ignored) stay under the 64 MiB a call carries;
4. prints the one command to run there.

``--mlflow auto`` (the default) carries the full ``mlflow`` wheel with its closure when that fits
under the limit, and otherwise ``mlflow-skinny`` with what its sqlite store needs (``sqlalchemy``,
``alembic``): the skinny wheel holds the whole ``mlflow`` Python package, store and migrations
included, and lacks only the UI/server and the SQL libraries (34.8 MiB of wheels for the full
closure, 19.4 for the skinny one, with mlflow 3.17.2). Both ran ``device_check.py --dry`` (the
project's tracking on a sqlite store, through the elastic launcher) in a scratch Python 3.11
whose only packages were the machine's list plus the bundle (``--python 3.11`` wheels of the same
versions) and in which ``import ray`` failed: no step of the path imports Ray.

KINDS.md gives the machine's packages without versions, so one that is there in a version too old
for a carried package is a failure only a run there shows (an ImportError naming it):
``--also NAME`` carries it as well, at this environment's version.

DIR must be ignored by git (``.whl/`` is, in ``.gitignore``; another folder:
``echo /DIR/ >> .git/info/exclude``) and named in the device call's ``carry`` (a folder git does
not ignore travels anyway, as untracked files, but then every call carries it, also those that
need no wheels).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the wheel tags the machine installs, and the names and error they share with this script
from bench.wheel_tags import PLATFORMS, PYTHON, BundleError, normalize, parse_wheel, tag_ok  # noqa: E402

LIMIT_BYTES = 64 * 2**20  # the working tree that travels, carried paths included (device README, Limits)

# The lent machine's Python packages: /work/.library/device/KINDS.md, "Python packages already
# there", nvidia-h200 (their image 'cuda', read on a machine running it on 2026-11-17). Versions
# are not listed there; a package present is taken to satisfy every need of it.
MACHINE_PACKAGES = frozenset(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()
)

# What bench/device_check.py imports that the machine may lack: Hydra's compose API and MLflow
# (orchestrator/tracking.py) on a sqlite store. Everything else on its path is the standard
# library, torch, numpy, pyyaml, tqdm, packaging (all on the machine) and this repository.
ROOTS = ("hydra-core", "omegaconf")
MLFLOW_FULL = ("mlflow",)
MLFLOW_SKINNY = ("mlflow-skinny", "sqlalchemy", "alembic")  # the package, and its sqlite store's needs

MACHINE = frozenset(normalize(n) for n in MACHINE_PACKAGES)


def marker_env(python: Tuple[int, int] = PYTHON) -> Dict[str, str]:
    """The environment markers are evaluated in: the machine's CPython on x86-64 Linux, no extra."""
    v = f"{python[0]}.{python[1]}"
    return {
        "python_version": v,
        "python_full_version": v + ".0",
        "implementation_name": "cpython",
        "implementation_version": v + ".0",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def needs(requires: Iterable[str], env: Dict[str, str]) -> List[str]:
    """The projects a distribution's ``Requires-Dist`` lines name for ``env`` (extras left out)."""
    out = []
    for line in requires or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # another Python, another platform, or only with an extra
        out.append(normalize(req.name))
    return out


MetaFn = Callable[[str], Tuple[str, List[str]]]


def installed(name: str) -> Tuple[str, List[str]]:
    """(version, Requires-Dist) of ``name`` as installed in this environment."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        raise BundleError(
            f"{name} is needed on the machine but not installed here, so there is no version to pin: "
            f"pip install it here first (the bundle carries what this environment runs)"
        ) from None
    return dist.version, list(dist.requires or [])


def resolve(
    roots: Sequence[str],
    have: Iterable[str] = MACHINE,
    meta: MetaFn = installed,
    python: Tuple[int, int] = PYTHON,
) -> Dict[str, str]:
    """{project: version} that the machine lacks: ``roots`` and everything their Requires-Dist
    needs, recursively, stopping at what ``have`` names (the machine's own packages)."""
    have = {normalize(n) for n in have}
    env = marker_env(python)
    pins: Dict[str, str] = {}
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop(0)
        if name in pins or name in have:
            continue
        version, requires = meta(name)
        pins[name] = version
        todo += [n for n in needs(requires, env) if n not in pins and n not in have]
    return dict(sorted(pins.items()))


# --- wheel files (their names and tags: bench/wheel_tags.py) -----------------------------------


def check_wheels(folder: Path, pins: Dict[str, str], python: Tuple[int, int] = PYTHON) -> List[str]:
    """What is wrong with the wheels in ``folder`` for ``pins``: a pinned project without its
    wheel, a second version of one, a wheel of a project not pinned, a tag the machine cannot
    install. Empty when the folder holds exactly one installable wheel per pin."""
    problems = []
    seen: Dict[str, List[str]] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, tags = parse_wheel(path.name)
        seen.setdefault(name, []).append(version)
        if name not in pins:
            problems.append(f"{path.name}: {name} is not in the bundle")
        elif version != pins[name]:
            problems.append(f"{path.name}: version {version}, pinned {pins[name]}")
        if not any(tag_ok(*t, python=python) for t in tags):
            problems.append(f"{path.name}: no tag for CPython {python[0]}.{python[1]} on x86-64 manylinux")
    for name, versions in seen.items():
        if len(versions) > 1:
            problems.append(f"{name}: {len(versions)} wheels ({', '.join(versions)}); keep one")
    problems += [f"{name}=={v}: no wheel" for name, v in pins.items() if name not in seen]
    return problems


def wheel_needs(path: Path, python: Tuple[int, int] = PYTHON) -> List[str]:
    """The projects a wheel's own METADATA requires (extras left out)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    lines = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    return needs(lines, marker_env(python))


def unmet(folder: Path, have: Iterable[str] = MACHINE, python: Tuple[int, int] = PYTHON) -> List[str]:
    """Needs, read from the wheels' own METADATA, that neither the bundle nor the machine meets."""
    wheels = list(folder.glob("*.whl"))
    bundled = {parse_wheel(p.name)[0] for p in wheels}
    have = {normalize(n) for n in have} | bundled
    return [f"{p.name} needs {n}" for p in sorted(wheels) for n in wheel_needs(p, python) if n not in have]


# --- sizes -------------------------------------------------------------------------------------


def travelling_files(root: Path = ROOT) -> List[Path]:
    """The repository's files that travel to the machine: tracked and untracked-not-ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return [root / p for p in out.decode().split("\0") if p]


def size_report(folder: Path, repo_files: Sequence[Path], limit: int = LIMIT_BYTES) -> Tuple[int, int, Optional[str]]:
    """(wheels' bytes, the repository's other travelling bytes, a problem or None). A wheel that
    git does not ignore travels as an untracked file anyway: counted once."""
    folder = folder.resolve()
    wheels = sum(p.stat().st_size for p in folder.glob("*.whl"))
    repo = sum(p.stat().st_size for p in repo_files if p.is_file() and folder not in p.resolve().parents)
    total = wheels + repo
    problem = None
    if total >= limit:
        problem = (
            f"the wheels ({wheels / 2**20:.1f} MiB) and the repository's travelling files "
            f"({repo / 2**20:.1f} MiB) make {total / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB a device "
            f"call carries: try --mlflow skinny, or ignore large untracked files"
        )
    return wheels, repo, problem


# --- download and command ----------------------------------------------------------------------


def _pip(args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def pip_download(pins: Dict[str, str], folder: Path, python: Tuple[int, int] = PYTHON) -> List[str]:
    """Fetch each pinned wheel not yet in ``folder``, one project at a time. A project that
    publishes no wheel for that version (``antlr4-python3-runtime`` 4.9.3, which Hydra 1.3 pins,
    is a source distribution only) is built into one here with ``pip wheel``; the tag check then
    refuses it unless it came out pure Python. Returns the projects built so."""
    have = {parse_wheel(p.name)[:2] for p in folder.glob("*.whl")}
    built = []
    flags = ["--no-deps", "--only-binary=:all:", "-q", "--python-version", f"{python[0]}.{python[1]}"]
    flags += ["--implementation", "cp"] + [x for plat in PLATFORMS for x in ("--platform", plat)]
    for name, version in pins.items():
        if (name, version) in have:
            continue
        proc = _pip(["download", *flags, "-d", str(folder), f"{name}=={version}"])
        if proc.returncode == 0:
            continue
        if "No matching distribution" not in proc.stderr:
            raise BundleError(f"pip download {name}=={version} failed:\n" + proc.stderr[-2000:])
        wheel = _pip(["wheel", "--no-deps", "-q", "-w", str(folder), f"{name}=={version}"])
        if wheel.returncode != 0:
            raise BundleError(
                f"{name}=={version}: no wheel for CPython {python[0]}.{python[1]} x86-64 manylinux, "
                f"and building one failed:\n" + (wheel.stderr or proc.stderr)[-2000:]
            )
        built.append(name)
    return built


def prune(folder: Path, pins: Dict[str, str], python: Tuple[int, int] = PYTHON) -> List[str]:
    """Remove the wheels in ``folder`` that are not the pinned version of a pinned project, or
    that the machine cannot install (a leftover of another target): one wheel of each stays."""
    gone = []
    for path in folder.glob("*.whl"):
        name, version, tags = parse_wheel(path.name)
        if pins.get(name) != version or not any(tag_ok(*t, python=python) for t in tags):
            path.unlink()
            gone.append(path.name)
    return gone


def remote_command(folder: str) -> str:
    """The one command the device call runs (DIR relative to the repository root there)."""
    d = shlex.quote(folder.rstrip("/"))
    return (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        f"--target /tmp/site {d}/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; "
        f"python3 bench/device_check.py --out $OUT"
    )


def relative_dir(folder: Path) -> str:
    try:
        return str(folder.resolve().relative_to(ROOT))
    except ValueError:
        return str(folder)


def git_ignored(folder: Path) -> bool:
    probe = folder.resolve() / "x.whl"
    return subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT).returncode == 0


def choose(
    mlflow: str,
    have: Iterable[str] = MACHINE,
    meta: MetaFn = installed,
    python: Tuple[int, int] = PYTHON,
    also: Sequence[str] = (),
) -> Dict[str, str]:
    """The pins for ``--mlflow`` full or skinny; ``also``: projects the machine has but in a
    version that does not serve (carried at this environment's version, and followed)."""
    flavour = MLFLOW_SKINNY if mlflow == "skinny" else MLFLOW_FULL
    extra = {normalize(n) for n in also}
    return resolve(ROOTS + flavour + tuple(extra), {normalize(n) for n in have} - extra, meta, python)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where the wheels go (inside the repository, ignored by git, named in carry)")
    ap.add_argument("--list", action="store_true", help="resolve and print the pins; download nothing")
    ap.add_argument("--mlflow", choices=("auto", "full", "skinny"), default="auto")
    ap.add_argument(
        "--python",
        default="%d.%d" % PYTHON,
        help="the target CPython (default the machine's 3.12); another only to rehearse the install here",
    )
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME",
        help="carry NAME too although the machine has it (its version there does not serve); repeatable",
    )
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    python = tuple(int(x) for x in args.python.split("."))[:2]
    try:
        flavour = "full" if args.mlflow == "auto" else args.mlflow
        pins = choose(flavour, python=python, also=args.also)
        if args.list:
            print(f"mlflow: {flavour}; {len(pins)} wheels the machine lacks:")
            print("\n".join(f"  {n}=={v}" for n, v in pins.items()))
            return 0
        folder.mkdir(parents=True, exist_ok=True)
        repo_files = travelling_files()
        while True:
            prune(folder, pins, python)
            built = pip_download(pins, folder, python)
            have = MACHINE - {normalize(n) for n in args.also}
            problems = check_wheels(folder, pins, python) + unmet(folder, have, python)
            if problems:
                raise BundleError("the wheels do not fit the machine:\n  " + "\n  ".join(problems))
            wheels, repo, too_big = size_report(folder, repo_files)
            if too_big and args.mlflow == "auto" and flavour == "full":
                print(f"full mlflow: {too_big}; falling back to mlflow-skinny", file=sys.stderr)
                flavour, pins = "skinny", choose("skinny", python=python, also=args.also)
                continue
            if too_big:
                raise BundleError(too_big)
            break
    except BundleError as err:
        print(f"device_bundle: {err}", file=sys.stderr)
        return 1
    print(f"mlflow: {flavour}; {len(pins)} wheels in {folder}: {wheels / 2**20:.1f} MiB")
    if built:
        print(f"built here from source distributions (pure Python): {', '.join(built)}")
    for path in sorted(folder.glob("*.whl")):
        print(f"  {path.name}  {path.stat().st_size / 2**20:.2f} MiB")
    print(f"with the repository's travelling files ({repo / 2**20:.1f} MiB): {(wheels + repo) / 2**20:.1f} MiB of 64")
    rel = relative_dir(folder)
    if not git_ignored(folder):
        print(f"note: {rel}/ is not ignored by git: `echo /{rel}/ >> .git/info/exclude`, then name it in carry")
    print(f'run it there with carry=["{rel}"] and the command:')
    print(remote_command(rel))
    return 0


if __name__ == "__main__":
    sys.exit(main())
