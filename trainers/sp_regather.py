"""Sequence parallelism keeping the shard, as Megatron does: the column-parallel linears of a
sub-layer (q/k/v, the MLP's first projections) save their input for the backward, and under
sequence parallelism that input is the all-gather of the sequence shards, whole on every TP rank.
Here the sub-layer's saves of that gathered tensor keep the shard instead (saved-tensor hooks
around the sub-layer's forward), and the backward gathers it again once, at its first use: a
sub-layer keeps s b h / t instead of s b h, for one more all-gather per sub-layer in the backward
(Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` under
``--sequence-parallel`` does the same gather again).

The input is cast to the compute dtype before the gather (under autocast with wider norms): the
gather moves half the bytes and the linears share one copy. Off where the block recomputes from
its input (``GPT.forward`` sets ``full_recompute``: the checkpoint keeps nothing inside it) and
inside a compiled block (the graph decides what it keeps).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn


class _Outer:
    """The saved-tensor hooks these ones sit inside (a profiler's, an offload's, a test's
    counter), which every save still goes through; none: autograd's own keeping."""

    def __init__(self):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.pack, self.unpack = top if top is not None else (None, None)

    def keep(self, t: torch.Tensor) -> Any:
        return self.pack(t) if self.pack is not None else t

    def get(self, h: Any) -> torch.Tensor:
        return self.unpack(h) if self.unpack is not None else h


class _Gathered:
    """One sub-layer call's gathered input: the shard it came from (kept through the outer
    hooks), gathered again on first use in the backward and kept while any save of it lives."""

    __slots__ = ("outer", "shard", "full")

    def __init__(self, shard, outer: _Outer):
        self.outer, self.shard = outer, outer.keep(shard)
        self.full: Optional[torch.Tensor] = None

    def local(self) -> torch.Tensor:
        if self.full is None:
            from torch.distributed.tensor import Replicate

            shard = self.outer.get(self.shard)
            full = shard.redistribute(shard.device_mesh, [Replicate()]).to_local()
            self.full = full.wait() if hasattr(full, "wait") else full  # an async collective's result
        return self.full


class _Saved:
    """A save of the gathered tensor: its view of the gathered storage and its DTensor spec."""

    __slots__ = ("gathered", "size", "stride", "offset", "spec")

    def __init__(self, gathered: _Gathered, t: Any):
        local = t.to_local() if hasattr(t, "to_local") else t
        self.gathered, self.spec = gathered, t if hasattr(t, "to_local") else None
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()

    def unpack(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = self.gathered.local().as_strided(self.size, self.stride, self.offset)
        s = self.spec
        if s is None:
            return local
        return DTensor.from_local(local, s.device_mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride())


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    while hasattr(local, "elem"):  # an async collective's wrapper
        local = local.elem
    return local.untyped_storage().data_ptr()


def keep_shard(sub: nn.Module, block: nn.Module) -> None:
    """Make ``sub`` (a block's attention or MLP, whose input a ``PrepareModuleInput`` gathers
    along the sequence) save that input as its shard. Hooks: one before the gather (the shard),
    one after it (the gathered tensor: the saved-tensor hooks open), one after the forward."""

    def before(module, args):
        x = args[0]
        if not hasattr(x, "redistribute"):  # not the norm's Shard(1) DTensor
            return None
        kind = x.device.type
        if torch.is_autocast_enabled(kind) and x.dtype != torch.get_autocast_dtype(kind):
            # the linears' input in the compute dtype before the gather: the gather moves it, the
            # linears share it (autocast would cast it once per linear) and the shard kept is it
            x = x.to(torch.get_autocast_dtype(kind))
        if _active(block):
            module._sp_shard = x
        return (x, *args[1:])

    def after_gather(module, args):
        shard = getattr(module, "_sp_shard", None)
        module._sp_shard = None
        if shard is None or not _active(block):
            return
        outer = _Outer()
        gathered, ptr = _Gathered(shard, outer), _storage(args[0])

        def pack(t):
            return _Saved(gathered, t) if _storage(t) == ptr else (outer.keep(t),)

        def unpack(h):
            return h.unpack() if isinstance(h, _Saved) else outer.get(h[0])

        module._sp_hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        module._sp_hooks.__enter__()

    def close(module, args, out):
        hooks = getattr(module, "_sp_hooks", None)
        if hooks is not None:
            module._sp_hooks = None
            hooks.__exit__(None, None, None)

    sub.register_forward_pre_hook(before, prepend=True)
    sub.register_forward_pre_hook(after_gather)
    # closed even when the forward raises: a context left open would pack later saves against a
    # freed tensor's address, which a new tensor may reuse
    sub.register_forward_hook(close, always_call=True)


def _active(block: nn.Module) -> bool:
    return torch.is_grad_enabled() and not getattr(block, "full_recompute", False) and not torch.compiler.is_compiling()
