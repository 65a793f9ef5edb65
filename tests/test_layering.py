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


def _trainer_modules(path: Path) -> set[str]:
    """The ``trainers`` modules ``path`` imports (``from trainers import rules``: trainers.rules)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "trainers":
            out.update(f"trainers.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("trainers."))
    return out


def test_trainers_import_no_control_plane_library():
    for path in (ROOT / "trainers").rglob("*.py"):
        bad = _imports(path) & {"ray", "hydra", "mlflow", "omegaconf", "orchestrator", "sweeps"}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# the worker entry, and the planner's operator capture and probe (torch only, run on meta tensors
# or on this machine's device; they never train); and the torch-free schema and layout rules the
# trainer owns and the control plane registers, validates and plans by
ALLOWED_FROM_TRAINERS = {
    ("trainers.loop", "worker_entry"),
    ("trainers.ops", "capture_ops"),
    ("trainers.ops", "probe_ops"),
    # Megatron's indexed corpus format (numpy, no torch): the validator opens a corpus's files and
    # orchestrator.data writes them, as the trainer's loader reads them
    ("trainers", "indexed"),
    ("trainers.indexed", "IndexedTokens"),
    ("trainers.indexed", "IndexedError"),
    # a Hugging Face weights folder's headers (json and struct, no torch), checked before launch
    ("trainers.hf_layout", "check"),
    # the key of a step row's wall-clock time, part of the one reporting interface (typing only)
    ("trainers.reporter", "ROW_TIME"),
}
# (trainers.host: the cores a worker may use, which the planner's CPU host counts the same way)
TORCH_FREE = ("trainers.config", "trainers.rules", "trainers.host")


def test_orchestrator_uses_only_the_worker_entry_and_the_schema_of_trainers():
    for path in (ROOT / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "trainers" for a in node.names), path
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainers"):
                if node.module in TORCH_FREE:
                    continue
                # `from trainers import rules` is the torch-free module trainers.rules
                names = {(node.module, a.name) for a in node.names if f"{node.module}.{a.name}" not in TORCH_FREE}
                assert names <= ALLOWED_FROM_TRAINERS, (path, names)


def test_the_schema_and_the_layout_rules_import_no_torch():
    # composing and validating a config, and planning it, must not import torch
    for module in TORCH_FREE:
        path = ROOT / (module.replace(".", "/") + ".py")
        # the standard library's plain modules only (os, pathlib: trainers.config's cache folder)
        allowed = {"__future__", "dataclasses", "functools", "typing", "os", "pathlib", "trainers"}
        assert _imports(path) <= allowed, (module, _imports(path))
        # and from the trainer, only another of these (trainers.config reads the KV-heads rule)
        assert _trainer_modules(path) <= set(TORCH_FREE), (module, _trainer_modules(path))


def test_the_weights_headers_import_no_torch():
    # the validator checks a Hugging Face weights folder while composing a config
    for name in ("hf_layout.py", "safetensors_format.py"):
        allowed = {"__future__", "re", "json", "struct", "pathlib", "typing", "trainers"}
        assert _imports(ROOT / "trainers" / name) <= allowed


def test_the_indexed_format_imports_no_torch():
    # the validator reads a corpus's index while composing a config
    assert _imports(ROOT / "trainers" / "indexed.py") <= {"__future__", "os", "struct", "pathlib", "typing", "numpy"}


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
        # stdlib and Hydra only, and the other shims (each held to this same rule)
        assert top <= {"dataclasses", "typing", "importlib", "hydra", "hydra_plugins"}, (path, top)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _orchestrator_import_graph() -> dict[str, set[str]]:
    """Module -> the orchestrator modules it imports, at the top or inside a function (``import
    a.b``, ``from a import b`` where b is a module, ``from a.b import name``, relative forms)."""
    files = {_module_name(p): p for p in (ROOT / "orchestrator").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                # `import orchestrator.x.y` names a module; find the longest one that exists
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as a path (first == last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_orchestrator_modules_import_one_another_without_a_cycle():
    # a cycle hides as long as one of its imports sits inside a function, until the day the
    # import order changes; the graph counts those imports too
    graph = _orchestrator_import_graph()
    assert {"orchestrator.app", "orchestrator.trial", "orchestrator.ray_trial"} <= set(graph)
    assert "orchestrator.ray_trial" in graph["orchestrator.trial"]  # the graph sees the imports
    assert "orchestrator.tracking" in graph["orchestrator.sweep_parent"]
    assert not _cycle(graph), " -> ".join(_cycle(graph))
