"""The statuses a trial and a sweep end with: the values of the ``trial.status`` and ``sweep.status``
tags, of ``--json`` and of the reports, and the MLflow run status each is recorded under."""

from __future__ import annotations

RUNNING = "running"  # set when the run starts; a run still running after its driver died stays so
FINISHED = "finished"
KILLED = "killed"  # the driver was interrupted (Ctrl-C, SIGTERM) while the trial or sweep ran
FAILED = "failed"  # a sweep that ended on an error (a trial's failure has its own status below)
# a trial refused before any process started: the planner's reason, or an operator the chip lacks
INFEASIBLE = "infeasible"
UNSUPPORTED_OP = "unsupported_op"
# a trial whose workers failed, by what their error says (orchestrator/launch.py classify)
OOM = "oom"
NONFINITE = "nonfinite"
TIMEOUT = "timeout"
CRASH = "crash"
NODE_LOST = "node_lost"  # a Ray node went away under the trial

# a point of a study (the OVAT and auto sweepers): not run yet, or left out by the search
PENDING = "pending"
PRUNED = "pruned"

REFUSED = (INFEASIBLE, UNSUPPORTED_OP)
TRIAL_FAILED = (INFEASIBLE, OOM, NONFINITE, TIMEOUT, CRASH, NODE_LOST, UNSUPPORTED_OP, KILLED)
# MLflow's own run status (mlflow.entities.RunStatus) for a status: any other failure is FAILED
RUN_STATUS = {FINISHED: "FINISHED", FAILED: "FAILED", KILLED: "KILLED"}


def run_status(status: str) -> str:
    """The MLflow run status a trial or sweep with ``status`` ends under."""
    return RUN_STATUS.get(status, "FAILED")
