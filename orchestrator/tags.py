"""The MLflow tag names the control plane writes and reads: a contract with every tool that reads
the runs back (``best``, ``report``, ``compare``, the OVAT and auto sweepers, the planner's
calibration), so each is spelled here once."""

from __future__ import annotations

# a trial's run
TRIAL_STATUS = "trial.status"  # orchestrator/statuses.py: running, finished, or how it failed
TRIAL_REASON = "trial.reason"
CONFIG_HASH = "trial.config_hash"  # the sections that define what a trial computes (tracking.config_hash)
TRIAL_NODES = "trial.nodes"  # the Ray nodes its ranks ran on
TRIAL_WORKER_GROUP = "trial.worker_group"  # the warm worker group that ran it, and its trial count
TRIAL_ATTEMPTS = "trial.attempts"  # starts of rank 0, a node lost in between
RANK0_NODE, RANK0_IP = "trial.rank0_node", "trial.rank0_ip"
SWEEP = "sweep"  # the sweep's id, on the parent and each of its trials
# a sweep's parent run
SWEEP_STATUS = "sweep.status"
SWEEP_REASON = "sweep.reason"
SWEEP_LAUNCHER, SWEEP_SWEEPER, SWEEP_DIR = "sweep.launcher", "sweep.sweeper", "sweep.dir"
SWEEP_OVERRIDES = "sweep.overrides"  # a parameter of the parent: the sweep's command-line overrides
REUSED = "sweep.reused."  # + the job's number: the finished run a job reused
# a tuning study's conclusion, on the parent (orchestrator/report_render.py)
TUNING_OUTCOME, TUNING_COMMAND, TUNING_FINAL_OVERRIDES = "tuning.outcome", "tuning.command", "tuning.final_overrides"
AUTO_STOP = "auto.stop"  # why the auto search stopped measuring, on its parent
# MLflow's own
PARENT_RUN = "mlflow.parentRunId"  # nests a trial under its sweep in the UI
RUN_NAME = "mlflow.runName"  # mlflow.utils.mlflow_tags.MLFLOW_RUN_NAME: the name the UI lists
NOTE = "mlflow.note.content"  # mlflow.utils.mlflow_tags.MLFLOW_RUN_NOTE: the run's Description
# MLflow 3's UI picks an experiment's view from this tag (EXPERIMENT_KIND_TAG_KEY in
# mlflow/server/js/src/experiment-tracking/utils/ExperimentKindUtils.ts); the model-training
# kind is ExperimentKind.CUSTOM_MODEL_DEVELOPMENT in .../experiment-tracking/constants.ts
EXPERIMENT_KIND = "mlflow.experimentKind"
UNDELIVERED = "tracking.undelivered"  # the journal of records the store never got
