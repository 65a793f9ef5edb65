"""Every ``python -m orchestrator ...`` command shown in the README and the manual (``docs/``) still
composes, so the documents cannot drift from the code: a command shown with its output is run
as far as ``--cfg job`` (Hydra composes the whole config, every key and preset checked against
the schemas, and prints it; nothing is launched), and a command shown refused (its output starts
with ``error:`` or Hydra's "Could not override") is run for real and must be refused with exit
code 2 and that first line, launching nothing. A template with ``...`` in it is not a command; a
command that needs a file an earlier documented command writes is listed in :data:`NEEDS`."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, NamedTuple

import pytest

from tests.conftest import cli_in_process, search_runs

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# commands that run on a file an earlier documented command writes (``best --write``)
NEEDS = {
    "--config-dir conf_local": "conf_local/experiment/fastest.yaml, written by `orchestrator.best --write`",
    # the tours' own model folders and corpora (tests/test_hf_weights.py and test_tokenizer_data.py
    # build such folders and run those flows)
    "/models/": "a Hugging Face folder the tour made on its machine",
    "corpus/stdlib_text_document": "the corpus the tour's orchestrator.data command writes",
}


class Shown(NamedTuple):
    where: str  # file:line
    args: List[str]
    refused: str  # the first line of the output shown when the command is refused, else ""


def shown_commands() -> List[Shown]:
    out: List[Shown] = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        block = False
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if line.startswith("```"):
                block = not block
                continue
            text = line.strip().removeprefix("$ ")
            if not block or not (text == "python -m orchestrator" or text.startswith("python -m orchestrator ")):
                continue
            start = i
            while text.endswith("\\") and i < len(lines):  # a continued command
                text = text[:-1] + " " + lines[i].strip()
                i += 1
            if " ... " in f" {text} ":
                continue  # a template, not a command
            args = shlex.split(text.split(" | ")[0], comments=True)[3:]
            output = lines[i] if i < len(lines) and not lines[i].startswith("```") else ""
            refused = output if output.startswith(("error:", "Could not override")) else ""
            out.append(Shown(f"{path.relative_to(ROOT)}:{start}", args, refused))
    return out


SHOWN = shown_commands()


def one_point(args: List[str]) -> List[str]:
    """A multirun's first point (``--cfg`` prints one job's config): without ``-m``, each swept
    value (``a=1,2``, ``a=choice(1,2)``) at its first value."""
    if "-m" not in args and "--multirun" not in args:
        return list(args)
    out = []
    for a in args:
        if a in ("-m", "--multirun"):
            continue
        key, eq, value = a.partition("=")
        if eq and value.startswith("choice(") and value.endswith(")"):
            value = value[len("choice(") : -1]
        if eq and "," in value and not value.startswith(("[", "{")):
            value = value.split(",")[0]
        out.append(f"{key}={value}" if eq else a)
    return out


def test_the_documents_show_commands():
    # a parser that finds nothing would pass everything below
    assert len(SHOWN) >= 30 and sum(1 for s in SHOWN if s.refused) >= 3


@pytest.mark.parametrize("shown", SHOWN, ids=[s.where for s in SHOWN])
def test_a_documented_command_composes_or_is_refused_as_shown(shown, tmp_path, monkeypatch, capfd):
    need = next((why for flag, why in NEEDS.items() if flag in " ".join(shown.args)), None)
    if need:
        pytest.skip(f"needs {need}")
    if shown.refused:
        code, out, err = cli_in_process(shown.args, tmp_path, monkeypatch, capfd)
        assert code == 2, (shown.where, code, out[-1500:], err[-1500:])
        assert shown.refused.strip() in err + out, (shown.where, err[-2000:])
        db = tmp_path / "mlruns.db"
        assert not db.exists() or search_runs(f"sqlite:///{db}") == []  # nothing ran, nothing recorded
        return
    code, out, err = cli_in_process([*one_point(shown.args), "--cfg", "job"], tmp_path, monkeypatch, capfd)
    assert code == 0, (shown.where, out[-1500:], err[-2000:])
    assert "trainer:" in out and "model:" in out, (shown.where, out[-1500:])
