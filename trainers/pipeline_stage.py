"""The pipeline stage the trainer builds: torch's ``PipelineStage``, except under
``parallel.dp_shard=fsdp``, where each micro-batch's backward reduce-scatters its gradients.

torch 2.13's stage turns an FSDP2 module's gradient sync and its reshard-after-backward off for
every backward of a step (``backward_maybe_with_nosync``, ``pipelining/stage.py``) and reduces once,
after the last (its REDUCE_GRAD action): each rank then holds its stage's whole, unsharded
gradients through the step and every unit stays gathered after its backward. That is ``zero1``'s
trade (gather and reduce once a step). ZeRO-3 keeps only shards: here the stage leaves FSDP2's
defaults on, so each unit reduce-scatters into its sharded gradient (FSDP2 accumulates them) and
reshards after every backward; the step's REDUCE_GRAD then finds nothing left to reduce and waits
for the pending reductions.
"""

from __future__ import annotations

from typing import Any


def stage_class(wrapping: str, schedule: str) -> Any:
    """The stage class for this data-parallel wrapping (``trainers.rules.DP_MODES``) and
    schedule (ZB-V keeps torch's reduction once a step: :func:`trainers.rules.zero3`)."""
    from torch.distributed import pipelining as pl

    from trainers import rules

    if not rules.zero3(wrapping, 2, schedule):
        return pl.PipelineStage

    class ShardedGradStage(pl.PipelineStage):
        """A stage whose FSDP2 module reduce-scatters and reshards after every backward."""

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            module = self.submod
            # the base class switches both off before the backward; keep FSDP2's defaults (on)
            module.set_requires_gradient_sync = _keep
            module.set_reshard_after_backward = _keep
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            finally:
                del module.set_requires_gradient_sync, module.set_reshard_after_backward

    return ShardedGradStage


def _keep(*args: Any, **kwargs: Any) -> None:
    """Stands in for an FSDP2 switch the base stage would turn off."""
