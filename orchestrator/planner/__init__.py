"""The planner: will a trial fit, does every operator run on the chip, and how fast will it be,
answered on a laptop before any device is used.

One concern per module, each with its formulas and their sources in its docstring:

- :mod:`.shapes`: the model's sizes, one layout (``ModelShape``, ``ParallelShape``), and the
  parameter tensors each rank holds, by the trainer's own layout rules (``trainers/rules.py``);
- :mod:`.memory`: memory per rank: model state (exact bytes per rank), activations
  (Korthikanti et al. 2022), communication buffers, the runtime reserve;
- :mod:`.step_time`: step time: compute, pipeline bubble, DP/TP/PP communication (alpha-beta),
  data parallelism's collectives counted in :mod:`.dp_comm` as the trainer issues them;
- :mod:`.operators`: operator coverage against the chip's operator table, captured on meta tensors;
- :mod:`.calibration`: the step-time factors fitted to measured trials in MLflow, and judged on
  held-out ones (the least squares themselves in :mod:`.factor_fit`);
- :mod:`.preflight`: one layout planned as composed, the preflight report a trial is launched on;
- :mod:`.search`: every point the trainer can run on N devices (layouts x batch split x schedule
  x checkpointing x sharding x sequence parallelism, :mod:`.space`), fastest first, with why
  each excluded point is excluded.

Composing, validating and planning a config import no torch: the operator capture imports
``trainers.ops`` when first called.
"""

from orchestrator.planner.activations import (
    checkpointed_layer_bytes,
    inflight_microbatches,
    layer_activation_bytes,
)
from orchestrator.planner.calibration import (
    Calibration,
    HeldOut,
    calibrate,
    cross_validate,
    estimate,
    evaluate,
    layout_name,
    predict,
    split_by_layout,
    trial_parts,
)
from orchestrator.planner.dp_comm import allreduce_bytes, dp_calls, dp_traffic_bytes
from orchestrator.planner.measured import MeasuredTrial, config_from_params, measured_trials
from orchestrator.planner.memory import (
    MemoryPlan,
    ModelState,
    communicators,
    dp_buffer_bytes,
    memory_plan,
    model_state,
    model_state_bytes,
    rank_model_state,
    state_bytes,
)
from orchestrator.planner.operators import OpCoverage, OpPlan, captured_ops, op_coverage
from orchestrator.planner.preflight import (
    NOT_YET,
    LayoutPlan,
    plan_layout,
    planning_errors,
    preflight,
    resolved,
    state_bytes_per_rank,
    with_model_overrides,
)
from orchestrator.planner.rank_stats import spearman_rho
from orchestrator.planner.search import default_microbatches, layout_config, layouts, plan_devices, plan_space
from orchestrator.planner.shapes import (
    BYTES,
    GiB,
    MiB,
    ModelShape,
    ParallelShape,
    ParamTensor,
    RankContents,
    block_params,
    block_tensors,
    chunk,
    local_numel,
    rank_contents,
    rank_params,
    rank_tensors,
)
from orchestrator.planner.step_time import (
    StepEstimate,
    StepParts,
    bubble_fraction,
    collective_latency_s,
    combine,
    model_flops,
    step_parts,
    step_time,
)

__all__ = [
    "BYTES",
    "Calibration",
    "collective_latency_s",
    "GiB",
    "HeldOut",
    "LayoutPlan",
    "MeasuredTrial",
    "MemoryPlan",
    "MiB",
    "ModelShape",
    "ModelState",
    "NOT_YET",
    "OpCoverage",
    "OpPlan",
    "ParallelShape",
    "ParamTensor",
    "RankContents",
    "StepEstimate",
    "StepParts",
    "allreduce_bytes",
    "block_params",
    "block_tensors",
    "bubble_fraction",
    "calibrate",
    "captured_ops",
    "checkpointed_layer_bytes",
    "chunk",
    "combine",
    "communicators",
    "config_from_params",
    "cross_validate",
    "default_microbatches",
    "dp_buffer_bytes",
    "dp_calls",
    "dp_traffic_bytes",
    "estimate",
    "evaluate",
    "inflight_microbatches",
    "layer_activation_bytes",
    "layout_config",
    "layout_name",
    "layouts",
    "local_numel",
    "measured_trials",
    "memory_plan",
    "model_flops",
    "model_state",
    "model_state_bytes",
    "op_coverage",
    "plan_devices",
    "plan_space",
    "plan_layout",
    "planning_errors",
    "predict",
    "preflight",
    "rank_contents",
    "rank_model_state",
    "rank_params",
    "rank_tensors",
    "resolved",
    "spearman_rho",
    "split_by_layout",
    "state_bytes",
    "state_bytes_per_rank",
    "step_parts",
    "step_time",
    "trial_parts",
    "with_model_overrides",
]
