"""The device check's report: its table's columns, the table, and what the dry mode checks.

    from bench.device_report import check_dry, table
    print(table(rows, comm))          # one markdown row per case, then the communicator's memory
    problems = check_dry(rows, comm)  # empty when every row finished with every figure

``bench/device_check.py`` runs the rows (its module docstring says what each column means) and
prints and writes what these functions make of them.
"""

from __future__ import annotations

# The table's columns, in order: a row's key and the format of its value (None reads "-").
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
    ("planned_step_s", "{:.4f}"),
    ("step_plan_over_measured", "{:.2f}"),
    ("planned_gb", "{:.2f}"),
    ("reserved_gb", "{:.2f}"),
    ("allocated_gb", "{:.2f}"),
    ("device_used_gb", "{:.2f}"),
    ("plan_over_reserved", "{:.2f}"),
    ("planned_alloc_gb", "{:.2f}"),
    ("alloc_plan_over_measured", "{:.2f}"),
    ("compute_share", "{:.1%}"),
    ("comm_share", "{:.1%}"),
    ("plain_step_s", "{:.4f}"),
    ("plain_mfu", "{:.1%}"),
    ("trainer_over_plain", "{:.2f}"),
    ("wall_s", "{:.0f}"),
]


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
    real mode reports, the plain loop's included (MFU stays unknown on an emulated or CPU chip
    only if the chip has no peak)."""
    problems = []
    needed = ["step_s", "tokens_per_s", "mfu", "planned_step_s", "step_plan_over_measured"]
    needed += ["planned_gb", "reserved_gb", "allocated_gb", "device_used_gb"]
    needed += ["plan_over_reserved", "planned_alloc_gb", "alloc_plan_over_measured"]
    needed += ["plain_step_s", "plain_mfu", "trainer_over_plain"]
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
        if r.get("plain_status", "finished") != "finished":
            problems.append(f"{r['case']}: plain loop {r['plain_status']}")
        if missing:
            problems.append(f"{r['case']}: no {', '.join(missing)}")
    if comm.get("status") != "finished":
        problems.append(f"comm_memory: {comm.get('reason')}")
    return problems
