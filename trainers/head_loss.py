"""The model's loss: the token cross-entropy, over the vocabulary shards where the head is
tensor-parallel (:func:`loss_fn`), and over sequence chunks (``model.loss_chunks`` > 1,
:class:`ChunkedHeadLoss`): each chunk's logits are made, reduced to a loss and dropped, and made
again in the backward, so no rank keeps a whole micro-batch's logits (b x s x vocab/tp, in fp32
for the loss) for the backward or at the loss's peak. What stays is the head's input, sharded
along the sequence where it is (sequence parallelism), and each chunk's targets. The price is the
head's forward twice (and, with sequence parallelism, its gather twice): docs/planner.md, "Lean
ends"."""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, List, Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from trainers.model import cross_entropy


def vocab_offset(vocab_size: int, tp: int, tp_rank: int) -> int:
    """The first vocabulary id of TP rank ``tp_rank``'s head shard: ``Shard(-1)`` splits as
    ``torch.chunk`` does (ceil(vocab / tp) per rank, the last ones shorter or empty)."""
    return min(tp_rank * -(-vocab_size // tp), vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary across ``group``, as
    Megatron-LM's ``_VocabParallelCrossEntropy`` computes it: the max over the shards (all-reduce
    MAX), then the target's logit (from the one shard that holds it) and the sum of exponentials
    (one all-reduce SUM of both). Every rank ends with the same per-token losses and keeps only its
    shard's softmax for the backward, whose gradient, softmax - onehot, needs no communication:
    the head's column-parallel backward all-reduces what flows into the hidden states."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, lo: int, group) -> torch.Tensor:
        # logits: (tokens, shard) fp32, this rank's vocabulary [lo, lo + shard); targets: (tokens,)
        n, shard = logits.shape
        if shard:
            top = logits.amax(dim=-1)
        else:  # an empty shard (vocab < tp * ceil(vocab / tp)) takes part in the collectives only
            top = logits.new_full((n,), float("-inf"))
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # a new tensor: the caller's logits are left alone
        local_t = targets - lo
        owned = (local_t >= 0) & (local_t < shard)
        local_t = local_t.masked_fill(~owned, 0)
        both = logits.new_zeros((2, n))  # [target's shifted logit, sum of exp], one all-reduce
        if shard:
            both[0] = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        probs = shifted.exp_()
        both[1] = probs.sum(dim=-1)
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        probs.div_(both[1].unsqueeze(-1))  # this shard's softmax, in place
        ctx.save_for_backward(probs, local_t, owned)
        return both[1].log() - both[0]

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, local_t, owned = ctx.saved_tensors
        # softmax - onehot(target), in place on the saved softmax as Megatron does: no second
        # local-vocabulary buffer. A second backward through this node (retain_graph) fails
        # autograd's version check rather than reading the overwritten softmax; ZB-V's split
        # backward passes this node once (its weight pass starts below the loss)
        grad = probs
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_t.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """The mean token cross-entropy, in fp32, of logits (..., shard) that hold this TP rank's slice
    of the vocabulary (the tensor-parallel head's output): equal to :func:`cross_entropy` of the
    whole vocabulary's logits, without any rank holding them. ``targets`` are token ids (no
    ignore index: the trainer's data has none)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    lo = vocab_offset(vocab_size, tp, rank)
    if logits.shape[-1] != max(0, min(-(-vocab_size // tp), vocab_size - lo)):
        raise ValueError(f"logits of {logits.shape[-1]} ids are not TP rank {rank}'s shard of {vocab_size}")
    x = logits.float().reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(x, targets.reshape(-1), lo, group).mean()


def loss_fn(mesh: Optional[Any], vocab_size: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(logits, targets)`` for this rank's head output: the vocab-parallel cross-entropy where
    the head is tensor-parallel (tp > 1), the plain one otherwise."""
    if mesh is None or mesh.tp == 1:
        return cross_entropy
    return functools.partial(vocab_parallel_cross_entropy, group=mesh.group("tp"), vocab_size=vocab_size)


class ChunkedHeadLoss:
    """``loss(hidden, targets)``: the mean token loss of ``head(hidden)`` against ``targets``,
    computed over ``chunks`` slices of the sequence, each recomputed in the backward.

    ``hidden`` is the final norm's output as this rank holds it, (batch, seq / seq_shards, d):
    with sequence parallelism (``seq_shards`` = tp) rank r holds positions [r s/tp, (r+1) s/tp),
    and the tensor-parallel head gathers a chunk from every rank, so the chunk's targets are the
    same slice of each rank's part of the sequence, in rank order. ``loss(logits, targets)`` is
    the plain or the vocab-parallel cross-entropy (a mean); ``autocast`` the context the head's
    matmul runs in (the model's compute dtype; the loss takes fp32 logits whatever it is)."""

    def __init__(
        self,
        head: torch.nn.Module,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        chunks: int,
        seq_shards: int,
        autocast: Callable[[], ContextManager],
    ):
        self.head, self.loss, self.chunks, self.seq_shards, self.autocast = head, loss, chunks, seq_shards, autocast

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        # one autocast context over the chunks: the head's weight is cast to the compute dtype
        # once (autocast's cache), not once a chunk; each recompute enters it again (checkpoint
        # keeps the forward's autocast state) and casts the weight again
        with self.autocast():
            kind = hidden.device.type
            if torch.is_autocast_enabled(kind) and hidden.dtype != torch.get_autocast_dtype(kind):
                # the head's input as its matmul takes it: the chunks keep this, not a wider norm output
                hidden = hidden.to(torch.get_autocast_dtype(kind))
            # split, not sliced: one backward node concatenates the chunks' gradients, where each
            # slice's would be a whole zero-filled gradient of the hidden states, summed
            parts = torch.split(hidden, _sizes(hidden.shape[1], self.chunks), dim=1)
            for h, y in zip(parts, self.target_parts(targets)):
                if h.shape[1] == 0:
                    continue
                if torch.is_grad_enabled():
                    total = total + checkpoint(self._part, h, y, use_reentrant=False, preserve_rng_state=False)
                else:
                    total = total + self._part(h, y)
        return total / targets.numel()

    def target_parts(self, targets: torch.Tensor) -> List[torch.Tensor]:
        """Each chunk's targets, (batch, tokens), in the order the head's output gives them."""
        b, s = targets.shape
        n = self.seq_shards
        ranks = targets.reshape(b, n, s // n)  # each rank's part of the sequence
        return [y.reshape(b, -1) for y in torch.split(ranks, _sizes(s // n, self.chunks), dim=2)]

    def _part(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.head(h), y) * y.numel()  # the chunk's sum: chunks may differ in length


def _sizes(n: int, chunks: int) -> List[int]:
    """``n`` positions in ``chunks`` parts as ``torch.tensor_split`` cuts them (the first ones a
    position longer)."""
    q, r = divmod(n, chunks)
    return [q + (i < r) for i in range(chunks)]
