"""Step time and tokens/s of every parallel preset that fits this machine, and the ratio to `single`.

    python bench/parallel_presets.py [--model gpt_tiny] [--steps 20] [--repeats 2] [--max-procs 8]

Each preset runs as a real trial (torch's elastic launcher, gloo on CPU) with the same global
batch; presets are interleaved over ``--repeats`` rounds and each figure is the median over
rounds of the trial's median step time after its warm-up steps. On a CPU host the workers share
the cores, so these ratios measure the cost of the parallel machinery (collectives, pipeline
bubble, process count), not a speed-up: on real devices each rank has its own chip.
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
from orchestrator.layout import layout  # noqa: E402

PRESETS = ["single", "dp2", "dp4", "dp8", "tp2", "tp4", "pp2", "pp4", "tp2pp2", "dp2tp2", "dp2pp2", "dp2tp2pp2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-procs", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args()

    register_configs()
    base = [
        "+chip=cpu",
        f"model={args.model}",
        f"trainer.steps={args.steps}",
        f"trainer.warmup_steps={args.warmup}",
        f"trainer.global_batch={args.global_batch}",
        "trainer.micro_batch=2",
        "tracking.enabled=false",
    ]
    configs = {}
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        for name in PRESETS:
            cfg = compose("config", overrides=[*base, f"parallel={name}"])
            try:
                trial.prepare(cfg)
            except trial.ConfigError as err:
                print(f"skip {name}: {err.errors[0]}")
                continue
            if layout(cfg).world_size <= args.max_procs:
                configs[name] = cfg
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, cfg in configs.items():
            result = trial.run(cfg.copy(), [f"parallel={name}"], progress=False)
            if result["status"] != "finished":
                print(f"{name}: {result['status']}: {result.get('reason')}")
                continue
            times[name].append(result["summary"]["step_time_median_s"])
    tokens = args.global_batch * configs["single"].trainer.seq_len
    base_t = statistics.median(times["single"])
    print(
        f"model={args.model} global_batch={args.global_batch} seq_len={configs['single'].trainer.seq_len} "
        f"steps={args.steps} (first {args.warmup} not timed) repeats={args.repeats}"
    )
    print(f"{'preset':<11} {'procs':>5} {'step_time_s':>12} {'tokens/s':>10} {'vs single':>10}")
    for name, values in times.items():
        if not values:
            continue
        t = statistics.median(values)
        print(f"{name:<11} {layout(configs[name]).world_size:>5} {t:>12.4f} {tokens / t:>10.0f} {base_t / t:>10.3f}")


if __name__ == "__main__":
    main()
