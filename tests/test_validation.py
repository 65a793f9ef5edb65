"""Broken configs: each gets exit code 2, one line naming its key, no traceback, no MLflow run.

The CLI cases run the real entry point (`orchestrator.app.cli`, what `python -m orchestrator`
calls) in this process, one case after another, with its exit code and output; one case runs the
real command in a subprocess. The in-process config cases check that every broken rule of one
config is reported at once.
"""

from __future__ import annotations

import pytest

from orchestrator.trial import ConfigError, prepare
from tests.conftest import cli_in_process, run_cli

# (overrides, a key the error must name)
BROKEN = [
    (["parallel=dp2", "launch.world_size=3"], "launch.world_size"),
    (["parallel.dp=-1", "parallel.tp=2", "launch.world_size=3", "model.n_heads=4"], "parallel.dp=-1"),
    (["parallel.tp=3"], "parallel.tp=3"),
    (["parallel.pp=8", "model.n_layers=4"], "parallel.pp=8"),
    (["parallel=pp2", "parallel.microbatches=1"], "parallel.microbatches"),
    (["parallel=pp2", "parallel.microbatches=3", "trainer.global_batch=8"], "parallel.microbatches=3"),
    (["parallel=dp2", "parallel.microbatches=4"], "parallel.microbatches=4"),  # no pipeline to cut for
    # DDP over a pipeline of no more microbatches than pp (one stage a rank) or 2 x pp (several):
    # torch's reducer fails on the first step
    (["parallel=dp2pp2", "parallel.microbatches=2", "trainer.global_batch=8"], "parallel.microbatches=2 not above"),
    (["parallel=dp2pp2", "parallel.schedule=zbv", "trainer.global_batch=16"], "parallel.microbatches=4 not above"),
    # ZB-V's deferred weight gradients under the overlapped reduction: wrong gradients, refused
    (
        ["parallel=dp2pp2", "parallel.schedule=zbv", "trainer.global_batch=20", "parallel.microbatches=5"],
        "parallel.schedule=zbv",
    ),
    (["parallel=dp2pp2", "parallel.schedule=zbv", "parallel.dp_shard=fsdp"], "parallel.schedule=zbv"),
    (
        [
            "parallel=dp2pp2",
            "parallel.schedule=interleaved_1f1b",
            "parallel.virtual_stages=2",
            "trainer.global_batch=16",
        ],
        "parallel.microbatches=4 not above",
    ),
    (["trainer.global_batch=12", "trainer.micro_batch=8"], "trainer.micro_batch"),
    (["parallel=dp2", "trainer.global_batch=9", "trainer.micro_batch=1"], "trainer.global_batch=9"),
    (["model.n_heads=5"], "model.n_heads=5"),
    (["trainer.seq_len=512"], "trainer.seq_len=512"),
    (["comm.bucket_mb=0"], "comm.bucket_mb"),
    (["comm.buffsize_mb=-200"], "comm.buffsize_mb"),
    (["comm.timeout_s=0"], "comm.timeout_s"),
    (["comm.topk_ratio=1.5"], "comm.topk_ratio"),
    (["precision.compute_dtype=fp8"], "precision.compute_dtype"),
    (["+chip=cpu", "chip.dtypes=[fp32]", "precision=bf16"], "precision.compute_dtype=bf16"),
    (["parallel.schedule=zigzag"], "parallel.schedule"),
    (["trainer.steps=0"], "trainer.steps"),
    (["trainer.lr=-1"], "trainer.lr"),
    (["data=memmap"], "data.path"),
    (["data=memmap", "data.path=/nonexistent/tokens.bin"], "data.path"),
    (["+chip=ascend910b"], "chip.emulate=true"),
    (["+chip=h100"], "chip.emulate=true"),
    (["parallel=dp8", "+chip=cpu", "chip.devices_per_node=4"], "chip=cpu"),
    (["parallel=pp2", "model.tie_embeddings=true"], "model.tie_embeddings"),
    (["comm.compression=topk"], "comm.compression=topk"),
    (["parallel=dp2tp2", "comm.compression=powersgd"], "comm.compression=powersgd"),  # a DDP hook: tp=1
    (["parallel=dp2tp2", "parallel.dp_shard=zero1", "comm.compression=bf16"], "comm.compression=bf16"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["model.loss_chunks=0"], "model.loss_chunks=0"),
    (
        ["parallel=tp2", "parallel.sequence_parallel=true", "trainer.seq_len=64", "model.loss_chunks=33"],
        "model.loss_chunks",
    ),
    (["parallel=pp2", "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=1"], "parallel.virtual_stages"),
    (["parallel=pp4", "parallel.schedule=zbv"], "model.n_layers=4"),
    (["model.norm=batchnorm"], "model.norm"),
    (["trainer.fault.kill_rank=3"], "trainer.fault.kill_rank"),
    (["model.attn_impl=npu_fused"], "model.attn_impl=npu_fused"),  # torch_npu's kernel, on a CPU chip
    (["trainer.compile=true", "trainer.compile_backend=torchair"], "trainer.compile_backend=torchair"),
    (["+chip=ascend910a", "chip.emulate=true", "precision=bf16"], "precision.compute_dtype=bf16"),
    (["+chip=ascend910b", "chip.emulate=true", "chip.op_table=torch_npu-v0"], "chip.op_table=torch_npu-v0"),
    # the 910A has no bf16: its gradients cannot travel in it either
    (["+chip=ascend910a", "chip.emulate=true", "parallel=dp2", "comm.compression=bf16"], "comm.compression=bf16"),
    # a compiled npu_fusion_attention loses its dropout mask (aot_eager: seed 0; TorchAir: refused)
    (
        ["+chip=ascend910b", "chip.emulate=true", "trainer.compile=true", "model.attn_impl=npu_fused"]
        + ["model.dropout=0.1"],
        "model.dropout=0.1",
    ),
    # rejected by Hydra against the schema while composing
    (["parallel.tpp=2"], "parallel.tpp"),
    (["trainer.steps=ten"], "trainer.steps"),
    (["model=gpt5"], "model/gpt5"),
    (["+chip=tpu"], "chip/tpu"),
]


@pytest.mark.parametrize("overrides,key", BROKEN, ids=[" ".join(o) for o, _ in BROKEN])
def test_broken_config_exits_2_naming_the_key(tmp_path, monkeypatch, capfd, overrides, key):
    db = tmp_path / "mlruns.db"
    code, out, err = cli_in_process(
        ["trainer=smoke", *overrides], tmp_path, monkeypatch, capfd, MLFLOW_TRACKING_URI=f"sqlite:///{db}"
    )
    assert code == 2, out + err
    assert key in err, err
    assert "Traceback" not in err + out
    # nothing launched, nothing recorded: the store was never even opened
    assert not db.exists()
    assert not (tmp_path / "mlruns.db").exists() and not (tmp_path / "mlartifacts").exists()


def test_every_broken_rule_is_reported_at_once(compose_cfg):
    cfg = compose_cfg(
        [
            "+chip=cpu",
            "parallel=dp2",
            "trainer.global_batch=9",
            "model.n_heads=3",
            "comm.bucket_mb=0",
            "comm.timeout_s=-1",
            "trainer.seq_len=1024",
        ]
    )
    with pytest.raises(ConfigError) as info:
        prepare(cfg)
    lines = info.value.errors
    for key in ("trainer.global_batch=9", "model.n_heads=3", "comm.bucket_mb", "comm.timeout_s", "trainer.seq_len"):
        assert sum(key in line for line in lines) >= 1, (key, lines)
    assert len(lines) >= 5


def test_one_line_per_rule_and_no_traceback(tmp_path):
    proc = run_cli(["+chip=cpu", "comm.bucket_mb=0", "trainer.steps=0"], cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["error: trainer.steps=0: must be positive", "error: comm.bucket_mb=0.0: must be positive"]


def test_a_valid_config_passes(compose_cfg):
    assert prepare(compose_cfg(["+chip=cpu", "parallel=dp2"])).chip.name == "cpu"
    # ZB-V over replicas with the reduction after the backward, under DDP and FSDP, and with one
    # replica (each measured equal to the single-process reference: the refusals above go no wider)
    zbv = ["+chip=cpu", "parallel=dp2pp2", "parallel.schedule=zbv", "trainer.micro_batch=2"]
    for extra in (
        ["trainer.global_batch=16", "comm.overlap=false"],
        ["trainer.global_batch=16", "comm.overlap=false", "parallel.dp_shard=fsdp"],
        ["parallel=tp2pp2"],  # one replica: nothing to reduce
    ):
        prepare(compose_cfg([*zbv, *extra]))
    # DDP under interleaved 1F1B of 4 stages a rank: 6 microbatches run (the limit is 2 x pp, not 8 stages)
    prepare(compose_cfg(["+chip=cpu", "parallel=dp2pp2", "parallel.schedule=interleaved_1f1b",
                         "parallel.virtual_stages=4", "model.n_layers=8", "trainer.global_batch=12",
                         "trainer.micro_batch=1", "parallel.microbatches=6"]))  # fmt: skip


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["parallel.dp=-1", "parallel.tp=2", "launch.world_size=8"], "dp4tp2pp1"),  # filled from the world
        # every device of the nodes
        (["parallel.dp=-1", "parallel.pp=2", "chip.devices_per_node=4", "launch.nnodes=2"], "dp4tp1pp2"),
        (["parallel.dp=3", "launch.world_size=3"], "dp3tp1pp1"),  # given
    ],
)
def test_the_layout_fills_dp_from_the_world(compose_cfg, overrides, name):
    from orchestrator.layout import layout

    lay = layout(compose_cfg(["+chip=cpu", *overrides]))
    assert lay.name == name and lay.world_size == lay.dp * lay.tp * lay.pp


def test_a_layout_has_no_empty_dimension():
    from trainers.rules import Layout

    with pytest.raises(ValueError, match="dp=0"):
        Layout(0, 2, 1)
