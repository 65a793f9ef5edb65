"""One schema per section, and every key of it acts, is refused, or is a stated assumption.

A knob that is accepted and ignored is a bug: a tuner sweeping it measures noise. This file walks
every leaf key of the composed schema and fails on one that no code reads (outside the schema
itself), that the validator does not pin to the values it can honour, and that is not one of the
planner's documented assumptions (``planner.*``) or a label. What each key does is tested where
the key lives (tests/test_knobs.py and the component tests); this is the net under all of them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator import effects
from orchestrator.config import Config
from orchestrator.validate import CHOICES

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILES = {ROOT / "trainers" / "config.py", ROOT / "orchestrator" / "config.py"}
TRAINER_SECTIONS = ("model", "parallel", "precision", "comm", "data", "trainer")
# keys of the trainer's sections that the control plane turns into something the workers get
# (backend environment, the runtime) or records; the trainer never reads them itself
READ_BY_CONTROL_PLANE = {
    "comm.buffsize_mb",
    "comm.nccl_buffsize_mb",
    "comm.env",
    "comm.socket_ifname",
    "trainer.checkpoint_shared",
    "model.hf_config",  # the control plane fills the model section from it (orchestrator/hf_model.py)
    "comm.timeout_s",
    "model.name",
    "precision.name",
    "comm.name",
}


def leaf_keys(cls=Config, prefix=""):
    out = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out += leaf_keys(type(default), key + ".")
        else:
            out.append(key)
    return out


def _names_read(paths):
    """Attribute names and string subscripts/get() keys read anywhere in ``paths``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                names.add(str(node.slice.value))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(str(node.args[0].value))
    return names


def _sources(*dirs):
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if p not in SCHEMA_FILES]


TRAINER_READS = _names_read(_sources("trainers"))
ANY_READS = _names_read(_sources("trainers", "orchestrator", "sweeps"))
KEYS = leaf_keys()


def test_each_section_is_declared_once():
    """One dataclass per section: the trainer's sections only in trainers/config.py, the control
    plane's only in orchestrator/config.py; no other module declares a class of that name."""
    declared = {}
    for path in _sources("trainers", "orchestrator", "sweeps") + sorted(SCHEMA_FILES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and re.fullmatch(r"\w+(Config|Args)", node.name):
                declared.setdefault(node.name, []).append(path.relative_to(ROOT).as_posix())
    twice = {k: v for k, v in declared.items() if len(v) > 1}
    assert not twice, twice
    assert not [k for k in declared if k.endswith("Args")], "a second, trainer-side copy of a section"
    for section in TRAINER_SECTIONS:
        cls = type(getattr(Config(), section))
        assert cls.__module__ == "trainers.config", (section, cls.__module__)


def test_the_schema_covers_every_key_the_workers_receive():
    from trainers.config import TrialSpec

    for f in fields(TrialSpec):
        if f.name != "runtime":
            assert f.name in TRAINER_SECTIONS


@pytest.mark.parametrize("key", KEYS)
def test_every_key_acts_or_is_refused_or_is_a_planner_assumption(key):
    section, name = key.split(".")[0], key.split(".")[-1]
    if section == "planner":
        doc = OmegaConf.structured(Config).planner
        assert name in doc, key  # documented in PlannerConfig: assumptions of the plan, never of a run
        assert name in ANY_READS, f"{key}: a planner assumption the planner never reads"
        return
    if key in effects.LABELS:
        assert name in ANY_READS, f"{key}: a label nobody records"
        return
    if key in CHOICES and len(CHOICES[key]) == 1:
        return  # one honourable value; the validator refuses every other
    if section in TRAINER_SECTIONS and key not in READ_BY_CONTROL_PLANE:
        assert name in TRAINER_READS, f"{key}: declared for the trainer, never read by it"
    else:
        assert name in ANY_READS, f"{key}: never read"


def test_the_inert_rules_name_real_keys():
    keys = set(KEYS)
    for key in [*effects.RULES, *effects.LABELS]:
        assert key in keys, key
