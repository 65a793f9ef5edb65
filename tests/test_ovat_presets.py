"""The shipped sweep presets: each selects OVAT, each candidate composes, and each varies only
knobs that act on its layouts (the shared rules that find a no-op variable).
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml") if p.stem != "auto"))
def test_every_sweep_preset_selects_ovat_and_each_candidate_composes(preset):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from orchestrator import conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=[f"+sweep={preset}"], return_hydra_config=True)
            sweeper = cfg.hydra.sweeper
            assert sweeper._target_ == "hydra_plugins.ovat_sweeper.ovat_sweeper.OvatSweeper"
            assert len(sweeper.params) >= 2 and sweeper.repeats >= 2 and not sweeper.variables
            assert cfg.hydra.mode == RunMode.MULTIRUN  # a study needs no -m
            for key, values in sweeper.params.items():
                assert len(values) >= 2, key
                for v in values:
                    compose("config", overrides=[f"+sweep={preset}", f"{key}={v}"])
    finally:
        GlobalHydra.instance().clear()


def _compose_preset(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from orchestrator import chips, conf_dir
    from orchestrator.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            variables = {k: list(v) for k, v in cfg.hydra.sweeper.params.items()}
            base = {k: str(v[0]).lower() if isinstance(v[0], bool) else str(v[0]) for k, v in variables.items()}
            out = {}
            for key, values in variables.items():
                cands = []
                for v in values:
                    v = str(v).lower() if isinstance(v, bool) else str(v)
                    c = compose("config", overrides=[*overrides, *(f"{k}={x}" for k, x in {**base, key: v}.items())])
                    cands.append(chips.resolve(c))
                out[key] = cands
            return out
    finally:
        GlobalHydra.instance().clear()


def test_the_layout_preset_varies_only_knobs_that_act_on_its_layouts():
    """The dry run of conf/sweep/layout.yaml as its header runs it: every variable changes what
    the baseline trial computes (no variable measures noise)."""
    from orchestrator import effects

    for key, cfgs in _compose_preset(["+sweep=layout", "+chip=ascend910b", "model=llama2_13b"]).items():
        assert effects.no_effect(cfgs, key) is None, (key, effects.no_effect(cfgs, key))
        assert effects.differing(cfgs), key


def test_the_shared_rules_find_a_no_op_variable(compose_cfg):
    """The check the sweeper runs: the DDP bucket does nothing on tp8pp4 (dp=1); HCCL_BUFFSIZE
    does nothing on a CUDA chip; both act where the layout has what they configure."""
    from orchestrator import chips, effects

    base = ["+sweep=layout", "+chip=ascend910b", "model=llama2_13b", "parallel=tp8pp4"]
    cfgs = [chips.resolve(compose_cfg([*base, f"comm.bucket_mb={v}"])) for v in (25, 100)]
    assert "whole replicas" in effects.no_effect(cfgs, "comm.bucket_mb")
    cfgs = _compose_preset(["+sweep=layout", "+chip=h100", "model=llama2_13b"])
    assert "HCCL" in effects.no_effect(cfgs["comm.buffsize_mb"], "comm.buffsize_mb")


def test_ddp_buckets_act_only_where_the_trainer_builds_ddp(compose_cfg):
    from orchestrator import chips, effects

    def cands(*overrides):
        return [chips.resolve(compose_cfg(["+chip=cpu", *overrides, f"comm.bucket_mb={v}"])) for v in (25, 100)]

    assert effects.no_effect(cands("parallel=dp2"), "comm.bucket_mb") is None
    # whole replicas beside TP reduce their gradient shards in buckets too (trainers/replicas.py)
    assert effects.no_effect(cands("parallel=dp2tp2", "parallel.dp_shard=ddp"), "comm.bucket_mb") is None
    for shard in ("zero1", "fsdp"):
        why = effects.no_effect(cands("parallel=dp2tp2", f"parallel.dp_shard={shard}"), "comm.bucket_mb")
        assert "whole replicas" in why
    assert "whole replicas" in effects.no_effect(cands("parallel=dp2", "parallel.dp_shard=fsdp"), "comm.bucket_mb")
    assert "whole replicas" in effects.no_effect(cands("parallel=single"), "comm.bucket_mb")
