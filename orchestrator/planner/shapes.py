"""What the planner plans over: the model's sizes, one layout, and which parameter tensors each
rank of that layout holds.

The layout rules are the trainer's own (``trainers/rules.py``): the data-parallel wrapping
(:func:`rules.dp_wrapping`), how a replica's batch is cut (:func:`rules.batch_split`), which
stages, layers and model ends a pipeline rank holds (:func:`rules.rank_stages`). Nothing here
restates them.

The parameter tensors are those ``trainers/model.py`` builds (no biases; LayerNorm has a weight
and a bias, RMSNorm a weight), with the dimension ``trainers/parallel.py apply_tp`` shards:
q/k/v and the MLP's first projections column-parallel (a ``nn.Linear`` weight is (out, in), so
dim 0), the output projections row-parallel (dim 1), the token embedding vocabulary-parallel
(dim 0), the head over the vocabulary (dim 0); norms and learned positions stay whole. A
DTensor shard and an FSDP2 shard are cut as ``torch.chunk`` cuts (the first pieces one larger
when the size does not divide; FSDP2 chunks dim 0 of the TP-local tensor), so the element
count of every rank is exact, not an average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from trainers import rules
from trainers.rules import Layout

GiB = 2**30
MiB = 2**20
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a GPT-style decoder that memory and FLOPs depend on (model config section)."""

    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    max_seq_len: int
    swiglu: bool
    layernorm: bool
    learned_pos: bool
    tied: bool
    fused_attention: bool
    checkpointing: bool
    dropout: float = 0.0  # attention-probability and residual dropout (model.dropout)
    selective: bool = False  # model.recompute_granularity=selective: the attention core only
    recompute_layers: int = -1  # model.recompute_layers: the first N blocks of each stage chunk
    lean: bool = True  # model.lean_ops: RMSNorm and SwiGLU keep what their backward needs
    loss_chunks: int = 1  # model.loss_chunks: the head and loss over sequence chunks, recomputed
    qkv_bias: bool = False  # model.family=qwen2: q, k and v projections with biases
    qk_norm: bool = False  # model.family=qwen3: each q and k head RMS-normalised (one weight each)

    @classmethod
    def of(cls, model: DictConfig | Dict[str, Any]) -> "ModelShape":
        return cls(
            vocab=int(model["vocab_size"]),
            d=int(model["d_model"]),
            layers=int(model["n_layers"]),
            heads=int(model["n_heads"]),
            kv_heads=rules.kv_heads(model["n_heads"], model["n_kv_heads"]),
            d_ff=int(model["d_ff"]),
            max_seq_len=int(model["max_seq_len"]),
            swiglu=model["mlp"] == "swiglu",
            layernorm=model["norm"] == "layernorm",
            learned_pos=model["pos_emb"] == "learned",
            tied=bool(model["tie_embeddings"]),
            fused_attention=model["attn_impl"] in ("fused", "npu_fused"),
            checkpointing=bool(model["activation_checkpointing"]),
            dropout=float(model["dropout"]),
            selective=str(model.get("recompute_granularity", "full")) == "selective",
            recompute_layers=int(model.get("recompute_layers", -1)),
            lean=bool(model.get("lean_ops", True)),
            loss_chunks=int(model.get("loss_chunks", 1)),
            qkv_bias=rules.qkv_bias(str(model.get("family", "llama"))),
            qk_norm=rules.qk_norm(str(model.get("family", "llama"))),
        )

    @property
    def full_recompute(self) -> bool:
        return self.checkpointing and not self.selective

    def recomputed(self, layers: int) -> int:
        """Blocks of a stage chunk of ``layers`` that recompute (the trainer's rule,
        ``trainers/model.py GPT.forward``: the first ``recompute_layers``, or all)."""
        if not self.checkpointing:
            return 0
        return layers if self.recompute_layers < 0 else min(self.recompute_layers, layers)

    @property
    def layer_matrices(self) -> List[Tuple[int, int]]:
        """Weight matrices of one block (no biases, as trainers/model.py): wq wk wv wo w1 w2 (w3)."""
        kv_dim = self.kv_heads * (self.d // self.heads)
        mats = [
            (self.d, self.d),
            (self.d, kv_dim),
            (self.d, kv_dim),
            (self.d, self.d),
            (self.d, self.d_ff),
            (self.d_ff, self.d),
        ]
        return mats + ([(self.d, self.d_ff)] if self.swiglu else [])

    @property
    def layer_sharded(self) -> int:  # split by tensor parallelism: the matrices and q/k/v biases
        return sum(a * b for a, b in self.layer_matrices) + self.qkv_bias_params

    @property
    def qkv_bias_params(self) -> int:
        return self.d + 2 * self.kv_heads * (self.d // self.heads) if self.qkv_bias else 0

    @property
    def norm_params(self) -> int:
        return 2 * self.d if self.layernorm else self.d

    @property
    def layer_replicated(self) -> int:  # two norms per block (and Qwen3's q/k norms), replicated across TP ranks
        return 2 * self.norm_params + (2 * (self.d // self.heads) if self.qk_norm else 0)

    @property
    def embedding(self) -> int:
        return self.vocab * self.d

    @property
    def positions(self) -> int:
        return self.max_seq_len * self.d if self.learned_pos else 0

    @property
    def n_params(self) -> int:
        """All parameters, a tied head counted once (trainers.model.count_params)."""
        head = 0 if self.tied else self.embedding
        return (
            self.embedding
            + self.positions
            + self.layers * (self.layer_sharded + self.layer_replicated)
            + self.norm_params
            + head
        )

    def matrices(self) -> List[Tuple[int, int]]:
        """Every 2-D parameter of the model (for PowerSGD's compressed size)."""
        mats = self.layer_matrices * self.layers + [(self.vocab, self.d)]
        mats += [(self.max_seq_len, self.d)] if self.learned_pos else []
        return mats + ([] if self.tied else [(self.vocab, self.d)])


@dataclass(frozen=True)
class ParallelShape:
    """One layout and how each replica's batch is cut (parallel and trainer sections).

    With a pipeline the replica's batch is split into ``parallel.microbatches`` microbatches (the
    trainer does so itself); without one, ``microbatches`` counts gradient-accumulation steps of
    ``trainer.micro_batch`` sequences (:func:`trainers.rules.batch_split`)."""

    dp: int
    tp: int
    pp: int
    microbatches: int
    micro_batch: int
    seq_len: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    # parallel.dp_shard as the trainer runs it (trainers.rules.DP_MODES); read only where dp > 1
    dp_mode: str = "ddp"
    compiled: str = ""  # trainer.compile's backend for the chip (trainers.rules), "" when eager

    @classmethod
    def of(cls, parallel: DictConfig, trainer: DictConfig, lay: Layout, device_type: str = "cuda") -> "ParallelShape":
        """``device_type``: the chip's, which picks ``trainer.compile_backend=auto``'s backend."""
        compiled = bool(getattr(trainer, "compile", False))
        backend = rules.compile_backend_name(device_type, str(getattr(trainer, "compile_backend", "auto")))
        split = rules.batch_split(
            int(trainer.global_batch), lay.dp, lay.pp, int(trainer.micro_batch), int(parallel.microbatches)
        )
        return cls(
            dp=lay.dp,
            tp=lay.tp,
            pp=lay.pp,
            microbatches=split.count,
            micro_batch=split.size,
            seq_len=int(trainer.seq_len),
            schedule=str(parallel.schedule),
            virtual_stages=int(parallel.virtual_stages),
            sequence_parallel=bool(parallel.sequence_parallel) and lay.tp > 1,
            dp_mode=str(parallel.dp_shard),
            compiled=backend if compiled else "",
        )

    @property
    def wrapping(self) -> str:
        """The trainer's data-parallel wrapping: ``none`` with one replica, else the mode."""
        return rules.dp_wrapping(self.dp, self.tp, self.dp_mode)

    @property
    def fsdp(self) -> bool:
        """Parameters, gradients and optimizer state sharded over the replicas between steps
        (FSDP2: ``zero1`` and ``fsdp``)."""
        return rules.sharded(self.wrapping)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def fused(self) -> bool:
        """Elementwise chains fused into kernels (the fused memory traffic, planner/traffic.py)."""
        return self.compiled in rules.FUSING_BACKENDS

    @property
    def min_cut(self) -> bool:
        """The blocks' backward is Inductor's min-cut partition (planner/activations.py)."""
        return self.compiled in rules.MIN_CUT_BACKENDS

    @property
    def traced(self) -> bool:
        """DTensor traced into plain tensors: no per-operator TP host cost (planner/step_time.py)."""
        return self.compiled in rules.AOT_BACKENDS

    @property
    def chunks_per_rank(self) -> int:
        return rules.stages_per_rank(self.pp, self.schedule, self.virtual_stages)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank: the trainer's mesh is (dp, pp, tp), tp
        innermost (trainers/parallel.py build_mesh)."""
        return rank // (self.tp * self.pp), (rank // self.tp) % self.pp, rank % self.tp


def chunk_layers(m: ModelShape, s: "ParallelShape", rc: rules.RankStages) -> List[int]:
    """The layers of each stage chunk pipeline rank contents ``rc`` hold (the trainer's split)."""
    split = rules.layer_split(m.layers, s.pp * s.chunks_per_rank)
    return [len(split[sid]) for sid in rc.stages]


def recomputed_layers(m: ModelShape, s: "ParallelShape", rc: rules.RankStages) -> int:
    """Blocks of pipeline rank contents ``rc`` that recompute (full or selective)."""
    return sum(m.recomputed(n) for n in chunk_layers(m, s, rc))


def model_recomputed_layers(m: ModelShape, s: "ParallelShape") -> int:
    """Blocks of the whole model that recompute (full or selective), every stage chunk's first
    ``recompute_layers``."""
    return sum(m.recomputed(len(chunk)) for chunk in rules.layer_split(m.layers, s.pp * s.chunks_per_rank))


def full_recompute_share(m: ModelShape, s: "ParallelShape") -> float:
    """The share of the model's blocks that recompute from their input (full granularity)."""
    return model_recomputed_layers(m, s) / max(1, m.layers) if m.full_recompute else 0.0


def work_factor(m: ModelShape, s: "ParallelShape") -> float:
    """A layer's work per micro-batch over its forward and backward's: full recomputation runs
    a block's forward once more, a third more (the backward is twice the forward), on the share of
    blocks that recompute; selective recomputation's attention core is :func:`core_flops`."""
    return 1.0 + full_recompute_share(m, s) / 3.0


def core_flops(m: ModelShape, s: "ParallelShape") -> float:
    """FLOPs selective recomputation adds per step: the attention core's forward (q k^T and the
    product with v, 4 s d a token and layer, PaLM's count) again, on the blocks that recompute."""
    if not (m.checkpointing and m.selective):
        return 0.0
    tokens = s.dp * s.microbatches * s.micro_batch * s.seq_len
    return 4.0 * model_recomputed_layers(m, s) * m.d * s.seq_len * tokens


def head_recompute_flops(m: ModelShape, s: "ParallelShape") -> float:
    """FLOPs ``model.loss_chunks`` adds per step: each chunk's head matmul again in its backward
    (2 d V a token)."""
    if m.loss_chunks <= 1:
        return 0.0
    return 2.0 * m.d * m.vocab * s.dp * s.microbatches * s.micro_batch * s.seq_len


RankContents = rules.RankStages  # what one pipeline rank holds: stages, layers, the model's ends


def rank_contents(m: ModelShape, s: ParallelShape, rank: int) -> rules.RankStages:
    """Which stages, layers and model ends pipeline rank ``rank`` holds (the trainer's split)."""
    return rules.rank_stages(m.layers, s.pp, s.schedule, s.virtual_stages, rank)


# ---------------------------------------------------------------------------------------------
# parameter tensors


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the trainer's model: its full shape and the dimension tensor
    parallelism shards (None: every TP rank holds it whole)."""

    name: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int] = None


def block_tensors(m: ModelShape) -> List[ParamTensor]:
    """The parameters of one transformer block, as ``apply_tp`` shards them."""
    hd = m.d // m.heads
    out = [
        ParamTensor("attn.wq.weight", (m.heads * hd, m.d), 0),
        ParamTensor("attn.wk.weight", (m.kv_heads * hd, m.d), 0),
        ParamTensor("attn.wv.weight", (m.kv_heads * hd, m.d), 0),
        ParamTensor("attn.wo.weight", (m.d, m.heads * hd), 1),
        ParamTensor("mlp.w1.weight", (m.d_ff, m.d), 0),
        ParamTensor("mlp.w2.weight", (m.d, m.d_ff), 1),
    ]
    if m.swiglu:
        out.append(ParamTensor("mlp.w3.weight", (m.d_ff, m.d), 0))
    if m.qkv_bias:  # column-parallel with their weights
        out += [
            ParamTensor("attn.wq.bias", (m.heads * hd,), 0),
            ParamTensor("attn.wk.bias", (m.kv_heads * hd,), 0),
            ParamTensor("attn.wv.bias", (m.kv_heads * hd,), 0),
        ]
    if m.qk_norm:  # replicated: each TP rank normalises its own heads with the whole weight
        out += [ParamTensor("attn.q_norm.weight", (hd,)), ParamTensor("attn.k_norm.weight", (hd,))]
    return out + norm_tensors(m, "attn_norm") + norm_tensors(m, "mlp_norm")


def norm_tensors(m: ModelShape, name: str) -> List[ParamTensor]:
    return [ParamTensor(f"{name}.weight", (m.d,))] + ([ParamTensor(f"{name}.bias", (m.d,))] if m.layernorm else [])


def rank_tensors(m: ModelShape, rc: rules.RankStages) -> List[ParamTensor]:
    """The parameters a pipeline rank's stage modules hold: its layers, the embeddings on the
    first stage, the final norm and the head on the last. A tied head is the embedding itself
    only where one stage module holds both ends (no pipeline); each stage is its own module, so
    a stage holding the head alone (ZB-V's rank 0 included) holds a copy."""
    out = [ParamTensor(f"layers.{i}.{t.name}", t.shape, t.tp_dim) for i in rc.layers for t in block_tensors(m)]
    if rc.embedding:
        out.append(ParamTensor("tok_emb.weight", (m.vocab, m.d), 0))
        if m.learned_pos:
            out.append(ParamTensor("pos_emb.weight", (m.max_seq_len, m.d)))
    if rc.head:
        out += norm_tensors(m, "norm")
        if not (m.tied and rc.embedding and len(rc.stages) == 1):
            out.append(ParamTensor("head.weight", (m.vocab, m.d), 0))
    return out


def chunk(n: int, k: int, i: int) -> int:
    """Size of piece ``i`` of ``n`` cut into ``k`` as ``torch.chunk`` does (DTensor's Shard and
    FSDP2 both cut so): pieces of ceil(n/k), the last ones smaller or empty."""
    if k <= 1:
        return n
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def local_numel(t: ParamTensor, s: ParallelShape, tp_rank: int = 0, dp_rank: int = 0) -> int:
    """Elements of ``t`` a rank holds: its TP shard, then (FSDP) its piece of dim 0 of that."""
    shape = list(t.shape)
    if s.tp > 1 and t.tp_dim is not None:
        shape[t.tp_dim] = chunk(shape[t.tp_dim], s.tp, tp_rank)
    if s.fsdp:
        shape[0] = chunk(shape[0], s.dp, dp_rank)
    return math.prod(shape)


def rank_params(m: ModelShape, s: ParallelShape, rc: rules.RankStages, tp_rank: int = 0) -> int:
    """Parameters a pipeline rank holds before FSDP sharding: its layers' matrices / tp, the
    norms, the vocabulary-parallel embedding / tp on the first stage and the head (a copy of a
    tied embedding when the stages differ) / tp on the last. TP rank 0 holds the most."""
    return sum(local_numel(t, replace(s, dp_mode="ddp"), tp_rank) for t in rank_tensors(m, rc))


def block_params(m: ModelShape, s: ParallelShape, tp_rank: int = 0) -> int:
    """Parameters of one block on one TP rank, before FSDP sharding (what FSDP gathers per unit)."""
    return sum(local_numel(t, replace(s, dp_mode="ddp"), tp_rank) for t in block_tensors(m))
