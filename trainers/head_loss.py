"""The head and the loss over sequence chunks (``model.loss_chunks`` > 1): each chunk's logits are
made, reduced to a loss and dropped, and made again in the backward, so no rank keeps a whole
micro-batch's logits (b x s x vocab/tp, in fp32 for the loss) for the backward or at the loss's
peak. What stays is the head's input, sharded along the sequence where it is (sequence
parallelism), and each chunk's per-token loss inputs. The price is the head's forward twice
(and, with sequence parallelism, its gather twice): docs/planner.md, "Lean ends"."""

from __future__ import annotations

from typing import Callable, ContextManager, List

import torch
from torch.utils.checkpoint import checkpoint


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
