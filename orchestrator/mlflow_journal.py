"""The journal of rank 0's reporter (:mod:`orchestrator.mlflow_reporter`): a JSON-lines file of
the records a trial produced and the marks of those delivered, with copies of queued files in a
folder beside it (``<journal>.files``). Its first line names the store and the run; a record
carries its sequence number (``seq``), a mark lists the numbers delivered (``{"done": [...]}``).
Each line is flushed as it is written, so a killed process loses nothing the OS holds; whoever
opens the journal next (a restarted worker group, the driver at the trial's end) takes over what
is not marked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional


def read_journal(path: str) -> List[Dict[str, Any]]:
    """The records of a journal not yet delivered, in order ([] when there is none)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    ops: Dict[int, Dict[str, Any]] = {}
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if "done" in entry:
            for seq in entry["done"]:
                ops.pop(seq, None)
        elif "op" in entry:
            ops[entry["seq"]] = entry
    return [ops[k] for k in sorted(ops)]


def journal_head(path: str) -> Optional[Dict[str, Any]]:
    """The store (``uri``) and ``run_id`` a journal's records belong to; None without a journal."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8").splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


class Journal:
    """One reporter's handle on the journal at ``path`` (records of run ``run_id`` in ``uri``).
    Not thread-safe: the reporter calls it under its own lock. Any ``OSError`` reaches the caller,
    which goes on without a journal."""

    def __init__(self, path: str, uri: str, run_id: str):
        self.path, self.uri, self.run_id = str(path), uri, run_id
        self._file: Any = None

    def _header(self) -> str:
        return json.dumps({"uri": self.uri, "run_id": self.run_id}) + "\n"

    def write(self, entry: Dict[str, Any]) -> None:
        """Append a record or a mark, flushed to the OS."""
        if self._file is None:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not path.exists() or path.stat().st_size == 0
            self._file = open(path, "a", encoding="utf-8")
            if fresh:
                self._file.write(self._header())
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def take_over(self, first_seq: int) -> List[Dict[str, Any]]:
        """What the journal holds undelivered (an earlier process of the trial died or gave up),
        renumbered from ``first_seq``; the file is rewritten atomically with just that, under this
        handle's store and run."""
        pending = read_journal(self.path)
        if not pending:
            return []
        path = Path(self.path)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self._header())
            for i, op in enumerate(pending):
                op["seq"] = first_seq + i
                f.write(json.dumps(op) + "\n")
        os.replace(tmp, path)
        return pending

    def stage(self, path: str, seq: int) -> str:
        """A copy of the file at ``path``, kept until it is delivered: in a folder of its own (named
        by the record's ``seq``), under its own name (the name MLflow gives the artifact)."""
        folder = Path(self.path + ".files") / f"{seq:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / Path(path).name
        shutil.copyfile(path, staged)
        return str(staged)

    @staticmethod
    def unstage(staged: str) -> None:
        """Delete a delivered copy, then its folder, now empty."""
        try:
            os.unlink(staged)
            os.rmdir(os.path.dirname(staged))
        except OSError:
            pass

    def close(self, delete: bool) -> None:
        """Close the file; ``delete``: everything was delivered, the journal and its copies go."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if delete:
            Path(self.path).unlink(missing_ok=True)
            shutil.rmtree(self.path + ".files", ignore_errors=True)
