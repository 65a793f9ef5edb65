"""The prepared device check: what a lent GPU (or NPU) machine runs, in one table.

    python bench/device_check.py            # on a machine with a GPU: the real check, < 8 min on one H200
    python bench/device_check.py --dry      # anywhere: gpt_tiny and llama_tiny on the CPU, the check's plumbing

Real mode (a CUDA GPU or an Ascend NPU is visible, the chip detected by its full name): trials
through the real entry path (``orchestrator.trial.run``: validation, planner preflight, torch's
elastic launcher, the trainer, MLflow in a temporary sqlite store), of two models:

- ``gpt2_small`` (124M) at its full context: 16 sequences of 1024 tokens a step, micro-batches
  of 8 (two accumulated), 40 steps, the first 10 not timed;
- ``llama_1b`` (``conf/model/llama_1b.yaml``, 1.04B, grouped-query attention) at 2048 tokens:
  16 sequences a step in one micro-batch of 16, which the planner puts at 95.6 GiB of the
  H200's 141 GB (params, grads and AdamW state 15.5, activations and the loss's peak 74.2, the
  runtime reserve 6.0; 87.9 allocated on one on 2026-12-04), 10 steps, 3 not timed;

each in bf16 and fp16, compile off, then compile on (the device's default backend, per block) in
bf16 and then fp16 while the time budget (``--budget-s``, 480) allows: a row whose estimate (the
walls its model's earlier rows took) would end past it is recorded ``skipped (budget)``. At world
size 2 too (gpt2_small, compile off) where the machine has two devices. Every trial is profiled
over a window of timed steps: compute share and exposed communication share. Then
``bench/comm_memory.py`` measures the communicator's memory beside the planner's term, and last
(so no trial shares the device with this process's context) ``bench/plain_loop.py`` trains each
row's model in this process, same micro-batch, accumulation, sequence length, dtype and compile
setting, timed by device events with one synchronisation at the end.

Per row the table gives the median step time after the warm-up, tokens/s, the MFU against the
detected chip's dense peak for the dtype, the planner's step time for the same config (default
efficiencies, no fit) and its ratio to the measured one, the planner's memory per rank against
what the allocator allocated and reserved and what the device itself reports used, the profile
split, the plain loop's step time and MFU (same FLOPs, same peak) and ``trainer_over_plain``
(the trainer's MFU over the plain loop's, = plain step time / trainer step time).

The estimate of the real mode on one H200, from FLOPs at about 40% of the 989 TFLOP/s dense bf16
peak (396 TFLOP/s): gpt2_small 0.86 GFLOP a token (6N + 12 L d T) x 16,384 tokens = 14 TFLOP, 36
ms a step, 1.4 s of compute per 40-step run; llama_1b 7.0 GFLOP a token x 32,768 = 230 TFLOP, 0.58
s a step, 6 s per 10-step run. Around that: a trial's start (launcher, worker imports, CUDA
context, the model's initialisation on the host, MLflow) about 20 s for gpt2_small and 30 s for
llama_1b, a plain loop's model build 3 and 10 s, and a compile of one block's forward and backward
about 40 s in the trial and again in the plain loop (Inductor's on-disk cache may shorten the
second). Compile-off rows: gpt2_small 3 x 26 s, llama_1b 3 x 52 s (each row trial + plain loop),
the bf16 compile rows +80 s each, the communicator 15 s: about 7 min; the fp16 compile rows
run only if the rest came in under that.

Dry mode runs gpt_tiny (bf16, fp16, and at world size 2 over gloo) and llama_tiny (bf16, fp16)
on the CPU, a few steps, compile off, and checks that every row finished and every column the
real mode fills is there. Exit code 1 when a row failed (a row skipped for the budget is not a
failure). ``--out DIR`` (default ``$OUT`` when set) also writes ``device_check.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.device_report import check_dry, table  # noqa: E402  (the table's columns, and the dry mode's checks)

# Per model: the overrides, steps, warm-up steps (not timed) and the profiler's window (start,
# steps), inside the timed steps. Dry: the CPU presets at trainer=smoke's shapes.
MODELS = {
    "gpt2_small": dict(
        overrides=["trainer.seq_len=1024", "trainer.global_batch=16", "trainer.micro_batch=8"],
        steps=40,
        warmup=10,
        window=(32, 3),
        guess_s=30.0,  # a row's trial, before any row of the model has run (compile-off; compile x3)
    ),
    "llama_1b": dict(
        overrides=["trainer.seq_len=2048", "trainer.global_batch=16", "trainer.micro_batch=16"],
        steps=10,
        warmup=3,
        window=(6, 2),
        guess_s=45.0,
    ),
}
DRY_MODELS = {
    "gpt_tiny": dict(overrides=["trainer=smoke"], steps=6, warmup=2, window=(2, 2), guess_s=10.0),
    "llama_tiny": dict(overrides=["trainer=smoke"], steps=6, warmup=2, window=(2, 2), guess_s=10.0),
}
PLAIN_SHARE = 0.7  # a plain loop's wall against its trial's, for the budget before it has run
COMM_RESERVE_S = 20.0  # bench/comm_memory.py's processes, kept back from the budget


def cases(dry: bool, devices: int) -> list[dict]:
    """The rows, in the order they run (what matters most first: the budget cuts from the end)."""
    models = DRY_MODELS if dry else MODELS
    both = ("bf16", "fp16")
    rows = []
    for i, model in enumerate(models):
        # dry: the plumbing, not the figures; one dtype per model (they alternate), both covered
        for dtype in (both[i % 2],) if dry else both:
            rows.append(dict(model=model, world=1, dtype=dtype, compile=False))
    first = next(iter(models))
    if dry or devices >= 2:
        for dtype in both[:1] if dry else both:
            rows.append(dict(model=first, world=2, dtype=dtype, compile=False))
    if not dry:
        for dtype in ("bf16", "fp16"):
            for model in models:
                rows.append(dict(model=model, world=1, dtype=dtype, compile=True))
    for r in rows:
        r["case"] = (
            f"{r['model']} {r['dtype']}" + ("+compile" if r["compile"] else "") + (" x2" if r["world"] > 1 else "")
        )
        r["profile"] = True
    return rows


def model_setup(row: dict, dry: bool, steps: int = 0) -> dict:
    setup = dict((DRY_MODELS if dry else MODELS)[row["model"]])
    if steps:  # --steps: the same warm-up, the window just before the end
        setup["steps"] = steps
        setup["warmup"] = min(setup["warmup"], max(steps - 3, 0))
        setup["window"] = (max(steps - setup["window"][1] - 1, setup["warmup"]), setup["window"][1])
    return setup


def overrides(row: dict, dry: bool, uri: str, steps: int = 0) -> list[str]:
    setup = model_setup(row, dry, steps)
    base = [f"tracking.uri={uri}", "tracking.experiment=device_check", f"precision={row['dtype']}"]
    base += [f"parallel.dp={row['world']}", f"launch.world_size={row['world']}", f"model={row['model']}"]
    if dry:
        base.append("+chip=cpu")
    base += setup["overrides"]
    base += [f"trainer.steps={setup['steps']}", f"trainer.warmup_steps={setup['warmup']}"]
    if row["compile"]:
        base.append("trainer.compile=true")
    if row["profile"]:
        start, n = setup["window"]
        base += ["trainer.profile=true", f"trainer.profile_start={start}", f"trainer.profile_steps={n}"]
    return base


def compose(ov: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import conf_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=ov)


def run_row(row: dict, dry: bool, uri: str, steps: int, workdir: Path) -> dict:
    from orchestrator import trial

    ov = overrides(row, dry, uri, steps)
    t0 = time.perf_counter()
    os.chdir(workdir)  # profiles/ and checkpoints/ of the trial land here
    cfg = compose(ov)
    try:
        result = trial.run(cfg, ov, progress=False)
    except trial.ConfigError as err:
        return {**row, "status": "config error", "reason": "; ".join(err.errors), "overrides": ov}
    s = result.get("summary") or {}
    pre = result.get("preflight") or {}
    parts = pre.get("memory_gb") or {}
    terms = [parts.get(k) for k in ("params", "grads", "optimizer", "activations")]
    alloc = sum(terms) if None not in terms else None
    planned_step = (pre.get("step") or {}).get("step_time_s")
    out = {
        **row,
        "chip": cfg.chip.name,
        "status": result["status"],
        "reason": result.get("reason", ""),
        "step_s": s.get("step_time_median_s"),
        "tokens_per_s": s.get("tokens_per_s_median"),
        "mfu": s.get("mfu"),
        "planned_gb": pre.get("planned_mem_gb"),
        "reserved_gb": s.get("peak_mem_reserved_gb"),
        "allocated_gb": s.get("peak_mem_gb"),
        "device_used_gb": s.get("device_mem_used_gb"),
        "plan_over_reserved": s.get("mem_plan_ratio"),
        # what the caching allocator holds of the plan (no runtime reserve, no NCCL buffers)
        "planned_alloc_gb": alloc,
        "alloc_plan_over_measured": alloc / s["peak_mem_gb"] if alloc and s.get("peak_mem_gb") else None,
        # the planner's step time for this config, with its default efficiencies (no fit)
        "planned_step_s": planned_step,
        "step_plan_over_measured": planned_step / s["step_time_median_s"]
        if planned_step and s.get("step_time_median_s")
        else None,
        "compute_share": s.get("compute_share"),
        "comm_share": s.get("comm_share"),
        "trial_wall_s": time.perf_counter() - t0,
        "run_id": result.get("run_id"),
        "overrides": ov,
    }
    return out


def plain_key(row: dict) -> tuple:
    """Rows that share a plain loop: the same model, dtype and compile setting (the plain loop
    does a step's whole global batch in one process, whatever the trial's world size)."""
    return (row["model"], row["dtype"], row["compile"])


def plain_rows(rows: List[dict], dry: bool, steps: int, device: str, deadline: float) -> None:
    """Fill each finished row's plain-loop columns (``bench/plain_loop.py``), one loop per
    :func:`plain_key`, in this process, after every trial; skipped past ``deadline``."""
    from bench.plain_loop import plain_loop_stats
    from orchestrator import trial

    done: Dict[tuple, dict] = {}
    for r in rows:
        r["wall_s"] = r.get("trial_wall_s")
        if r.get("status") != "finished":
            continue
        key = plain_key(r)
        if key not in done:
            estimate = PLAIN_SHARE * r.get("trial_wall_s", 0.0)
            if time.perf_counter() + estimate > deadline:
                done[key] = {"plain_status": "skipped (budget)"}
            else:
                setup = model_setup(r, dry, steps)
                t0 = time.perf_counter()
                try:
                    spec = trial.build_spec(trial.prepare(compose(r["overrides"])))
                    stats = plain_loop_stats(spec, setup["steps"], setup["warmup"], device=device)
                    done[key] = {"plain_status": "finished", "plain_step_s": stats["step_s"]}
                    done[key]["plain_allocated_gb"] = stats["allocated_gb"]
                    done[key]["plain_reserved_gb"] = stats["reserved_gb"]
                except Exception as err:  # one loop's failure (out of memory, a compile error) is one row's
                    reason = (str(err).strip().splitlines() or [""])[0][:200]
                    done[key] = {"plain_status": f"failed: {type(err).__name__}: {reason}"}
                # the row that ran the loop carries its wall time; rows sharing it carry none
                r["wall_s"] = r["wall_s"] + time.perf_counter() - t0
        r.update(done[key])
        plain = r.get("plain_step_s")
        if plain and r.get("step_s"):
            r["trainer_over_plain"] = plain / r["step_s"]
            r["plain_mfu"] = r["mfu"] * r["step_s"] / plain if r.get("mfu") is not None else None


def estimate_s(row: dict, history: List[dict], dry: bool) -> float:
    """A row's trial wall time from its model's earlier rows (a compiled row from the model's
    last compiled one, else three times a compile-off one), else the model's guess."""
    same = [h for h in history if h["model"] == row["model"] and h.get("trial_wall_s")]
    like = [h["trial_wall_s"] for h in same if h["compile"] == row["compile"]]
    if like:
        return like[-1]
    base = [h["trial_wall_s"] for h in same if not h["compile"]]
    guess = base[-1] if base else model_setup(row, dry)["guess_s"]
    return guess * (3 if row["compile"] else 1)


def comm_memory_row(dry: bool) -> dict:
    """``bench/comm_memory.py`` in its own processes (it starts its own process group)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "comm_memory.py"), "--json", "--repeats", "1" if dry else "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        return {"status": "failed", "reason": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return {"status": "finished", **json.loads(proc.stdout.strip().splitlines()[-1])}


def run_rows(
    dry: bool, count: int, uri: str, steps: int, workdir: Path, deadline: float, only: Optional[List[str]] = None
) -> List[dict]:
    """Each row's trial, in order (of ``only``'s cases, when given), while its estimate (and the
    plain loops and communicator check still to come) ends before ``deadline``."""
    rows: List[dict] = []
    chosen = cases(dry, count)
    if only:
        unknown = sorted(set(only) - {r["case"] for r in chosen})
        if unknown:
            raise SystemExit(f"--only: no case {', '.join(map(repr, unknown))} (cases: {[r['case'] for r in chosen]})")
        chosen = [r for r in chosen if r["case"] in only]
    for row in chosen:
        trial_s = estimate_s(row, rows, dry)
        pending = sum(PLAIN_SHARE * r["trial_wall_s"] for r in rows if r.get("trial_wall_s"))
        if time.perf_counter() + trial_s * (1 + PLAIN_SHARE) + pending + COMM_RESERVE_S > deadline:
            rows.append({**row, "status": "skipped (budget)", "reason": f"estimated {trial_s:.0f} s"})
            continue
        rows.append(run_row(row, dry, uri, steps, workdir))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="gpt_tiny and llama_tiny on the CPU: the check's own plumbing")
    ap.add_argument("--steps", type=int, default=0, help="steps per trial (default per model: 40, 10; dry 6)")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="the whole check's time, rows past it skipped (480; dry: none)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write device_check.md/.json here")
    ap.add_argument(
        "--only", nargs="+", default=None, help="run only these cases, by their names ('llama_1b bf16+compile')"
    )
    args = ap.parse_args()

    from bench.comm_memory import device_kind
    from orchestrator.config import register_configs

    kind, count = device_kind()
    dry = args.dry or kind == "cpu"
    register_configs()
    started = time.perf_counter()
    budget = args.budget_s if args.budget_s is not None else (float("inf") if dry else 480.0)
    deadline = started + budget
    with tempfile.TemporaryDirectory() as tmp:
        uri = "sqlite:///" + str(Path(tmp) / "mlruns.db")
        rows = run_rows(dry, count, uri, args.steps, Path(tmp), deadline, args.only)
        os.chdir(ROOT)
    comm = comm_memory_row(dry)
    # last: this process takes the device only once no trial or communicator check needs it clean
    plain_rows(rows, dry, args.steps, "cpu" if dry else kind, deadline)
    text = table(rows, comm)
    mode = "dry (CPU plumbing)" if dry else f"{kind} x{count}"
    models = DRY_MODELS if dry else MODELS
    steps = ", ".join(f"{m} {model_setup(dict(model=m), dry, args.steps)['steps']}" for m in models)
    print(f"device check: {mode}, steps per trial: {steps}; {time.perf_counter() - started:.0f} s in all")
    print(text)
    failed = [r for r in rows if r.get("status") not in ("finished", "skipped (budget)")]
    for r in rows:
        if r.get("status") != "finished":
            print(f"{r['case']}: {r.get('status')}: {r.get('reason', '')}")
        elif r.get("plain_status") not in (None, "finished"):
            print(f"{r['case']}: plain loop {r['plain_status']}")
    problems = check_dry(rows, comm) if dry else []
    for p in problems:
        print(f"dry-mode check: {p}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "device_check.md").write_text(f"device check: {mode}\n\n{text}\n")
        record = {"mode": mode, "rows": rows, "comm": comm}
        Path(args.out, "device_check.json").write_text(json.dumps(record, default=str))
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
