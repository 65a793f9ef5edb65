"""Steady-state tokens/s of the trainer against a plain PyTorch loop of the same model.

    python bench/trainer_throughput.py [--steps 40] [--repeats 3] [--model gpt_tiny]

Three variants, interleaved in one run so that they see the same machine state, each repeated
``--repeats`` times; a variant's figure is the median over repeats of its median step time after
the warm-up steps:

- plain:    model + AdamW (the trainer's kernel) + cross-entropy on tokens already in memory;
            nothing else (``bench/plain_loop.py``).
- trainer:  ``trainers.loop.train`` in this process (real corpus through the DataLoader, LR
            schedule, gradient clipping, loss scaler bookkeeping, metric batching).
- launched: the full path, ``orchestrator.trial.run``: torch's elastic launcher starts one
            worker process (tracking off); start-up is not in the figure, steady state is.

``--ablate`` adds variants that account for the gap, each the trainer in this process with one
of its per-step parts taken out (figures only: the trainer never runs so):

- no-tracker: the per-block non-finite probes (one fp32 sum of each block output);
- no-norm:    the global gradient norm (clipping and the overflow flag read it);
- spawned:    the trainer alone in a fresh process (multiprocessing spawn, no launcher), and
- plain-spawned: the plain loop likewise: a fresh process against a fresh process, what being a
              new process costs either loop (its allocator and thread pool not yet warm), apart
              from the elastic launcher's.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from bench.plain_loop import plain_loop  # noqa: E402
from orchestrator import conf_dir, trial  # noqa: E402
from orchestrator.config import register_configs  # noqa: E402
from trainers.loop import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--ablate", action="store_true", help="also the variants that account for the gap")
    args = ap.parse_args()

    register_configs()
    overrides = [
        "+chip=cpu",
        f"model={args.model}",
        f"trainer.steps={args.steps}",
        f"trainer.warmup_steps={args.warmup}",
        "tracking.enabled=false",
    ]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = trial.prepare(compose("config", overrides=overrides))
    spec = trial.build_spec(cfg)
    tokens = cfg.trainer.global_batch * cfg.trainer.seq_len
    train(spec)  # builds the corpus cache and warms the allocator before anything is timed

    ablations = ["no-tracker", "no-norm", "spawned", "plain-spawned"]
    names = ["plain", "trainer", "launched"] + (ablations if args.ablate else [])
    runs: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        runs["plain"].append(plain_loop(spec, args.steps, args.warmup))
        runs["trainer"].append(train(spec)["step_time_median_s"])
        result = trial.run(cfg.copy(), overrides, progress=False)
        runs["launched"].append(result["summary"]["step_time_median_s"])
        if args.ablate:
            for name in ("no-tracker", "no-norm"):
                with _without(name):
                    runs[name].append(train(spec)["step_time_median_s"])
            runs["spawned"].append(_spawned(spec, "trainer", args))
            runs["plain-spawned"].append(_spawned(spec, "plain", args))

    base = statistics.median(runs["plain"])
    print(
        f"model={args.model} global_batch={cfg.trainer.global_batch} seq_len={cfg.trainer.seq_len} "
        f"steps={args.steps} (first {args.warmup} not timed) repeats={args.repeats} threads={torch.get_num_threads()}"
    )
    print(f"{'variant':<13} {'step_time_s':>12} {'tokens/s':>10} {'ratio to plain':>15} {'ms over plain':>14}")
    for name, values in runs.items():
        st = statistics.median(values)
        print(f"{name:<13} {st:>12.4f} {tokens / st:>10.0f} {base / st:>15.3f} {1e3 * (st - base):>14.1f}")


@contextlib.contextmanager
def _without(part: str):
    """The trainer with one per-step part replaced by a no-op (bench figures only)."""
    import trainers.loop as loop
    from trainers.monitor import FiniteTracker

    saved = (FiniteTracker._hook, loop.global_grad_norm)
    if part == "no-tracker":
        FiniteTracker._hook = lambda self, slot: lambda module, inputs, output: None
    else:
        loop.global_grad_norm = lambda params, mesh: torch.zeros((), dtype=torch.float64)
    try:
        yield
    finally:
        FiniteTracker._hook, loop.global_grad_norm = saved


def _child(spec, which: str, steps: int, warmup: int, out) -> None:
    out.put(train(spec)["step_time_median_s"] if which == "trainer" else plain_loop(spec, steps, warmup))


def _spawned(spec, which: str, args) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(spec, which, args.steps, args.warmup, out))
    proc.start()
    value = out.get()
    proc.join()
    return value


if __name__ == "__main__":
    main()
