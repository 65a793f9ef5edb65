"""What this trainer keeps for the backward against Megatron-LM's activation formula, per layer
and for the model's ends, on the Llama-2 layouts the planner's docs compare.

    python bench/megatron_activations.py

The trainer's bytes are the planner's count (``orchestrator/planner/activations.py``), which
``tests/test_activation_bytes.py`` and ``tests/test_rank_activations.py`` hold to what autograd
saves, to the byte. Megatron's are ``compute_activation_memory`` of
``megatron/training/theoretical_memory_usage.py`` as Korthikanti et al. 2022 derive it: per layer
``s b h (18 + 4 f / h) / t`` bytes with sequence parallelism and selective recomputation (its
only case), bf16, flash attention; without sequence parallelism the layer's norms, residual and
dropout part (``10 s b h``) is whole on each TP rank. The ends: the output layer and the loss,
``4 s b h (1 + V / h) / t`` with a pipeline of one stage (without sequence parallelism the output
layer's input, ``4 s b h``, is whole on each TP rank, as the layer's norms are); the ends are given with the head and
loss at once and over ``model.loss_chunks`` = 16 sequence chunks (``trainers/head_loss.py``; the count
the search adds, ``orchestrator/planner/space.py``'s ``LEAN_CHUNKS``). Sequence
4096, micro-batch 1, bf16 parameters and compute, fused attention, no dropout.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from orchestrator import conf_dir  # noqa: E402
from orchestrator.config import Config  # noqa: E402
from orchestrator.planner import activations as acts  # noqa: E402
from orchestrator.planner.shapes import ModelShape  # noqa: E402
from orchestrator.planner.space import LEAN_CHUNKS  # noqa: E402

SEQ, B = 4096, 1
CHUNKS = LEAN_CHUNKS  # model.loss_chunks of the last column
LAYOUTS = [(1, False), (8, False), (8, True)]  # (tp, sequence parallel)


def model_shape(name: str) -> ModelShape:
    cfg = OmegaConf.structured(Config)
    cfg.model = OmegaConf.merge(cfg.model, OmegaConf.load(conf_dir() / "model" / f"{name}.yaml"))
    return ModelShape.of(cfg.model)


def megatron_layer(m: ModelShape, t: int, sp: bool) -> float:
    s, b, h = SEQ, B, m.d
    if sp:
        return s * b * h * (18 + 4 * m.d_ff / h) / t
    return s * b * h * (10 + (8 + 4 * m.d_ff / h) / t)


def megatron_ends(m: ModelShape, t: int, sp: bool) -> float:
    return 4 * SEQ * B * m.d / (t if sp else 1) + 4 * SEQ * B * m.vocab / t


def main() -> None:
    cfg = OmegaConf.structured(Config)
    cfg.precision.param_dtype = cfg.precision.compute_dtype = "bf16"
    print(
        f"per layer and for the ends (final norm, head, loss), this trainer / Megatron's formula; seq {SEQ}, "
        f"micro-batch {B}, bf16, fused attention"
    )
    print(
        f"{'model':<12}{'tp':>4}{'sp':>4}{'layer':>8}{'selective':>11}{'ends':>8}{f'ends/{CHUNKS}':>9}"
        f"{'Megatron MiB/layer':>20}"
    )
    for name in ("llama2_7b", "llama2_13b", "llama2_70b"):
        m = model_shape(name)
        ab = acts.ActBytes.of(cfg.precision, m, "cuda")
        for t, sp in LAYOUTS:
            layer = acts.layer_activation_bytes(m, SEQ, B, t, sp, ab)
            core = acts.core_activation_bytes(m, SEQ, B, t, ab)
            ends = ends_bytes(m, t, sp, ab)
            chunked = ends_bytes(dataclasses.replace(m, loss_chunks=CHUNKS), t, sp, ab)
            ref, ref_ends = megatron_layer(m, t, sp), megatron_ends(m, t, sp)
            print(
                f"{name:<12}{t:>4}{'on' if sp else '-':>4}{layer / ref:>8.2f}{(layer - core) / ref:>11.2f}"
                f"{ends / ref_ends:>8.2f}{chunked / ref_ends:>9.2f}{ref / 2**20:>20.0f}"
            )


def ends_bytes(m: ModelShape, t: int, sp: bool, ab) -> float:
    """The final norm, head and loss: what they save and the loss's own peak."""
    return acts.head_activation_bytes(m, SEQ, B, t, sp, ab) + acts.loss_transient_bytes(m, SEQ, B, t, ab)


if __name__ == "__main__":
    main()
