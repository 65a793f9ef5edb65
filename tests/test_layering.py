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


def test_orchestrator_uses_only_the_worker_entry_of_trainers():
    for path in (ROOT / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers"):
                assert node.module == "trainers.loop" and [a.name for a in node.names] == ["worker_entry"], path
