"""Compare two trials step by step and layer by layer: where do they part?

    python -m orchestrator.compare RUN_A RUN_B [--threshold 0.02] [--tracking-uri URI] [--experiment NAME]
                                   [--out DIR] [--json] [--log]

RUN_A / RUN_B are MLflow run ids, or the start of one (as ``orchestrator.best`` prints them) among
the runs of --experiment. The per-step losses are aligned on the step; the first step
whose relative difference |a - b| / |a| exceeds the threshold is the first divergence. Where both
runs recorded per-layer statistics (``precision.monitor=k``), each sampled step's activation and
gradient statistics are compared per layer (relative error of mean |x|, cosine similarity of the
channel-mean fingerprints), and the first layer that departs (by the same threshold, or a
cosine below 1 - threshold) is named. Writes ``compare.md`` and ``compare_loss.png`` to --out;
``--log`` also logs them to RUN_B in MLflow. It exits 3 (nothing matched) when the two runs have
no logged loss step in common.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator import cli, exit_codes, results, tracking


def _losses(client, run_id: str) -> Dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, "loss")}


def _monitor(client, run_id: str) -> Dict[int, List[Dict[str, Any]]]:
    """Per sampled step, the monitor's rows (artifacts monitor/step_NNNNNN.json)."""
    import tempfile

    out: Dict[int, List[Dict[str, Any]]] = {}
    try:
        files = client.list_artifacts(run_id, "monitor")
    except Exception:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            local = client.download_artifacts(run_id, f.path, tmp)
            step = int(Path(f.path).stem.split("_")[-1])
            out[step] = json.loads(Path(local).read_text())
    return out


def _cosine(a: List[float], b: List[float]) -> Optional[float]:
    if not a or len(a) != len(b):
        return None
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else None


def rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-12)


def compare(uri: str, run_a: str, run_b: str, threshold: float = 0.02) -> Dict[str, Any]:
    client = tracking.client(uri)
    la, lb = _losses(client, run_a), _losses(client, run_b)
    steps = sorted(set(la) & set(lb))
    per_step = [{"step": s, "loss_a": la[s], "loss_b": lb[s], "rel_diff": rel(la[s], lb[s])} for s in steps]
    first_step = next((r["step"] for r in per_step if r["rel_diff"] > threshold), None)
    ma, mb = _monitor(client, run_a), _monitor(client, run_b)
    layers: List[Dict[str, Any]] = []
    for s in sorted(set(ma) & set(mb)):
        rows_b = {(r["layer"], r["kind"]): r for r in mb[s]}
        for r in ma[s]:
            other = rows_b.get((r["layer"], r["kind"]))
            if other is None:
                continue
            layers.append(
                {
                    "step": s,
                    "layer": r["layer"],
                    "kind": r["kind"],
                    "mean_abs_rel_err": rel(r["mean_abs"], other["mean_abs"]),
                    "max_abs_rel_err": rel(r["max_abs"], other["max_abs"]),
                    "cosine": _cosine(r.get("fingerprint", []), other.get("fingerprint", [])),
                    "nonfinite_a": r["nonfinite"],
                    "nonfinite_b": other["nonfinite"],
                }
            )
    first_layer = None
    for row in sorted(layers, key=lambda r: (r["step"], r["kind"] != "activation", r["layer"])):
        departs = row["mean_abs_rel_err"] > threshold or (row["cosine"] is not None and row["cosine"] < 1 - threshold)
        if departs:
            first_layer = {"step": row["step"], "layer": f"layers.{row['layer']}", "kind": row["kind"]}
            break
    finite = [r["rel_diff"] for r in per_step if math.isfinite(r["rel_diff"])]
    return {
        "run_a": run_a,
        "run_b": run_b,
        "threshold": threshold,
        "steps_compared": len(steps),
        "first_divergence_step": first_step,
        "first_divergent_layer": first_layer["layer"] if first_layer else None,
        "first_divergent_layer_detail": first_layer,
        "max_rel_loss_diff": max(finite) if finite else (math.inf if per_step else None),
        "per_step": per_step,
        "layers": layers,
    }


def write_report(result: Dict[str, Any], out: Path) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = [
        f"# {result['run_a']} vs {result['run_b']}",
        "",
        f"- steps compared: {result['steps_compared']}, threshold {result['threshold']}",
        f"- first divergence step: {result['first_divergence_step']}",
        f"- first divergent layer: {result['first_divergent_layer']}",
        f"- max relative loss difference: {result['max_rel_loss_diff']}",
        "",
        "| step | loss A | loss B | rel diff |",
        "|---:|---:|---:|---:|",
    ]
    md += [f"| {r['step']} | {r['loss_a']:.6f} | {r['loss_b']:.6f} | {r['rel_diff']:.2e} |" for r in result["per_step"]]
    if result["layers"]:
        md += ["", "| step | layer | kind | mean abs rel err | cosine |", "|---:|---:|---|---:|---:|"]
        md += [
            f"| {r['step']} | {r['layer']} | {r['kind']} | {r['mean_abs_rel_err']:.2e} | "
            f"{'' if r['cosine'] is None else format(r['cosine'], '.6f')} |"
            for r in result["layers"]
        ]
    paths = [out / "compare.md"]
    paths[0].write_text("\n".join(md) + "\n")
    fig = loss_figure(result)
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.savefig(out / "compare_loss.png", dpi=100)
        plt.close(fig)
        paths.append(out / "compare_loss.png")
    return paths


def loss_figure(result: Dict[str, Any]) -> Any:
    """Both loss curves and the first divergence; None without matplotlib (it comes with mlflow;
    without it, the markdown alone)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in result["per_step"]]
    ax.plot(steps, [r["loss_a"] for r in result["per_step"]], label=result["run_a"][:8])
    ax.plot(steps, [r["loss_b"] for r in result["per_step"]], label=result["run_b"][:8], linestyle="--")
    if result["first_divergence_step"] is not None:
        ax.axvline(result["first_divergence_step"], color="red", linewidth=0.8, label="first divergence")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    return fig


def log_report(uri: str, run_id: str, paths: List[Path], result: Dict[str, Any]) -> None:
    """``--log``: the report's files under ``compare/`` of ``run_id``, the plot as a figure
    (``MlflowClient.log_figure``)."""
    c = tracking.client(uri)
    for p in paths:
        fig = loss_figure(result) if p.suffix == ".png" else None
        if fig is None:
            c.log_artifact(run_id, str(p), "compare")
            continue
        import matplotlib.pyplot as plt

        c.log_figure(run_id, fig, f"compare/{p.name}", save_kwargs={"dpi": 100})
        plt.close(fig)


def resolve_run(uri: str, experiment: str, ref: str) -> List[str]:
    """The run ids ``ref`` can mean: itself when it is a run, else the runs of ``experiment``
    whose id starts with it (empty when none does)."""
    try:
        return [tracking.client(uri).get_run(ref).info.run_id]
    except Exception:  # noqa: BLE001 - MLflow's "run not found": try it as a prefix
        pass
    if len(ref) < 4:
        return []
    return [r.info.run_id for r in results.search(uri, experiment, trials_only=False) if r.info.run_id.startswith(ref)]


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("orchestrator.compare", __doc__)
    ap.add_argument("run_a", help="a run id, or its first characters (at least 4) among the runs of --experiment")
    ap.add_argument("run_b", help="the run compared to RUN_A; --log logs the report on it")
    ap.add_argument("--threshold", type=float, default=0.02, help="relative difference that counts (default 0.02)")
    cli.add_tracking_args(ap)
    ap.add_argument("--out", default="compare", help="folder for compare.md and compare_loss.png")
    cli.add_json_arg(ap, "the result")
    cli.add_log_arg(ap, "RUN_B")
    args = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if not args.threshold > 0:
        return cli.bad_input(f"--threshold={args.threshold}: must be positive")
    uri = cli.tracking_uri(args.tracking_uri)
    why = cli.store_error(uri)
    if why:
        return cli.bad_input(why)
    run_ids = []
    for key, ref in (("run_a", args.run_a), ("run_b", args.run_b)):
        found = resolve_run(uri, args.experiment, ref)
        if len(found) != 1:
            some = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            what = f"{len(found)} runs start with it ({some})" if found else "no such run"
            return cli.bad_input(f"{key}={ref}: {what} in {uri} (experiment {args.experiment})")
        run_ids.append(found[0])
    result = compare(uri, *run_ids, args.threshold)
    if not result["steps_compared"]:
        return cli.no_match(f"run_a={args.run_a}, run_b={args.run_b}: no step whose loss both runs logged")
    paths = write_report(result, Path(args.out))
    if args.log:
        log_report(uri, run_ids[1], paths, result)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("per_step", "layers")}, default=str))
    else:
        print((Path(args.out) / "compare.md").read_text().split("\n| step")[0])
        print(f"report: {', '.join(str(p) for p in paths)}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
