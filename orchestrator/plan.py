"""python -m orchestrator.plan [--devices N [--top K]] [--json] [--calibrate] [--tracking-uri URI] [--experiment NAME]
                           [--probe FILE] [overrides ...]

Plans a trial without running it, from the same overrides as ``python -m orchestrator``:

    python -m orchestrator.plan +chip=ascend910b model=llama2_13b parallel=tp8pp4 trainer.global_batch=64
    python -m orchestrator.plan +chip=ascend910b model=llama2_13b trainer.global_batch=64 --devices 32 --json

prints the memory breakdown per rank, whether it fits, the pipeline bubble, the communication
share, the estimated step time and MFU, for the composed layout or, with ``--devices N``, for
every point the trainer can run on N devices (each DP/TP/PP layout with every micro-batch or
microbatch count its batch allows, pipeline schedule and stages per rank, activation
checkpointing, DDP/FSDP and sequence parallelism; the composed values of those keys are not
used): the ``--top K`` fastest that fit (10; 0: all), the fastest of each layout, and the
points excluded counted by the rule they break, with the seconds the search took. With
``--json`` the list holds the shortlist (the closest misses, ``fits`` false, when nothing fits)
and the counts go to stderr. ``--calibrate`` first fits the efficiency
factors to the finished trials of this chip in MLflow (``--tracking-uri``/``--experiment``, which
set ``tracking.uri``/``tracking.experiment``; those overrides work too, the flags win).
``--probe FILE`` instead runs every operator of the model on this machine's device and writes the
chip's operator table (``unsupported_ops``) to FILE.

Exit codes: 0 planned; 2 the flags, overrides or config are broken (one ``error:`` line each);
3 ``--calibrate`` found no finished trial of the chip to fit to.
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from orchestrator import cli, exit_codes, planner
from orchestrator.planner import search
from trainers.rules import Layout


def compose(overrides: List[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            return hydra_compose("config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _error_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        line = line.rstrip(".") + ": " + str(cause).strip().splitlines()[0]
    return line


def _fail(lines: List[str]) -> int:
    for line in lines:
        cli.bad_input(line)
    return exit_codes.BAD_INPUT


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _gb(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def table(plans: List[planner.LayoutPlan]) -> str:
    head = (
        f"{'layout':<14}{'mb':>5} {'schedule':<17}{'params':>8}{'grads':>8}{'optim':>8}{'act':>8}{'buf':>8}"
        f"{'total':>8}{'fits':>6}{'bubble':>8}{'comm':>7}{'step_s':>10}{'mfu':>7}"
    )
    rows = [head, "-" * len(head)]
    for p in plans:
        s, g = p.shape, p.memory.gb()
        sched = s.schedule if s.pp > 1 else "-"
        if s.schedule == "interleaved_1f1b" and s.pp > 1:
            sched += f"(v={s.virtual_stages})"
        name = (
            Layout(s.dp, s.tp, s.pp).name
            + ("+sp" if s.sequence_parallel else "")
            + (f"+{s.wrapping}" if s.wrapping not in ("none", "ddp") else "")
        )
        mem = "".join(f"{_gb(g[k]):>8}" for k in ("params", "grads", "optimizer", "activations", "buffers", "total"))
        rows.append(
            f"{name:<14}{s.microbatches:>5} {sched:<17}{mem}"
            f"{'yes' if p.memory.fits else 'no':>6}{_pct(p.step.bubble_fraction):>8}"
            f"{_pct(p.step.comm_share):>7}{p.step.step_time_s:>10.3f}{_pct(p.step.mfu):>7}"
        )
    return "\n".join(rows)


def _onoff(x: bool) -> str:
    return "on" if x else "-"


def _recompute(c: search.Candidate) -> str:
    """The ckpt column: -, full (every block), sel (the attention core) or Nblk (full, the first
    N blocks of each stage chunk)."""
    if not c.activation_checkpointing:
        return "-"
    if c.recompute_granularity == "selective":
        return "sel"
    return f"{c.recompute_layers}blk" if c.recompute_layers >= 0 else "full"


def space_table(plans: List[search.SpacePlan]) -> str:
    """The shortlist of ``--devices N``: one point a row, its knobs, memory and speed (a
    ``cmp`` column, trainer.compile, and a ``lc`` column, model.loss_chunks, where a row sets them)."""
    compiled = any(p.candidate.compile for p in plans)
    chunked = any(p.candidate.loss_chunks > 1 for p in plans)
    head = (
        f"{'layout':<14}{'mbs':>4}{'m':>5} {'schedule':<17}{'v':>3} {'ckpt':<6}{'dp':<6}{'sp':<4}"
        + f"{'cmp':<4}" * compiled
        + f"{'lc':>3} " * chunked
        + f"{'mem_gb':>8}{'fits':>5}{'bubble':>8}{'comm':>7}{'step_s':>10}{'mfu':>7}"
    )
    rows = [head, "-" * len(head)]
    for p in plans:
        c, s = p.candidate, p.shape
        pipe = s.pp > 1
        shard = s.wrapping if s.dp > 1 else "-"
        rows.append(
            f"{c.layout:<14}{s.micro_batch:>4}{(s.microbatches if pipe else '-'):>5} "
            f"{(s.schedule if pipe else '-'):<17}{(s.chunks_per_rank if pipe else '-'):>3} "
            f"{_recompute(c):<6}{shard:<6}{_onoff(s.sequence_parallel):<4}"
            + f"{_onoff(c.compile):<4}" * compiled
            + f"{c.loss_chunks:>3} " * chunked
            + f"{_gb(p.memory.total / planner.GiB):>8}{'yes' if p.fits else 'no':>5}{_pct(p.step.bubble_fraction):>8}"
            f"{_pct(p.step.comm_share):>7}{p.step.step_time_s:>10.3f}{_pct(p.step.mfu):>7}"
        )
    return "\n".join(rows)


def space_report(res: search.SpaceResult, top: int) -> str:
    """What ``--devices N`` prints after the header."""
    n_layouts = len(res.layouts)
    lines = [
        f"searched {res.count} points of {n_layouts} DP/TP/PP layout(s) of {res.devices} devices in "
        f"{res.seconds:.2f} s: {res.fit} fit, {res.n_excluded} excluded",
        "",
    ]
    shown = res.plans[:top] if top > 0 else res.plans
    if shown:
        lines.append(f"the {len(shown)} fastest that fit (mem_gb: the most loaded rank, buffers and reserve included):")
        lines.append(space_table(shown))
    else:
        lines.append(f"no point fits; the {len(res.closest)} closest (least memory first):")
        lines.append(space_table(res.closest))
    lines += ["", "the fastest point of each layout:"]

    def order(item):
        best = item[1].best
        return (best is None, best.step.step_time_s if best else 0.0, item[0])

    for name, summary in sorted(res.layouts.items(), key=order):
        if summary.best is not None:
            b = summary.best
            lines.append(
                f"  {name:<14}{b.step.step_time_s:>9.3f} s  {b.candidate.name} ({summary.fit}/{summary.candidates} fit)"
            )
        else:
            why = max(summary.reasons.items(), key=lambda kv: kv[1])[0] if summary.reasons else "no point"
            lines.append(f"  {name:<14}{'-':>9}    none of {summary.candidates} fits; most: {why}")
    if res.excluded:
        lines += ["", "excluded, by rule (points; a point breaking several rules counts under each):"]
        for key, ex in sorted(res.excluded.items(), key=lambda kv: -kv[1].count):
            point, line = ex.examples[0]
            lines.append(f"  {ex.count:>6}  {key}")
            lines.append(f"          e.g. {point.name}: {line}")
    return "\n".join(lines)


def header(cfg: DictConfig, cov: planner.OpCoverage, devices: Optional[int], calibrated: str) -> str:
    c, t = cfg.chip, cfg.trainer
    mapped = ", ".join(f"model.{k}={v}" for k, v in cov.model_overrides.items())
    hbm = float(c.hbm_gbps or 0)
    memory = f" memory {hbm:g} GB/s x {float(cfg.planner.memory_efficiency):.3g}," if hbm > 0 else ""
    lines = [
        f"{cfg.model.name} on {c.name}: {float(c.memory_gb):g} GB x headroom {float(cfg.planner.headroom):g}"
        f" = {float(c.memory_gb) * float(cfg.planner.headroom):.1f} GB usable per device"
        + (f", {devices} devices" if devices else "")
        + f"; global batch {t.global_batch} x {t.seq_len} tokens; {cfg.precision.name}"
        f" (params {cfg.precision.param_dtype}, compute {cfg.precision.compute_dtype})",
        f"operators: {cov.n_total}, coverage {_pct(cov.coverage)}, replacement rate {_pct(cov.replacement_rate)}"
        f" (mapped {cov.count('mapped')}, custom {cov.count('custom')})"
        + (f"; planned with {mapped}" if mapped else ""),
        f"efficiency: compute {float(cfg.planner.compute_efficiency):.3g}, "
        f"comm {float(cfg.planner.comm_efficiency):.3g},{memory}"
        f" latency {planner.collective_latency_s(cfg.planner, c) * 1e6:.3g} us per collective"
        f" ({calibrated}); memory in GiB per device, buffers include the runtime reserve",
    ]
    if cov.unresolved:
        lines.append("operators without support or mapping: " + ", ".join(cov.unresolved))
    return "\n".join(lines)


class NoTrials(LookupError):
    """--calibrate: nothing to fit to."""


def calibrate_into(cfg: DictConfig) -> str:
    """Fit the efficiencies to MLflow's finished trials of this chip; say what was done. Raises
    ValueError (no such store or experiment) or NoTrials (no finished trial of the chip in it)."""
    from orchestrator import tracking

    uri = tracking.resolve_uri(cfg.tracking)
    why = cli.experiment_error(uri, cfg.tracking.experiment, ("tracking.uri", "tracking.experiment"))
    if why:
        raise ValueError(why)
    trials = planner.measured_trials(uri, cfg.tracking.experiment, cfg.chip.name)
    if not trials:
        raise NoTrials(
            f"--calibrate: no finished trial of chip={cfg.chip.name} with step_time_median_s "
            f"in experiment {cfg.tracking.experiment} ({uri})"
        )
    cal = planner.calibrate(trials, cfg.planner)
    loo = planner.cross_validate(trials, cfg.planner)  # before the fitted factors replace the configured
    cal.apply(cfg.planner)  # every fitted factor, the host terms included
    rho = "n/a" if cal.spearman_rho is None else f"{cal.spearman_rho:.2f}"
    text = (
        f"{cal.n_fitted} factor(s) fitted to {cal.n_runs} trial(s): median |error| "
        f"{_pct(cal.median_abs_rel_error)}, Spearman rho {rho}"
    )
    if loo.n_runs:  # the fit judged on layouts it did not see
        loo_rho = "n/a" if loo.spearman_rho is None else f"{loo.spearman_rho:.2f}"
        text += f"; each layout left out in turn: median |error| {_pct(loo.median_abs_rel_error)}, rho {loo_rho}"
    return text


def probe(cfg: DictConfig, path: str) -> Dict[str, Dict[str, str]]:
    """Run the model's operators on this machine's device; write the chip's operator table."""
    import yaml

    from trainers.ops import probe_ops

    chip = cfg.chip
    device = "cpu" if chip.emulate else str(chip.device_type)
    plugin = None if chip.emulate else chip.torch_plugin
    results = probe_ops(device, OmegaConf.to_container(cfg.model, resolve=True), plugin, cfg.precision.compute_dtype)
    missing = sorted(op for op, r in results.items() if r["status"] in ("fallback", "error"))
    body = {"unsupported_ops": missing, "probe": results}
    with open(path, "w") as f:
        f.write(
            f"# operator probe of model={cfg.model.name} on {device} (chip={chip.name}, "
            f"compute {cfg.precision.compute_dtype}); unsupported_ops goes into conf/chip/{chip.name}.yaml\n"
        )
        yaml.safe_dump(body, f, sort_keys=False, allow_unicode=True)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    ap = cli.parser("orchestrator.plan", __doc__.split("\n\n")[1])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m orchestrator")
    ap.add_argument("--devices", type=int, default=None, help="plan every point the trainer can run on N devices")
    ap.add_argument("--top", type=int, default=10, help="with --devices: the K fastest points that fit (0: all)")
    cli.add_json_arg(ap, "a list, one object per layout (per point, with --devices),")
    ap.add_argument("--calibrate", action="store_true", help="fit efficiency factors to finished MLflow trials")
    cli.add_tracking_args(ap, defaults=False)
    ap.add_argument("--probe", metavar="FILE", help="probe the operators on this machine's device, write FILE")
    args = ap.parse_intermixed_args(argv)
    if args.devices is not None and args.devices < 1:
        return _fail([f"--devices={args.devices}: must be positive"])
    if args.top < 0:
        return _fail([f"--top={args.top}: must not be negative"])
    try:
        cfg = planner.resolved(compose(args.overrides))
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors: bad input
        return _fail([_error_line(err)])
    # the flags over tracking.* (set after composing: a URI needs no quoting for Hydra's grammar)
    if args.tracking_uri is not None:
        cfg.tracking.uri = args.tracking_uri
    if args.experiment is not None:
        cfg.tracking.experiment = args.experiment

    if args.probe:
        results = probe(cfg, args.probe)
        bad = {op: r for op, r in results.items() if r["status"] in ("fallback", "error")}
        print(f"probed {len(results)} operators on {cfg.chip.name}: {len(bad)} unsupported; wrote {args.probe}")
        return exit_codes.OK

    calibrated = "defaults from planner.*; --calibrate fits them"
    if args.calibrate:
        try:
            calibrated = calibrate_into(cfg)
        except ValueError as err:
            return _fail([str(err)])
        except NoTrials as err:
            return cli.no_match(str(err))
        if args.json:
            print(calibrated, file=sys.stderr)
    cov = planner.op_coverage(cfg.model, int(cfg.trainer.seq_len), cfg.precision.compute_dtype, cfg.chip)
    if args.devices is not None:
        return _plan_devices(cfg, cov, args.devices, args.top, args.json, calibrated)
    errors = planner.planning_errors(cfg)
    if errors:
        return _fail(errors)
    planned = planner.with_model_overrides(cfg, cov.model_overrides)
    plans = [planner.plan_layout(planned)]
    if args.json:
        n_params = planner.ModelShape.of(planned.model).n_params
        print(json.dumps([search.contract(p, n_params) for p in plans], indent=1))
        return exit_codes.OK
    print(header(cfg, cov, args.devices, calibrated))
    print()
    print(table(plans))
    return exit_codes.OK


def _plan_devices(
    cfg: DictConfig, cov: planner.OpCoverage, devices: int, top: int, as_json: bool, calibrated: str
) -> int:
    res = search.plan_space(cfg, devices, coverage=cov)
    if not res.plans and not res.closest:  # every point broke a rule: nothing planned
        return _fail(
            [ex.examples[0][1] for ex in res.excluded.values()]
            or [f"--devices={devices}: no DP/TP/PP layout of {cfg.model.name} fits that many devices"]
        )
    if as_json:
        shown = (res.plans[:top] if top > 0 else res.plans) or res.closest
        print(json.dumps([p.contract() for p in shown], indent=1))
        counts = ", ".join(f"{ex.count} {key}" for key, ex in res.excluded.items())
        print(
            f"searched {res.count} points in {res.seconds:.2f} s: {res.fit} fit, {res.n_excluded} excluded"
            + (f" ({counts})" if counts else ""),
            file=sys.stderr,
        )
        return exit_codes.OK
    print(header(cfg, cov, devices, calibrated))
    print()
    print(space_report(res, top))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
