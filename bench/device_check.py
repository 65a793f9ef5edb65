"""The prepared device check: what a lent GPU (or NPU) machine runs, in one table.

    python bench/device_check.py            # on a machine with a GPU: the real check, < 8 min on one
    python bench/device_check.py --dry      # anywhere: gpt_tiny on the CPU, the check's own plumbing

Real mode (a CUDA GPU or an Ascend NPU is visible, the chip detected by its full name):
``gpt2_small`` trials through the real entry path (``orchestrator.trial.run``: validation,
planner preflight, torch's elastic launcher, the trainer, MLflow in a temporary sqlite store):

- bf16 and fp16 at world size 1, and at world size 2 where the machine has two devices;
- compile on (the device's default backend) beside compile off, bf16, world size 1;
- the profiler over a window of each bf16 trial: compute share and exposed communication share;
- the communicator's memory measured by ``bench/comm_memory.py`` beside the planner's term.

Per trial the table gives the median step time after the warm-up, tokens/s, the MFU against the
detected chip's dense peak for the dtype, the planner's memory per rank against what the
allocator reserved (and what the device itself reports used), and the profile split. Dry mode
runs the same rows with gpt_tiny on the CPU (gloo, a few steps, compile off) and checks that
every row finished and every column the real mode fills is there. Exit code 1 when a row failed.
``--out DIR`` (default ``$OUT`` when set) also writes ``device_check.md`` and ``.json``.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLUMNS = [
    ("case", "{}"),
    ("chip", "{}"),
    ("world", "{}"),
    ("dtype", "{}"),
    ("compile", "{}"),
    ("status", "{}"),
    ("step_s", "{:.4f}"),
    ("tokens_per_s", "{:.0f}"),
    ("mfu", "{:.1%}"),
    ("planned_gb", "{:.2f}"),
    ("reserved_gb", "{:.2f}"),
    ("allocated_gb", "{:.2f}"),
    ("device_used_gb", "{:.2f}"),
    ("plan_over_reserved", "{:.2f}"),
    ("compute_share", "{:.1%}"),
    ("comm_share", "{:.1%}"),
    ("wall_s", "{:.0f}"),
]


def cases(dry: bool, devices: int) -> list[dict]:
    """The rows: (name, world, dtype, compile, profile)."""
    rows = [
        dict(case="bf16", world=1, dtype="bf16", compile=False, profile=True),
        dict(case="fp16", world=1, dtype="fp16", compile=False, profile=False),
    ]
    if not dry:
        rows.append(dict(case="bf16+compile", world=1, dtype="bf16", compile=True, profile=False))
    if dry or devices >= 2:
        rows.append(dict(case="bf16 x2", world=2, dtype="bf16", compile=False, profile=True))
        rows.append(dict(case="fp16 x2", world=2, dtype="fp16", compile=False, profile=False))
    return rows


def overrides(row: dict, dry: bool, uri: str, steps: int) -> list[str]:
    base = [f"tracking.uri={uri}", "tracking.experiment=device_check", f"precision={row['dtype']}"]
    base += [f"parallel.dp={row['world']}", f"launch.world_size={row['world']}"]
    if dry:
        base += ["+chip=cpu", "model=gpt_tiny", "trainer=smoke", f"trainer.steps={steps}", "trainer.warmup_steps=2"]
        window = (2, 2)
    else:
        # gpt2_small at its full context: 16 sequences of 1024 tokens per step, micro-batches of 8
        base += ["model=gpt2_small", f"trainer.steps={steps}", "trainer.warmup_steps=10", "trainer.seq_len=1024"]
        base += ["trainer.global_batch=16", "trainer.micro_batch=8", "data.num_workers=2"]
        window = (steps - 8, 3)
    if row["compile"]:
        base.append("trainer.compile=true")
    if row["profile"]:
        base += ["trainer.profile=true", f"trainer.profile_start={window[0]}", f"trainer.profile_steps={window[1]}"]
    return base


def run_row(row: dict, dry: bool, uri: str, steps: int, workdir: Path) -> dict:
    from hydra import compose, initialize_config_dir

    from orchestrator import conf_dir, trial

    ov = overrides(row, dry, uri, steps)
    t0 = time.perf_counter()
    os.chdir(workdir)  # profiles/ and checkpoints/ of the trial land here
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=ov)
    try:
        result = trial.run(cfg, ov, progress=False)
    except trial.ConfigError as err:
        return {**row, "status": "config error", "reason": "; ".join(err.errors)}
    s = result.get("summary") or {}
    pre = result.get("preflight") or {}
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
        "compute_share": s.get("compute_share"),
        "comm_share": s.get("comm_share"),
        "wall_s": time.perf_counter() - t0,
        "run_id": result.get("run_id"),
    }
    return out


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


def fmt(value, spec: str) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(rows: list[dict], comm: dict) -> str:
    head = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(name), spec) for name, spec in COLUMNS) + " |")
    measured = comm.get("measured_mib")
    seen = "n/a (CPU)" if measured is None else f"{measured:.1f} MiB"
    fitted = comm.get("fitted_nccl_channels")
    lines.append("")
    lines.append(
        f"communicator memory ({comm.get('backend', '?')}, world {comm.get('world', '?')}): measured {seen}, "
        f"planned {fmt(comm.get('planned_mib'), '{:.1f}')} MiB"
        + (f", planner.nccl_channels that fits: {fitted:.1f}" if fitted else "")
    )
    return "\n".join(lines)


def check_dry(rows: list[dict], comm: dict) -> list[str]:
    """What the dry mode holds its own plumbing to: every row finished with every figure the
    real mode reports (MFU stays unknown on an emulated or CPU chip only if the chip has no peak)."""
    problems = []
    needed = ["step_s", "tokens_per_s", "planned_gb", "reserved_gb", "allocated_gb", "device_used_gb"]
    needed.append("plan_over_reserved")
    for r in rows:
        if r["status"] != "finished":
            problems.append(f"{r['case']}: {r['status']} {r.get('reason', '')}")
            continue
        missing = [k for k in needed if r.get(k) is None]
        if r["profile"]:
            missing += [k for k in ("compute_share", "comm_share") if r.get(k) is None]
            shares = (r.get("compute_share") or 0) + (r.get("comm_share") or 0)
            if shares > 1 + 1e-9:
                problems.append(f"{r['case']}: compute + comm share {shares:.3f} > 1")
        if missing:
            problems.append(f"{r['case']}: no {', '.join(missing)}")
    if comm.get("status") != "finished":
        problems.append(f"comm_memory: {comm.get('reason')}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="gpt_tiny on the CPU: the check's own plumbing")
    ap.add_argument("--steps", type=int, default=0, help="steps per trial (default 40; dry 6)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write device_check.md/.json here")
    args = ap.parse_args()

    from bench.comm_memory import device_kind
    from orchestrator.config import register_configs

    kind, count = device_kind()
    dry = args.dry or kind == "cpu"
    steps = args.steps or (6 if dry else 40)
    register_configs()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        uri = "sqlite:///" + str(Path(tmp) / "mlruns.db")
        rows = [run_row(r, dry, uri, steps, Path(tmp)) for r in cases(dry, count)]
        os.chdir(ROOT)
    comm = comm_memory_row(dry)
    text = table(rows, comm)
    mode = "dry (CPU plumbing)" if dry else f"{kind} x{count}"
    print(f"device check: {mode}, {steps} steps per trial, {time.perf_counter() - started:.0f} s in all")
    print(text)
    failed = [r for r in rows if r.get("status") != "finished"]
    for r in failed:
        print(f"{r['case']}: {r.get('status')}: {r.get('reason', '')}")
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
