"""What autograd keeps for the backward of the head + loss and of grouped-query attention, before
and after the vocab-parallel loss and the unexpanded kv heads (issue 26).

    python bench/saved_activations.py

Measured on small shapes (CPU, fp32; two gloo processes for tp=2), with the saved-tensor hooks of
``tests/test_saved_activations.py`` (each saved storage counted once, parameters and buffers
left out). "Before" is rebuilt here: the head's logits gathered to the whole vocabulary
(``ColwiseParallel(output_layouts=Replicate())``) and the plain cross-entropy; keys and values
repeated to every query head (``repeat_interleave``) before attention. Then the same terms are
computed for a Llama-3-8B-like rank (vocab 128256, d 4096, 32 heads on 8 kv heads, head dim 128)
at seq 4096, micro-batch 1, tp 8, bf16 compute, from the formulas that the measured rows check to
the byte (head + loss) or to the kv width (attention).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import test_saved_activations as sa  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainers.config import ModelConfig  # noqa: E402

MiB = 2**20


def head_loss_formula(tokens: int, vocab: int, d: int, tp: int, act_bytes: int, sharded: bool) -> int:
    """Bytes saved from the head's input on: the input (whole on every TP rank), the fp32
    (log-)softmax over the vocabulary (a shard of it when sharded), the int64 targets (and the
    vocab-parallel loss's bool mask of the tokens this shard owns)."""
    if sharded:
        return tokens * d * act_bytes + tokens * -(-vocab // tp) * 4 + tokens * (8 + 1)
    return tokens * d * act_bytes + tokens * vocab * 4 + tokens * 8 + 4  # + nll_loss's total weight


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from trainers.config import ParallelConfig
    from trainers.head_loss import loss_fn
    from trainers.model import GPT, cross_entropy
    from trainers.parallel import build_mesh, build_stages

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        margs = ModelConfig(**sa.TP_MODEL, tie_embeddings=False)
        p = ParallelConfig(dp=1, tp=world, pp=1)
        mesh = build_mesh("cpu", p)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, margs.vocab_size, sa.TOKENS, generator=g)
        y = torch.randint(0, margs.vocab_size, sa.TOKENS, generator=g)
        ((_, after),) = build_stages(margs, p, mesh, torch.device("cpu"), seed=0)
        before = GPT(margs, seed=0)  # the head as it was: logits gathered, a plain loss
        parallelize_module(before, mesh.sub("tp"), {"head": ColwiseParallel(output_layouts=Replicate())})
        rows = {}
        for name, model, fn in (
            ("single", GPT(margs, seed=0), cross_entropy),
            ("before", before, cross_entropy),
            ("after", after, loss_fn(mesh, margs.vocab_size)),
        ):
            _, nbytes, largest = sa.head_and_loss(model, x, y, fn)
            rows[name] = (nbytes, largest)
        torch.save(rows, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measured_head_loss(world: int = 2) -> dict:
    import torch.multiprocessing as mp

    from orchestrator.launch import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, free_port(), out), nprocs=world, join=True)
        return torch.load(os.path.join(out, "rank0.pt"))


def _repeated(self, q, k, v, p):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return self._decomposed_inner(q, k, v, p)


def measured_attention() -> dict:
    """Bytes saved by the first attention of the GQA test model (8 heads on 2 kv heads), as it is
    and with keys and values repeated to every query head first (before)."""
    from trainers.model import GPT, Attention

    out = {}
    for impl in ("fused", "decomposed"):
        out[impl, "after"] = sa.gqa_attention_saved(impl)[0].total
        model = GPT(ModelConfig(**sa.GQA_MODEL, attn_impl=impl), seed=0)
        attn = model.layers["0"].attn
        if impl == "fused":

            def old_forward(x, rope=None, attn=attn):
                b, t, _ = x.shape
                q = attn.wq(x).view(b, t, -1, attn.hd).transpose(1, 2)
                k = attn.wk(x).view(b, t, -1, attn.hd).transpose(1, 2)
                v = attn.wv(x).view(b, t, -1, attn.hd).transpose(1, 2)
                from trainers.rope import apply_rope

                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return attn.wo(y.transpose(1, 2).reshape(b, t, -1))

            attn.forward = old_forward
        else:
            attn._decomposed_inner = attn._decomposed
            attn._decomposed = _repeated.__get__(attn, Attention)
        out[impl, "before"] = sa.gqa_attention_saved(impl, model)[0].total
    return out


def main() -> None:
    m = sa.TP_MODEL
    n = sa.TOKENS[0] * sa.TOKENS[1]
    rows = measured_head_loss()
    print(f"head + loss, measured: {n} tokens, vocab {m['vocab_size']}, d {m['d_model']}, fp32, tp 2 (rank 0)")
    print(f"  {'':<28} {'saved bytes':>12} {'formula':>12} {'largest tensor (elements)':>27}")
    for name, sharded, tp in (("single process", False, 1), ("tp2 before", False, 2), ("tp2 after", True, 2)):
        nbytes, largest = rows[{"single process": "single", "tp2 before": "before", "tp2 after": "after"}[name]]
        f = head_loss_formula(n, m["vocab_size"], m["d_model"], tp, 4, sharded)
        print(f"  {name:<28} {nbytes:>12} {f:>12} {largest:>27}")
    big = dict(tokens=4096, vocab=128256, d=4096, tp=8, act_bytes=2)
    before = head_loss_formula(**big, sharded=False)
    after = head_loss_formula(**big, sharded=True)
    logits = big["tokens"] * big["vocab"]
    print("head + loss, computed: seq 4096, micro-batch 1, vocab 128256, d 4096, bf16 compute, tp 8, per rank")
    print(f"  saved for the backward: before {before / MiB:8.1f} MiB   after {after / MiB:8.1f} MiB")
    print(
        f"  made in the forward: before the gathered bf16 logits {logits * 2 / MiB:.1f} MiB + their fp32 copy"
        f" {logits * 4 / MiB:.1f} MiB + fp32 log-softmax {logits * 4 / MiB:.1f} MiB;"
        f" after a 1/8 shard of each ({logits * 10 / 8 / MiB:.1f} MiB)"
    )
    att = measured_attention()
    b, t = sa.TOKENS
    g = sa.GQA_MODEL
    hd = g["d_model"] // g["n_heads"]
    heads = f"{g['n_heads']} heads on {g['n_kv_heads']} kv heads"
    print(f"attention, measured: batch {b}, seq {t}, {heads}, head dim {hd}, fp32")
    wide = 2 * b * (g["n_heads"] - g["n_kv_heads"]) * t * hd * 4
    for impl in ("fused", "decomposed"):
        was, now = att[impl, "before"], att[impl, "after"]
        print(f"  {impl:<11} before {was:>8} B  after {now:>8} B  ({was - now} B less; 2 b (h - kv) t hd 4 = {wide} B)")
    h, kv, hd, tp, layers = 32, 8, 128, 8, 32
    per_layer = 2 * ((h - kv) // tp) * 4096 * hd * 2  # k and v, micro-batch 1, bf16, a rank's heads
    print(
        f"attention, computed: Llama-3-8B-like ({h} heads on {kv} kv heads, head dim {hd}), seq 4096, bf16,"
        f" tp {tp}: {per_layer / MiB:.1f} MiB less per layer and micro-batch,"
        f" {per_layer * layers / MiB:.0f} MiB over {layers} layers"
    )


if __name__ == "__main__":
    main()
