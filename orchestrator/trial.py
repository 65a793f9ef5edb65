"""One trial, end to end: resolve the chip, validate, record in MLflow, launch, record the end.

Nothing is launched and no MLflow run is created for a config that breaks a rule, or when the
tracking store cannot be used (``tracking.uri``: a server that does not answer, a sqlite file whose
directory cannot be made); a trial that fails after launch ends with its classified status and
reason in MLflow. A store that goes away during the trial fails nothing: rank 0's records wait in
a journal next to the trial's output until the store is back (see ``orchestrator.tracking``).

A composed config is resolved once per job (:func:`resolve`: chip resolved, rules checked, layout
worked out, launch path decided) into a :class:`ResolvedTrial`, whose preflight is planned once
(:meth:`ResolvedTrial.preflight`); the steps after it (a sweep job's finished-before check, the
start, the launch) take the config, the layout and the plan from there instead of working them out
again (``tests/test_resolved_once.py`` counts them).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator import (
    chips,
    mlflow_reporter,
    mlflow_store,
    mlflow_ui,
    planner,
    ray_cluster,
    ray_trial,
    statuses,
    sweep_parent,
    tags,
    tracking,
    trial_files,
)
from orchestrator.filled import fill
from orchestrator.launch import TrialFailed, launch_local, start_workers_early, trial_nodes
from orchestrator.layout import Layout, layout
from orchestrator.ray_trial import BoardSlot, Placement
from orchestrator.validate import cluster_errors, validate
from trainers.config import TrialSpec

log = logging.getLogger("orchestrator")


class ConfigError(ValueError):
    """Broken rules of a config; ``errors`` has one line per rule."""

    def __init__(self, errors: List[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass
class ResolvedTrial:
    """A composed config made concrete once, for one trial: ``cfg`` with its chip resolved and
    every rule checked, its ``layout`` (``parallel.dp=-1`` filled), the ``nodes`` it spans, and
    its launch path: ``path`` is ``local`` (torch's elastic launcher on this node) or ``ray``,
    with ``placement`` saying how its workers ask Ray for devices."""

    cfg: DictConfig
    layout: Layout
    nodes: int
    path: str
    placement: Placement
    _report: Optional[Dict[str, Any]] = field(default=None, repr=False)

    def preflight(self) -> Dict[str, Any]:
        """The planner's report, planned on the first call (the trainer's mapped decompositions
        applied to ``cfg`` then) and kept."""
        if self._report is None:
            self._report = _preflight(self.cfg)
        return self._report

    def outcome(self) -> Dict[str, Any]:
        """What :func:`start` will decide, without recording or launching anything: ``status``
        (``ready``, ``infeasible`` or ``unsupported_op``), ``reasons``, the ``preflight`` report
        and the ``config_hash`` its run will carry."""
        report = self.preflight()
        return {
            "status": "ready" if report["feasible"] else _infeasible_status(report),
            "reasons": report["reasons"],
            "preflight": report,
            "config_hash": tracking.config_hash(self.cfg),
        }

    def launch_section(self) -> Dict[str, Any]:
        """``launch`` as plain data, what a launch path gets."""
        return OmegaConf.to_container(self.cfg.launch, resolve=True)


def resolve(cfg: DictConfig, launcher: Optional[str] = None) -> ResolvedTrial:
    """Resolve the chip, check every rule (raise ConfigError listing all broken ones), work out
    the layout and the launch path. ``launcher``: None chooses (Ray when the trial spans nodes or
    a cluster address is set, else local), "local" or "ray" (``hydra/launcher=ray``) forces one."""
    why = fill(cfg)
    if why:
        raise ConfigError([why])
    lay = layout(cfg)
    nodes = trial_nodes(lay.world_size, int(cfg.chip.devices_per_node), int(cfg.launch.nnodes))
    errors = validate(cfg) + ray_cluster.launch_errors(cfg.chip, cfg.launch, lay.world_size, nodes)
    errors += cluster_errors(cfg, nodes)
    if errors:
        raise ConfigError(errors)
    to_ray = launcher == "ray" or (launcher is None and ray_cluster.goes_to_ray(nodes, cfg.launch.ray))
    return ResolvedTrial(cfg, lay, nodes, "ray" if to_ray else "local", Placement.of(cfg.chip, cfg.launch.ray, nodes))


def prepare(cfg: DictConfig) -> DictConfig:
    """Resolve the chip and check every rule; raise ConfigError listing all broken ones.
    Returns ``cfg`` (completed in place); :func:`resolve` returns what was worked out too."""
    return resolve(cfg).cfg


def build_spec(cfg: DictConfig, lay: Optional[Layout] = None) -> TrialSpec:
    """The trainer's sections as their own dataclasses (one schema, ``trainers/config.py``), the
    layout (``lay``, else worked out from ``cfg``) filled in, the chip turned into a runtime."""
    lay = lay or layout(cfg)
    sections = {k: OmegaConf.to_object(cfg[k]) for k in ("model", "trainer", "data", "precision", "comm", "parallel")}
    sections["parallel"].dp, sections["parallel"].tp, sections["parallel"].pp = lay.dp, lay.tp, lay.pp
    return TrialSpec(**sections, runtime=chips.runtime(cfg.chip, cfg.comm, cfg.precision.compute_dtype))


def trial_tags(cfg: DictConfig, lay: Optional[Layout] = None) -> Dict[str, str]:
    """The run's tags of a trial (``lay``: its layout, else worked out from ``cfg``)."""
    lay = lay or layout(cfg)
    out = {
        "chip": cfg.chip.name,
        "chip.source": cfg.chip.source,
        "chip.vendor": cfg.chip.vendor,
        "emulated": str(bool(cfg.chip.emulate)).lower(),
        "model": cfg.model.name,
        "precision": cfg.precision.name,
        "layout": lay.name,
        "world_size": str(lay.world_size),
    }
    f = cfg.trainer.fault
    if f.at_step >= 0 or f.nan_at_step >= 0 or f.straggle_s > 0:  # a drill ran: its step times say so
        out["fault"] = OmegaConf.to_yaml(f).strip().replace("\n", ", ")
    return out


def record_infeasible(
    cfg: DictConfig,
    overrides: Iterable[str],
    errors: List[str],
    status: str = statuses.INFEASIBLE,
    preflight: Optional[Dict[str, Any]] = None,
    lay: Optional[Layout] = None,
) -> Optional[str]:
    """A trial that cannot run still gets a run, with its status and the reasons; not launched.
    ``lay``: its layout when already worked out. None (a warning) when the store cannot be used."""
    run_tags = trial_tags(cfg, lay) if not OmegaConf.is_missing(cfg.chip, "name") else {}
    run_tags.update(sweep_parent.child_tags(cfg.tracking))
    why = mlflow_store.store_problem(tracking.resolve_uri(cfg.tracking))
    if why:  # nowhere to record it: say so instead of waiting on the store
        log.warning("not recorded (%s: %s): %s", tracking.resolve_uri(cfg.tracking), why, "; ".join(errors))
        return None
    uri, run_id = tracking.start_run(cfg, overrides, run_tags)
    if preflight is not None:
        _log_preflight(uri, run_id, preflight)
    tracking.end_run(uri, run_id, status, "; ".join(errors))
    return run_id


def _log_preflight(uri: str, run_id: str, report: Dict[str, Any]) -> None:
    tracking.client(uri).log_text(run_id, json.dumps(report, indent=1, default=str), "preflight.json")
    step = report.get("step") or {}
    tracking.log_metrics(
        uri,
        run_id,
        {
            "planned_mem_gb": report.get("planned_mem_gb"),
            "planned_step_time_s": step.get("step_time_s"),
            "planned_mfu": step.get("mfu"),
            "planned_bubble_fraction": step.get("bubble_fraction"),
            "planned_comm_share": step.get("comm_share"),
            "op_coverage": (report.get("ops") or {}).get("coverage"),
            "op_replacement_rate": (report.get("ops") or {}).get("replacement_rate"),
        },
    )


def _preflight(cfg: DictConfig) -> Dict[str, Any]:
    """The planner, before any device is used: memory fit and operator coverage. The trainer runs
    with the decompositions it maps (e.g. model.attn_impl=decomposed where fused attention is
    missing on the chip), and the recorded config says so."""
    report = planner.preflight(cfg, filled=True)
    for key, value in report["model_overrides"].items():
        cfg.model[key] = value
    return report


def _infeasible_status(report: Dict[str, Any]) -> str:
    return statuses.UNSUPPORTED_OP if report["ops"].get("unresolved") else statuses.INFEASIBLE


def check(cfg: DictConfig) -> Dict[str, Any]:
    """What :func:`start` would decide for this config, without recording or launching anything:
    ``status`` (``ready``, ``infeasible`` or ``unsupported_op``), ``reasons``, the ``preflight``
    report (None for a broken rule) and the ``config_hash`` its run will carry. ``cfg`` is
    completed as :func:`start` completes it (chip resolved, the planner's mappings applied)."""
    try:
        return resolve(cfg).outcome()
    except ConfigError as err:
        return {
            "status": statuses.INFEASIBLE,
            "reasons": err.errors,
            "preflight": None,
            "config_hash": tracking.config_hash(cfg),
        }


@dataclass
class Trial:
    """A trial past validation and preflight: recorded in MLflow (a run with status running) and
    ready to launch with ``spec``, or already ended before any launch (``spec`` is None, the
    result says infeasible or unsupported_op)."""

    resolved: ResolvedTrial
    overrides: List[str]
    result: Dict[str, Any]
    spec: Optional[TrialSpec] = None
    reporter: Optional[mlflow_reporter.MlflowReporter] = None

    @property
    def cfg(self) -> DictConfig:
        return self.resolved.cfg

    @property
    def layout(self) -> Layout:
        return self.resolved.layout


# a launch path: (spec, reporter, world_size, launch section) -> rank 0's summary; raises TrialFailed
LaunchFn = Callable[[TrialSpec, Any, int, Dict[str, Any]], Dict[str, Any]]


def start(resolved: ResolvedTrial, overrides: Iterable[str], progress: Optional[bool] = None) -> Trial:
    """Preflight and record one resolved trial, up to the launch; both launch paths share it.

    Raises ConfigError (before anything is launched or recorded) for a tracking store that cannot
    be used.
    """
    cfg = resolved.cfg
    if cfg.tracking.enabled:
        try:
            mlflow_store.check_store(cfg.tracking)
        except mlflow_store.StoreUnreachable as err:
            raise ConfigError([str(err)]) from None
    if resolved.path == "local":  # its workers' imports go on beside the preflight and the run's creation
        start_workers_early(resolved.launch_section())
    overrides = list(overrides)
    lay = resolved.layout
    report = resolved.preflight()
    result: Dict[str, Any] = {"status": statuses.RUNNING, "run_id": None, "preflight": report}
    trial = Trial(resolved, overrides, result)
    if not report["feasible"]:
        status = _infeasible_status(report)
        result.update(status=status, reason="; ".join(report["reasons"]))
        if cfg.tracking.enabled:
            result["run_id"] = record_infeasible(cfg, overrides, report["reasons"], status, report, lay)
        return trial
    spec = build_spec(cfg, lay)
    reporter = None
    if cfg.tracking.enabled:
        uri, run_id = tracking.start_run(
            cfg, overrides, {**trial_tags(cfg, lay), **sweep_parent.child_tags(cfg.tracking)}
        )
        result["run_id"] = run_id
        reporter = mlflow_reporter.MlflowReporter(
            uri, run_id, int(cfg.trainer.steps), progress, journal=trial_files.journal(run_id)
        )
        tracking.log_metrics(uri, run_id, {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "world_size": lay.world_size})
        _log_preflight(uri, run_id, report)
    if cfg.trainer.checkpoint_every > 0:
        spec.trainer.checkpoint_dir = trial_files.checkpoint_dir(cfg, result["run_id"] or uuid.uuid4().hex)
    if cfg.trainer.profile and not spec.trainer.profile_dir:
        spec.trainer.profile_dir = str(Path("profiles").resolve() / (result["run_id"] or uuid.uuid4().hex))
    trial.spec, trial.reporter = spec, reporter
    return trial


def finish(trial: Trial, launch: Optional[LaunchFn] = None) -> Dict[str, Any]:
    """Launch a started trial with ``launch`` (default: its own launch path, see
    :func:`launch_path`) and record how it ended."""
    chip, lay, result, reporter = trial.resolved.cfg.chip, trial.resolved.layout, trial.result, trial.reporter
    if trial.spec is None:
        return result
    launch = launch or launch_path(trial.resolved)
    log.info(
        "trial %s on %s%s: %s, %d process(es)",
        result["run_id"] or "(untracked)",
        chip.name,
        " (emulated)" if chip.emulate else "",
        lay.name,
        lay.world_size,
    )
    # torch's elastic launcher turns SIGINT/SIGTERM into its own SignalException (an Exception,
    # which Hydra reports and swallows) and never restores the handlers it installs: give the
    # driver its own back after the launch, so a later Ctrl-C is a KeyboardInterrupt again
    interrupts = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in interrupts} if main_thread else {}
    try:
        summary = launch(trial.spec, reporter, lay.world_size, trial.resolved.launch_section())
        result.update(status=statuses.FINISHED, summary=summary)
        _log_memory_check(reporter, result)
    except TrialFailed as err:
        result.update(status=err.status, reason=err.reason)
    except BaseException as err:  # the control plane itself was interrupted: still close the run
        # a KeyboardInterrupt, or torch's SignalException for SIGINT/SIGTERM
        interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "sigval", None) in interrupts
        result.update(status=statuses.KILLED if interrupted else statuses.CRASH, reason=f"{type(err).__name__}: {err}")
        if reporter is not None:  # what rank 0 left undelivered stays in its journal
            tracking.end_run(
                reporter.uri, reporter.run_id, result["status"], result["reason"], run_tags=_undelivered(reporter)
            )
        if interrupted and not isinstance(err, KeyboardInterrupt):
            # one kind of interrupt for the driver: the sweep stops, and its parent run ends KILLED
            raise KeyboardInterrupt(str(err)) from None
        raise
    finally:
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
    if reporter is not None:
        run_tags = _undelivered(reporter, deliver=True)
        # the backend variables as rank 0 ran with them (trainers.runtime.ran_with)
        run_tags.update({f"env.{k}": v for k, v in ((result.get("summary") or {}).get("backend_env") or {}).items()})
        tracking.end_run(
            reporter.uri, reporter.run_id, result["status"], result.get("reason", ""), result.get("summary"), run_tags
        )
    return result


def _undelivered(reporter: mlflow_reporter.MlflowReporter, deliver: bool = False) -> Dict[str, str]:
    """Records rank 0 left in its journal (its process died, or the store stayed away past its
    wait): delivered now when ``deliver``; what is still left is tagged on the run."""
    journal = reporter.journal
    if not journal or not Path(journal).exists():
        return {}
    if deliver and mlflow_reporter.deliver_journal(journal):
        return {}
    log.warning("run %s: records the store has not got are kept in %s", reporter.run_id, journal)
    return {tags.UNDELIVERED: journal}


def _log_memory_check(reporter: Optional[mlflow_reporter.MlflowReporter], result: Dict[str, Any]) -> None:
    """The planner's memory per rank against what the allocator really reserved on the fullest
    rank (not the allocated figure, which leaves out the allocator's slack): ``mem_plan_ratio``
    = planned / reserved, above 1 when the plan is conservative."""
    planned = (result.get("preflight") or {}).get("planned_mem_gb")
    reserved = (result.get("summary") or {}).get("peak_mem_reserved_gb")
    if not planned or not reserved:
        return
    result["summary"]["mem_plan_ratio"] = planned / reserved
    if reporter is not None:
        try:
            mlflow_store.retrying(
                lambda: tracking.log_metrics(reporter.uri, reporter.run_id, {"mem_plan_ratio": planned / reserved}),
                f"run {reporter.run_id}: mem_plan_ratio",
            )
        except Exception as err:  # noqa: BLE001 - a derived figure: the trial itself finished
            log.warning("run %s: mem_plan_ratio not recorded: %s", reporter.run_id, err)


def launch_path(resolved: ResolvedTrial, slot: Optional[BoardSlot] = None) -> LaunchFn:
    """The trial's launch path (decided by :func:`resolve`): the local elastic launcher, or Ray
    with the trial's placement; ``slot``: a Ray sweep job's place on its sweep's progress board."""
    if resolved.path == "ray":
        return ray_trial.trial_launcher(resolved.placement, slot)
    return launch_local


def run(
    cfg: DictConfig,
    overrides: Iterable[str],
    progress: Optional[bool] = None,
    launcher: Optional[str] = None,
    slot: Optional[BoardSlot] = None,
) -> Dict[str, Any]:
    """Validate, launch and record one trial; returns a result dict with status and run id.

    ``launcher``: None chooses (see :func:`resolve`), "local" or "ray" forces a path; ``slot``:
    the job's place on its Ray sweep's progress board (``orchestrator.ray_sweep.board_slot``).
    Raises ConfigError (before anything is launched or recorded) for a broken config.
    """
    return run_resolved(resolve(cfg, launcher), overrides, progress, slot)


def run_resolved(
    resolved: ResolvedTrial, overrides: Iterable[str], progress: Optional[bool] = None, slot: Optional[BoardSlot] = None
) -> Dict[str, Any]:
    """:func:`run` of a trial resolved already (a job that checked it first: ``orchestrator.app``)."""
    cfg = resolved.cfg
    trial = start(resolved, overrides, progress)
    result = trial.result if trial.spec is None else finish(trial, launch_path(trial.resolved, slot))
    if result.get("run_id") and sweep_parent.current() is None:  # where to look; a sweep says it once, at its end
        mlflow_ui.show_ui(tracking.resolve_uri(cfg.tracking), result["run_id"])
    return result
