"""The step-time model's host fixed costs (per layer and micro-batch, per pipeline stage chunk and
micro-batch, per log2 step of a collective's group) and the calibration that fits them: the
terms move a plan the right way, and the fit, given step times planted from a known model plus
noise, finds that model back and reports its held-out error and rank correlation as computed
independently here. Tests of the fitting code, not of any machine's timings."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from omegaconf import OmegaConf

from orchestrator import chips, conf_dir, planner
from orchestrator.config import Config
from orchestrator.planner import ModelShape, ParallelShape
from orchestrator.planner.calibration import HOST_FACTORS
from orchestrator.planner.rank_stats import kendall_tau
from orchestrator.planner.step_time import HostCosts

DEFAULTS = OmegaConf.structured(Config)


def _model(name: str):
    return OmegaConf.merge(DEFAULTS.model, OmegaConf.load(conf_dir() / "model" / f"{name}.yaml"))


def _pl(**kw):
    return OmegaConf.merge(DEFAULTS.planner, kw)


def _parts(m, s, chip="ascend910b", **planner_kw):
    return planner.step_parts(m, s, DEFAULTS.precision, DEFAULTS.comm, chips.load_preset(chip), _pl(**planner_kw))


# --- the terms ---------------------------------------------------------------------------------


def test_more_microbatches_cost_more_host_time():
    """The same tokens in 16 micro-batches instead of 4: the compute is the same, the host's
    per-layer dispatch four times as much. On a CPU it adds; on an accelerator it hides behind
    the kernels until it is longer than them."""
    m = ModelShape.of(_model("gpt_mini"))
    few, many = ParallelShape(1, 1, 1, 4, 4, 128), ParallelShape(1, 1, 1, 16, 1, 128)
    a, b = (planner.combine(_parts(m, s, "cpu"), 0.5, 0.7) for s in (few, many))
    assert a.compute_s == pytest.approx(b.compute_s)
    layer_s = float(DEFAULTS.planner.layer_host_us) * 1e-6
    assert a.host_s == pytest.approx(6 * 4 * layer_s) and b.host_s == pytest.approx(6 * 16 * layer_s)
    assert b.step_time_s - a.step_time_s == pytest.approx(6 * 12 * layer_s)
    # llama2_7b on a 910B: ~20 s of kernels hide 4 x 32 dispatches of the default; 300 ms ones show
    m7 = ModelShape.of(_model("llama2_7b"))
    one = ParallelShape(1, 1, 1, 4, 1, 4096)
    assert planner.combine(_parts(m7, one), 0.5, 0.7).host_s == 0.0
    slow = planner.combine(_parts(m7, one, layer_host_us=3e5), 0.5, 0.7)
    assert slow.host_s == pytest.approx(4 * 32 * 3e5 * 1e-6 - slow.compute_s) and slow.host_s > 0
    # recomputing the forward dispatches it again: a third more
    ck = ModelShape.of(dict(_model("gpt_mini"), activation_checkpointing=True))
    assert _parts(ck, many, "cpu").layer_passes == pytest.approx(6 * 16 * 4 / 3)


def test_more_virtual_stages_cost_more_per_stage():
    """Interleaving more stage chunks per rank shrinks the bubble and costs a forward/backward
    call, send/recv setup and wait per chunk and micro-batch; with a large enough per-stage cost
    fewer chunks are faster, with none more are always faster."""
    m = ModelShape.of(_model("llama2_7b"))

    def est(v, comm_efficiency=0.7, **kw):
        s = ParallelShape(1, 8, 4, 16, 1, 4096, schedule="interleaved_1f1b", virtual_stages=v)
        return planner.combine(_parts(m, s, **kw), 0.5, comm_efficiency)

    stage_s = float(DEFAULTS.planner.stage_host_us) * 1e-6
    for v in (2, 4, 8):
        e = est(v)
        assert e.host_s == pytest.approx(v * 16 * stage_s / (1 - e.bubble_fraction))
    assert est(8).host_s > est(4).host_s > est(2).host_s > 0
    # without a pipeline there is no stage call to pay for
    assert _parts(m, ParallelShape(1, 8, 1, 16, 1, 4096)).stage_passes == 0
    # with sends that cost nothing (the v-fold activation traffic of interleaving aside) and no
    # per-stage cost, more chunks are always faster; with a per-stage cost of 50 ms, fewer are
    free = dict(stage_host_us=0.0, collective_latency_us=0.0, collective_hop_us=0.0)
    free = [est(v, 1e9, **free).step_time_s for v in (2, 4, 8)]
    costly = [est(v, 1e9, stage_host_us=5e4).step_time_s for v in (2, 4, 8)]
    assert free[0] > free[1] > free[2]
    assert costly[0] < costly[1] < costly[2]


def test_the_search_prefers_fewer_stages_when_stages_cost(compose_cfg):
    """The plan moves: llama2_7b's fastest interleaved point on 8 devices has one layer per stage
    (32 stages: pp8 x v4, or pp4 x v8 under FSDP; pp4 x v8 under DDP with its 8 microbatches is
    refused) without a per-stage cost, and fewer stages with 10 ms of it. (At the default 100 us
    it stays at 32: the bubble it saves is worth more; from ~300 us the fastest point on 8 devices
    has no pipeline at all.)"""
    from orchestrator.planner import search

    def fastest_stages(**kw):
        cfg = compose_cfg(["+chip=ascend910b", "model=llama2_7b"])
        for k, v in kw.items():
            cfg.planner[k] = v
        res = search.plan_space(cfg, 8)
        inter = [p for p in res.plans if p.fits and p.candidate.schedule == "interleaved_1f1b"]
        best = min(inter, key=lambda p: p.step.step_time_s).candidate
        return best.pp * best.virtual_stages

    assert fastest_stages(stage_host_us=0.0) == 32 and fastest_stages(stage_host_us=1e4) < 32


def test_collective_latency_grows_with_log2_of_the_group():
    m = ModelShape.of(_model("llama2_7b"))
    pl = dict(dp_overlap=0.0)
    for tp in (2, 4, 8):
        p = _parts(m, ParallelShape(1, tp, 1, 4, 1, 4096), **pl)
        assert p.tp_hops == pytest.approx(p.tp_calls * math.log2(tp))
        with_hops = planner.combine(p, 0.5, 0.7, 30e-6, HostCosts(0.0, 0.0, 5e-6))
        without = planner.combine(p, 0.5, 0.7, 30e-6, HostCosts(0.0, 0.0, 0.0))
        assert with_hops.tp_comm_s - without.tp_comm_s == pytest.approx(p.tp_calls * math.log2(tp) * 5e-6)
    dp = _parts(m, ParallelShape(16, 1, 1, 1, 1, 4096), **pl)
    assert dp.dp_hops == pytest.approx(dp.dp_calls * 4)
    pp = _parts(m, ParallelShape(1, 1, 2, 8, 1, 4096), **pl)
    assert pp.pp_hops == pp.pp_calls  # a send is one hop


# --- the fit, on planted step times -------------------------------------------------------------

# the planted model: none of it at the planner's defaults, so a fit that kept a default fails
TRUTH = dict(
    compute_efficiency=0.8,
    comm_efficiency=0.05,
    collective_latency_us=400.0,
    layer_host_us=900.0,
    stage_host_us=2500.0,
    collective_hop_us=250.0,
    tp_layer_host_us=6000.0,
)
# (preset of conf/parallel, overrides): gpt_mini on the CPU chip, the layouts and batch splits
# the bench runs, and more, so every host term varies across the fit set
POINTS = [
    ("single", {}),
    ("single", {"trainer.micro_batch": 1}),
    ("single", {"trainer.micro_batch": 2}),
    ("dp2", {}),
    ("dp2", {"trainer.micro_batch": 1}),
    ("dp4", {}),
    ("tp2", {}),
    ("tp2", {"trainer.micro_batch": 1}),
    ("tp4", {}),
    ("pp2", {}),
    ("pp2", {"parallel.microbatches": 8}),
    ("pp2", {"parallel.microbatches": 16}),
    ("pp2", {"parallel.schedule": "interleaved_1f1b", "parallel.virtual_stages": 3}),
    ("pp4", {}),
    ("tp2pp2", {}),
    ("dp2pp2", {}),
    ("dp2tp2", {}),
    ("dp2pp2", {"parallel.microbatches": 8}),
    # many small DDP buckets: collectives whose latency is not a TP layer's, over groups of 2 and 4
    # (what tells the per-call latency from the per-hop one, and both from TP's per-layer cost)
    ("dp2", {"comm.bucket_mb": 1}),
    ("dp4", {"comm.bucket_mb": 1}),
]
HELD = ["dp4tp1pp1", "dp1tp1pp4", "dp1tp2pp2", "dp2tp2pp1"]  # the bench's fixed four


def cpu_config(preset: str, overrides):
    c = OmegaConf.structured(Config)
    c.chip = chips.load_preset("cpu")
    c.model = _model("gpt_mini")
    c.parallel = OmegaConf.merge(c.parallel, OmegaConf.load(conf_dir() / "parallel" / f"{preset}.yaml"))
    c.trainer.global_batch, c.trainer.micro_batch, c.trainer.seq_len = 16, 4, 128
    c.planner.host_cores = 2  # the bench's host, whatever machine runs the test
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def planted(seed: int, sigma: float):
    """Trials whose "measured" step time is the model at TRUTH times lognormal noise (and their
    host_busy, the ranks' work over the step, divided by the same noise: a slower step, the same
    work)."""
    rng = random.Random(seed)
    truth = HostCosts(*(TRUTH[k] * 1e-6 for k in HOST_FACTORS))
    out = []
    for i, (preset, ov) in enumerate(POINTS):
        cfg = cpu_config(preset, ov)
        est = planner.combine(
            planner.trial_parts(cfg),
            TRUTH["compute_efficiency"],
            TRUTH["comm_efficiency"],
            TRUTH["collective_latency_us"] * 1e-6,
            truth,
        )
        noise = math.exp(rng.gauss(0.0, sigma))
        out.append(planner.MeasuredTrial(f"t{i}", cfg, est.step_time_s * noise, None, est.host_busy / noise))
    return out


def test_the_planted_model_has_host_terms_that_matter():
    """The premise: each host term makes a measurable share of some planted step time."""
    trials = planted(0, 0.0)
    for key in HOST_FACTORS:
        zero = HostCosts(*(0.0 if k == key else TRUTH[k] * 1e-6 for k in HOST_FACTORS))
        full = HostCosts(*(TRUTH[k] * 1e-6 for k in HOST_FACTORS))
        shares = []
        for t in trials:
            p = planner.trial_parts(t.cfg)
            args = (TRUTH["compute_efficiency"], TRUTH["comm_efficiency"], TRUTH["collective_latency_us"] * 1e-6)
            a, b = planner.combine(p, *args, full).step_time_s, planner.combine(p, *args, zero).step_time_s
            shares.append((a - b) / a)
        assert max(shares) > 0.05, (key, shares)


def test_the_fit_recovers_every_planted_factor():
    """Noise-free step times, no prior: all seven factors found back."""
    cal = planner.calibrate(planted(0, 0.0), DEFAULTS.planner, prior_weight=0.0, fit_host="all")
    assert set(cal.fitted) == set(TRUTH) and cal.n_fitted == 7
    for key, want in TRUTH.items():
        assert getattr(cal, key) == pytest.approx(want, rel=0.01), (key, cal.values())
    assert cal.median_abs_rel_error < 1e-3 and cal.spearman_rho == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(3))
def test_the_fit_on_noisy_times_stays_near_the_planted_factors(seed):
    """2% run-to-run noise, the default prior: the efficiencies within 5% and 25%, the per-layer
    dispatch within a factor of 2.2 (it trades against the per-collective latency: a TP layout
    makes 4 collectives per layer and micro-batch). The per-stage and per-hop terms, a few
    percent of a step here, are not determined at this noise; the prior keeps them at the
    planner's defaults (measured over seeds 0-2: 0.04x and 0.03x the planted values, while the
    fit without the prior scatters them 0-3x)."""
    cal = planner.calibrate(planted(seed, 0.02), DEFAULTS.planner, fit_host="all")
    assert set(cal.fitted) == set(TRUTH)
    assert cal.compute_efficiency == pytest.approx(TRUTH["compute_efficiency"], rel=0.05)
    assert cal.comm_efficiency == pytest.approx(TRUTH["comm_efficiency"], rel=0.25)
    assert 1 / 2.2 < cal.layer_host_us / TRUTH["layer_host_us"] < 2.2
    for key in ("stage_host_us", "collective_hop_us"):
        assert getattr(cal, key) == pytest.approx(float(DEFAULTS.planner[key]), rel=0.5)


def _independent(measured, predicted):
    from scipy import stats

    errors = [abs(p - m) / m for m, p in zip(measured, predicted)]
    return (
        sum(errors) / len(errors),
        statistics.median(errors),
        max(errors),
        stats.spearmanr(predicted, measured).statistic,
        stats.kendalltau(predicted, measured).statistic,
    )


@pytest.mark.parametrize("seed", range(3))
def test_held_out_metrics_are_computed_right(seed):
    """The fixed held-out split and leave-one-layout-out: the reported mean, median and largest
    relative error, Spearman's rho and Kendall's tau are those of the predictions of fits that
    never saw the layout, as scipy computes them; on 2% noise the errors clear the bench's bar,
    and the held-out ranking is within one swap of the planted model's own ranking of the noisy
    times (the planted held-out set holds two pairs 0.5% and 3% apart, tp2pp2 and dp2tp2 both
    throughput-bound on the two cores, which the noise alone swaps: the truth itself ranks them at
    rho 0.6-1.0 over seeds 0-2)."""
    trials = planted(seed, 0.02)
    fit, held = planner.split_by_layout(trials, HELD)
    cal = planner.calibrate(fit, DEFAULTS.planner, held_out=held, fit_host="all")
    h = cal.heldout
    assert {r["run_id"] for r in cal.runs} == {t.run_id for t in fit} and h.n_runs == len(held) == 5
    predicted = [planner.predict(cal, t.cfg) for t in held]
    assert [r["predicted_s"] for r in h.runs] == pytest.approx(predicted)
    mean, median, worst, rho, tau = _independent([t.step_time_s for t in held], predicted)
    assert (h.mean_abs_rel_error, h.median_abs_rel_error, h.max_abs_rel_error) == pytest.approx((mean, median, worst))
    assert h.spearman_rho == pytest.approx(rho) and h.kendall_tau == pytest.approx(tau)
    exact = {t.run_id: t.step_time_s for t in planted(seed, 0.0)}
    truth_rho = _independent([t.step_time_s for t in held], [exact[t.run_id] for t in held])[3]
    assert h.mean_abs_rel_error <= 0.10 and h.spearman_rho >= min(0.8, truth_rho - 0.2) - 1e-9

    loo = planner.cross_validate(trials, DEFAULTS.planner, fit_host="all")
    layouts = sorted({planner.layout_name(t.cfg) for t in trials})
    assert loo.n_runs == len(trials)
    want = []
    for name in layouts:  # each layout's runs predicted by a fit to the other layouts' runs
        rest, mine = planner.split_by_layout(trials, [name])
        alone = planner.calibrate(rest, DEFAULTS.planner, fit_host="all")
        want += [(t.step_time_s, planner.predict(alone, t.cfg)) for t in mine]
    assert [r["predicted_s"] for r in loo.runs] == pytest.approx([p for _, p in want])
    mean, median, worst, rho, tau = _independent([m for m, _ in want], [p for _, p in want])
    assert (loo.mean_abs_rel_error, loo.max_abs_rel_error) == pytest.approx((mean, worst))
    assert loo.spearman_rho == pytest.approx(rho) and loo.kendall_tau == pytest.approx(tau)
    # over seeds 0-2: rho 0.90-0.93, tau 0.76-0.81 (the noise alone, the planted model against the
    # noisy times: 0.97, 0.86-0.90); the bar keeps a margin for the near-ties named above
    assert loo.mean_abs_rel_error <= 0.10 and loo.spearman_rho >= 0.85 and loo.kendall_tau >= 0.7


def test_kendall_tau():
    from scipy import stats

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    a, b = [1, 2, 2, 3, 5, 4], [2, 1, 3, 3, 4, 6]  # ties in both: tau-b, as scipy's default
    assert kendall_tau(a, b) == pytest.approx(stats.kendalltau(a, b).statistic)
    assert kendall_tau([1], [1]) is None


def test_calibration_applies_every_factor():
    cal = planner.calibrate(planted(0, 0.0), DEFAULTS.planner, prior_weight=0.0, fit_host="all")
    pl = OmegaConf.merge(DEFAULTS.planner, {})
    cal.apply(pl)
    assert {k: float(pl[k]) for k in TRUTH} == pytest.approx(cal.values())
    assert planner.step_time(
        ModelShape.of(_model("gpt_mini")),
        ParallelShape(1, 1, 2, 8, 2, 128),
        DEFAULTS.precision,
        DEFAULTS.comm,
        chips.load_preset("cpu"),
        pl,
    ).step_time_s == pytest.approx(planner.predict(cal, cpu_config("pp2", {"parallel.microbatches": 8})))
