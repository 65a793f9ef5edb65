"""The planner's model state, rank by rank, against what the trainer really holds.

After its first optimizer step every rank reports the bytes of its parameters (local shards, a
tied weight once), their gradients and the optimizer's tensors (``model_state_bytes`` of the
summary, ``trainers/memory.py``). The planner predicts the same three integers for every rank
(``orchestrator.planner.state_bytes_per_rank``: the trainer's stage split, TP placements and
FSDP chunking, ``orchestrator/planner/shapes.py``). They must be equal, to the byte: an average,
a tolerance or a rank the planner does not model would hide exactly what this test is for.

Every parallel preset that gpt_tiny runs on a CPU is launched for one step, plus FSDP on dp2
(with one unit per block, and with ``comm.overlap=false`` one per stage) and a tied embedding
under TP.
Not launched: ``tp8``, ``tp8pp4`` and ``tp4pp8``, which the validator refuses for gpt_tiny (tp=8
does not divide its 4 heads; pp=8 exceeds its 4 layers), checked below; ``dp8``, eight processes
for the rule (DDP replicates everything) that dp2 and dp4 already check, planned only.
16-bit parameters (``precision.param_dtype=bf16``, with and without fp32 master weights) are
checked where the trainer honours the dtype, and skipped while it stores fp32 parameters.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
from omegaconf import OmegaConf

from orchestrator import chips, planner, trial
from orchestrator.validate import layout, validate

BASE = ["+chip=cpu", "model=gpt_tiny", "trainer=smoke", "trainer.steps=1", "trainer.global_batch=8",
        "trainer.micro_batch=2", "trainer.seq_len=16", "trainer.warmup_steps=0", "trainer.log_every=1",
        "data=synthetic", "data.num_workers=0", "tracking.enabled=false"]
PRESETS = {
    "single": ["parallel=single"],
    "auto_dp": ["parallel=auto_dp", "launch.world_size=2"],
    "dp2": ["parallel=dp2"],
    "dp2-fsdp": ["parallel=dp2", "parallel.dp_shard=fsdp"],
    "dp4": ["parallel=dp4"],
    "tp2": ["parallel=tp2"],
    "tp4": ["parallel=tp4"],
    "pp2": ["parallel=pp2"],
    "pp4": ["parallel=pp4"],
    "tp2pp2": ["parallel=tp2pp2"],
    "dp2tp2": ["parallel=dp2tp2"],
    "dp2pp2": ["parallel=dp2pp2"],
    "dp2tp2pp2": ["parallel=dp2tp2pp2"],
    # one FSDP unit per stage instead of one per block: the same shards
    "dp2-fsdp-no-overlap": ["parallel=dp2", "parallel.dp_shard=fsdp", "comm.overlap=false"],
    "tp2-tied": ["parallel=tp2", "model.tie_embeddings=true"],  # one vocabulary-parallel weight for both ends
}
BF16 = ["precision.param_dtype=bf16", "precision.compute_dtype=bf16"]
SIXTEEN_BIT = {  # the first one tells whether the trainer honours param_dtype yet
    "single-bf16-master": ["parallel=single", *BF16],
    "single-bf16-no-master": ["parallel=single", *BF16, "precision.master_weights_fp32=false"],
    "dp2-fsdp-bf16-master": ["parallel=dp2", "parallel.dp_shard=fsdp", *BF16],
    "tp2-bf16-no-master": ["parallel=tp2", *BF16, "precision.master_weights_fp32=false"],
}
_not_honoured: List[str] = []  # why the 16-bit cases are skipped, once the first one found out


def _table(name: str, planned: List[Dict[str, int]], measured: List[Dict[str, int]]) -> str:
    rows = [f"{name}: rank  params planned/measured  grads planned/measured  optimizer planned/measured"]
    for r, (p, m) in enumerate(zip(planned, measured)):
        rows.append(f"  {r:>2}  " + "  ".join(f"{p[k]:>9}/{m[k]:<9}" + ("" if p[k] == m[k] else " <-")
                                              for k in ("params", "grads", "optimizer")))
    return "\n".join(rows)


def _run(compose_cfg, overrides: List[str]):
    """One step of the trial; (planned, measured) per rank, in rank order."""
    cfg = compose_cfg([*BASE, *overrides])
    result = trial.run(cfg, overrides, progress=False)  # resolves the chip into cfg, as the plan needs
    assert result["status"] == "finished", result.get("reason")
    measured = [{k: int(v) for k, v in r.items()} for r in result["summary"]["model_state_bytes"]]
    return cfg, planner.state_bytes_per_rank(cfg), measured


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_rank_holds_the_planned_bytes(compose_cfg, name):
    cfg, planned, measured = _run(compose_cfg, PRESETS[name])
    print("\n" + _table(name, planned, measured))
    assert len(measured) == layout(cfg).world_size
    assert measured == planned, _table(name, planned, measured)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SIXTEEN_BIT))
def test_16bit_parameters_hold_the_planned_bytes(compose_cfg, name):
    if _not_honoured:
        pytest.skip(_not_honoured[0])
    try:
        cfg, planned, measured = _run(compose_cfg, SIXTEEN_BIT[name])
    except trial.ConfigError as err:
        _not_honoured.append(f"the validator refuses 16-bit parameters yet: {'; '.join(err.errors)}")
        pytest.skip(_not_honoured[0])
    as_fp32 = OmegaConf.merge(cfg, {"precision": {"param_dtype": "fp32"}})
    if [r["params"] for r in measured] == [r["params"] for r in planner.state_bytes_per_rank(as_fp32)]:
        _not_honoured.append("the trainer does not honour precision.param_dtype=bf16 yet (4 bytes/param held)")
        pytest.skip(_not_honoured[0])
    print("\n" + _table(name, planned, measured))
    assert measured == planned, _table(name, planned, measured)


# --- without processes --------------------------------------------------------------------------

@pytest.mark.parametrize("preset,why", [
    ("tp8", "parallel.tp=8 does not divide model.n_heads=4"),
    ("tp8pp4", "parallel.tp=8 does not divide model.n_heads=4"),
    ("tp4pp8", "parallel.pp=8 exceeds model.n_layers=4"),
])
def test_the_presets_left_out_are_refused_for_gpt_tiny(compose_cfg, preset, why):
    cfg = chips.resolve(compose_cfg([*BASE, f"parallel={preset}"]))
    errors = validate(cfg)
    assert any(why in e for e in errors), errors


@pytest.mark.parametrize("pp,schedule,v", [(1, "1f1b", 1), (2, "1f1b", 1), (4, "gpipe", 1),
                                           (2, "interleaved_1f1b", 2), (2, "zbv", 1)])
@pytest.mark.parametrize("tied", [False, True])
def test_planned_tensors_are_the_stage_modules_tensors(pp, schedule, v, tied):
    """The planner's tensors of each pipeline rank are those the trainer's stage modules hold
    (built on meta, as trainers/parallel.py builds them), names and shapes, a tied weight once."""
    from trainers import rules
    from trainers.config import ModelConfig
    from trainers.parallel import make_stage

    args = ModelConfig(n_layers=4 if schedule == "1f1b" or pp < 4 else 8, tie_embeddings=tied)
    body = {k: getattr(args, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                         "max_seq_len", "norm", "mlp", "pos_emb", "tie_embeddings", "attn_impl")}
    m = planner.ModelShape.of(body)
    s = planner.ParallelShape(1, 1, pp, 2 * pp, 1, 16, schedule=schedule, virtual_stages=v)
    n_stages = pp * rules.stages_per_rank(pp, schedule, v)
    for rank in range(pp):
        stages = [make_stage(args, sid, n_stages) for sid in rules.stage_ids(pp, schedule, v, rank)]
        held = {id(p): (name, tuple(p.shape)) for module in stages for name, p in module.named_parameters()}
        built = sorted(held.values())
        planned = sorted((t.name, t.shape) for t in planner.rank_tensors(m, planner.rank_contents(m, s, rank)))
        assert planned == built, (rank, set(planned) ^ set(built))
