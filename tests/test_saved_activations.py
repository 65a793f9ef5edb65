"""What autograd keeps for the backward, counted with saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``: every tensor an op saves, counted once per storage
by its ``untyped_storage()`` address and size; parameters and buffers left out, they are held
anyway).

- The tensor-parallel head and its loss (two gloo processes, tp=2, a Llama-shaped block with a
  vocabulary large beside d_model: 4096 ids, d 64). Each rank saves about 1/tp of what the single
  process saves for the head and the cross-entropy (measured: 0.508 of it; the rest is the
  head's input, which every rank keeps whole), and no tensor the forward makes on a rank is
  larger than its vocabulary shard's logits. The loss and the gradients equal the single
  process's. Before the logits stayed sharded (``ColwiseParallel(output_layouts=Replicate())``
  and a plain cross-entropy), each rank saved 1.0x the single process's bytes and made the whole
  (tokens x vocab) logits.
- Grouped-query attention (8 query heads on 2 kv heads) keeps no key or value repeated to the
  query heads' width, on each attention path: SDPA's own GQA (``enable_gqa``), the NPU kernel's
  stand-in off the NPU, and the decomposed matmul path, which stacks each kv head's query heads
  along the rows of one matmul. Before, ``repeat_interleave`` made them for every path but the NPU
  kernel, and SDPA / the matmuls saved them.

``python bench/saved_activations.py`` prints the bytes, before and after, measured here and
computed for a 128k vocabulary at seq 4096, tp8.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from trainers.config import ModelConfig

# a Llama-shaped block whose head dominates: vocab 4096 against d_model 64
TP_MODEL = dict(
    vocab_size=4096,
    d_model=64,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    d_ff=128,
    max_seq_len=64,
    norm="rmsnorm",
    mlp="swiglu",
    pos_emb="rope",
)
GQA_MODEL = dict(TP_MODEL, vocab_size=64, n_heads=8, n_kv_heads=2, max_seq_len=32)
TOKENS = (2, 32)  # batch, seq
TP_CASES = {"tp2": dict(sp=False, tied=False), "tp2-sequence-parallel-tied": dict(sp=True, tied=True)}


class SavedBytes:
    """Pack hook for ``saved_tensors_hooks``: the storages of what autograd saves, each once."""

    def __init__(self, module: torch.nn.Module):
        self.held = {_storage(t)[0] for t in [*module.parameters(), *module.buffers()]}
        self.storages: Dict[int, int] = {}
        self.tensors: List[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes, local = _storage(t)
        if ptr not in self.held:
            self.storages[ptr] = nbytes
            self.tensors.append(local.detach())
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _storage(t: torch.Tensor):
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        local = t.to_local() if isinstance(t, DTensor) else t
    s = local.untyped_storage()
    return s.data_ptr(), s.nbytes(), local


def _largest_output_mode():
    """A dispatch mode that records the most elements of any tensor an op gives out (a DTensor's
    local shard: what the rank holds)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, (t._local_tensor if isinstance(t, DTensor) else t).numel())
            return out

    return Largest()


def head_and_loss(model, x: torch.Tensor, y: torch.Tensor, loss_fn):
    """One forward of ``model`` and ``loss_fn``: the loss, the bytes autograd saves from the head's
    input on (the head's input preparation, the head, the loss), and the most elements of any
    tensor made there."""
    saved, largest = SavedBytes(model), _largest_output_mode()
    ctxs = [saved.hooks(), largest]

    def enter(module, args):
        for c in ctxs:
            c.__enter__()

    handle = model.head.register_forward_pre_hook(enter, prepend=True)  # before TP's input hook
    try:
        loss = loss_fn(model(x), y)
    finally:
        handle.remove()
        for c in reversed(ctxs):
            c.__exit__(None, None, None)
    return loss, saved.total, largest.numel


def _tp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from trainers.config import ParallelConfig
    from trainers.head_loss import loss_fn
    from trainers.model import GPT, cross_entropy
    from trainers.parallel import build_mesh, build_stages

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, TP_MODEL["vocab_size"], TOKENS, generator=g)
        y = torch.randint(0, TP_MODEL["vocab_size"], TOKENS, generator=g)
        results = {}
        for name, case in TP_CASES.items():
            margs = ModelConfig(**TP_MODEL, tie_embeddings=case["tied"])
            p = ParallelConfig(dp=1, tp=world, pp=1, sequence_parallel=case["sp"])
            mesh = build_mesh("cpu", p)
            ((_, model),) = build_stages(margs, p, mesh, torch.device("cpu"), seed=0)
            loss, nbytes, largest = head_and_loss(model, x, y, loss_fn(mesh, margs.vocab_size))
            loss.backward()
            grads = {n: _full(q.grad) for n, q in model.named_parameters() if n in _CHECKED}
            row = dict(loss=loss.item(), bytes=nbytes, largest=largest, grads=grads)
            if rank == 0:
                whole = GPT(margs, seed=0)
                ref, ref_bytes, ref_largest = head_and_loss(whole, x, y, cross_entropy)
                ref.backward()
                ref_grads = {n: q.grad for n, q in whole.named_parameters() if n in _CHECKED}
                row["ref"] = dict(loss=ref.item(), bytes=ref_bytes, largest=ref_largest, grads=ref_grads)
            results[name] = row
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


_CHECKED = ("head.weight", "tok_emb.weight", "layers.0.attn.wq.weight", "layers.0.mlp.w2.weight", "norm.weight")


def run_tp(out_dir: str, world: int = 2) -> List[dict]:
    """Each rank's results of :func:`_tp_worker`, from ``world`` spawned gloo processes."""
    import torch.multiprocessing as mp

    from tests.conftest import held_port

    with held_port() as port:
        mp.spawn(_tp_worker, args=(world, port, out_dir), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return run_tp(str(tmp_path_factory.mktemp("tp")))


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp_head_and_loss_keep_a_vocabulary_shard_per_rank(tp_results, case):
    ref = tp_results[0][case]["ref"]
    n, vocab = math.prod(TOKENS), TP_MODEL["vocab_size"]
    for rank, results in enumerate(tp_results):
        r = results[case]
        ratio = r["bytes"] / ref["bytes"]
        # about 1/tp: the fp32 softmax of this rank's vocabulary shard, plus the head's input
        # (whole on every rank) and the targets; the replicated logits' loss saved 1.0x
        assert 0.45 < ratio < 0.55, f"rank {rank}: {r['bytes']} B saved, {ratio:.3f} of the single process's"
        # nothing made on the rank holds more than its shard of the logits (ceil(vocab / tp) ids)
        assert r["largest"] <= n * -(-vocab // 2) < ref["largest"], (r["largest"], ref["largest"])
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}")


def gqa_attention_saved(impl: str, model: Optional[torch.nn.Module] = None):
    """One training forward of a GQA model's first attention: the tensors autograd saves in it (as
    :class:`SavedBytes` holds them), and its keys and values after RoPE at kv width."""
    from trainers.model import GPT
    from trainers.rope import apply_rope

    model = model or GPT(ModelConfig(**GQA_MODEL, attn_impl=impl), seed=0)
    attn = model.layers["0"].attn
    saved, seen = SavedBytes(model), {}
    ctx = saved.hooks()

    def enter(module, args):
        seen["x"] = args[0].detach()
        ctx.__enter__()

    pre = attn.register_forward_pre_hook(enter)
    post = attn.register_forward_hook(lambda m, a, o: ctx.__exit__(None, None, None))
    try:
        model(torch.randint(0, GQA_MODEL["vocab_size"], TOKENS, generator=torch.Generator().manual_seed(0)))
    finally:
        pre.remove()
        post.remove()
    b, t = TOKENS
    with torch.no_grad():
        k = attn.wk(seen["x"]).view(b, t, -1, attn.hd).transpose(1, 2)
        v = attn.wv(seen["x"]).view(b, t, -1, attn.hd).transpose(1, 2)
        k = apply_rope(k, model.rope_cos, model.rope_sin)
    return saved, k, v


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same multiset of values, in any layout (a transposed or flattened copy counts)."""
    return a.numel() == b.numel() and torch.equal(a.flatten().sort().values, b.flatten().sort().values)


@pytest.mark.parametrize("impl", ["fused", "npu_fused", "decomposed"])
def test_grouped_query_attention_saves_no_full_width_keys_or_values(impl):
    saved, k, v = gqa_attention_saved(impl)
    rep = GQA_MODEL["n_heads"] // GQA_MODEL["n_kv_heads"]
    wide = {"k": k.repeat_interleave(rep, dim=1), "v": v.repeat_interleave(rep, dim=1)}
    for name, full in wide.items():
        kept = [tuple(s.shape) for s in saved.tensors if _same_values(s, full)]
        assert not kept, f"{impl}: {name} repeated to {rep}x its heads is saved: {kept}"
    # the detector sees keys and values where they are saved: at kv width
    assert any(_same_values(s, k) for s in saved.tensors), impl
    assert any(_same_values(s, v) for s in saved.tensors), impl


def test_grouped_query_attention_paths_agree_with_repeated_kv():
    """Each path's forward and gradients equal SDPA over keys and values repeated to every query
    head (what every path but the NPU kernel computed before)."""
    from trainers.model import GPT, Attention

    def repeated(self, q, k, v, p):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    x = torch.randint(0, GQA_MODEL["vocab_size"], TOKENS, generator=torch.Generator().manual_seed(1))

    def run(impl, patch=False):
        model = GPT(ModelConfig(**GQA_MODEL, attn_impl=impl), seed=3)
        if patch:
            for block in model.layers.values():
                block.attn._decomposed = repeated.__get__(block.attn, Attention)
        out = model(x)
        out.square().mean().backward()
        return out, {n: q.grad for n, q in model.named_parameters()}

    want, want_grads = run("decomposed", patch=True)  # the decomposed path's slot, the old computation
    for impl in ("fused", "npu_fused", "decomposed"):
        got, grads = run(impl)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=impl)
        for n, g in want_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-7, msg=f"{impl} {n}")
