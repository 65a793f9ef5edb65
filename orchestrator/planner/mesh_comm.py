"""Tensor and pipeline parallelism's collectives per step, as the trainer issues them: the seconds
their bytes take over the link their group spans, and the calls (each one a collective's fixed
cost, priced by :mod:`.step_time`). Counted on the trainer's own ranks by
``tests/test_tp_collectives.py``.

- TP (Megatron, ``trainers/parallel.py apply_tp``): per layer and micro-batch, each sub-layer's
  row-parallel output is all-reduced in the forward, and its input's gradient, which the
  column-parallel linears that read it add up on one replicated DTensor, once in the backward: 4
  all-reduces of ``s b h``. Sequence parallelism turns each into an all-gather and a
  reduce-scatter of half the volume each (Korthikanti et al. 2022, sec. 4.2.2): 8 calls, the same
  bytes; and the norms' weights (and LayerNorm's biases), replicated over sequence shards, get
  their gradients all-reduced in each backward (DTensor makes a replicated parameter's partial
  gradient whole where it is made; Megatron-LM defers these to the end of the step): 2 calls of
  ``d`` fp32 values a layer, 4 with LayerNorm. Activation checkpointing re-runs the forward, up to
  its last saved tensor (``torch.utils.checkpoint``'s early stop): all of the forward's
  collectives but the last, 1 more (3 with sequence parallelism).
- PP: each micro-batch sends its activation forward and its gradient back across each of the
  rank's stage boundaries (a 1/t sequence shard with sequence parallelism).
"""

from __future__ import annotations

from typing import Optional, Tuple

from omegaconf import DictConfig

from orchestrator.planner.dp_comm import allreduce_bytes
from orchestrator.planner.shapes import ModelShape, ParallelShape


def link(chip: DictConfig, ranks_spanned: int) -> float:
    """Per-device bandwidth, bytes/s, of a group whose ranks span this many consecutive devices."""
    gbps = chip.intra_node_gbps if ranks_spanned <= int(chip.devices_per_node) else chip.inter_node_gbps
    return max(float(gbps), 1e-9) * 1e9


def dp_link(chip: DictConfig, s: ParallelShape) -> float:
    """Per-device bandwidth, bytes/s, of a data-parallel group's collectives. Across nodes each of
    the group's k members on a node drives its own NIC (``inter_node_gbps`` is per device: DGX
    A100 and H100 have one 200/400 Gb/s port a GPU, an Atlas 800T A2 one 200GE port an NPU), and
    the collective splits the bytes over them: NCCL runs a ring per channel with the channels
    spread over the NICs, HCCL's hierarchical algorithms reduce within the server over HCCS and
    cross servers from every NPU at once. So the group moves k times one NIC's rate, at most the
    intra-node link; k = devices a node / (tp x pp), the mesh being (dp, pp, tp) with tp
    innermost. A CPU host's worker processes share its one NIC (k = 1)."""
    per_node = int(chip.devices_per_node)
    if s.world <= per_node:
        return link(chip, s.world)
    k = 1 if chip.device_type == "cpu" else max(1, per_node // (s.tp * s.pp))
    return min(float(chip.intra_node_gbps), k * float(chip.inter_node_gbps)) * 1e9


def tp_collectives(m: ModelShape, s: ParallelShape) -> Tuple[int, int]:
    """A layer's TP collectives per micro-batch on the sub-layers' activations (all-reduces, or
    with sequence parallelism all-gathers and reduce-scatters, and the backward's gathers again:
    :func:`regathers`) and on the norms' gradients."""
    if s.tp == 1:
        return 0, 0
    forward = _forward_calls(s)
    act = 2 * forward + (forward - 1 if m.full_recompute else regathers(s))
    return act, (2 * (2 if m.layernorm else 1) if s.sequence_parallel else 0)


def regathers(s: ParallelShape) -> int:
    """All-gathers a block that does not recompute from its input adds in its backward: with
    sequence parallelism its two sub-layers gather their kept input shard again
    (``trainers/sp_regather.py``; not in a compiled block)."""
    return 2 if s.sequence_parallel and not s.compiled else 0


def _forward_calls(s: ParallelShape) -> int:
    """A block's activation collectives in one forward: 2 all-reduces, or with sequence
    parallelism 2 all-gathers and 2 reduce-scatters; the backward has as many."""
    return 4 if s.sequence_parallel else 2


def mesh_comm(
    m: ModelShape, s: ParallelShape, chip: DictConfig, layers: int, act_b: int, recomputed: Optional[int] = None
) -> Tuple[float, int, float, int]:
    """Seconds and calls, per step on a rank holding ``layers`` layers (``recomputed`` of them
    recompute: all by default), of the tensor-parallel collectives and of the pipeline's sends."""
    msg = s.seq_len * s.micro_batch * m.d * act_b
    tp_s, tp_calls = 0.0, 0
    if s.tp > 1:
        act, norm = tp_collectives(m, s)
        # a block that does not recompute repeats none of its forward's collectives
        # (and makes the backward's gathers again instead)
        spared = (layers - (layers if recomputed is None else recomputed)) * (
            act - 2 * _forward_calls(s) - regathers(s)
        )
        per_call = allreduce_bytes(msg, s.tp) / (2 if s.sequence_parallel else 1)
        norm_bytes = norm * allreduce_bytes(m.d * 4, s.tp)
        tp_calls = ((act + norm) * layers - spared) * s.microbatches
        tp_s = ((act * layers - spared) * per_call + norm_bytes * layers) * s.microbatches / link(chip, s.tp)
    pp_s, pp_calls = 0.0, 0
    if s.pp > 1:
        pp_calls = 2 * s.microbatches * s.chunks_per_rank
        pp_s = pp_calls * msg / (s.tp if s.sequence_parallel else 1) / link(chip, s.tp * s.pp)
    return tp_s, tp_calls, pp_s, pp_calls
