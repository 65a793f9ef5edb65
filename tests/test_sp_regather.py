"""``trainers/sp_regather.py`` on a one-rank tensor-parallel mesh, against the same sub-layer
without it: the gradients are the same, what the sub-layer's linears save is the shard's storage
(not the gathered copy's), and a forward that raises leaves no saved-tensor hooks open."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trainers.sp_regather import keep_shard


class _Sub(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.a, self.b, self.fail = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("a forward that fails")
        return self.a(x) + self.b(x)


@pytest.fixture
def mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _run(mesh, keep: bool, fail: bool = False):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    torch.manual_seed(0)
    block = nn.Module()
    block.sub = _Sub(fail)
    plan = {
        "sub": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "sub.a": ColwiseParallel(),
        "sub.b": ColwiseParallel(),
    }
    parallelize_module(block, mesh, plan)
    if keep:
        keep_shard(block.sub, block)
    x = torch.randn(2, 4, 8, requires_grad=True)
    shard = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    saved = []

    def pack(t):
        saved.append(t.to_local().untyped_storage().data_ptr() if hasattr(t, "to_local") else None)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block.sub(shard)
    (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    return x.grad, [w.grad.to_local() for w in (block.sub.a.weight, block.sub.b.weight)], saved, x


def test_the_sub_layer_keeps_the_shard_and_gets_the_same_gradients(mesh):
    g_ref, w_ref, _, _ = _run(mesh, keep=False)
    g, w, saved, x = _run(mesh, keep=True)
    assert torch.equal(g, g_ref) and all(torch.equal(a, b) for a, b in zip(w, w_ref))
    # the outer hooks saw the shard (the input's own storage) once, kept for both linears
    assert saved.count(x.untyped_storage().data_ptr()) == 1


def test_a_forward_that_raises_leaves_no_hooks_open(mesh):
    with pytest.raises(RuntimeError, match="a forward that fails"):
        _run(mesh, keep=True, fail=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
