"""An OVAT study's definition (:class:`Study`) and how the sweeper's config becomes one
(:func:`parse_study`: every broken key one line of a :class:`StudyError`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from orchestrator import results

log = logging.getLogger("orchestrator")

PREFIX = "hydra.sweeper"
# metrics whose better direction is known: True when lower is better
LOWER_IS_BETTER = {
    "step_time_median_s": True,
    "peak_mem_gb": True,
    "final_loss": True,
    "tokens_per_s_median": False,
    "mfu": False,
}


class StudyError(ValueError):
    def __init__(self, errors: List[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass
class Study:
    name: str
    variables: "OrderedDict[str, List[str]]"  # override key -> candidates; the first is the baseline
    fixed: List[str]  # overrides every point shares
    objective: str = "step_time_median_s"
    direction: str = "minimize"
    repeats: int = 2
    min_speedup: float = 1.02
    loss_band: float = 0.05
    passes: int = 1
    resume: bool = True
    planner_skip: bool = True
    space: str = "params"  # the sweeper key the variables came from (params, or its alias variables)

    def overrides(self, assignment: Dict[str, str]) -> List[str]:
        return [*self.fixed, *(f"{k}={v}" for k, v in assignment.items())]


def _as_override_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_as_override_value(x) for x in v) + "]"
    return str(v)


def _preset_space(spec: Dict[str, Any], parser: Any, errors: List[str]) -> Tuple["OrderedDict[str, List[str]]", str]:
    """The preset's variables (``params``, or its alias ``variables``) and which key held them."""
    variables: "OrderedDict[str, List[str]]" = OrderedDict()
    space, where = spec.get("params") or {}, "params"
    if spec.get("variables"):
        if space and dict(space) != dict(spec["variables"]):
            errors.append(
                f"{PREFIX}.variables: an alias of {PREFIX}.params, and both are given with different "
                "variables; give the search space in one of them"
            )
        space, where = spec["variables"], "variables"
    for key, cands in space.items():
        if isinstance(cands, str):
            try:
                (ov,) = parser.parse_overrides([f"{key}={cands}"])
                values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
            except Exception as err:  # noqa: BLE001 - a grammar error, reported with its key
                errors.append(f"{PREFIX}.{where}.{key}={cands}: {str(err).splitlines()[0]}")
                continue
        elif isinstance(cands, (list, tuple)):
            values = [_as_override_value(c) for c in cands]
        else:
            values = [_as_override_value(cands)]
        variables[str(key)] = values
    return variables, where


def _command_line(arguments: Sequence[str], parser: Any, variables, errors: List[str]):
    """Sweep overrides (``KEY=a,b``) become variables, after the preset's or in place of one of
    them; a plain override fixes its key. Returns the fixed overrides and their parsed values."""
    fixed: List[str] = []
    fixed_values: Dict[str, Any] = {}  # key -> value of each plain override, as Hydra parsed it
    for ov in parser.parse_overrides(list(arguments)):
        key = ov.get_key_element()
        if ov.is_sweep_override():
            if not ov.is_discrete_sweep():
                errors.append(
                    f"{ov.input_line}: the ovat sweeper takes a list of candidates (a,b,c), "
                    f"not a {ov.value_type.name.lower()} sweep"
                )
                continue
            variables[key] = list(ov.sweep_string_iterator())
        else:
            variables.pop(key, None)
            fixed.append(ov.input_line)
            fixed_values[ov.key_or_group] = None if ov.is_delete() else ov.value()
    return fixed, fixed_values


def _study_errors(study: Study) -> List[str]:
    errors = []
    if not study.objective:
        errors.append(f"{PREFIX}.objective: empty; name a metric every trial logs (e.g. step_time_median_s)")
    if study.direction not in results.DIRECTIONS:
        errors.append(f"{PREFIX}.direction={study.direction}: must be one of {', '.join(results.DIRECTIONS)}")
    if study.repeats < 1:
        errors.append(f"{PREFIX}.repeats={study.repeats}: must be at least 1 (2 or more measure the noise)")
    if study.passes < 1:
        errors.append(f"{PREFIX}.passes={study.passes}: must be at least 1")
    if study.min_speedup < 1.0:
        errors.append(f"{PREFIX}.min_speedup={study.min_speedup}: must be at least 1.0 (a speedup S >= 1)")
    if study.loss_band <= 0:
        errors.append(
            f"{PREFIX}.loss_band={study.loss_band}: must be above 0 (a fraction of the baseline's final loss)"
        )
    return errors


def parse_study(spec: Dict[str, Any], arguments: Sequence[str], parser: Any, name: str) -> Study:
    """The study from the sweeper's config and the command line; StudyError lists every broken key.

    Command-line sweep overrides (``KEY=a,b``) become variables after the preset's (or replace a
    preset variable's candidates in place); a plain override of a preset variable fixes it.
    """
    errors: List[str] = []
    variables, where = _preset_space(spec, parser, errors)
    fixed, fixed_values = _command_line(arguments, parser, variables, errors)
    for key, values in list(variables.items()):
        unique = list(OrderedDict.fromkeys(values))
        if len(unique) < 2:
            errors.append(
                f"{PREFIX}.{where}.{key}: needs at least two candidates (the first is the baseline), got {values}"
            )
        variables[key] = unique
    if not variables and not errors:
        errors.append(
            f"{PREFIX}.params: the study has no variables; give them in a +sweep preset or as "
            "KEY=a,b,c on the command line"
        )
    min_speedup = float(spec.get("min_speedup", 1.0))
    adaptive = fixed_values.get("trainer.measure") == "adaptive"
    if adaptive and "trainer.measure_tolerance" not in fixed_values and min_speedup > 1.0:
        # adaptive trials measure until the median is known to within half the smallest speedup
        # the study counts as a win: an interval that narrow cannot turn a tie into a win (with no
        # min_speedup above 1, trainer.measure_tolerance keeps its default)
        fixed.append(f"trainer.measure_tolerance={(min_speedup - 1.0) / 2:.6g}")
    study = Study(
        name=name,
        variables=variables,
        fixed=fixed,
        objective=str(spec.get("objective") or ""),
        direction=str(spec.get("direction")),
        repeats=int(spec.get("repeats", 2)),
        min_speedup=min_speedup,
        loss_band=float(spec.get("loss_band", 0.05)),
        passes=int(spec.get("passes", 1)),
        resume=bool(spec.get("resume", True)),
        planner_skip=bool(spec.get("planner_skip", True)),
        space=where,
    )
    errors += _study_errors(study)
    if errors:
        raise StudyError(errors)
    expected = LOWER_IS_BETTER.get(study.objective)
    if expected is not None and expected != (study.direction == "minimize"):
        log.warning(
            "ovat: hydra.sweeper.direction=%s for %s, which is better %s: is that what you mean?",
            study.direction,
            study.objective,
            "lower" if expected else "higher",
        )
    return study


# objectives the planner predicts, as the power of the step time they go with
