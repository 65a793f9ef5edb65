"""The automatic search's stage 3, *polish*: one variable at a time over the knobs that act on the
winner the search measured (``hydra.sweeper.polish``: communication buckets and buffers,
compression, precision), with the OVAT engine of ``sweeps/ovat.py`` as it is: the winner is the
baseline, each variable's other values are A/B tested against the incumbent with the noise
threshold, the repeats and the loss-band quality gate, and a variable the layout rules call inert
on the winner (DDP buckets with dp=1, HCCL_BUFFSIZE off an Ascend chip) is skipped with its
reason. Its trials are the search's sweep's, so ``best`` and the report see them.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator import report_render
from sweeps.ovat import PREFIX, Runner, Study, descend

log = logging.getLogger("orchestrator")
KEY = "polish"


def _text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _same(a: str, b: str) -> bool:
    """Whether two spellings of a value are one (``25`` and ``25.0``)."""
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b))
    except ValueError:
        return False


def current_value(cfg: DictConfig, key: str) -> str:
    """What ``key`` is on a composed config: a leaf's value, or a config group's preset ``name``."""
    node = OmegaConf.select(cfg, key, default=None)
    if OmegaConf.is_config(node):
        return _text(node.get("name"))
    return _text(node)


def variables(cfg: DictConfig, polish: Dict[str, List[Any]]) -> "OrderedDict[str, List[str]]":
    """Each polish variable's candidates, the winner's own value first (the OVAT baseline)."""
    out: "OrderedDict[str, List[str]]" = OrderedDict()
    for key, values in polish.items():
        here = current_value(cfg, key)
        out[key] = [here] + [v for v in dict.fromkeys(_text(x) for x in values) if not _same(v, here)]
    return out


def check(runner_compose: Any, arguments: List[str], polish: Dict[str, Any]) -> List[str]:
    """Bad polish input, one line per key, before anything runs: not a list, or a value that does
    not compose on the study's own overrides."""
    errors = []
    for key, values in polish.items():
        if not isinstance(values, (list, tuple)) or not values:
            errors.append(f"{PREFIX}.{KEY}.{key}: give a list of values, e.g. [{key.split('.')[-1]}_a, ...]")
            continue
        for v in values:
            try:
                runner_compose([*arguments, f"{key}={_text(v)}"])
            except Exception as err:  # noqa: BLE001 - Hydra's composition errors, reported per key
                msg = " ".join(str(err).split("Config search path")[0].split())
                errors.append(f"{PREFIX}.{KEY}.{key}: {v!r} does not compose: {msg[:300]}")
    return errors


def run(sweeper: Any, info: Dict[str, str], winner_overrides: List[str], polish: Dict[str, List[Any]],
        repeats: int, min_speedup: float, out_dir: Path) -> Optional[Dict[str, Any]]:  # fmt: skip
    """Descend one variable at a time from the winner; the OVAT report's data (also rendered to
    ``out_dir/polish_report``), or None with nothing to polish."""
    if not polish:
        return None
    probe = Runner(sweeper, Study("auto-polish", OrderedDict(), list(winner_overrides)), info)
    cfg = probe.compose(list(winner_overrides))
    study = Study(
        name="auto-polish",
        variables=variables(cfg, polish),
        fixed=list(winner_overrides),
        repeats=repeats,
        min_speedup=min_speedup,
    )
    runner = Runner(sweeper, study, info)
    log.info("auto: polish from the winner, %s", ", ".join(f"{k}={','.join(v)}" for k, v in study.variables.items()))
    before = runner.trial_seconds()  # the sweep's so far: the search's trials
    data = descend(study, runner)
    data["trials"]["trial_seconds"] = runner.trial_seconds() - before
    data["files"] = [str(f) for f in report_render.render(data, out_dir / "polish_report")]
    return data


def summary(data: Optional[Dict[str, Any]], why_not: str = "") -> Dict[str, Any]:
    """What the auto report says of the polish stage."""
    if data is None:
        return {"ran": False, "why_not": why_not or "nothing to polish (hydra.sweeper.polish is empty)"}
    final = data["final"]
    return {
        "ran": True,
        "variables": data["variables"],
        "helped": data["helped"],
        "did_not_help": data["did_not_help"],
        "skipped": data["skipped"],
        "s_total": final["s_total"],
        "objective": final["objective"],
        "overrides": final["overrides"],
        "command": final["command"],
        "trials": data["trials"],
        "noise": data["noise"],
        "threshold": data["threshold"],
    }
