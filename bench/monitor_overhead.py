"""Cost of the precision monitor: step time with it off, and on every k steps, in one run.

    python bench/monitor_overhead.py [--steps 30] [--repeats 3] [--every 1 10]

The variants are interleaved over repeats (``trainers.loop.train`` in this process, gpt_tiny,
no tracking); each figure is the median over repeats of the run's median step time after the
warm-up steps. The ratio is against monitoring off. The non-finite tracker (one isfinite
reduction per block, always on) is part of every variant.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402

from orchestrator import conf_dir, trial  # noqa: E402
from orchestrator.config import register_configs  # noqa: E402
from trainers.loop import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10])
    args = ap.parse_args()
    register_configs()
    base = [
        "+chip=cpu",
        f"trainer.steps={args.steps}",
        "trainer.warmup_steps=5",
        "tracking.enabled=false",
        "data.num_workers=0",
    ]
    specs = {}
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        for k in [0, *args.every]:
            specs[k] = trial.build_spec(trial.prepare(compose("config", overrides=[*base, f"precision.monitor={k}"])))
    train(specs[0])  # warm the corpus cache and allocator
    times: dict[int, list[float]] = {k: [] for k in specs}
    for _ in range(args.repeats):
        for k, spec in specs.items():
            times[k].append(train(spec)["step_time_median_s"])
    off = statistics.median(times[0])
    print(f"gpt_tiny, {args.steps} steps (5 not timed), repeats={args.repeats}")
    print(f"{'monitor':<12} {'step_time_s':>12} {'ratio to off':>13}")
    for k, values in times.items():
        t = statistics.median(values)
        print(f"{'off' if k == 0 else f'every {k}':<12} {t:>12.4f} {t / off:>13.3f}")


if __name__ == "__main__":
    main()
