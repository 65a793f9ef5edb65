"""The trainer imports no Ray, Hydra or MLflow; the control plane imports only its entry."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_trainers_import_no_control_plane_library():
    for path in (ROOT / "trainers").rglob("*.py"):
        bad = _imports(path) & {"ray", "hydra", "mlflow", "omegaconf", "orchestrator", "sweeps"}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# the worker entry, and the planner's operator capture and probe (torch only, run on meta tensors
# or on this machine's device; they never train); and the torch-free schema and layout rules the
# trainer owns and the control plane registers, validates and plans by
ALLOWED_FROM_TRAINERS = {("trainers.loop", "worker_entry"), ("trainers.ops", "capture_ops"),
                         ("trainers.ops", "probe_ops")}
TORCH_FREE = ("trainers.config", "trainers.rules")


def test_orchestrator_uses_only_the_worker_entry_and_the_schema_of_trainers():
    for path in (ROOT / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "trainers" for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers"):
                if node.module in TORCH_FREE:
                    continue
                names = {(node.module, a.name) for a in node.names}
                assert names <= ALLOWED_FROM_TRAINERS, (path, names)


def test_the_schema_and_the_layout_rules_import_no_torch():
    # composing and validating a config, and planning it, must not import torch
    for module in TORCH_FREE:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert _imports(path) <= {"__future__", "dataclasses", "typing"}, (module, _imports(path))


def test_the_control_plane_does_not_import_search_strategies():
    # sweeps/ builds on orchestrator/ (planner, tracking, reports), never the other way round
    for path in (ROOT / "orchestrator").rglob("*.py"):
        assert "sweeps" not in _imports(path), path


def test_hydra_plugin_shims_import_nothing_heavy_at_module_level():
    # Hydra imports every plugin module at start-up, for every command
    for path in (ROOT / "hydra_plugins").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                top.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                top.add(node.module.split(".")[0])
        assert top <= {"dataclasses", "typing", "hydra"}, (path, top)
