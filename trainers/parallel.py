"""3D parallelism on a device mesh: pipeline stages first, then tensor parallelism, activation
checkpointing, then data parallelism (``trainers/assembly.py``: DDP or whole TP replicas, or
FSDP2 ``fully_shard`` for ``zero1`` and ``fsdp``).

Mesh order is (dp, pp, tp) with tp innermost: consecutive ranks form a TP group, so a TP group
stays inside one node (8 NPUs of an Atlas 800T A2, 8 GPUs of a DGX) where HCCS/NVLink carry its
per-layer all-reduces; PP crosses nodes next, DP outermost.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from trainers import rules
from trainers.config import ModelConfig, ParallelConfig
from trainers.model import GPT
from trainers.sp_regather import keep_shard


@dataclass
class Mesh:
    """The world as (dp, pp, tp) coordinates, with the process groups each dimension needs."""

    device_mesh: Any
    dp: int
    pp: int
    tp: int
    dp_rank: int
    pp_rank: int
    tp_rank: int

    def group(self, dim: str):
        return self.device_mesh[dim].get_group()

    def sub(self, dim: str):
        return self.device_mesh[dim]


def build_mesh(device_type: str, p: ParallelConfig, timeout: Optional[timedelta] = None) -> Mesh:
    """The (dp, pp, tp) mesh over the world. Each dimension's groups are made here with
    ``timeout`` (default: the world group's, which the launcher set from ``comm.timeout_s``):
    ``init_device_mesh`` makes them with ``new_group``'s default instead (30 min on gloo,
    10 on nccl), so a rank hung in a tp or pp collective would hold its peers that long. A
    dimension spanning the whole world uses the world group itself, as ``init_device_mesh`` does."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    if p.dp * p.pp * p.tp != world:
        raise ValueError(f"dp*pp*tp={p.dp}*{p.pp}*{p.tp} does not equal the world size {world}")
    timeout = timeout or group_timeout(dist.group.WORLD, device_type)
    ranks = torch.arange(world, dtype=torch.int).reshape(p.dp, p.pp, p.tp)
    groups = []
    for dim in range(ranks.ndim):
        # every group along `dim`, in the same order on every rank (new_group is collective)
        rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        if len(rows) == 1:
            groups.append(dist.group.WORLD)
        else:
            groups.append(dist.new_subgroups_by_enumeration(rows, timeout=timeout)[0])
    mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=("dp", "pp", "tp"))
    coord = mesh.get_coordinate()
    return Mesh(mesh, p.dp, p.pp, p.tp, coord[0], coord[1], coord[2])


def group_timeout(group: Any, device_type: str) -> Optional[timedelta]:
    """The collective timeout of ``group``'s backend for ``device_type`` (None where the backend
    does not expose its options)."""
    backend = group._get_backend(torch.device(device_type))
    return getattr(getattr(backend, "options", None), "_timeout", None)


def make_stage(args: ModelConfig, stage: int, n_stages: int) -> GPT:
    """The part of the model that stage ``stage`` of ``n_stages`` runs, built on meta."""
    with torch.device("meta"):
        model = GPT(args)
    if n_stages == 1:
        return model
    keep = set(map(str, rules.layer_split(args.n_layers, n_stages)[stage]))
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_emb, model.pos_emb = None, None
    if stage != n_stages - 1:
        model.norm, model.head = None, None
    return model


def apply_tp(model: GPT, tp_mesh, sequence_parallel: bool) -> None:
    """Megatron-style tensor parallelism with DTensor: q/k/v and the MLP's first projections
    column-parallel, the output projections row-parallel (one all-reduce per sub-layer forward),
    a vocab-parallel embedding, and a head sharded over the vocabulary whose logits stay sharded:
    each rank gives out its (batch, seq, vocab/tp) slice, and ``trainers.head_loss.loss_fn`` takes
    the cross-entropy over the shards. With sequence parallelism the norms and residual stream are
    sharded along the sequence (all-gather before, reduce-scatter after each sub-layer; each
    sub-layer keeps its input's shard: ``trainers/sp_regather.py``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    sp = sequence_parallel
    top = _ends_plan(model, sp)
    if top:
        parallelize_module(model, tp_mesh, top)
    # parallelize_module gave each module its own DTensor parameter, silently untying a tied
    # head. Both are Shard(0) over the vocabulary on the tp mesh, so one parameter serves both:
    # one initial value, one gradient (the sum of both uses), one optimizer state.
    model.tie_weights()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
        if sp:  # the sub-layers save their gathered input as its shard (Megatron's way)
            keep_shard(block.attn, block)
            keep_shard(block.mlp, block)
    if sp and model.tok_emb is not None:
        # the embedding (plus learned positions) is replicated; the first block shards the
        # residual stream along the sequence. Between pipeline stages it travels sharded.
        first = next(iter(model.layers.values()))
        parallelize_module(
            first,
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True
            ),
        )


def _ends_plan(model: GPT, sp: bool) -> Dict[str, Any]:
    """The plan of the model's ends this stage holds: the vocab-parallel embedding, the final norm
    and the vocab-sharded head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    top: Dict[str, Any] = {}
    if model.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.head is not None:
        # the logits stay Shard(-1), a plain local tensor out (use_local_output): no rank holds
        # the whole vocabulary's logits (at tp8, seq 4096, vocab 128k the fp32 copy alone would
        # be 2 GiB a micro-batch), and pipeline stages and the evaluation pass plain tensors
        act = Shard(1) if sp else Replicate()
        top["head"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=True)
        if sp:
            # a plain tensor out, this rank's part of the sequence: the head takes it as Shard(1),
            # and a chunked loss (trainers/head_loss.py) slices it before the head gathers it
            top["norm"] = SequenceParallel(use_local_output=True)
    return top


def _block_plan(block: Any, sp: bool) -> Dict[str, Any]:
    """One transformer block's plan: q/k/v and w1 (w3) column-parallel, wo and w2 row-parallel
    into the residual stream's layout (sharded along the sequence with ``sp``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sp else Replicate()
    plan: Dict[str, Any] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=act),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=act),
    }
    if block.mlp.w3 is not None:
        plan["mlp.w3"] = ColwiseParallel()
    # Each sub-layer's input enters as one replicated DTensor that its column-parallel linears
    # share: their input gradients (partial sums on each rank) add up on it, and one collective
    # makes them whole in the backward (Megatron's "f"; with sequence parallelism the reduce-
    # scatter back to the sequence shard). Given to each linear as a plain tensor, each would
    # all-reduce its own: 3 for q/k/v and 2 for SwiGLU's w1/w3 instead of 1 and 1.
    plan["attn"] = PrepareModuleInput(input_layouts=(act, None), desired_input_layouts=(Replicate(), None))
    plan["mlp"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
    if sp:
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    if block.attn.q_norm is not None:
        # Qwen3's per-head norms see this rank's heads (dim 2 of (b, s, heads, head_dim)): the
        # weight replicated, its gradient a partial sum over the rank's heads made whole by DTensor
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan.update({"attn.q_norm": heads, "attn.k_norm": heads})
    return plan


def keep_grads_sharded(model: nn.Module) -> None:
    """Keep each tensor-parallel parameter's gradient in the parameter's own placement.

    DTensor's embedding backward hands the vocabulary-parallel embedding a replicated gradient
    (all of vocab x d on every TP rank, though the parameter is Shard(0)); the rank would hold
    tp times its share until the next zero_grad, and the optimizer would step a shard with a
    full gradient. Replicate -> Shard is a local slice (no communication). FSDP2 does the same
    for its parameters (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
    ``_get_grad_inner_tensor``); this does it where there is no FSDP. The gradient hooks are
    attached at the forward pass, to the parameters as they are then: a later ``to_empty`` or
    dtype cast swaps a DTensor parameter's tensor and drops hooks attached before it."""
    from torch.distributed.tensor import DTensor

    def attach(module: nn.Module, args) -> None:
        for param in module.parameters():
            if isinstance(param, DTensor) and not getattr(param, "_grad_kept_sharded", False):
                param.register_post_accumulate_grad_hook(reshard_grad)
                param._grad_kept_sharded = True

    model.register_forward_pre_hook(attach)


def reshard_grad(param: torch.Tensor) -> None:
    """Put a DTensor parameter's gradient in the parameter's own placement (a replicated
    embedding gradient of a vocabulary-sharded parameter becomes its local slice): the local
    gradient then has the parameter's local shape. A no-op where it already has."""
    from torch.distributed.tensor import DTensor

    g = param.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(param.placements):
        param.grad = g.redistribute(param.device_mesh, param.placements)


def apply_fsdp(model: GPT, dp_mesh, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: each block is its own unit (its all-gather overlaps the previous block's compute),
    then the stage root gathers what is left (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def build_stages(
    margs: ModelConfig, p: ParallelConfig, mesh: Mesh, device: torch.device, seed: int
) -> List[Tuple[int, GPT]]:
    """This rank's (stage index, module) pairs, materialised on ``device``, initialised exactly
    as the single-process model, tensor-parallel where tp > 1. Data parallelism comes after."""
    n_stages = p.pp * rules.stages_per_rank(p.pp, p.schedule, p.virtual_stages)
    out = []
    for sid in rules.stage_ids(p.pp, p.schedule, p.virtual_stages, mesh.pp_rank):
        module = make_stage(margs, sid, n_stages)
        if p.tp > 1:
            apply_tp(module, mesh.sub("tp"), p.sequence_parallel)
        module.to_empty(device=device)
        module.tie_weights()  # to_empty gives each module a new plain parameter: tie them again
        module.init_weights(seed)
        if p.tp > 1 and not rules.sharded(rules.dp_wrapping(p.dp, p.tp, p.dp_shard)):
            keep_grads_sharded(module)  # FSDP reshards the gradients itself
        out.append((sid, module))
    return out


def replication(t: torch.Tensor, mesh: Mesh) -> int:
    """How many ranks of one pipeline stage hold an identical copy of these values.

    A stage is spread over dp*tp ranks; a DTensor sharded over mesh dims of total size S has
    dp*tp/S identical copies; a plain tensor is a full copy on each of the dp*tp ranks. Asked of
    the gradient, not the parameter: a sharded embedding's gradient can come back replicated."""
    from torch.distributed.tensor import DTensor, Shard

    shard = 1
    if isinstance(t, DTensor):
        for size, placement in zip(t.device_mesh.shape, t.placements):
            if isinstance(placement, Shard) or type(placement).__name__ == "_StridedShard":
                shard *= size
    return max(1, (mesh.dp * mesh.tp) // shard)


def acc_dtype(device: torch.device) -> torch.dtype:
    """float64 for reductions of many squares, except on Ascend NPUs, whose vector units and HCCL
    collectives are built for 32-bit and narrower types."""
    return torch.float32 if device.type == "npu" else torch.float64


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _materialise_partial(g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
        return g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
    return g


def _norms_fp32(xs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's L2 norm, accumulated in fp32: a 16-bit tensor is cast first (its own
    ``_foreach_norm`` would sum its squares in its dtype, and an fp16 sum overflows at 65504);
    fp32 ones, every parameter's gradient in the shipped precisions, go as they are."""
    return list(torch._foreach_norm([x if x.dtype == torch.float32 else x.float() for x in xs], 2))


@torch.no_grad()
def global_grad_norm(
    params: List[torch.nn.Parameter], mesh: Optional[Mesh], local_extra: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient across TP shards, pipeline stages and replicas,
    each value counted once: sum over ranks of (local squares / copies), one all-reduce. A 0-dim
    tensor on the device: nothing is read back (it is also the step's overflow flag, finite
    exactly when every gradient value is). ``local_extra``: added to this rank's sum before the
    all-reduce (a saturating NPU's overflow as inf: ``trainers/overflow.py``)."""
    grads = [_materialise_partial(p.grad) for p in params if p.grad is not None]
    device = local(grads[0]).device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=acc_dtype(device), device=device)
    by_copies: Dict[int, List[torch.Tensor]] = {}
    for g in grads:
        by_copies.setdefault(replication(g, mesh) if mesh is not None else 1, []).append(local(g))
    for copies, xs in by_copies.items():
        # each tensor's norm in one multi-tensor kernel, accumulated in fp32 whatever the gradient
        # dtype (an fp16 sum of squares would overflow at 65504); no temporary of a gradient's
        # size, where a per-tensor (x * x).sum() made one each (~1.8 ms of gpt_tiny's CPU step).
        # The squares of the per-tensor norms are then summed in the accumulation dtype
        norms = torch.stack(_norms_fp32(xs)).to(total.dtype)
        total += (norms * norms).sum() / copies
    if local_extra is not None:
        total += local_extra.to(total.dtype)
    if mesh is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.sqrt()


@torch.no_grad()
def param_checksum(params: List[torch.nn.Parameter], mesh: Optional[Mesh]) -> float:
    """Sum of every parameter value of the whole model, each counted once (as the grad norm):
    equal before and after a step exactly when the step changed nothing."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=acc_dtype(device), device=device)
    for p in params:
        total += local(p).to(total.dtype).sum() / (replication(p, mesh) if mesh is not None else 1)
    if mesh is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return float(total)
