"""The automatic search's report (``+sweep=auto``, ``sweeps/auto_study.py``): the markdown, the
JSON it is made from, and the planner's predicted step time against the measured one, as files
in a folder. Written by the sweeper on its parent run, rendered again from that run by
``python -m orchestrator.report``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator import results

NAME = "auto_report"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def markdown(data: Dict[str, Any]) -> str:
    s = data["summary"]
    lines = [
        f"# Automatic search: {data['model']} on {data['devices']} x {data['chip']}",
        "",
        f"- planned: {data['points']} points, {data['fit']} fit, in {data['plan_seconds']:.2f} s",
        "- excluded: " + ("; ".join(f"{n} {why}" for why, n in data["excluded"].items()) or "none"),
        f"- measured: {s['trials']} trials, {s['trial_seconds']:.0f} trial-seconds "
        f"(budget: max_trials={data['budget']['max_trials']}, max_trial_seconds={data['budget']['max_trial_seconds']})",
        f"- stopped: {data['stop']}",
        f"- device-hours: {s.get('device_hours', 0.0):.3g} (budget: max_device_hours="
        f"{data['budget'].get('max_device_hours')}); planned memory corrected by out-of-memory trials: "
        f"x {s.get('memory_scale', 1.0):.2f}",
        f"- planner on the measured points: mean |error| {_pct(s['planner_mean_abs_error'])}, Kendall's tau "
        f"{results.fmt(s['planner_kendall_tau'], 2)}",
        f"- best: {s['best'] or '-'}" + (f" at {s['best_s']:.4g} s a step" if s["best_s"] else ""),
        f"- command: `{data['command']}`" if data.get("command") else "- command: -",
        "",
        "| candidate | fate | predicted s | corrected s | measured s | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["candidates"]:
        if r["fate"].startswith("not measured"):
            continue  # the table lists what ran or was ruled out; the rest are counted below
        lines.append(
            f"| {r['candidate']}{' (best)' if r['best'] else ''} | {r['fate']} | {r['predicted_s']:.4g} | "
            f"{results.fmt(r['corrected_s'])} | {_measured(r)} | {r['reason'][:120]} |"
        )
    lines += polish_lines(data.get("polish"))
    left = [r for r in data["candidates"] if r["fate"].startswith("not measured")]
    if left:
        lines += ["", f"{len(left)} candidate(s) {left[0]['fate']}; the next predicted: " + ", ".join(
            f"{r['candidate']} ({results.fmt(r['corrected_s'])} s)" for r in left[:5]
        )]  # fmt: skip
    return "\n".join(lines) + "\n"


def _measured(row: Dict[str, Any]) -> str:
    """A candidate's measured step time; with its runs where it ran more than once (confirmed)."""
    runs = row.get("samples") or []  # reports from before confirmation have no samples
    if len(runs) < 2:
        return results.fmt(row["measured_s"])
    return f"{results.fmt(row['measured_s'])} (median of {', '.join(results.fmt(v) for v in runs)})"


def polish_lines(p: Optional[Dict[str, Any]]) -> List[str]:
    """Stage 3's section: what one variable at a time from the winner changed."""
    if not p:
        return []
    if not p["ran"]:
        return ["", f"Polish: not run, {p['why_not']}."]
    t = p["trials"]
    lines = [
        "",
        f"Polish from the winner, one variable at a time ({', '.join(v['key'] for v in p['variables'])}): "
        f"S={results.fmt(p['s_total'], 3)} over the winner, {results.fmt(p['objective'])} s a step; "
        f"{t.get('launched', 0)} trial(s) launched, {t.get('trial_seconds', 0.0):.0f} trial-seconds; "
        f"a win needs S >= {p['threshold']:.3f}",
        "",
    ]
    lines += [f"- helped: {h}" for h in p["helped"]] or ["- helped: nothing (the winner stays as it was)"]
    lines += [f"- did not help: {h}" for h in p["did_not_help"]]
    lines += [f"- skipped: {h}" for h in p["skipped"]]
    return lines


def plot(data: Dict[str, Any], path: Path) -> bool:
    """Measured against predicted step time (log-log), the planner's raw prediction and the one
    corrected by the search's refit, with the diagonal; False when nothing was measured."""
    rows = [r for r in data["candidates"] if r["measured_s"]]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    meas = [r["measured_s"] for r in rows]
    ax.scatter([r["predicted_s"] for r in rows], meas, label="planner", marker="o")
    corr = [(r["corrected_s"], r["measured_s"]) for r in rows if r["corrected_s"]]
    if corr:
        ax.scatter(*zip(*corr), label="after the refit", marker="x")
    lo = min([r["predicted_s"] for r in rows] + meas) / 1.5
    hi = max([r["predicted_s"] for r in rows] + meas + [c for c, _ in corr]) * 1.5
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, label="measured = predicted")
    best = [r for r in rows if r["best"]]
    if best:
        ax.annotate("best", (best[0]["predicted_s"], best[0]["measured_s"]))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s)")
    s = data["summary"]
    ax.set_title(
        f"{data['model']} on {data['devices']} x {data['chip']}: {s['trials']} trials, "
        f"tau {results.fmt(s['planner_kendall_tau'], 2)}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def render(data: Dict[str, Any], out_dir: Path | str) -> List[Path]:
    """The markdown (first), the JSON and the predicted-versus-measured plot, in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / f"{NAME}.md", out / f"{NAME}.json", out / f"{NAME}_predicted_vs_measured.png"
    text = markdown(data)
    has_plot = plot(data, png)
    if has_plot:
        text += f"\n![predicted against measured]({png.name})\n"
    md.write_text(text)
    js.write_text(json.dumps(data, indent=1, default=str))
    return [md, js] + ([png] if has_plot else [])
