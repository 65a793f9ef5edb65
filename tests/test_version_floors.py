"""The version floors in pyproject.toml cover every torch and Ray API the code uses: each use the
source makes (found by scanning it) is in a table of the release it is known from, and each floor
is at least that release.
"""

from __future__ import annotations

import tomllib

import pytest

from tests.conftest import ROOT

# The APIs the code takes from torch and Ray that a floor in pyproject.toml must cover, each with
# the release it is known from and where that was read: (module, attribute, keyword or None,
# release, evidence). The release is the one that brought it where the evidence says "not in"
# the release before; otherwise the oldest release read that has it (an upper bound, which keeps
# the floor check sound). Read in each release's own Python sources, the files its PyPI wheel
# ships (torch 2.5.1, 2.6.0, 2.7.0; ray 2.51.0). A keyword row is a call that passes it.
_C10D = "torch/distributed/distributed_c10d.py"
_SCHED = "torch/distributed/pipelining/schedules.py"
_DT = "torch/distributed/tensor/__init__.py"
_TP = "torch/distributed/tensor/parallel/__init__.py"
_DCP = "torch/distributed/checkpoint/__init__.py"
_SD = "torch/distributed/checkpoint/state_dict.py"
_V2 = "ray/train/v2/_internal"
NEEDS = [
    # torch 2.7
    (
        "torch.distributed",
        "init_process_group",
        "device_id",
        "2.7",
        f"a non-CUDA device (npu:N): 2.6.0 {_C10D}:1862 raises unless its type is cuda; 2.7.0 :1831 refuses only cpu",
    ),
    (
        "torch.distributed.tensor",
        "distribute_tensor",
        "src_data_rank",
        "2.7",
        "2.7.0 torch/distributed/tensor/_api.py:642; not in 2.6.0 _api.py:629",
    ),
    (
        "torch.distributed.pipelining",
        "ScheduleGPipe",
        "scale_grads",
        "2.7",
        f"2.7.0 {_SCHED}:457 (PipelineScheduleSingle); not in 2.6.0",
    ),
    (
        "torch.distributed.pipelining",
        "Schedule1F1B",
        "scale_grads",
        "2.7",
        f"2.7.0 {_SCHED}:457 (PipelineScheduleSingle); not in 2.6.0",
    ),
    (
        "torch.distributed.pipelining",
        "ScheduleInterleaved1F1B",
        "scale_grads",
        "2.7",
        f"2.7.0 {_SCHED}:1995; not in 2.6.0",
    ),
    (
        "torch.distributed.pipelining",
        "ScheduleZBVZeroBubble",
        "scale_grads",
        "2.7",
        f"2.7.0 {_SCHED}:2305; not in 2.6.0",
    ),
    # torch 2.6
    ("torch.distributed.pipelining", "ScheduleZBVZeroBubble", None, "2.6", f"2.6.0 {_SCHED}:2188; not in 2.5.1"),
    (
        "torch.distributed.fsdp",
        "fully_shard",
        None,
        "2.6",
        "2.6.0 torch/distributed/fsdp/__init__.py:5; 2.5.1 has it only in torch.distributed._composable.fsdp",
    ),
    (
        "torch.distributed.fsdp",
        "FSDPModule",
        None,
        "2.6",
        "2.6.0 torch/distributed/fsdp/__init__.py:4; 2.5.1 has it only in torch.distributed._composable.fsdp",
    ),
    ("torch.distributed", "send", "group_dst", "2.6", f"2.6.0 {_C10D}:2429; not in 2.5.1"),
    ("torch.distributed", "recv", "group_src", "2.6", f"2.6.0 {_C10D}:2461; not in 2.5.1"),
    # older: in 2.5.1, the oldest release read
    (
        "torch.nn.functional",
        "scaled_dot_product_attention",
        "enable_gqa",
        "2.5",
        "2.5.1 torch/nn/functional.py:5610; 2.7.0 :5721-5723 (the builtin's signature, in its docstring)",
    ),
    ("torch.distributed.pipelining", "PipelineStage", None, "2.5", "2.5.1 torch/distributed/pipelining/__init__.py:12"),
    ("torch.distributed.pipelining", "ScheduleGPipe", None, "2.5", f"2.5.1 {_SCHED}:673"),
    ("torch.distributed.pipelining", "Schedule1F1B", None, "2.5", f"2.5.1 {_SCHED}:753"),
    ("torch.distributed.pipelining", "ScheduleInterleaved1F1B", None, "2.5", f"2.5.1 {_SCHED}:1805"),
    ("torch.distributed.tensor", "DTensor", None, "2.5", f"2.5.1 {_DT}:33"),
    ("torch.distributed.tensor", "distribute_tensor", None, "2.5", f"2.5.1 {_DT}:34"),
    ("torch.distributed.tensor", "Partial", None, "2.5", f"2.5.1 {_DT}:38"),
    ("torch.distributed.tensor", "Replicate", None, "2.5", f"2.5.1 {_DT}:37"),
    ("torch.distributed.tensor", "Shard", None, "2.5", f"2.5.1 {_DT}:36"),
    ("torch.distributed.tensor.parallel", "ColwiseParallel", None, "2.5", f"2.5.1 {_TP}:15"),
    ("torch.distributed.tensor.parallel", "RowwiseParallel", None, "2.5", f"2.5.1 {_TP}:19"),
    ("torch.distributed.tensor.parallel", "SequenceParallel", None, "2.5", f"2.5.1 {_TP}:20"),
    ("torch.distributed.tensor.parallel", "PrepareModuleInput", None, "2.5", f"2.5.1 {_TP}:17"),
    ("torch.distributed.tensor.parallel", "parallelize_module", None, "2.5", f"2.5.1 {_TP}:21"),
    (
        "torch.distributed.device_mesh",
        "DeviceMesh",
        None,
        "2.5",
        "2.5.1 torch/distributed/device_mesh.py:734 (from_group, with mesh= and mesh_dim_names=)",
    ),
    ("torch.distributed.checkpoint", "save", None, "2.5", f"2.5.1 {_DCP}:13"),
    ("torch.distributed.checkpoint", "load", None, "2.5", f"2.5.1 {_DCP}:12"),
    ("torch.distributed.checkpoint", "FileSystemWriter", None, "2.5", f"2.5.1 {_DCP}:3"),
    ("torch.distributed.checkpoint", "FileSystemReader", None, "2.5", f"2.5.1 {_DCP}:3"),
    (
        "torch.distributed.checkpoint._fsspec_filesystem",
        "FsspecWriter",
        None,
        "2.5",
        "2.5.1 torch/distributed/checkpoint/_fsspec_filesystem.py:77",
    ),
    (
        "torch.distributed.checkpoint._fsspec_filesystem",
        "FsspecReader",
        None,
        "2.5",
        "2.5.1 torch/distributed/checkpoint/_fsspec_filesystem.py:129",
    ),
    (
        "torch.distributed.checkpoint.state_dict",
        "StateDictOptions",
        None,
        "2.5",
        f"2.5.1 {_SD}:105 (flatten_optimizer_state_dict: 148)",
    ),
    ("torch.distributed.checkpoint.state_dict", "get_model_state_dict", None, "2.5", f"2.5.1 {_SD}:963"),
    ("torch.distributed.checkpoint.state_dict", "get_optimizer_state_dict", None, "2.5", f"2.5.1 {_SD}:1000"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict", None, "2.5", f"2.5.1 {_SD}:1167"),
    ("torch.distributed.checkpoint.state_dict", "set_optimizer_state_dict", None, "2.5", f"2.5.1 {_SD}:1206"),
    # Ray
    (
        "ray.train.v2._internal.execution.callback",
        "WorkerGroupCallback",
        None,
        "2.51",
        f"Ray Train v2 on by default: 2.51.0 {_V2}/constants.py:121; the class at {_V2}/execution/callback.py:26",
    ),
    (
        "ray.train.v2._internal.callbacks.accelerators",
        "_share_accelerator_ids",
        None,
        "2.51",
        f"2.51.0 {_V2}/callbacks/accelerators.py:80",
    ),
]

# What the scan below looks for. A name taken from one of these modules (imported, or reached
# through a module alias) must have a row above; so must a call passing one of these keywords
# (or the NEEDS rows' own) to a torch callable. These modules and keywords are where recent
# releases added what the code uses; in_order= (DataLoader, new in 2.6.0) is not used yet, and
# needs a row once it is.
GUARDED_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.device_mesh",
    "torch.accelerator",
    "ray.train.v2",
)
GUARDED_KEYWORDS = {"device_id", "src_data_rank", "scale_grads", "group_src", "group_dst", "enable_gqa", "in_order"}
SCANNED = ("orchestrator", "trainers", "sweeps", "bench", "hydra_plugins")


def _floor(requirement: str) -> str:
    import re

    return re.search(r">=\s*([0-9.]+)", requirement).group(1)


def _resolve(qualname: str):
    """The object a dotted name names, importing its module; None where it cannot be had."""
    import importlib

    parts = qualname.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _takes(obj, keyword: str) -> bool:
    """``obj`` (a function or class) names ``keyword`` among its parameters."""
    import inspect

    try:
        return keyword in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        # a builtin without a signature (torch's C functions, e.g. scaled_dot_product_attention):
        # the one its docstring opens with, as torch's _add_docstr writes it
        head = (getattr(obj, "__doc__", None) or "").split(") ->", 1)[0]
        return f"{keyword}=" in head.replace(" ", "")


def _import_aliases(nodes) -> dict:
    """The names the import statements among ``nodes`` bind, to what they stand for."""
    import ast

    alias = {}
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                alias[a.asname or a.name] = f"{n.module}.{a.name}"
    return alias


def _outside_functions(node):
    """The nodes below ``node`` that no function or lambda holds (a module's own statements)."""
    import ast

    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _outside_functions(child)


def _guarded_uses(sources: dict) -> tuple:
    """The guarded uses in ``sources`` ({path: text}): the names taken from GUARDED_MODULES, as
    {(qualname, where)}, and the guarded keywords passed to torch callables, as
    {(qualname, keyword, where)}. A callee is resolved through the file's imports; where it
    cannot be (``cls(..., scale_grads=True)``, or ``**{"device_id": d}``), every torch callable
    the enclosing function names that takes the keyword counts as called with it."""
    import ast

    keywords = GUARDED_KEYWORDS | {k for _, _, k, _, _ in NEEDS if k}
    names, calls = set(), set()

    for path, text in sources.items():
        tree = ast.parse(text, filename=path)
        top = list(_outside_functions(tree))
        scopes = [(tree, top)] + [
            (f, list(ast.walk(f))) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for scope, nodes in scopes:
            alias = {**_import_aliases(top), **_import_aliases(nodes)}

            def qual(e):
                if isinstance(e, ast.Name):
                    return alias.get(e.id)
                if isinstance(e, ast.Attribute):
                    base = qual(e.value)
                    return base and f"{base}.{e.attr}"
                return None

            where = f"{path}:{getattr(scope, 'name', '<module>')}"
            named = {q for n in nodes if isinstance(n, (ast.Name, ast.Attribute)) and (q := qual(n))}
            named |= {
                f"{n.module}.{a.name}" for n in nodes if isinstance(n, ast.ImportFrom) and n.module for a in n.names
            }
            for q in named:
                if any(q.startswith(m + ".") for m in GUARDED_MODULES):
                    names.add((q, where))
            unresolved = set()
            for n in nodes:
                if isinstance(n, ast.Call):
                    q = qual(n.func)
                    for kw in n.keywords:
                        if kw.arg in keywords:
                            if q and q.split(".")[0] in ("torch", "ray"):
                                calls.add((q, kw.arg, where))
                            elif not q:
                                unresolved.add(kw.arg)
                elif isinstance(n, ast.Dict):  # keywords passed as **{...}
                    unresolved |= {k.value for k in n.keys if isinstance(k, ast.Constant) and k.value in keywords}
            for k in unresolved:
                for q in named:
                    if q.split(".")[0] == "torch" and _takes(_resolve(q), k):
                        calls.add((q, k, where))
    return names, calls


def _listed(qualname: str, keyword) -> bool:
    for module, attr, kw, _, _ in NEEDS:
        row = f"{module}.{attr}"
        if kw == keyword and (qualname == row or (keyword is None and qualname.startswith(row + "."))):
            return True
    return False


def _project_sources() -> dict:
    return {
        str(f.relative_to(ROOT)): f.read_text()
        for d in SCANNED
        for f in sorted((ROOT / d).rglob("*.py"))
        if "__pycache__" not in f.parts
    }


@pytest.mark.parametrize("package", ["torch", "ray"])
def test_version_floors_cover_what_the_code_uses(package):
    """Each floor in pyproject.toml is the newest release in NEEDS for its package (so no older
    than any API the code uses, and raised for a reason the table states), and the installed
    release has each API: the attribute, and the keyword among its parameters."""
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [d for d in deps if d.split(">=")[0].split("[")[0].strip() == package]
    rows = [r for r in NEEDS if r[0].split(".")[0] == package]
    assert rows, package
    floor = Version(_floor(req))
    for module, attr, kw, since, evidence in rows:
        api = f"{module}.{attr}" + (f"({kw}=)" if kw else "")
        assert floor >= Version(since), f"{package} floor {req} predates {api}, from {since}: {evidence}"
        obj = _resolve(f"{module}.{attr}")
        assert obj is not None, f"the installed {package} lacks {module}.{attr}"
        assert kw is None or _takes(obj, kw), f"the installed {package}'s {module}.{attr} takes no {kw}="
    newest = max(Version(r[3]) for r in rows)
    assert floor == newest, f"{package} floor {req}: the newest API in NEEDS is from {newest}; state the reason"


def test_floor_table_lists_every_guarded_use():
    """Every guarded name and keyword the project's sources use has a NEEDS row (so a new use
    cannot slip past the floor unchecked), and every row is still used (so the floor's stated
    reasons stay true)."""
    names, calls = _guarded_uses(_project_sources())
    missing = sorted({f"{q} ({w})" for q, w in names if not _listed(q, None)})
    missing += sorted({f"{q}({k}=) ({w})" for q, k, w in calls if not _listed(q, k)})
    assert not missing, "add these to NEEDS, with the release that brought each and where it was read: " + "; ".join(
        missing
    )
    used = {(q, None) for q, _ in names} | {(q, k) for q, k, _ in calls}
    stale = [
        f"{m}.{a}" + (f"({k}=)" if k else "")
        for m, a, k, _, _ in NEEDS
        if not any(q == f"{m}.{a}" or (k is None and q.startswith(f"{m}.{a}.")) for q, kk in used if kk == k)
    ]
    assert not stale, f"NEEDS rows no code uses any more (remove them, and lower the floor if they raised it): {stale}"


_UNLISTED = """
from torch.utils.data import DataLoader
from torch.distributed import pipelining as pl
from torch.distributed.tensor.parallel import loss_parallel
from orchestrator import helper

def loader(dataset):
    return DataLoader(dataset, in_order=False)

def schedule(stage):
    cls = {"gpipe": pl.ScheduleGPipe, "looped": pl.ScheduleLoopedBFS}["looped"]
    helper(stage, device_id=0)  # not torch's: nothing here takes it
    return cls(stage, n_microbatches=2, scale_grads=False)

def join(device):
    import torch.distributed as dist
    dist.init_process_group("gloo", **{"device_id": device})
    dist.new_group(device_id=device)
"""


def test_floor_scan_finds_unlisted_uses():
    """The scan sees a guarded keyword passed directly, through ``**{...}`` and to a callee held
    in a variable, and a name imported from a guarded module; it ignores a keyword that no torch
    callable of the function takes."""
    names, calls = _guarded_uses({"fake.py": _UNLISTED})
    assert {q for q, _ in names if not _listed(q, None)} == {
        "torch.distributed.tensor.parallel.loss_parallel",
        "torch.distributed.pipelining.ScheduleLoopedBFS",
    }
    assert {(q, k) for q, k, _ in calls if not _listed(q, k)} == {
        ("torch.utils.data.DataLoader", "in_order"),
        ("torch.distributed.pipelining.ScheduleLoopedBFS", "scale_grads"),
        ("torch.distributed.new_group", "device_id"),
    }
    assert ("torch.distributed.init_process_group", "device_id", "fake.py:join") in calls  # listed
    assert ("torch.distributed.pipelining.ScheduleGPipe", "scale_grads", "fake.py:schedule") in calls
