"""Activation memory per rank (bytes), as autograd keeps it in the trainer's model.

What autograd saves in the trainer's model, tensor by tensor and dtype by dtype (:class:`ActBytes`:
residual stream in the parameter dtype, matmuls in the compute dtype, norms and the decomposed
softmax in fp32 when ``precision.fp32_ops`` lists them; dropout masks only when ``model.dropout >
0``, 1 byte on CUDA/NPU), per block (:func:`layer_activation_bytes`: norms, the linears' input (one
cast copy per linear when the residual is wider than the compute dtype), q and K/V at kv-heads
width, the fused kernel's output and log-sum-exp or the decomposed probabilities, the MLP's
d_ff-wide tensors), for the embedding's ids and for the final norm, head input and the fp32
log-softmax of the rank's vocabulary shard (:func:`head_activation_bytes`); autocast's
compute-dtype copies of fp32 weights once per rank (:func:`layer_weight_cast_bytes`). Under tensor
parallelism attention and the MLP are 1/t, the norms and residual masks 1/t only with sequence
parallelism, and the linears' input whole on every rank (replicated; with sequence parallelism
the rank's shard, gathered again in the backward). Full activation checkpointing keeps each
block's input (residual dtype, 1/t with sequence parallelism), plus one block's full set while it
is recomputed.
``tests/test_activation_bytes.py`` measures the tp=1 terms with saved-tensor hooks on CPU (within
5%, to the byte in most cases); ``tests/test_rank_activations.py`` measures the composition per
rank (the peak of what autograd holds through one step of the trainer's own ``RankModel``) on tp2,
tp2 with sequence parallelism, dp2 with DDP and FSDP, every pipeline schedule, tp2pp2, dp2tp2 and
pp4, in fp32, bf16 and fp16 compute: within 0.2%, most to the byte. The recompute peak of
checkpointing is not measured (the checkpoint's own hooks hide it from outer ones). Each rank holds
the activations of its in-flight microbatches: 1 without a pipeline, all m for GPipe, ``min(m, p -
rank)`` for 1F1B, Megatron's interleaved warm-up ``((p - rank - 1) 2 + (v - 1) p + 1) / v`` (for
rank 0, ``p (1 + (p-1)/(p v))``), and ``min(m, p)`` on every rank for ZB-V (Qi et al. 2024: the
same peak as 1F1B); the head and loss once (every microbatch's under GPipe).

A block compiled with Inductor (``trainer.compile``: ``ParallelShape.min_cut``) keeps less:
:func:`fused_layer_activation_bytes`, measured the same way on compiled blocks
(:func:`block_activation_bytes` picks the count).

The loss's own peak (:func:`loss_transient_bytes`): the gradients its backward allocates over
the vocabulary, not saved tensors but on top of them at the step's peak; counted in
``activations`` of the head's rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from orchestrator.planner.shapes import BYTES, ModelShape, ParallelShape, recomputed_layers
from trainers import rules


@dataclass(frozen=True)
class ActBytes:
    """Bytes per element of what the trainer's forward saves, by the trainer's precision rules
    (``trainers/precision.py``, ``trainers/model.py in_dtype``).

    ``residual``: the residual stream, in the parameter dtype (the embedding is no autocast op, and
    the residual adds promote to it). ``linear``: the matmuls' inputs and outputs, autocast's
    compute dtype (the parameter dtype when that is narrower: no autocast widens). ``norm`` and
    ``softmax``: fp32 when listed in ``precision.fp32_ops``, the compute dtype otherwise. ``mask``:
    a dropout mask, 1 byte (``native_dropout``'s bool mask on CUDA and NPU) or, on a CPU, the
    dropped tensor's dtype (its ``input * noise`` fallback). ``param``: the parameter dtype;
    ``weight_casts``: autocast keeps a ``linear``-dtype copy of every fp32 matrix it multiplies."""

    residual: int
    linear: int
    norm: int
    softmax: int
    mask: int
    param: int
    fused_out_copy: bool = False  # the fused kernel's output is (b, heads, s, hd)-major: wo reads a copy
    # torch_npu's fused RMSNorm runs the lean norm on an NPU (trainers/lean_ops.py): the same saved
    # set (the input, gamma, a per-token rstd), one kernel each way (orchestrator/planner/traffic.py)
    npu_kernels: bool = False
    # an Atlas A2-class NPU (the 910B and later): torch_npu's interleaved RoPE kernel and its SwiGLU
    # run there (trainers/rope.py, trainers/lean_ops.py)
    npu_a2: bool = False

    @classmethod
    def of(cls, precision: Any, m: ModelShape, device_type: str = "cuda", a2: bool = False) -> "ActBytes":
        pb, cb = BYTES[precision.param_dtype], BYTES[precision.compute_dtype]
        ops = set(getattr(precision, "fp32_ops", None) or ())
        lin = min(pb, cb)
        return cls(
            residual=pb,
            linear=lin,
            norm=4 if ("layer_norm" if m.layernorm else "rms_norm") in ops else cb,
            softmax=4 if "softmax" in ops else cb,
            mask=lin if device_type == "cpu" else 1,
            param=pb,
            # CUDA's flash and memory-efficient kernels give (b, s, heads, hd)-major output, so
            # wo's input is a view of it; the NPU kernel's BNSD output, and the CPU's for a
            # contiguous (RoPE-rotated) query, are (b, heads, s, hd)-major, so it is a copy
            fused_out_copy=device_type == "npu" or (device_type == "cpu" and not m.learned_pos),
            npu_kernels=device_type == "npu",
            npu_a2=device_type == "npu" and a2,
        )

    @classmethod
    def on(cls, precision: Any, m: ModelShape, chip: Any) -> "ActBytes":
        """:meth:`of` on the chip config ``chip`` (its device type, and whether it is an A2 part)."""
        return cls.of(precision, m, str(chip.device_type), atlas_a2(chip))

    def rope_kernel(self, m: ModelShape, b: int, tp: int) -> bool:
        """Whether torch_npu's RoPE kernel rotates this rank's q and k (``trainers/rope.py``):
        on a part and in the shapes it takes (``trainers.rules.npu_rope``)."""
        return not m.learned_pos and rules.npu_rope(self.npu_a2, b, m.heads // tp, m.d // m.heads)

    @property
    def weight_casts(self) -> bool:
        return self.param > self.linear


def atlas_a2(chip: Any) -> bool:
    """Whether the chip is an Atlas A2-class NPU (the 910B and later, whose torch_npu kernels
    take bf16 and the interleaved RoPE): of the NPU presets, those with bf16 (the 910A has none)."""
    return str(chip.device_type) == "npu" and "bf16" in list(chip.dtypes or ())


def _norm_bytes(m: ModelShape, tokens: float, ab: ActBytes, width: int = 0, given: float = 0.0) -> float:
    """One norm over ``tokens`` rows of ``width`` (a block's: d_model, its input in the residual
    dtype; else an RMSNorm over ``width`` whose input comes in ``given`` bytes): LayerNorm saves its
    input (cast to the norm dtype) and fp32 mean and rstd, plus the weight's and bias's cast where
    the norm dtype is not the parameter dtype; the lean RMSNorm of ``trainers/lean_ops.py`` its
    input as it came and the rsqrt in the norm dtype (the decomposition it replaced kept the input
    cast, ``x * rsqrt(...)`` and the weight's cast too)."""
    n, w = ab.norm, width or m.d
    weight = m.norm_params if not width else width
    if m.layernorm and not width:
        return tokens * w * n + 2 * tokens * 4 + (weight * n if ab.param != n else 0)
    if m.lean:
        return tokens * w * (given or ab.residual) + tokens * n
    return 2 * tokens * w * n + tokens * n + (weight * n if ab.param != n else 0)


def layer_activation_bytes(
    m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes, keep_shard: bool = True
) -> float:
    """Bytes one transformer block saves for its backward, per microbatch and TP rank (the
    activations only: autocast's weight copies are :func:`layer_weight_cast_bytes`).

    Tensor by tensor, as autograd saves them in ``trainers/model.py`` (``tests/test_activation_bytes.py``
    measures them): two norms (:func:`_norm_bytes`, on a 1/t sequence shard with sequence
    parallelism); the linears' input, whole on every TP rank (replicated, or gathered along the
    sequence with sequence parallelism), once when the residual dtype is the compute dtype, else one
    cast copy per linear that reads it (q, k, v; w1 and w3); q, and k and v at kv-heads width; the
    fused kernel's output and fp32 log-sum-exp, or the decomposed path's probabilities (softmax
    dtype, plus their compute-dtype copy) and causal mask; the attention output's reshaped copy for
    wo; the MLP's d_ff-wide tensors (2 for GELU, 4 for SwiGLU); with dropout > 0 the masks of the
    two residual branches (and of the probabilities, decomposed) and the dropped probabilities; RoPE's
    cos/sin tables cast to a 16-bit compute dtype (``ActBytes.fused_out_copy``: whether wo reads a
    copy of the fused kernel's output). Everything inside attention and the MLP is 1/t. RMSNorm
    and SwiGLU are ``trainers/lean_ops.py``'s. With sequence parallelism each sub-layer's input is
    cast to the compute dtype before its gather and kept as the rank's shard, gathered again in the
    backward (``trainers/sp_regather.py``); whole where that is off (``keep_shard`` false: a
    compiled block, or one recomputing from its input)."""
    T = seq * b
    u = tp if sp else 1
    lin, hd = ab.linear, m.d // m.heads
    heads, kv_w = m.heads / tp, m.kv_heads * hd / tp
    casts = ab.residual != lin  # the norm's output is cast anew by each linear that reads it
    out = 2 * _norm_bytes(m, T / u, ab)
    if sp:  # attention's and the MLP's input, one compute-dtype copy each
        out += 2 * T * m.d * lin / (tp if keep_shard else 1)
    else:
        out += (3 if casts else 1) * T * m.d * lin  # attention's input
        out += ((2 if m.swiglu else 1) if casts else 1) * T * m.d * lin  # the MLP's input
    out += T * (heads * hd + 2 * kv_w) * lin  # q, k, v
    out += qk_norm_bytes(m, T, tp, ab)
    drop = m.dropout > 0
    if m.fused_attention:
        out += T * heads * hd * lin + b * heads * seq * 4  # the kernel's output and log-sum-exp
        out += T * heads * hd * lin if ab.fused_out_copy else 0.0  # wo's input, a copy of it
    else:
        e = b * heads * seq * seq
        out += T * heads * hd * lin  # wo's input: the (b, heads, s, hd) product reshaped, a copy
        out += e * ab.softmax + seq * seq  # probabilities, the causal mask
        if drop:
            out += e * (ab.mask + lin)  # the mask and the dropped probabilities
        elif ab.softmax != lin:
            out += e * lin  # the probabilities' compute-dtype copy
    out += _rope_bytes(m, seq, b, tp, ab)
    # GELU: its input and output; the lean SwiGLU: w1's and w3's outputs and their product
    out += (2 if not m.swiglu else 3 if m.lean else 4) * T * m.d_ff / tp * lin
    if drop:
        out += 2 * T / u * m.d * ab.mask  # the residual branches' masks
    return out


def qk_norm_bytes(m: ModelShape, tokens: float, tp: int, ab: ActBytes) -> float:
    """Qwen3's per-head norms of q and k (``model.family=qwen3``), over this rank's heads: the lean
    RMSNorm keeps the projection's output as it came and one rsqrt a head and token; autograd's
    decomposition keeps the cast input, its product with the rsqrt, the rsqrt and the weight's cast."""
    if not m.qk_norm:
        return 0.0
    hd = m.d // m.heads
    # one norm over (token, head) rows of q, one of k, each taking the projection's output
    return sum(_norm_bytes(m, tokens * h / tp, ab, hd, ab.linear) for h in (m.heads, m.kv_heads))


def core_activation_bytes(m: ModelShape, seq: int, b: int, tp: int, ab: ActBytes) -> float:
    """Of :func:`layer_activation_bytes`, what the attention core saves beyond its inputs q, k
    and v: what selective recomputation (``model.recompute_granularity=selective``, the core
    under ``torch.utils.checkpoint``) does not keep. The fused kernel's log-sum-exp, and its
    output where wo reads a copy of it (else the output is wo's saved input); the decomposed
    path's probabilities, causal mask and their dropout mask and dropped copy, or compute-dtype
    copy; RoPE's cast tables. Measured: ``tests/test_activation_bytes.py``, to the byte on the
    knob cases."""
    lin, hd, heads = ab.linear, m.d // m.heads, m.heads / tp
    T = seq * b
    if m.fused_attention:
        out = b * heads * seq * 4 + (T * heads * hd * lin if ab.fused_out_copy else 0.0)
    else:
        e = b * heads * seq * seq
        out = e * ab.softmax + seq * seq
        if m.dropout > 0:
            out += e * (ab.mask + lin)
        elif ab.softmax != lin:
            out += e * lin
    return out + _rope_bytes(m, seq, b, tp, ab)


def _rope_bytes(m: ModelShape, seq: int, b: int, tp: int, ab: ActBytes) -> float:
    """What RoPE keeps: the decomposition its cos and sin cast to a 16-bit compute dtype, for q
    and for k; torch_npu's kernel its input (this rank's q and k before the rotation, a copy beside
    the rotated ones attention keeps) and its two pair-repeated tables in the compute dtype."""
    hd = m.d // m.heads
    if m.learned_pos:
        return 0.0
    if ab.rope_kernel(m, b, tp):
        qk = seq * b * (m.heads + m.kv_heads) * hd / tp
        return (qk + 2 * seq * hd) * ab.linear
    return 2 * seq * hd * ab.linear if ab.linear != 4 else 0.0


def fused_layer_activation_bytes(m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes) -> float:
    """What one block saves compiled (``trainer.compile``: Inductor's min-cut partition of the
    block's joint graph, which saves the matmuls' inputs and outputs and recomputes the elementwise
    work between them in the backward), per microbatch and TP rank; as
    :func:`layer_activation_bytes`, the activations only.

    Measured with the same hooks in ``tests/test_activation_bytes.py`` (the CompiledFunction saves
    through autograd): the block's input once (residual dtype), each norm's statistics (the
    normalised values are recomputed from the input), each norm's output once as the linears'
    input (one compute-dtype copy, however many linears read it), wo's output (the residual after
    attention is recomputed from it), q and K/V at kv-heads width, the fused kernel's output and
    log-sum-exp (and wo's input copy where :attr:`ActBytes.fused_out_copy`), or, decomposed, the
    probabilities once in the compute dtype, two when they also need a recompute (fp32 softmax
    over a narrower compute dtype: the scores and the cast probabilities, with the softmax's
    per-row max and sum; dropout: the dropped ones too); the MLP's d_ff-wide tensors (2 for GELU,
    3 for SwiGLU: SiLU is recomputed); RoPE's cos and sin cast once; dropout masks as 1-byte
    bools (Inductor draws them itself, on a CPU as well)."""
    T = seq * b
    u = tp if sp else 1
    lin, hd = ab.linear, m.d // m.heads
    heads, kv_w = m.heads / tp, m.kv_heads * hd / tp
    q_w = heads * hd
    out = T / u * m.d * ab.residual  # the block's input
    out += 2 * (2 if m.layernorm else 1) * T / u * ab.norm  # mean and rstd, or rstd
    out += 2 * T * m.d * lin  # the norms' outputs, whole on every TP rank
    out += T / u * m.d * lin  # wo's output
    out += T * (q_w + 2 * kv_w) * lin  # q, k, v
    if m.qk_norm:  # Qwen3's per-head norms: their statistics, as the block norms' (not yet measured)
        out += T * (m.heads + m.kv_heads) / tp * ab.norm
    drop = m.dropout > 0
    if m.fused_attention:
        out += T * q_w * lin + b * heads * seq * 4
        out += T * q_w * lin if ab.fused_out_copy else 0.0
    else:
        e = b * heads * seq * seq
        out += T * q_w * lin + seq * seq  # wo's input (a copy), the causal mask
        recompute = ab.softmax != lin
        if drop or recompute:
            out += 2 * e * lin + (e if drop else 0.0) + (2 * b * heads * seq * ab.softmax if recompute else 0.0)
        else:
            out += e * lin
    if not m.learned_pos and lin != 4:
        out += seq * hd * lin
    out += (3 if m.swiglu else 2) * T * m.d_ff / tp * lin
    if drop:
        out += 2 * T / u * m.d
    return out


def layer_weight_cast_bytes(m: ModelShape, tp: int, ab: ActBytes) -> float:
    """Autocast's compute-dtype copies of one block's fp32 matrices (kept while autocast's context
    lasts, for the backward): none unless the parameters are wider than the compute dtype."""
    return m.layer_sharded / tp * ab.linear if ab.weight_casts else 0.0


def checkpointed_layer_bytes(m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes) -> float:
    """Full recomputation (``torch.utils.checkpoint``, non-reentrant) keeps only each block's
    input, in the residual dtype (a 1/t sequence shard with sequence parallelism)."""
    return seq * b * m.d * ab.residual / (tp if sp else 1)


def embedding_activation_bytes(m: ModelShape, seq: int, b: int) -> float:
    """The embedding saves its int64 token ids (and the learned positions' int64 indices)."""
    return 8 * seq * b + (8 * seq if m.learned_pos else 0)


def head_activation_bytes(m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes) -> float:
    """The final norm, the head's input (whole on every TP rank), the fp32 log-softmax of this
    rank's vocabulary shard, and the int64 targets (with TP the vocab-parallel loss's bool mask;
    without, ``nll_loss``'s 4-byte total weight): ``bench/saved_activations.py``'s formula."""
    T = seq * b
    if m.loss_chunks > 1:
        # the chunks' checkpoints keep the head's input as this rank holds it (its part of the
        # sequence under sequence parallelism, in the compute dtype) and each chunk's targets
        # (trainers/head_loss.py)
        part = T / (tp if sp else 1)
        return _norm_bytes(m, part, ab) + part * m.d * ab.linear + 8 * T
    loss = 4 * T * -(-m.vocab // tp) + (9 * T if tp > 1 else 8 * T + 4)
    return _norm_bytes(m, T / (tp if sp else 1), ab) + T * m.d * ab.linear + loss


def loss_transient_bytes(m: ModelShape, seq: int, b: int, tp: int, ab: ActBytes, pipelined: bool = False) -> float:
    """What the loss allocates beyond what it saves, at its own peak, over the rank's vocabulary
    shard of ``T = b * seq`` tokens: the plain cross-entropy's backward holds the fp32 gradient
    of its log-softmax output (``nll_loss``'s, dense) beside the fp32 gradient it makes of the
    logits (8 bytes a logit; the forward's head output and its fp32 copy, 6, are fewer); the
    vocab-parallel loss computes its gradient in place on the saved softmax, so its peak is in
    the forward, where the head's output and its fp32 copy (one tensor when the output is fp32)
    stand beside the softmax being built. Not saved tensors, so not in
    :func:`rank_activation_bytes`; measured with every other allocation of a step in
    ``tests/test_step_peak.py``; on an H200 (``bench/device_check.py``, docs/benchmarks.md) the
    plan's allocator-side terms were 3.99 GiB (gpt2_small) and 7.96 GiB (llama_1b) under the
    allocator's peak without it, and 0.99 and 1.02 of it with it. Under a pipeline
    (``pipelined``) torch's last stage keeps its output, the head's logits, for the backward
    (``fwd_cache``), where the trainer's own loop drops them before it: they stand beside the
    plain loss's backward peak (measured on pp2's last stage, ``tests/test_step_peak.py``)."""
    logits = b * seq * -(-m.vocab // tp)
    if m.loss_chunks > 1:
        # one chunk's, in its backward, and the head's weight gradient that chunk makes before
        # autograd adds it into the others' (in the compute dtype: the chunks share autocast's
        # one cast of the weight, whose backward casts the sum once); and that cast, made again
        # by the chunk's recompute (inside the checkpoint, so not among the saved activations)
        chunk = chunked_loss_transient_bytes(tp, ab) * logits / m.loss_chunks
        return chunk + -(-m.vocab // tp) * m.d * ab.linear + head_weight_cast_bytes(m, tp, ab)
    if tp == 1:
        return (8.0 + (ab.linear if pipelined else 0)) * logits
    return (4.0 + (ab.linear if ab.linear < 4 else 0)) * logits


def chunked_loss_transient_bytes(tp: int, ab: ActBytes) -> float:
    """Bytes a logit of one chunk of ``model.loss_chunks`` at the chunk's backward: the recomputed
    fp32 log-softmax (or the vocab-parallel softmax) and the gradients made over it. Measured
    (``tests/test_step_peak.py``): 16 for the plain loss in fp32, 12 for the vocab-parallel one
    under bf16 autocast (its fp32 softmax, the bf16 logits and their gradient's cast)."""
    return 16.0 if tp == 1 else 8.0 + 2.0 * ab.linear


def head_weight_cast_bytes(m: ModelShape, tp: int, ab: ActBytes) -> float:
    return m.vocab * m.d / tp * ab.linear if ab.weight_casts else 0.0


def inflight_microbatches(s: ParallelShape, rank: int) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak, in units of the rank's
    whole share of layers."""
    if s.pp == 1:
        return 1.0
    if s.schedule == "gpipe":
        return float(s.microbatches)
    if s.schedule == "interleaved_1f1b":
        v = s.virtual_stages
        chunk_mbs = min(s.microbatches * v, (s.pp - rank - 1) * 2 + (v - 1) * s.pp + 1)
        return chunk_mbs / v
    if s.schedule == "zbv":
        return float(min(s.microbatches, s.pp))
    return float(min(s.microbatches, s.pp - rank))


def block_activation_bytes(m: ModelShape, s: ParallelShape, ab: ActBytes, recomputing: bool = False) -> float:
    """One block's activations per microbatch, by how the trial runs it: compiled with Inductor
    (:func:`fused_layer_activation_bytes`), else as eager mode keeps them (``aot_eager`` and
    TorchAir too: ``trainers.rules``); ``recomputing``: while a block is recomputed from its input
    (the sequence-parallel input kept whole)."""
    if s.min_cut:
        return fused_layer_activation_bytes(m, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, ab)
    # a compiled block traces the decomposition, not the lean functions (trainers/lean_ops.py)
    block = dataclasses.replace(m, lean=False) if m.lean and s.compiled else m
    keep = not (s.compiled or recomputing)
    return layer_activation_bytes(block, s.seq_len, s.micro_batch, s.tp, s.sequence_parallel, ab, keep)


def rank_activation_bytes(m: ModelShape, s: ParallelShape, rc: Any, rank: int, ab: ActBytes) -> float:
    """Activation bytes pipeline rank ``rank`` (holding ``rc``) keeps at its peak: its in-flight
    microbatches' blocks (a recomputing block keeps its input only, or under selective
    recomputation all but its attention core, and one block's full set, or core, lives while it
    is recomputed), the embedding's ids, the head and loss (every microbatch's under GPipe, else
    one), and autocast's weight copies once (one block's only where every block recomputes from
    its input without a pipeline: each forward's autocast context closes before its backward)."""
    seq, b, tp, sp = s.seq_len, s.micro_batch, s.tp, s.sequence_parallel
    layers = len(rc.layers)
    rec = recomputed_layers(m, s, rc)
    full = block_activation_bytes(m, s, ab)
    if m.selective:
        core = core_activation_bytes(m, seq, b, tp, ab)
        kept, transient = full - core, core
    else:
        kept, transient = checkpointed_layer_bytes(m, seq, b, tp, sp, ab), block_activation_bytes(m, s, ab, True)
    k = inflight_microbatches(s, rank)
    act = k * ((layers - rec) * full + rec * kept) + (transient if rec else 0.0)
    cast_layers = layers - rec + min(rec, 1) if m.full_recompute and s.pp == 1 else layers
    act += cast_layers * layer_weight_cast_bytes(m, tp, ab)
    if rc.embedding:
        act += k * embedding_activation_bytes(m, seq, b)
    if rc.head:
        head_k = s.microbatches if s.pp > 1 and s.schedule == "gpipe" else 1
        act += head_k * head_activation_bytes(m, seq, b, tp, sp, ab)
        if m.loss_chunks <= 1:  # the chunks cast the weight inside their checkpoints: a transient
            act += head_weight_cast_bytes(m, tp, ab)
    return act
