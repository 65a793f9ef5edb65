"""The pipeline stage the trainer builds: torch's ``PipelineStage``, except under
``parallel.dp_shard=fsdp``, where each micro-batch's backward reduce-scatters its gradients.

torch 2.13's stage turns an FSDP2 module's gradient sync and its reshard-after-backward off for
every backward of a step (``backward_maybe_with_nosync``, ``pipelining/stage.py``) and reduces once,
after the last (its REDUCE_GRAD action): each rank then holds its stage's whole, unsharded
gradients through the step and every unit stays gathered after its backward. That is ``zero1``'s
trade (gather and reduce once a step). ZeRO-3 keeps only shards: here the stage leaves FSDP2's
defaults on, so each unit reduce-scatters into its sharded gradient (FSDP2 accumulates them),
reshards after every backward, and the backward waits for its reductions (with the base's
``set_is_last_backward(False)`` their whole-gradient inputs stayed in flight into the next
micro-batch: measured on dp2pp2's last stage); the step's REDUCE_GRAD then finds nothing left.
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
            # the base class switches these off before the backward; keep FSDP2's defaults (on):
            # reduce-scatter, reshard, and wait for the reductions at the backward's end, which
            # frees their whole-gradient inputs before the next micro-batch
            module.set_requires_gradient_sync = _keep
            module.set_reshard_after_backward = _keep
            module.set_is_last_backward = _keep
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            finally:
                del module.set_requires_gradient_sync, module.set_reshard_after_backward
                del module.set_is_last_backward

    return ShardedGradStage


def _keep(*args: Any, **kwargs: Any) -> None:
    """Stands in for an FSDP2 switch the base stage would turn off."""
