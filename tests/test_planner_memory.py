"""The planner's memory per rank by the trainer's rules: what each kind of parallelism shards,
activation checkpointing, communication buffers, the planner's own keys.
"""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from orchestrator import planner
from orchestrator.planner import ModelShape, ParallelShape
from orchestrator.planner import activations as pacts
from tests.planner_cases import DEFAULTS, model, planner_cfg, precision, preset, states


def test_fsdp_divides_states_by_dp_as_zero3():
    """ZeRO (Rajbhandari et al. 2020, Figure 1): mixed-precision Adam keeps 16 bytes/param,
    7.5B params on 64 GPUs: 120 GB per GPU replicated, 1.9 GB with P_os+g+p (= FSDP full shard)."""
    m = ModelShape.of(preset("model", "llama2_7b"))
    prec = precision(param_dtype="bf16", compute_dtype="bf16", master_weights_fp32=True)
    chip = preset("chip", "a100")
    ddp = planner.memory_plan(m, ParallelShape(64, 1, 1, 1, 1, 4096), prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    fsdp = planner.memory_plan(
        m, ParallelShape(64, 1, 1, 1, 1, 4096, dp_mode="fsdp"), prec, DEFAULTS.comm, chip, DEFAULTS.planner
    )
    assert states(ddp) == pytest.approx(16 * m.n_params)
    assert states(fsdp) == pytest.approx(states(ddp) / 64)
    assert 7.5e9 * 16 / 1e9 == 120 and 7.5e9 * 16 / 64 / 1e9 == pytest.approx(1.9, abs=0.05)
    assert fsdp.activations == pytest.approx(ddp.activations)  # FSDP shards states, not activations


def test_parallelism_divides_what_it_shards():
    m = ModelShape.of(preset("model", "llama2_13b"))
    chip, prec = preset("chip", "ascend910b"), precision(compute_dtype="bf16")
    base = planner.memory_plan(m, ParallelShape(1, 1, 1, 8, 1, 4096), prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    tp8 = planner.memory_plan(m, ParallelShape(1, 8, 1, 8, 1, 4096), prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    sp8 = planner.memory_plan(
        m, ParallelShape(1, 8, 1, 8, 1, 4096, sequence_parallel=True), prec, DEFAULTS.comm, chip, DEFAULTS.planner
    )
    pp4 = planner.memory_plan(m, ParallelShape(1, 1, 4, 8, 1, 4096), prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    # TP shards every matrix and the vocabulary; only the norms stay whole
    assert states(tp8) == pytest.approx(states(base) / 8, rel=0.001)
    assert sp8.activations < tp8.activations < base.activations
    # 1F1B: the first of 4 stages holds a quarter of the layers but 4 microbatches of them
    assert states(pp4) == pytest.approx(states(base) / 4, rel=0.05)
    ab = pacts.ActBytes.on(prec, m, chip)
    # (autocast's weight copies once per block the stage holds, not per microbatch)
    layers = planner.layer_activation_bytes(m, 4096, 1, 1, False, ab) * m.layers
    casts = pacts.layer_weight_cast_bytes(m, 1, ab) * m.layers / 4
    assert pp4.activations == pytest.approx(layers + casts + 4 * pacts.embedding_activation_bytes(m, 4096, 1))


def test_activation_checkpointing_and_decomposed_attention():
    kw = dict(
        d_model=4096,
        n_heads=32,
        n_layers=32,
        d_ff=11008,
        mlp="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
        vocab_size=32000,
    )
    chip, prec, s = preset("chip", "ascend910b"), precision(compute_dtype="bf16"), ParallelShape(1, 1, 1, 1, 1, 4096)
    plain = planner.memory_plan(model(**kw), s, prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    ckpt = planner.memory_plan(
        model(**kw, activation_checkpointing=True), s, prec, DEFAULTS.comm, chip, DEFAULTS.planner
    )
    dec = planner.memory_plan(model(**kw, attn_impl="decomposed"), s, prec, DEFAULTS.comm, chip, DEFAULTS.planner)
    m, mc, md = model(**kw), model(**kw, activation_checkpointing=True), model(**kw, attn_impl="decomposed")
    ab = pacts.ActBytes.on(prec, m, chip)
    one_layer = planner.layer_activation_bytes(m, 4096, 1, 1, False, ab)
    ends = pacts.embedding_activation_bytes(m, 4096, 1) + pacts.head_activation_bytes(m, 4096, 1, 1, False, ab)
    ends += pacts.loss_transient_bytes(m, 4096, 1, 1, ab)  # the loss's own peak, on top of what is saved
    casts = pacts.layer_weight_cast_bytes(m, 1, ab)
    assert plain.activations == pytest.approx(32 * (one_layer + casts) + ends + pacts.head_weight_cast_bytes(m, 1, ab))
    # checkpointing keeps each block's input (fp32 here: the residual is in the parameter dtype),
    # one block's full set while it is recomputed, and one block's weight copies
    kept = planner.checkpointed_layer_bytes(mc, 4096, 1, 1, False, ab)
    assert kept == 4096 * 4096 * 4
    assert ckpt.activations == pytest.approx(
        32 * kept + one_layer + casts + ends + pacts.head_weight_cast_bytes(m, 1, ab)
    )
    # the decomposed attention keeps the a s^2 probabilities (fp32: bf16 compute, softmax in
    # fp32_ops by default) and their bf16 copy, and the s^2 causal mask, in every layer
    probs = 32 * 4096 * 4096
    per_layer = probs * (ab.softmax + (ab.linear if ab.softmax != ab.linear else 0)) + 4096 * 4096
    fused_only = 4096 * 4096 * 2 + 32 * 4096 * 4  # the fused kernel's output and log-sum-exp
    fused_only += 4096 * 4096 * 2 if ab.fused_out_copy else 0
    decomposed_only = 4096 * 4096 * 2  # wo's input: the product reshaped
    assert dec.activations - plain.activations == pytest.approx(32 * (per_layer + decomposed_only - fused_only))
    assert md.fused_attention is False


def test_comm_buffers_per_communicator_and_ddp_buckets():
    """HCCL: each communicator holds 2 x HCCL_BUFFSIZE (CANN env-var reference, HCCL_BUFFSIZE)."""
    m, chip = ModelShape.of(preset("model", "llama2_7b")), preset("chip", "ascend910b")
    comm = OmegaConf.merge(DEFAULTS.comm, {"buffsize_mb": 200})
    s = ParallelShape(dp=2, tp=2, pp=2, microbatches=4, micro_batch=1, seq_len=2048)
    mp = planner.memory_plan(m, s, precision(), comm, chip, DEFAULTS.planner)
    # world, dp, tp and pp groups (batch_isend_irecv runs on the pp group's communicator), and a
    # point-to-point communicator of P2P_HCCL_BUFFSIZE (20 MB) with the one neighbour of an end
    # stage (plain isend/irecv): torch_npu's ProcessGroupHCCL
    assert mp.communicators == 5
    assert mp.comm_buffers == 4 * 2 * 200 * 2**20 + 2 * 20 * 2**20
    wide = OmegaConf.merge(comm, {"env": {"P2P_HCCL_BUFFSIZE": "50"}})
    assert planner.memory_plan(m, s, precision(), wide, chip, DEFAULTS.planner).comm_buffers == (
        4 * 2 * 200 * 2**20 + 2 * 50 * 2**20
    )
    # the TP replicas' buckets copy every gradient, made as the last backward frees the
    # activations: they add what exceeds them (nothing here)
    assert mp.dp_buffers == pytest.approx(max(0.0, mp.grads - mp.activations)) == 0.0
    # DDP without gradient_as_bucket_view keeps a copy of every gradient in its buckets
    no_tp = ParallelShape(dp=2, tp=1, pp=2, microbatches=4, micro_batch=1, seq_len=2048)
    mp1 = planner.memory_plan(m, no_tp, precision(), comm, chip, DEFAULTS.planner)
    assert mp1.dp_buffers == pytest.approx(mp1.grads)
    gloo = planner.memory_plan(m, s, precision(), comm, preset("chip", "cpu"), DEFAULTS.planner)
    assert gloo.comm_buffers == 0


def test_the_planner_s_own_keys_move_the_plan():
    """The planner-only keys (not the trainer's: documented so in PlannerConfig) each move the part
    of the plan they name, and only that: the NCCL channels the communicators' buffers, the runtime
    reserve and the fragmentation fraction the overhead, the headroom what is usable and so the
    verdict."""
    m, chip = ModelShape.of(preset("model", "llama2_7b")), preset("chip", "a100")
    s = ParallelShape(dp=2, tp=2, pp=2, microbatches=4, micro_batch=1, seq_len=2048)

    def plan(**kw):
        return planner.memory_plan(m, s, precision(), DEFAULTS.comm, chip, planner_cfg(**kw))

    base = plan()
    twice = plan(nccl_channels=2 * DEFAULTS.planner.nccl_channels)
    assert twice.comm_buffers == pytest.approx(2 * base.comm_buffers) and base.comm_buffers > 0
    assert twice.total - base.total == pytest.approx(base.comm_buffers)
    reserve = plan(runtime_overhead_gb=DEFAULTS.planner.runtime_overhead_gb + 3)
    assert reserve.overhead - base.overhead == pytest.approx(3 * 2**30)
    no_fraction = plan(overhead_fraction=0.0)
    assert no_fraction.overhead == pytest.approx(DEFAULTS.planner.runtime_overhead_gb * 2**30)
    assert base.overhead - no_fraction.overhead == pytest.approx(
        DEFAULTS.planner.overhead_fraction * (states(base) + base.activations)
    )
    total_gb = base.total / 2**30
    assert plan(headroom=1.01 * total_gb / chip.memory_gb).fits
    assert not plan(headroom=0.99 * total_gb / chip.memory_gb).fits


def test_shards_are_cut_as_torch_chunk_cuts():
    """DTensor's Shard and FSDP2 both cut with torch.chunk: pieces of ceil(n/k), the last ones
    smaller or empty. The planner's per-rank counts follow it, not n/k."""
    import torch

    for n in range(0, 13):
        for k in range(1, 6):
            pieces = [c.shape[0] for c in torch.chunk(torch.empty(n), k)] if n else []
            pieces += [0] * (k - len(pieces))
            assert [planner.chunk(n, k, i) for i in range(k)] == pieces, (n, k)


def test_state_bytes_per_rank_follow_the_mesh_and_the_most_loaded_is_planned():
    """Global rank r is (dp r // (tp pp), pp (r // tp) % pp, tp r % tp). A vocabulary that TP
    does not divide leaves TP rank 0 one row more; memory_plan plans the most loaded rank."""
    m = model(vocab_size=51201, n_layers=4, tie_embeddings=False, pos_emb="learned")
    s = ParallelShape(dp=2, tp=2, pp=2, microbatches=4, micro_batch=1, seq_len=2048, dp_mode="fsdp")
    prec = precision()
    per_rank = [planner.rank_model_state(m, s, prec, DEFAULTS.planner, r) for r in range(8)]
    assert [s.coords(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert per_rank[0].params > per_rank[1].params  # the extra vocabulary row, on TP rank 0
    assert per_rank[0].params != per_rank[2].params  # the first stage holds the embeddings
    # FSDP cuts each TP shard over dp: the 25601 vocabulary rows of TP rank 0 as 12801 + 12800
    assert per_rank[0].params - per_rank[4].params == 4 * m.d
    assert all(per_rank[4 + i].params <= per_rank[i].params for i in range(4))
    assert all(r.grads == r.params and r.optimizer == 2 * r.params for r in per_rank)  # fp32: 4 + 4 + 8
    # the 8 ranks hold every element once (FSDP's dp pieces add up to the TP shard), except what
    # TP replicates, which both TP ranks hold: the norms and the learned positions
    total = sum(r.params for r in per_rank) // 4
    assert total == m.n_params + 4 * m.layer_replicated + m.norm_params + m.positions
    mp = planner.memory_plan(m, s, prec, DEFAULTS.comm, preset("chip", "a100"), DEFAULTS.planner)
    # the pipeline rank with the largest total (here the last: the loss's fp32 log-probabilities),
    # and of its ranks the most loaded one
    assert mp.rank == 1
    assert mp.params == max(p.params for r, p in enumerate(per_rank) if s.coords(r)[1] == mp.rank)


def test_without_overlap_dp_buffers_and_collectives():
    """comm.overlap=false: DDP has no wrapper; after the backward pass every gradient is copied
    into flat buckets of comm.bucket_mb, all in flight at once (trainers/comm.py); FSDP is one
    unit per stage: all the stage's parameters gathered and its full gradient before the
    reduce-scatter, one all-gather and one reduce-scatter per stage."""
    m, chip, prec = ModelShape.of(preset("model", "llama2_7b")), preset("chip", "ascend910b"), precision()
    pb, gb, _ = planner.state_bytes(prec, DEFAULTS.planner)
    on, off = DEFAULTS.comm, OmegaConf.merge(DEFAULTS.comm, {"overlap": False})
    ddp = ParallelShape(8, 1, 1, 1, 1, 4096)
    assert planner.memory_plan(m, ddp, prec, on, chip, DEFAULTS.planner).dp_buffers == 4 * m.n_params
    assert planner.memory_plan(m, ddp, prec, off, chip, DEFAULTS.planner).dp_buffers == 4 * m.n_params
    p_on = planner.step_parts(m, ddp, prec, on, chip, DEFAULTS.planner)
    p_off = planner.step_parts(m, ddp, prec, off, chip, DEFAULTS.planner)
    assert p_off.dp_calls == p_on.dp_calls == math.ceil(4 * m.n_params / (25 * 2**20))
    # the bucket the backward fills last is reduced after it: (n - 1) / n of the traffic can hide
    assert p_on.overlap == pytest.approx(DEFAULTS.planner.dp_overlap * (1 - 1 / p_on.dp_calls)) and p_off.overlap == 0.0
    one = planner.step_parts(m, ddp, prec, OmegaConf.merge(on, {"bucket_mb": 1e6}), chip, DEFAULTS.planner)
    assert one.dp_calls == 1 and one.overlap == 0.0  # one bucket holding every gradient hides nothing
    assert planner.combine(p_off, 0.5, 0.7).dp_exposed_s == planner.combine(p_off, 0.5, 0.7).dp_comm_s

    fsdp = ParallelShape(8, 1, 1, 1, 1, 4096, dp_mode="fsdp")
    n = planner.rank_params(m, fsdp, planner.rank_contents(m, fsdp, 0))
    assert n == m.n_params
    block = planner.block_params(m, fsdp)
    root = n - 32 * block  # the embedding, final norm and head: the stage root's unit
    # one micro-batch: the gathered block and the prefetched next beside the root; a block's
    # whole gradient before its reduce-scatter
    gathered = 2 * block + root
    assert planner.memory_plan(m, fsdp, prec, on, chip, DEFAULTS.planner).dp_buffers == gathered * pb + block * gb
    # the one root unit: every parameter gathered (and landing), whole gradients beside the shards
    sharded = planner.model_state(m, fsdp, prec, DEFAULTS.planner, 0).params // pb
    assert planner.memory_plan(m, fsdp, prec, off, chip, DEFAULTS.planner).dp_buffers == 2 * n * pb + (n - sharded) * gb
    f_on = planner.step_parts(m, fsdp, prec, on, chip, DEFAULTS.planner)
    f_off = planner.step_parts(m, fsdp, prec, off, chip, DEFAULTS.planner)
    # one micro-batch: each of the 32 block units and the root gathered twice and reduce-scattered
    # once; without overlap the root alone, once each (the trainer's counts: test_dp_collectives.py)
    assert f_on.dp_calls == 3 * (32 + 1) and f_off.dp_calls == 2
    assert f_off.dp_comm_s == pytest.approx(f_on.dp_comm_s * (pb + gb) / (2 * pb + gb))
    # two stages per rank (interleaved): one unit each, ZeRO-3 gathering and reduce-scattering it
    # for each of the 4 micro-batches; zero1 once a step
    inter = ParallelShape(4, 1, 2, 4, 1, 4096, schedule="interleaved_1f1b", virtual_stages=2, dp_mode="fsdp")
    assert planner.step_parts(m, inter, prec, off, chip, DEFAULTS.planner).dp_calls == 2 * (4 + 4)
    inter1 = ParallelShape(4, 1, 2, 4, 1, 4096, schedule="interleaved_1f1b", virtual_stages=2, dp_mode="zero1")
    assert planner.step_parts(m, inter1, prec, off, chip, DEFAULTS.planner).dp_calls == 2 * (1 + 1)
