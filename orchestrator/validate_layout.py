"""The rules of a parallel layout (``validate()`` calls them): the mesh fits the world, the heads,
the FFN and the layers divide among its ranks, the batch splits into replicas and micro-batches,
and a pipeline fills with its schedule's stages and holds under the data-parallel wrapping the
trainer builds (two combinations torch 2.13's pipelining gets wrong are refused, each measured).
"""

from __future__ import annotations

from typing import Callable, Optional

from omegaconf import DictConfig

from orchestrator.layout import Layout, layout, world_size
from trainers import rules


def layout_rules(cfg: DictConfig, err: Callable[[str], None]) -> Optional[Layout]:
    """The parallel layout's rules; its Layout, or None when dp is broken (nothing else can be said)."""
    m, p, t, c = cfg.model, cfg.parallel, cfg.trainer, cfg.comm
    kv = rules.kv_heads(m.n_heads, m.n_kv_heads)
    if int(p.dp) == 0 or int(p.dp) < -1:
        err(f"parallel.dp={p.dp}: must be positive, or -1 to fill from launch.world_size")
        return None
    lay = layout(cfg)
    world = int(cfg.launch.world_size)
    if int(p.dp) == -1:
        fill = world_size(cfg)
        if fill % (lay.tp * lay.pp):
            err(f"parallel.dp=-1: world size {fill} is not divisible by parallel.tp*parallel.pp={lay.tp * lay.pp}")
    elif world > 0 and lay.world_size != world:
        err(f"parallel.dp*tp*pp={lay.dp}*{lay.tp}*{lay.pp}={lay.world_size} does not equal launch.world_size={world}")
    if m.n_heads % lay.tp:
        err(f"parallel.tp={lay.tp} does not divide model.n_heads={m.n_heads}")
    elif kv % lay.tp:
        err(f"parallel.tp={lay.tp} does not divide the key/value heads (model.n_kv_heads={kv})")
    if m.d_ff % lay.tp:
        err(f"parallel.tp={lay.tp} does not divide model.d_ff={m.d_ff}")
    if lay.pp > m.n_layers:
        err(f"parallel.pp={lay.pp} exceeds model.n_layers={m.n_layers}: a stage needs at least one layer")
    per_replica, rem = divmod(int(t.global_batch), lay.dp)
    if rem:
        err(f"trainer.global_batch={t.global_batch} is not divisible by parallel.dp={lay.dp}")
    elif lay.pp == 1 and per_replica % int(t.micro_batch):
        err(
            f"trainer.global_batch={t.global_batch} / parallel.dp={lay.dp} = {per_replica} is not a multiple of "
            f"trainer.micro_batch={t.micro_batch}"
        )
    if lay.pp == 1 and int(p.microbatches) != 1:
        err(
            f"parallel.microbatches={p.microbatches} applies to a pipeline (parallel.pp>1); without one, "
            f"gradient accumulation is trainer.global_batch/parallel.dp/trainer.micro_batch: set it to 1"
        )
    if lay.pp > 1:
        _pipeline_rules(cfg, lay, per_replica, rem, err)
    if c.compression != "none" and (lay.dp == 1 or p.dp_shard != "ddp"):
        err(
            f"comm.compression={c.compression} applies to the gradients' all-reduce between whole replicas: "
            f"it needs parallel.dp>1 and parallel.dp_shard=ddp (zero1 and fsdp reduce-scatter)"
        )
    elif c.compression in ("powersgd", "topk") and lay.tp > 1:
        err(
            f"comm.compression={c.compression} is a DDP communication hook, and replicas beside parallel.tp={lay.tp} "
            f"are not DDP's: it needs parallel.tp=1 (fp16 and bf16 cast the TP replicas' buckets too)"
        )
    if p.sequence_parallel and lay.tp == 1:
        err("parallel.sequence_parallel=true needs parallel.tp>1")
    held = chunkable_positions(int(cfg.trainer.seq_len), lay.tp, bool(p.sequence_parallel))
    if not 1 <= int(cfg.model.loss_chunks) <= held:
        err(
            f"model.loss_chunks={cfg.model.loss_chunks}: must be from 1 to the {held} sequence positions "
            f"each rank's head holds (trainer.seq_len={cfg.trainer.seq_len}"
            + (f" over parallel.tp={lay.tp} with sequence parallelism)" if held != int(cfg.trainer.seq_len) else ")")
        )

    return lay


def chunkable_positions(seq_len: int, tp: int, sequence_parallel: bool) -> int:
    """The sequence positions each rank's head holds, which the chunked loss slices
    (trainers/head_loss.py): model.loss_chunks is from 1 to these."""
    return seq_len // (tp if sequence_parallel and tp > 1 else 1)


def _pipeline_rules(cfg: DictConfig, lay: Layout, per_replica: int, rem: int, err: Callable[[str], None]) -> None:
    """A pipeline's: microbatches that fill it and divide the replica's batch, its schedule's
    stages, an untied head."""
    m, p, c = cfg.model, cfg.parallel, cfg.comm
    # the pipeline splits each replica's batch into parallel.microbatches itself
    if p.microbatches < lay.pp:
        err(f"parallel.microbatches={p.microbatches} is below parallel.pp={lay.pp}: the pipeline never fills")
    per_rank = rules.stages_per_rank(lay.pp, p.schedule, p.virtual_stages)
    stages = lay.pp * per_rank
    ddp = c.overlap and lay.tp == 1 and rules.dp_wrapping(lay.dp, lay.tp, str(p.dp_shard)) == "ddp"
    if p.schedule == "zbv" and lay.dp > 1 and c.overlap:
        # measured on dp2pp2 against the single-process reference (gpt_tiny, torch 2.13): DDP's
        # losses leave it from the second step, FSDP's stop falling (a stage never trains); with
        # the reduction after the backward (comm.overlap=false) both equal it
        err(
            f"parallel.schedule=zbv with parallel.dp={lay.dp} and comm.overlap=true: ZB-V computes the "
            f"weight gradients after the backward pass that DDP's and FSDP's reduction hooks follow, so "
            f"gradients are reduced before they exist; set comm.overlap=false (the reduction after the "
            f"backward) or another parallel.schedule"
        )
    limit = lay.pp * min(per_rank, 2)
    if ddp and p.schedule == "gpipe":
        # measured under DDP (gpt_tiny, dp2pp2, torch 2.13): GPipe crashes at 2, 4 and 8
        # microbatches with the same reducer assertion as below
        err(
            f"parallel.schedule=gpipe under DDP (parallel.dp={lay.dp}, parallel.tp=1, comm.overlap=true): "
            f"torch's DDP reducer fails on the pipeline's first step ('rebuilt parameter indices size is not "
            f"same as original model parameters size'); use parallel.dp_shard=zero1 or fsdp, comm.overlap=false "
            f"or another parallel.schedule"
        )
    elif lay.pp <= p.microbatches <= limit and ddp:
        # measured under DDP (gpt_tiny, torch 2.13), crash / run by microbatches: 1F1B pp2 2 / 3, 4;
        # pp4 1F1B 5 runs; interleaved pp2 v2 4 / 6, 8; pp2 v4 4 / 6, 8; pp4 v2
        # 4, 8 / 12; ZB-V pp2 4 / 5. FSDP and DDP without overlap run every one of them
        err(
            f"parallel.microbatches={p.microbatches} not above {limit} under DDP (parallel.dp={lay.dp}, "
            f"parallel.pp={lay.pp}, {per_rank} stage(s) a rank): torch's DDP reducer fails on the "
            f"pipeline's first step ('rebuilt parameter indices size is not same as original model "
            f"parameters size'); use more microbatches, parallel.dp_shard=zero1 or fsdp, or comm.overlap=false"
        )
    if not rem and per_replica % p.microbatches:
        err(
            f"parallel.microbatches={p.microbatches} does not divide the per-replica batch "
            f"trainer.global_batch/parallel.dp={per_replica}"
        )
    if p.schedule == "interleaved_1f1b" and p.microbatches % lay.pp:
        err(
            f"parallel.microbatches={p.microbatches} must be a multiple of parallel.pp={lay.pp} "
            f"for parallel.schedule=interleaved_1f1b"
        )
    if p.schedule == "interleaved_1f1b" and p.virtual_stages < 2:
        err(
            f"parallel.virtual_stages={p.virtual_stages}: parallel.schedule=interleaved_1f1b needs at least "
            f"2 stages per rank"
        )
    if stages > m.n_layers >= lay.pp:
        err(f"parallel.pp={lay.pp} x stages per rank = {stages} stages exceeds model.n_layers={m.n_layers}")
    if m.tie_embeddings:
        err(
            f"model.tie_embeddings=true with parallel.pp={lay.pp}: the embedding and the head sit on "
            f"different stages; set model.tie_embeddings=false"
        )
