"""The prepared device check passes its dry mode on the CPU: the script a lent GPU runs is sound.
Its rows, overrides and time budget as the real mode lays them out, and the plain loop it sets
beside the trainer, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# both models, both dtypes and both world sizes, in three rows
DRY_CASES = {"gpt_tiny bf16", "llama_tiny fp16", "gpt_tiny bf16 x2"}


@pytest.mark.slow
@pytest.mark.distributed
def test_device_check_dry_mode_runs_every_row_and_fills_every_column(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "device_check.py"), "--dry", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device check: dry (CPU plumbing)" in proc.stdout and "dry-mode check" not in proc.stdout
    record = json.loads((tmp_path / "device_check.json").read_text())
    rows = {r["case"]: r for r in record["rows"]}
    assert set(rows) == DRY_CASES
    for row in rows.values():
        assert row["status"] == "finished" and row["step_s"] > 0 and row["reserved_gb"] > 0
        assert row["planned_gb"] / row["reserved_gb"] == pytest.approx(row["plan_over_reserved"])
        assert row["planned_step_s"] / row["step_s"] == pytest.approx(row["step_plan_over_measured"])
        # every row profiled: shares of one window
        assert 0 < row["compute_share"] and row["compute_share"] + row["comm_share"] <= 1
        # the plain loop beside it: same FLOPs and peak, so the MFU ratio is the step-time ratio
        assert row["plain_status"] == "finished" and row["plain_step_s"] > 0
        assert row["trainer_over_plain"] == pytest.approx(row["plain_step_s"] / row["step_s"])
        assert row["mfu"] / row["plain_mfu"] == pytest.approx(row["trainer_over_plain"])
    for case in DRY_CASES - {"gpt_tiny bf16 x2"}:
        assert rows[case]["comm_share"] == 0  # one process talks to none
    assert rows["gpt_tiny bf16 x2"]["comm_share"] > 0
    # the x2 rows share their model's one plain loop (one process does the whole global batch)
    assert rows["gpt_tiny bf16 x2"]["plain_step_s"] == rows["gpt_tiny bf16"]["plain_step_s"]
    assert record["comm"]["status"] == "finished" and record["comm"]["backend"] == "gloo"
    md = (tmp_path / "device_check.md").read_text()
    assert md.count("| finished |") == len(DRY_CASES)
    assert "| plain_step_s | plain_mfu | trainer_over_plain |" in md


def test_real_mode_rows_cover_both_models_both_dtypes_compile_off_and_on():
    dc = _load("device_check")
    rows = dc.cases(dry=False, devices=1)
    got = [(r["model"], r["dtype"], r["compile"]) for r in rows]
    want = {(m, d, c) for m in ("gpt2_small", "llama_1b") for d in ("bf16", "fp16") for c in (False, True)}
    assert set(got) == want and len(got) == len(want)
    assert all(r["world"] == 1 and r["profile"] for r in rows)
    assert [c for _, _, c in got] == sorted(c for _, _, c in got)  # compile rows last: the budget cuts them first
    assert {r["case"] for r in dc.cases(dry=False, devices=2)} - {r["case"] for r in rows} == {
        "gpt2_small bf16 x2",
        "gpt2_small fp16 x2",
    }


def test_real_mode_overrides_give_each_model_its_shape_and_a_window_inside_the_timed_steps():
    dc = _load("device_check")
    by_model = {}
    for row in dc.cases(dry=False, devices=1):
        ov = dc.overrides(row, dry=False, uri="sqlite:///x.db")
        by_model.setdefault(row["model"], ov)
        assert f"precision={row['dtype']}" in ov and ("trainer.compile=true" in ov) == row["compile"]
        assert not any(o.startswith("+chip=") for o in ov)  # the chip is detected there
    llama = by_model["llama_1b"]
    assert "model=llama_1b" in llama and "trainer.seq_len=2048" in llama and "trainer.micro_batch=16" in llama
    for model, ov in by_model.items():
        kv = dict(o.split("=", 1) for o in ov)
        steps, warmup = int(kv["trainer.steps"]), int(kv["trainer.warmup_steps"])
        start, n = int(kv["trainer.profile_start"]), int(kv["trainer.profile_steps"])
        assert warmup <= start and start + n <= steps, model
    # --steps keeps the window inside
    kv = dict(o.split("=", 1) for o in dc.overrides(dc.cases(False, 1)[0], False, "sqlite:///x.db", steps=8))
    assert int(kv["trainer.steps"]) == 8
    assert int(kv["trainer.warmup_steps"]) <= int(kv["trainer.profile_start"])
    assert int(kv["trainer.profile_start"]) + int(kv["trainer.profile_steps"]) <= 8


def test_llama_1b_preset_is_about_a_billion_parameters_with_grouped_kv_heads():
    import torch
    from omegaconf import OmegaConf

    from trainers.config import ModelConfig
    from trainers.model import GPT, count_params

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "llama_1b.yaml")
    m = ModelConfig(**OmegaConf.to_container(cfg))
    assert m.kv_heads == 8 < m.n_heads and m.head_dim == 128
    with torch.device("meta"):
        assert 0.95e9 < count_params(GPT(m)) < 1.1e9


def test_the_budget_skips_the_rows_that_would_end_past_it(monkeypatch):
    dc = _load("device_check")
    clock = [0.0]
    monkeypatch.setattr(dc.time, "perf_counter", lambda: clock[0])

    def fake_run(row, dry, uri, steps, workdir):
        clock[0] += 100.0 if row["compile"] else 20.0
        return {**row, "status": "finished", "trial_wall_s": 100.0 if row["compile"] else 20.0}

    monkeypatch.setattr(dc, "run_row", fake_run)
    rows = dc.run_rows(dry=False, count=1, uri="", steps=0, workdir=ROOT, deadline=400.0)
    status = {r["case"]: r["status"] for r in rows}
    assert all(status[c] == "finished" for c in status if "compile" not in c)
    assert "skipped (budget)" in status.values() and status["gpt2_small bf16+compile"] == "finished"
    # the estimate of a compiled row before any ran: three times its model's compile-off trial
    history = [dict(model="llama_1b", compile=False, trial_wall_s=30.0)]
    assert dc.estimate_s(dict(model="llama_1b", compile=True), history, dry=False) == 90.0
    # no budget in the dry mode unless asked for
    assert dc.run_rows(dry=True, count=0, uri="", steps=0, workdir=ROOT, deadline=float("inf"))


def _spec(model: str, precision: str = "fp32", extra=()):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import conf_dir, trial
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    ov = ["+chip=cpu", f"model={model}", f"precision={precision}", "trainer=smoke", "tracking.enabled=false", *extra]
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = trial.prepare(compose("config", overrides=ov))
    GlobalHydra.instance().clear()
    return trial.build_spec(cfg)


@pytest.mark.parametrize("model,precision", [("gpt_tiny", "fp32"), ("llama_tiny", "fp16")])
def test_plain_loop_trains_the_trials_model_on_the_cpu(model, precision):
    import torch

    plain = _load("plain_loop")
    spec = _spec(model, precision, ["trainer.global_batch=4", "trainer.micro_batch=2", "trainer.seq_len=32"])
    stats = plain.plain_loop_stats(spec, steps=3, warmup=1)
    assert len(stats["times"]) == 3 and stats["step_s"] > 0 and stats["allocated_gb"] is None
    assert stats["tokens_per_step"] == 4 * 32
    assert plain.plain_loop(spec, steps=2, warmup=1) > 0  # the float form bench/trainer_throughput.py uses
    model_ = plain.build(spec, torch.device("cpu"), compile=False)
    norms = [m for m in model_.modules() if hasattr(m, "compute_dtype")]
    assert norms and all(m.compute_dtype == torch.float32 for m in norms)  # precision.fp32_ops, as the trial


def test_plain_loop_stores_parameters_in_the_param_dtype_and_keeps_rope_tables_fp32():
    import torch

    plain = _load("plain_loop")
    spec = _spec("llama_tiny", "bf16", ["precision.param_dtype=bf16"])
    model = plain.build(spec, torch.device("cpu"), compile=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32
