"""A tuning report rendered: its markdown, its PNG plots (the objective per candidate value, each
repeat a dot; the loss curves of the baseline and finalists), and the copy attached to the sweep's
parent run in MLflow. The report's data comes from an OVAT study (``sweeps.ovat``) or from any
sweep's trials (``orchestrator.grid_report``); ``python -m orchestrator.report`` writes it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator import mlflow_ui, statuses, tags, tracking
from orchestrator.results import fmt

REPORT = "tuning_report"


# ----------------------------------------------------------------------------- rendering


def _slug(key: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", key.lstrip("+~")).strip("_") or "variable"


def markdown(data: Dict[str, Any]) -> str:
    """The tuning report as markdown: the study's rules and counts, its steps, the final config and
    its command, what helped and what did not, the plots."""
    lines = _head(data) + _steps(data["rows"]) + _final(data["final"], data["objective"])
    lines += ["", "## What helped", ""]
    lines += [f"- [x] {h}" for h in data["helped"]] or ["- nothing beat the baseline by more than the threshold"]
    lines += ["", "## What did not", ""]
    lines += [f"- [ ] {h}" for h in data["did_not_help"]] or ["- (every change tried helped)"]
    if data.get("skipped"):
        lines += ["", "## Not measured: no effect on the incumbent, or predicted slower", ""]
        lines += [f"- {s}" for s in data["skipped"]]
    plots = data.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _head(data: Dict[str, Any]) -> List[str]:
    """The title and the study's rules: objective, repeats, noise, threshold, trials spent."""
    obj, direction = data["objective"], data["direction"]
    s_word = "T_baseline / T" if direction == "minimize" else "value / value_baseline"
    title = f"Tuning report: {data.get('study') or data['kind']} (sweep {data['sweep']})"
    lines = [
        f"# {title}",
        "",
        f"- experiment `{data['experiment']}`, {data['kind']} sweep, objective `{obj}` ({direction}), S = {s_word}",
        f"- repeats per point: {data.get('repeats', 1)}; noise (spread of the baseline's repeats): "
        f"{100 * data.get('noise', 0.0):.1f}%; a change counts when S >= {data['threshold']:.3f} "
        f"(max of min_speedup {data['min_speedup']} and 1 + noise) and beats the spread of both points' "
        f"repeats; quality gate: no divergence, final loss within {data['loss_band']:.0%} of the baseline's",
    ]
    if data.get("fixed"):
        lines.append(f"- fixed overrides: `{' '.join(data['fixed'])}`")
    t = data.get("trials") or {}
    if t:
        lines.append(
            f"- trials: {t.get('launched', 0)} launched, {t.get('reused', 0)} reused from MLflow, "
            f"{t.get('pruned', 0)} pruned before launch, {t.get('predicted_skips', 0)} skipped as predicted slower; "
            f"{t.get('trial_seconds', 0.0):.1f} trial-seconds"
        )
    if data.get("planner_error") is not None:
        lines.append(
            f"- the planner's step-time error on the measured points (largest error of a predicted ratio): "
            f"{100 * data['planner_error']:.1f}%"
        )
    if data.get("outcome") not in (None, statuses.FINISHED):
        lines.append(f"- outcome: **{data['outcome']}**")
    return lines


def _steps(rows: List[Dict[str, Any]]) -> List[str]:
    """The table of the study's steps, the adopted values in bold."""
    lines = [
        "",
        "## Steps",
        "",
        "| step | pass | variable | value | n | median objective | spread | S vs baseline | S vs previous best "
        "| final loss | decision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decision = r["decision"].replace("|", "\\|")
        mark = "**" if r.get("adopted") else ""
        lines.append(
            f"| {r['step']} | {r.get('pass', '')} | `{r['variable']}` | {mark}`{r['value']}`{mark} | {r['n']} "
            f"| {fmt(r['objective'])} | {100 * r['spread']:.1f}% | {fmt(r['s_base'], 3)} "
            f"| {fmt(r.get('s_prev'), 3)} | {fmt(r['final_loss'])} | {decision} |"
        )
    return lines


def _final(final: Dict[str, Any], obj: str) -> List[str]:
    """The final config, its objective and speedup, and the command that reproduces it."""
    lines = ["", "## Final config", ""]
    if final.get("assignment"):
        lines += [f"- `{k}={v}`" for k, v in final["assignment"].items()]
    return lines + [
        "",
        f"{obj} = {fmt(final.get('objective'))}, S = {fmt(final.get('s_total'), 3)} over the baseline "
        f"(runs {', '.join(final.get('run_ids') or []) or '-'})",
        "",
        "Reproduce it:",
        "",
        "```",
        final["command"],
        "```",
    ]


def _save(fig: Any, path: Path) -> bool:
    """Write a figure (None: there was nothing to plot) as a PNG; whether one was written."""
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_variable(data: Dict[str, Any], key: str, path: Path) -> bool:
    return _save(_variable_figure(data, key), path)


def _plot_losses(curves: Dict[str, List[float]], path: Path) -> bool:
    return _save(_losses_figure(curves), path)


def _variable_figure(data: Dict[str, Any], key: str) -> Any:
    """The objective per value of one variable: each repeat a dot, the median a bar; an OVAT
    step's incumbent first, in gray; the adopted value in green; a point that did not run, in red.
    None when no row has the variable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a grid's per-variable view is its one-variable slices through the baseline
    rows = [r for r in data.get("variable_rows") or data["rows"] if r["variable"] == key]
    if not rows:
        return None
    columns = []  # (label, values, median, color, status)
    seen_refs = set()
    for r in rows:
        ref = r.get("reference_label")
        if ref is not None and (r.get("pass"), ref) not in seen_refs:
            seen_refs.add((r.get("pass"), ref))
            columns.append((f"{ref} (incumbent)", r.get("reference_values") or [], r.get("reference"), "gray", ""))
        label = str(r["value"]) if not r.get("pass") or r["pass"] <= 1 else f"{r['value']} (pass {r['pass']})"
        color = "tab:green" if r.get("adopted") else ("black" if r["step"] == 0 else "tab:blue")
        columns.append((label, r["values"], r["objective"], color, "" if r["values"] else r["status"]))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(columns) + 2), 3.4))
    for i, (label, values, median, color, missing) in enumerate(columns):
        if values:
            ax.scatter([i] * len(values), values, color=color, alpha=0.5, s=18)
            ax.scatter([i], [median], color=color, marker="_", s=500)
        else:
            ax.annotate(
                missing or "-",
                (i, 0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 8),
                textcoords="offset points",
                ha="center",
                color="tab:red",
                fontsize=8,
            )
    ax.set_xticks(range(len(columns)), [c[0] for c in columns], rotation=20, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(columns) - 0.4)
    ax.set_ylabel(data["objective"])
    ax.set_title(f"{key} ({data['direction']})", fontsize=9)
    fig.tight_layout()
    return fig


def _losses_figure(curves: Dict[str, List[float]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, losses in curves.items():
        ax.plot(range(len(losses)), [v if math.isfinite(v) else float("nan") for v in losses], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss curves: baseline and finalists", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def render(data: Dict[str, Any], out_dir: Path | str) -> List[Path]:
    """Write the report into ``out_dir``; returns the files, the markdown first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for var in data["variables"]:
        name = f"objective_{_slug(var['key'])}.png"
        if _plot_variable(data, var["key"], out / name):
            plots.append(name)
    if _plot_losses(data.get("curves") or {}, out / "loss_curves.png"):
        plots.append("loss_curves.png")
    data["plots"] = plots
    md = out / f"{REPORT}.md"
    md.write_text(markdown(data))
    js = out / f"{REPORT}.json"
    js.write_text(json.dumps(data, indent=1, default=str))
    return [md, js, *(out / p for p in plots)]


PLOTS = "plots"  # the artifact folder of the report's figures on its run


def _figures(data: Dict[str, Any]) -> Dict[str, Any]:
    """The report's plots by file name (as :func:`render` names them), each a function drawing it."""
    out: Dict[str, Any] = {
        f"objective_{_slug(v['key'])}.png": (_variable_figure, data, v["key"]) for v in data["variables"]
    }
    out["loss_curves.png"] = (_losses_figure, data.get("curves") or {})
    return out


def artifact_links(md: str, run_id: str, plots: List[str], base: Optional[str]) -> str:
    """The report's markdown with each plot's image linked where MLflow's UI can show it.

    The UI's markdown view (3.17's bundle, mlflow/server/js) prints an image whose URL has no
    scheme as the text ``[alt](url)``, and its URL filter drops ``data:`` sources: a sibling link
    (what the local copy has) or a relative one shows no picture there. The link used is the
    absolute URL the UI's own image view fetches an artifact from,
    ``BASE/get-artifact?path=...&run_uuid=...``, BASE the UI's root (:func:`mlflow_ui.ui_base`: the
    tracking server, or ``mlflow ui``'s default address for a local store). With no UI address (a
    Databricks workspace) the markdown keeps the artifact's path, ``plots/NAME``."""
    from urllib.parse import quote

    for name in plots:
        path = f"{PLOTS}/{name}"
        url = f"{base}/get-artifact?path={quote(path, safe='')}&run_uuid={run_id}" if base else path
        md = md.replace(f"]({name})", f"]({url})")
    return md


def attach(uri: str, run_id: str, files: List[Path], data: Dict[str, Any]) -> None:
    """Put the report on the sweep's parent run: the JSON and the markdown (its images linked for
    MLflow's UI, :func:`artifact_links`) at the top, each plot as a figure under ``plots/``
    (``MlflowClient.log_figure``), the final config, headline figures."""
    import matplotlib.pyplot as plt

    c = tracking.client(uri)
    figures = _figures(data)
    plots = [f.name for f in files if f.suffix == ".png"]
    for f in files:
        if f.suffix == ".md":
            c.log_text(run_id, artifact_links(f.read_text(), run_id, plots, mlflow_ui.ui_base(uri)), f.name)
        elif f.suffix == ".png" and f.name in figures:
            draw, *args = figures[f.name]
            fig = draw(*args)
            c.log_figure(run_id, fig, f"{PLOTS}/{f.name}", save_kwargs={"dpi": 100})
            plt.close(fig)
        else:
            c.log_artifact(run_id, str(f), PLOTS if f.suffix == ".png" else None)
    final = data["final"]
    c.set_tag(run_id, tags.TUNING_FINAL_OVERRIDES, " ".join(final["overrides"])[:5000])
    c.set_tag(run_id, tags.TUNING_COMMAND, final["command"][:5000])
    c.set_tag(run_id, tags.TUNING_OUTCOME, str(data.get("outcome", statuses.FINISHED)))
    base = data["rows"][0]["objective"] if data["rows"] else None
    t = data.get("trials") or {}
    tracking.log_metrics(
        uri,
        run_id,
        {
            "baseline_objective": base,
            "best_objective": final.get("objective"),
            "speedup": final.get("s_total"),
            "noise": data.get("noise"),
            "trials_launched": t.get("launched"),
            "trials_reused": t.get("reused"),
            "trials_pruned": t.get("pruned"),
            "trials_predicted_skips": t.get("predicted_skips"),
            "planner_error": data.get("planner_error"),
            "trial_seconds": t.get("trial_seconds"),
        },
    )


# ----------------------------------------------------------------------------- any sweep, from its trials
