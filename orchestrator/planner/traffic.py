"""Memory traffic per step (bytes), what the trainer's operators other than its matmuls read and
write, and the seconds it takes at the chip's memory bandwidth.

A transformer layer's matmuls are bound by the chip's arithmetic; its norms, activations,
residual adds, RoPE, dropout, casts and (decomposed attention) its scaled, masked softmax are
bound by its memory: each reads and writes whole activation tensors and does a few operations an
element. Their time is bytes / bandwidth (Williams et al. 2009, "Roofline"), and it does not
shrink with the hidden size as the matmuls' share grows: at GPT-2's widths it is a third or more
of a layer's time, at 20k wide a few percent (``bench/published_throughput.py``).

Counted tensor by tensor, as :mod:`orchestrator.planner.activations` counts what autograd saves,
in units of "passes" (one read or one write of a whole tensor), forward and backward:

- eager (each operator its own kernel: ``trainer.compile=false``, or a backend that runs the
  captured graph's operators one by one, ``aot_eager``, the NPU's ``auto``): the trainer's operators as
  they dispatch (``trainers/model.py``): residual adds 3 passes forward and their gradient sums 3
  backward; LayerNorm 2 + 3, the lean RMSNorm (``trainers/lean_ops.py``) 22;
  GELU 2 + 3 of the d_ff-wide tensor, the lean SwiGLU 5 + 13; RoPE 26.5 of each rotated tensor (slices,
  products, a stack and their gradients); the sums of the gradients of a tensor several linears
  read; autocast's casts (the norm's input and output when its dtype is not the residual's, each
  linear's input when the residual is wider than the compute dtype, and the weights' copies);
  decomposed attention's scale, causal mask and softmax (13 passes of the ``b x heads x s x s``
  scores) and the operands of its four backward and two forward batched matmuls (those are
  memory-bound at a head width below the chip's FLOP-per-byte ratio, 96-128 against A100's 153);
  dropout (``native_dropout``: 2 passes and a 1-byte mask each way; a CPU's fallback draws the
  mask in the dropped tensor's dtype, 9 passes). ``tests/test_memory_traffic.py`` counts the
  trainer's own operators with a dispatch mode, knob by knob, on a CPU: within 7%. On an NPU,
  torch_npu's kernels where the trainer calls them: RMSNorm 5, and on an A2 part RoPE 7 and SwiGLU
  16 (read from op-plugin, not measured: ``tests/test_npu_kernels.py``, ``tests/test_npu_rope.py``).
- fused (``trainer.compile=true`` with a fusing backend, ``trainers.rules.FUSING_BACKENDS``:
  Inductor, TorchAir; or a framework's hand-fused kernels such as Megatron-LM's):
  every elementwise chain between two matmuls is one kernel that reads its inputs and writes its
  outputs once: forward the norm (read x, write its output), RoPE (q and k read and written), the
  residual add fused with the next norm, the MLP's activation (reads the up projections, writes
  one), the decomposed softmax (read the scores, write the probabilities, and the dropped ones);
  backward about twice the forward's passes (each kernel reads the incoming gradient and what it
  saved, writes one gradient). An estimate of what a graph compiler can reach, not a measurement:
  inductor's own byte count (``torch._inductor.metrics.num_bytes_accessed``) is kept for its GPU
  kernels only, and none runs here.

Under tensor parallelism attention and the MLP are 1/t, the norms and residual adds 1/t only with
sequence parallelism, the sums of the linears' input gradients whole (as
:func:`activations.layer_activation_bytes` counts the linears' input). Activation checkpointing
runs the forward twice (a forward is about a third of a layer's passes).
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from orchestrator.planner.activations import ActBytes
from orchestrator.planner.shapes import ModelShape, ParallelShape, work_factor

# trainers/lean_ops.py RMSNorm: pow, mean, rsqrt, two products; its backward's products, mean and
# sums (measured in a block by tests/test_memory_traffic.py's dispatch count: about 22); the
# decomposition (model.lean_ops=false, and compiled blocks run eagerly): seven elementwise
# products and a mean and their gradients, 31
RMSNORM_PASSES, RMSNORM_DECOMPOSED_PASSES = 22.0, 31.0
# torch_npu.npu_rms_norm on an NPU: read x, write y; its backward reads dy and x, writes dx (in
# the residual stream's dtype: the kernel takes it as it comes, no casts around it)
RMSNORM_NPU_PASSES = 5.0
LAYERNORM_PASSES = 5.0  # native_layer_norm: read x, write y; backward read dy and x, write dx
ROPE_PASSES = 26.5  # apply_rope: four half-width products, a sum, a difference, a stack; gradients
# torch_npu.npu_rotary_mul (trainers/rope.py): read x, write y; its backward reads dy and x, writes
# dx; the (b, s, heads, hd)-major q or k made contiguous first (aclnn's Contiguous: read, write).
# Read from op-plugin's kernel and derivative, not measured (no NPU here)
ROPE_NPU_PASSES = 7.0
# of one d_ff-wide tensor, forward and backward (the lean SwiGLU recomputes silu: 5 + 13; the
# decomposition 14)
GELU_PASSES, SWIGLU_PASSES, SWIGLU_DECOMPOSED_PASSES = 5.0, 18.0, 14.0
# torch_npu.npu_swiglu on an A2 part (trainers/lean_ops.py): w1's and w3's outputs concatenated
# (read 2, write 2), the kernel (read 2, write 1; backward read 1 + 2, write 2), the gradient's
# halves made contiguous for the two linears' backward (read 2, write 2). Read, not measured
SWIGLU_NPU_PASSES = 16.0
SOFTMAX_PASSES = 13.0  # decomposed: scale 2+2, masked_fill 2+2, softmax 2+3, of the scores
ATTN_BMM_SCORE_PASSES = 6.0  # the batched matmuls' score-sized operands: forward 2, backward 4


def _dropout_passes(ab: ActBytes, cpu: bool) -> float:
    """Bytes a dropped element costs forward and backward, per byte of the dropped tensor's
    dtype: ``native_dropout`` reads x, writes y and a 1-byte mask, and its backward reads the
    gradient and the mask and writes one; a CPU's fallback (bernoulli into a tensor of the input's
    dtype, scaled in place, then a product each way) 9 passes."""
    return 9.0 if cpu else 4.0 + 2.0 * ab.mask / ab.linear


def _widths(m: ModelShape, seq: int, b: int, tp: int, sp: bool):
    """Tokens of a micro-batch, one TP rank's q, k/v and d_ff widths, and the tokens x d_model of
    a whole residual tensor and of this rank's (a 1/t sequence shard with sequence parallelism)."""
    T = float(seq * b)
    hd = m.d // m.heads
    return T, m.heads * hd / tp, m.kv_heads * hd / tp, m.d_ff / tp, T * m.d, T * m.d / (tp if sp else 1)


def _npu_rms_norm(m: ModelShape, tp: int, sp: bool, ab: ActBytes) -> bool:
    """Whether the NPU's fused RMSNorm runs a norm, as the trainer calls it: the lean norm on
    plain tensors (a sequence-parallel norm's are DTensors: ``trainers/lean_ops.py
    npu_rms_norm_takes``)."""
    return ab.npu_kernels and m.lean and not m.layernorm and not (sp and tp > 1)


def _mlp_passes(m: ModelShape, ab: ActBytes) -> float:
    """Passes of one d_ff-wide tensor the eager MLP's activation makes, forward and backward."""
    if not m.swiglu:
        return GELU_PASSES
    if not m.lean:
        return SWIGLU_DECOMPOSED_PASSES
    return SWIGLU_NPU_PASSES if ab.npu_a2 else SWIGLU_PASSES


def _norm_traffic(elements: float, given: float, nb: float, passes: float) -> float:
    """A norm over ``elements`` whose input comes in ``given`` bytes and which runs in ``nb``: its
    passes, and where the dtypes differ in_dtype's casts (the input to the norm's dtype and the
    output back, each way)."""
    return passes * elements * nb + (4.0 * elements * (given + nb) if nb != given else 0.0)


def _eager(m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes, cpu: bool) -> float:
    T, q_w, kv_w, f, td, tdu = _widths(m, seq, b, tp, sp)
    r, lin, nb = ab.residual, ab.linear, ab.norm
    readers = 3 + (2 if m.swiglu else 1)  # linears reading a norm's output: q, k, v; w1 (and w3)
    out = 12.0 * tdu * r  # two residual adds and the two gradient sums of the residual stream
    out += (readers - 2) * 3.0 * td * r  # the gradients of a norm's output summed over its readers
    rms = RMSNORM_PASSES if m.lean else RMSNORM_DECOMPOSED_PASSES
    if _npu_rms_norm(m, tp, sp, ab):
        out += 2 * RMSNORM_NPU_PASSES * tdu * r
    else:
        out += 2 * _norm_traffic(tdu, r, nb, LAYERNORM_PASSES if m.layernorm else rms)
    if m.qk_norm:  # Qwen3's per-head norms of q and k, as the block's (the NPU kernel on plain tensors: tp 1)
        qk = T * (q_w + kv_w)
        if ab.npu_kernels and m.lean and tp == 1:
            out += RMSNORM_NPU_PASSES * qk * lin
        else:
            out += _norm_traffic(qk, lin, nb, rms)
    if r != lin and sp:  # each sub-layer's shard cast once before its gather (trainers/sp_regather.py)
        out += 2 * 2.0 * tdu * (r + lin)
    elif r != lin:  # autocast: each linear casts its input, and its gradient back
        out += readers * 2.0 * td * (r + lin)
    if ab.weight_casts:  # autocast's copies of the block's fp32 matrices and their gradients' casts
        out += 2.0 * m.layer_sharded / tp * (ab.param + lin)
    out += _mlp_passes(m, ab) * T * f * lin
    if not m.learned_pos:
        out += (ROPE_NPU_PASSES if ab.rope_kernel(m, b, tp) else ROPE_PASSES) * T * (q_w + kv_w) * lin
    drop = _dropout_passes(ab, cpu) if m.dropout > 0 else 0.0
    out += 2 * drop * tdu * lin  # the two residual branches' dropout
    if m.fused_attention:
        out += 4.0 * T * q_w * lin if ab.fused_out_copy else 0.0  # wo's input copied, and its gradient
        return out
    e = b * (m.heads / tp) * seq * seq
    out += SOFTMAX_PASSES * e * lin + (4.0 * e * (ab.softmax + lin) if ab.softmax != lin else 0.0)
    out += ATTN_BMM_SCORE_PASSES * e * lin + 6.0 * T * (q_w + kv_w) * lin  # the batched matmuls' operands
    out += drop * e * lin
    out += 16.0 * T * q_w * lin  # q regrouped, the output reshaped for wo, and their gradients: copies
    return out


def _fused(m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes) -> float:
    T, q_w, kv_w, f, td, tdu = _widths(m, seq, b, tp, sp)
    r, lin = ab.residual, ab.linear
    mask = ab.mask if m.dropout > 0 else 0
    readers = 3 + (2 if m.swiglu else 1)
    # forward: two residual adds, each fused with the norm after it (read x and the branch,
    # write x and the normalised copy), the branches' dropout masks written; the activation
    # reads the up projection(s) and writes one; RoPE reads and writes q and k
    out = 2 * tdu * (2 * r + 2 * lin + mask)
    out += T * f * lin * (3 if m.swiglu else 2)
    # backward: each norm reads the gradients its readers made, its saved input and the residual
    # gradient, and writes one; the activation reads its gradient and inputs and writes theirs
    out += tdu * 6 * r + readers * td * lin + 2 * tdu * mask
    out += T * f * lin * (5 if m.swiglu else 3)
    if not m.learned_pos:
        out += 4 * T * (q_w + kv_w) * lin
    if not m.fused_attention:
        e = b * (m.heads / tp) * seq * seq
        # forward: scores written by their matmul, scaled, masked and normalised in one pass,
        # the (dropped) probabilities read by the next; backward: the probabilities' gradient
        # written, the probabilities read, the softmax's gradient written and read twice
        out += e * (10 * lin + (2 * lin + 2 * mask if mask else 0))
        out += 6.0 * T * (q_w + kv_w) * lin  # the batched matmuls' q, k, v-wide operands
    return out


def layer_traffic_bytes(
    m: ModelShape, seq: int, b: int, tp: int, sp: bool, ab: ActBytes, fused: bool = False, cpu: bool = False
) -> float:
    """Bytes one transformer block's non-matmul operators read and write, forward and backward,
    per micro-batch and TP rank (one forward: :func:`memory_seconds` adds checkpointing's
    recomputed one)."""
    return _fused(m, seq, b, tp, sp, ab) if fused else _eager(m, seq, b, tp, sp, ab, cpu)


def head_traffic_bytes(
    m: ModelShape, seq: int, b: int, tp: int, ab: ActBytes, fused: bool = False, sp: bool = False
) -> float:
    """The final norm, the head's casts and the loss over this rank's vocabulary shard, forward
    and backward. Eager: ``cross_entropy`` on fp32 logits is 32 bytes a logit (log-softmax 8,
    the dense gradient ``nll_loss`` makes 4, the log-softmax's gradient 12, and their reads), 12
    more for the cast to fp32 and back when the head computes narrower, and the forward's 8 (and
    6) again with ``model.loss_chunks``; fused: the logits read and their gradient written."""
    T = float(seq * b)
    td = T * m.d
    logits = T * -(-m.vocab // tp)
    if fused:
        return 2.0 * logits * ab.linear + td * (3 * ab.residual + 3 * ab.linear)
    # the lean RMSNorm's input gradient is written whole here, where a block's is summed into the
    # residual stream's (counted there): 4 passes more (measured: 4.1 fp32, 5.7 bf16)
    rms = RMSNORM_PASSES + 4.0 if m.lean else RMSNORM_DECOMPOSED_PASSES
    if _npu_rms_norm(m, tp, sp, ab):
        out = RMSNORM_NPU_PASSES * td * ab.residual
    else:
        out = (LAYERNORM_PASSES if m.layernorm else rms) * td * ab.norm
        out += 4.0 * td * (ab.residual + ab.norm) if ab.norm != ab.residual else 0.0
    out += 2.0 * td * (ab.residual + ab.linear) if ab.residual != ab.linear else 0.0
    out += 2.0 * m.vocab / tp * m.d * (ab.param + ab.linear) if ab.weight_casts else 0.0
    per_logit = 32.0 + (12.0 if ab.linear != 4 else 0.0)
    if m.loss_chunks > 1:
        out += _chunks_extra(m, T, tp, ab)
        # each chunk's forward again in its backward: the log-softmax, the loss's read and the cast
        # (in fp32, a copy)
        per_logit += 12.0 + (6.0 if ab.linear != 4 else 8.0)
    return out + logits * per_logit


def _chunks_extra(m: ModelShape, tokens: float, tp: int, ab: ActBytes) -> float:
    """What ``model.loss_chunks`` adds beside the logits: each chunk after the first makes a head
    weight gradient that autograd adds into the others' (read twice, written once, in the
    compute dtype: the chunks share autocast's one cast of the weight, whose backward casts the
    sum once); each chunk's recompute casts the weight to the compute dtype again; the split's
    backward concatenates the chunks' input gradients (compute dtype)."""
    c, weight = m.loss_chunks, -(-m.vocab // tp) * m.d
    out = (c - 1) * weight * 3.0 * ab.linear + 2.0 * tokens * m.d * ab.linear
    if ab.weight_casts:
        out += c * weight * (ab.param + ab.linear)
    return out


def memory_seconds(
    m: ModelShape, s: ParallelShape, precision: DictConfig, chip: DictConfig, planner: DictConfig
) -> float:
    """Seconds a rank's non-matmul operators spend on memory traffic per step (a replica's layers
    and head spread over its pipeline ranks, as the compute is: :mod:`traffic`), at the chip's
    ``hbm_gbps`` x ``planner.memory_efficiency``; 0 where the chip gives no bandwidth."""
    gbps = float(chip.hbm_gbps or 0.0)
    if gbps <= 0:
        return 0.0
    ab = ActBytes.on(precision, m, chip)
    args = (m, s.seq_len, s.micro_batch, s.tp)
    # a compiled block traces the decomposition, not the lean functions (trainers/lean_ops.py)
    block = dataclasses.replace(m, lean=m.lean and not s.compiled)
    layer = layer_traffic_bytes(block, *args[1:], s.sequence_parallel, ab, s.fused, chip.device_type == "cpu")
    per_mb = m.layers * layer * work_factor(m, s) + head_traffic_bytes(*args, ab, s.fused, s.sequence_parallel)
    return per_mb * s.microbatches / s.pp / (gbps * 1e9 * float(planner.memory_efficiency))
