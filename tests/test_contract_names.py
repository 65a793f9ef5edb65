"""The control plane's contract names are spelled once: a trial's and a sweep's statuses
(``orchestrator/statuses.py``), the MLflow tag names (``orchestrator/tags.py``) and the exit codes
(``orchestrator/exit_codes.py``). Every other source file refers to them by name, so a status or
tag renamed in one place cannot leave a reader matching the old spelling (issue 45: ``"finished"``
had been a literal in 9 files, ``"trial.status"`` in 8, the exit codes defined twice)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("orchestrator", "trainers", "sweeps", "hydra_plugins")
OWNERS = {"statuses": ROOT / "orchestrator/statuses.py", "tags": ROOT / "orchestrator/tags.py"}
# the same word meaning something else: text matched in a worker's error message, and the
# training monitor's count of non-finite values (a figure of the summary, not a status)
ELSEWHERE = {
    ("orchestrator/launch.py", "timeout"),
    ("trainers/monitor.py", "nonfinite"),
    ("trainers/loop.py", "nonfinite"),
    ("orchestrator/compare.py", "nonfinite"),
    # the reports' count of points pruned before launch (their --json field)
    ("orchestrator/grid_report.py", "pruned"),
    ("orchestrator/report_render.py", "pruned"),
}
# words whose tag is held by the read check below only: "sweep" is also the reports' --json field,
# Hydra's config group and the progress bar's title
WORDS = {"sweep"}


def _strings(tree: ast.AST) -> Iterator[ast.Constant]:
    """The module's string constants, docstrings left out."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node


def _defined(path: Path) -> Dict[str, str]:
    """Module-level NAME = "value" (and NAME, NAME = "a", "b") of an owner module: value -> name."""
    out: Dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for name, value in zip(names, values):
                if isinstance(name, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    out[value.value] = name.id
    return out


def _sources() -> Iterator[Tuple[str, ast.AST]]:
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text())


def test_the_owner_modules_define_what_this_test_looks_for():
    assert {"finished", "crash", "node_lost", "running"} <= set(_defined(OWNERS["statuses"]))
    assert {"trial.status", "trial.config_hash", "sweep.status", "mlflow.note.content"} <= set(_defined(OWNERS["tags"]))


def test_statuses_and_tag_names_are_spelled_in_their_own_module_only():
    names = {value: f"{owner}.{name}" for owner, path in OWNERS.items() for value, name in _defined(path).items()}
    owners = {str(p.relative_to(ROOT)) for p in OWNERS.values()}
    found: Dict[str, Set[str]] = {}
    for rel, tree in _sources():
        if rel in owners:
            continue
        for node in _strings(tree):
            if node.value in names and node.value not in WORDS and (rel, node.value) not in ELSEWHERE:
                found.setdefault(f"{rel}:{node.lineno}", set()).add(f"{node.value!r} (use {names[node.value]})")
    assert not found, "\n".join(f"{where}: {', '.join(sorted(v))}" for where, v in sorted(found.items()))


def test_tags_are_read_by_name():
    """A run's tags are read with the tag's name, never a literal: ``run.data.tags.get("sweep")``
    and ``tags["trial.status"]`` spell a contract again (any tag of ``orchestrator/tags.py``)."""
    names = _defined(OWNERS["tags"])
    literal = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                owner, key = node.func.value, node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript):
                owner, key = node.value, node.slice
            else:
                continue
            read = isinstance(owner, ast.Attribute) and owner.attr == "tags"
            if read and isinstance(key, ast.Constant) and key.value in names:
                literal.append(f"{rel}:{node.lineno}: {key.value!r} (use tags.{names[key.value]})")
    assert not literal, "\n".join(literal)


def test_exit_codes_are_named():
    """No command exits with a bare number: ``SystemExit(2)``, ``sys.exit(1)``, ``parser.exit(3)``."""
    bare = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("SystemExit", "exit", "_exit") and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, int) and node.args[0].value != 0:
                    bare.append(f"{rel}:{node.lineno}")
    assert not bare, bare
