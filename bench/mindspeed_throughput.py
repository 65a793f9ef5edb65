"""The search's best planned throughput on Ascend 910B against MindSpeed-LLM's published figures.

    python bench/mindspeed_throughput.py [--json]

For each case (Llama-2 7B on 8 NPUs, 13B on 32, 70B on 64 and on 1024; sequence 4096; bf16
parameters with fp32 master weights and bf16 compute, as MindSpeed-LLM's Llama-2 scripts train)
the whole space the trainer can run is planned (``orchestrator.planner.search.plan_space``: every
layout, batch split, schedule, recompute, data-parallel mode and sequence parallelism) and the
fastest point that fits is printed with its tokens per second per NPU, beside the figure
MindSpeed-LLM publishes for the model (:data:`PUBLISHED`, with where). The planner runs with its
default assumptions: nothing here is fitted to these figures. The global batches are this
script's, MindSpeed's own where its example scripts give one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# model preset, NPUs, global batch (sequences of 4096 tokens)
CASES = [
    ("llama2_7b", 8, 256),
    ("llama2_13b", 32, 512),
    ("llama2_70b", 64, 1024),
    ("llama2_70b", 1024, 1024),
]
# tokens/s per NPU MindSpeed-LLM (then ModelLink) published for Llama-2, bf16, seq 4096, in the
# model table of its README.md at commit b2915bd2 (2024-04-26), each with the example script's
# layout: 7B on 8 NPUs (TP1 PP2 DP4, global batch 256), 13B on 8 (TP8, 512), 70B on 64 (TP8
# PP8, 1024). Its newest tokens/s table (tag v1.0.RC3.0, MCore with MC2 on, Atlas 900 A2 PODc):
# 4672, 2016 and 439 (70B on 32 NPUs); later releases publish MFU only.
PUBLISHED = {
    "llama2_7b": (4200, 4672, "8 NPUs, TP1 PP2 DP4, gbs 256"),
    "llama2_13b": (1990, 2016, "8 NPUs, TP8, gbs 512"),
    "llama2_70b": (350, 439, "64 NPUs, TP8 PP8, gbs 1024 (v1.0.RC3.0: 32 NPUs)"),
}
SEQ = 4096


def plan(model: str, devices: int, batch: int) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import conf_dir
    from orchestrator.config import register_configs
    from orchestrator.planner.search import plan_space

    register_configs()
    GlobalHydra.instance().clear()
    overrides = [
        "+chip=ascend910b",
        f"model={model}",
        "precision=bf16",
        "precision.param_dtype=bf16",
        f"trainer.global_batch={batch}",
        f"trainer.seq_len={SEQ}",
    ]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    res = plan_space(cfg, devices)
    GlobalHydra.instance().clear()
    if not res.plans:
        return {"model": model, "devices": devices, "batch": batch, "point": None, "count": res.count}
    best = res.plans[0]
    tokens = batch * SEQ / best.step.step_time_s / devices
    published, newest, _ = PUBLISHED[model]
    return {
        "model": model,
        "devices": devices,
        "batch": batch,
        "point": best.candidate.name,
        "count": res.count,
        "fit": res.fit,
        "step_time_s": best.step.step_time_s,
        "mfu": best.step.mfu,
        "tokens_per_s_per_npu": tokens,
        "published": published,
        "ratio": tokens / published,
        "newest": newest,
        "ratio_newest": tokens / newest,
        "seconds": res.seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [plan(*case) for case in CASES]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"ascend910b, seq {SEQ}, bf16 parameters (fp32 masters), the search's best planned point, no fit")
    print(
        f"{'model':<11}{'NPUs':>6}{'batch':>6}  {'point':<58}{'step_s':>8}{'mfu':>6}{'tok/s/NPU':>10}"
        f"{'MindSpeed':>10}{'ratio':>7}{'newest':>8}{'ratio':>7}"
    )
    for r in rows:
        if r["point"] is None:
            print(f"{r['model']:<11}{r['devices']:>6}{r['batch']:>6}  no point fits ({r['count']} planned)")
            continue
        print(
            f"{r['model']:<11}{r['devices']:>6}{r['batch']:>6}  {r['point']:<58}{r['step_time_s']:>8.2f}"
            f"{100 * r['mfu']:>5.1f}%{r['tokens_per_s_per_npu']:>10.0f}{r['published']:>10}{r['ratio']:>7.2f}"
            f"{r['newest']:>8}{r['ratio_newest']:>7.2f}"
        )
    print("MindSpeed-LLM's figures: README.md at commit b2915bd2 (newest: tag v1.0.RC3.0), measured at")
    for model, (_, _, where) in PUBLISHED.items():
        print(f"  {model}: {where}")


if __name__ == "__main__":
    main()
