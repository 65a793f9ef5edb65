"""What the orchestrator can make again but would rather not make on every trial's critical path:
an empty MLflow store already migrated (``orchestrator.tracking``), the operators a model calls
(``orchestrator.planner.operators``). Everything here is keyed by what it was made from, so a stale
entry is never read: a cache that cannot be written or read is skipped, never an error.

The folder is the trainer's (its stdlib corpus is kept there too): ``$CHIP_ORCHESTRATOR_CACHE``,
else ``$XDG_CACHE_HOME/chip-orchestrator``, else ``~/.cache/chip-orchestrator``; deleting it is
always safe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from trainers.config import default_cache_dir

log = logging.getLogger("orchestrator")
TRAINERS = Path(__file__).resolve().parents[1] / "trainers"


def root() -> Path:
    """The cache folder, the trainer's own (``trainers.config.default_cache_dir``)."""
    return default_cache_dir()


def version(package: str) -> str:
    """An installed package's version without importing it (importing torch costs seconds)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def trainer_source_digest() -> str:
    """A digest of the trainer's source: what it computes may change with any of its files."""
    h = hashlib.sha256()
    for path in sorted(TRAINERS.rglob("*.py")):
        h.update(path.relative_to(TRAINERS).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tmp_name(path: Path) -> Path:
    """A name beside ``path`` no other process or thread writes, for a write-then-rename."""
    return path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"


def json_entry(kind: str, key: Any, make: Callable[[], Any]) -> Any:
    """``make()``'s JSON-able value for ``key``, read from ``<root>/<kind>/<digest of key>.json``
    when an earlier call stored it, else made and stored (whole or not at all: written aside
    and renamed, so a reader never sees half a file)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = root() / kind / f"{digest}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError):
        pass
    value = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(path)
        tmp.write_text(json.dumps({"key": key, "value": value}, sort_keys=True, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.debug("cache %s not written: %s", path, err)
    return value
