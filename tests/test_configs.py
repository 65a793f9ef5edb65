"""Every preset of every config group composes onto the typed schema, and typos do not."""

from __future__ import annotations

import re

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from orchestrator import chips, conf_dir
from orchestrator.config import GROUPS
from orchestrator.layout import layout
from orchestrator.trial import prepare

PRESETS = [(g, p.stem) for g in GROUPS for p in sorted((conf_dir() / g).glob("*.yaml"))]


def test_every_group_has_presets():
    groups = {g for g, _ in PRESETS}
    assert groups == set(GROUPS), f"groups without a preset: {set(GROUPS) - groups}"


@pytest.mark.parametrize("group,option", PRESETS, ids=[f"{g}={o}" for g, o in PRESETS])
def test_preset_composes(compose_cfg, group, option):
    override = f"+chip={option}" if group == "chip" else f"{group}={option}"
    cfg = compose_cfg([override])
    section = cfg[group]
    assert OmegaConf.get_type(section).__name__.endswith("Config")
    missing = [k for k in OmegaConf.to_container(section).keys() if OmegaConf.is_missing(section, k)]
    assert missing == []
    if group in ("chip", "model", "precision", "comm"):
        assert section.name == option


def test_chip_is_not_in_defaults_and_the_design_example_composes(compose_cfg):
    assert OmegaConf.is_missing(compose_cfg([]).chip, "name")  # detected at launch
    cfg = compose_cfg(["+chip=ascend910b", "parallel=tp8pp4"])
    assert (cfg.chip.name, cfg.chip.dist_backend, cfg.chip.device_type) == ("ascend910b", "hccl", "npu")
    assert (cfg.parallel.tp, cfg.parallel.pp) == (8, 4)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.tpp=2"],
        ["trainer.steps=ten"],
        ["model.d_model=1.5"],
        ["+chip=cpu", "chip.emulate=maybe"],
        ["+chip=cpu2"],
        ["comm.bucket_mb=big"],
        ["+chip=cpu", "chip.memroy_gb=3"],
        ["parallel=tp3"],
    ],
)
def test_typos_and_wrong_types_fail_to_compose(compose_cfg, overrides):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(overrides)


def test_parallel_presets_are_named_after_their_layout(compose_cfg):
    for option in [o for g, o in PRESETS if g == "parallel" and o not in ("single", "auto_dp")]:
        p = compose_cfg([f"parallel={option}"]).parallel
        sizes = dict(re.findall(r"(dp|tp|pp)(\d+)", option))
        assert all(int(p[k]) == int(sizes.get(k, 1)) for k in ("dp", "tp", "pp")), option


FIGURES = ("memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps")


def test_chip_presets_cite_their_figures():
    """A preset that states a figure says where it comes from; one that only builds on another
    (a kept name, a generic preset) says which SKU it stands for."""
    for path in (conf_dir() / "chip").glob("*.yaml"):
        text, own = path.read_text(), OmegaConf.load(path)
        if path.stem not in ("cpu", "cuda") and any(k in own for k in FIGURES):
            assert re.search(r"Source|Sources", text), f"{path.name} cites no source"
        if "defaults" in own and not any(k in own for k in FIGURES):
            assert re.search(r"stands for|Any (CUDA GPU|Ascend NPU)", text), f"{path.name} says not what it is"
        cfg = chips.load_preset(path.stem)
        assert cfg.memory_gb > 0 and cfg.peak_tflops["fp32"] > 0 and cfg.devices_per_node >= 1
        assert cfg.name == path.stem


def test_default_config_is_valid_on_the_detected_chip(compose_cfg):
    cfg = prepare(compose_cfg([]))
    assert cfg.chip.source == "detected"
    assert cfg.chip.name in chips.preset_names()
    assert layout(cfg).world_size == 1


def test_dp_fills_from_world_size(compose_cfg):
    cfg = compose_cfg(["+chip=cpu", "parallel=auto_dp", "launch.world_size=4"])
    assert layout(cfg).dp == 4
    cfg = compose_cfg(["+chip=a100", "parallel.dp=-1", "parallel.tp=2"])
    assert (layout(cfg).dp, layout(cfg).world_size) == (4, 8)  # 8 GPUs per node / tp 2


def test_chip_keys_without_a_preset_apply_to_the_detected_chip(compose_cfg):
    cfg = prepare(compose_cfg(["chip.emulate=true", "chip.devices_per_node=4"]))
    assert cfg.chip.source == "detected" and cfg.chip.emulate is True and cfg.chip.devices_per_node == 4
