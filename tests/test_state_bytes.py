"""The planner's model state, rank by rank, against what the trainer really holds.

After its first optimizer step every rank reports the bytes of its parameters (local shards, a
tied weight once), their gradients and the optimizer's tensors (``model_state_bytes`` of the
summary, ``trainers/memory.py``). The planner predicts the same three integers for every rank
(``orchestrator.planner.state_bytes_per_rank``: the trainer's stage split, TP placements and
FSDP chunking, ``orchestrator/planner/shapes.py``). They must be equal, to the byte: an average,
a tolerance or a rank the planner does not model would hide exactly what this test is for.

Every parallel preset that gpt_tiny runs on a CPU is checked, each where it is launched anyway
(``tests.conftest.assert_planned_state_bytes``): dp2, tp2, tp2 with sequence parallelism, pp2
(each schedule), tp2pp2 and dp2tp2pp2 in tests/test_parallel.py; dp2 with DDP and with FSDP, with
and without overlap, and bf16 parameters with fp32 masters on dp2, tp2 and pp2 in
tests/test_knobs_distributed.py; dp2tp2, dp2pp2 and tied embeddings under TP and FSDP in
tests/test_llama_parallel.py. This file launches the rest: ``auto_dp``, ``dp4``, ``tp4``,
``pp4``, FSDP over bf16 parameters and bf16 without master weights under TP; the single-process
cases run in this process.
Not launched: ``tp8``, ``tp8pp4`` and ``tp4pp8``, which the validator refuses for gpt_tiny (tp=8
does not divide its 4 heads; pp=8 exceeds its 4 layers), checked below; ``dp8``, eight processes
for the rule (DDP replicates everything) that dp2 and dp4 already check, planned only.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import pytest

from orchestrator import chips, planner, trial
from orchestrator.layout import layout
from orchestrator.validate import validate
from trainers.loop import train

BASE = [
    "+chip=cpu",
    "model=gpt_tiny",
    "trainer=smoke",
    "trainer.steps=1",
    "trainer.global_batch=8",
    "trainer.micro_batch=2",
    "trainer.seq_len=16",
    "trainer.warmup_steps=0",
    "trainer.log_every=1",
    "data=synthetic",
    "data.num_workers=0",
    "tracking.enabled=false",
]
BF16 = ["precision.param_dtype=bf16", "precision.compute_dtype=bf16"]
LAUNCHED = {
    "auto_dp": ["parallel=auto_dp", "launch.world_size=2"],
    "dp4": ["parallel=dp4"],
    "tp4": ["parallel=tp4"],
    "pp4": ["parallel=pp4"],
    "dp2-fsdp-bf16-master": ["parallel=dp2", "parallel.dp_shard=fsdp", *BF16],
    "tp2-bf16-no-master": ["parallel=tp2", *BF16, "precision.master_weights_fp32=false"],
}
IN_PROCESS = {
    "single": ["parallel=single"],
    "single-bf16-master": ["parallel=single", *BF16],
    "single-bf16-no-master": ["parallel=single", *BF16, "precision.master_weights_fp32=false"],
}


def _table(name: str, planned: List[Dict[str, int]], measured: List[Dict[str, int]]) -> str:
    rows = [f"{name}: rank  params planned/measured  grads planned/measured  optimizer planned/measured"]
    for r, (p, m) in enumerate(zip(planned, measured)):
        rows.append(
            f"  {r:>2}  "
            + "  ".join(
                f"{p[k]:>9}/{m[k]:<9}" + ("" if p[k] == m[k] else " <-") for k in ("params", "grads", "optimizer")
            )
        )
    return "\n".join(rows)


def _check(name: str, cfg, summary) -> None:
    measured = [{k: int(v) for k, v in r.items()} for r in summary["model_state_bytes"]]
    planned = planner.state_bytes_per_rank(cfg)
    print("\n" + _table(name, planned, measured))
    assert len(measured) == layout(cfg).world_size
    assert measured == planned, _table(name, planned, measured)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAUNCHED))
def test_every_rank_holds_the_planned_bytes(compose_cfg, name):
    cfg = compose_cfg([*BASE, *LAUNCHED[name]])
    result = trial.run(cfg, LAUNCHED[name], progress=False)  # resolves the chip into cfg, as the plan needs
    assert result["status"] == "finished", result.get("reason")
    _check(name, cfg, result["summary"])


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_one_process_holds_the_planned_bytes(compose_cfg, name):
    cfg = trial.prepare(compose_cfg([*BASE, *IN_PROCESS[name]]))
    _check(name, cfg, train(trial.build_spec(cfg)))


# --- without processes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,why",
    [
        ("tp8", "parallel.tp=8 does not divide model.n_heads=4"),
        ("tp8pp4", "parallel.tp=8 does not divide model.n_heads=4"),
        ("tp4pp8", "parallel.pp=8 exceeds model.n_layers=4"),
    ],
)
def test_the_presets_left_out_are_refused_for_gpt_tiny(compose_cfg, preset, why):
    cfg = chips.resolve(compose_cfg([*BASE, f"parallel={preset}"]))
    errors = validate(cfg)
    assert any(why in e for e in errors), errors


@pytest.mark.parametrize(
    "pp,schedule,v", [(1, "1f1b", 1), (2, "1f1b", 1), (4, "gpipe", 1), (2, "interleaved_1f1b", 2), (2, "zbv", 1)]
)
@pytest.mark.parametrize("tied", [False, True])
def test_planned_tensors_are_the_stage_modules_tensors(pp, schedule, v, tied):
    """The planner's tensors of each pipeline rank are those the trainer's stage modules hold
    (built on meta, as trainers/parallel.py builds them), names and shapes, a tied weight once."""
    from trainers import rules
    from trainers.config import ModelConfig
    from trainers.parallel import make_stage

    args = ModelConfig(n_layers=4 if schedule == "1f1b" or pp < 4 else 8, tie_embeddings=tied)
    m = planner.ModelShape.of(dataclasses.asdict(args))
    s = planner.ParallelShape(1, 1, pp, 2 * pp, 1, 16, schedule=schedule, virtual_stages=v)
    n_stages = pp * rules.stages_per_rank(pp, schedule, v)
    for rank in range(pp):
        stages = [make_stage(args, sid, n_stages) for sid in rules.stage_ids(pp, schedule, v, rank)]
        held = {id(p): (name, tuple(p.shape)) for module in stages for name, p in module.named_parameters()}
        built = sorted(held.values())
        planned = sorted((t.name, t.shape) for t in planner.rank_tensors(m, planner.rank_contents(m, s, rank)))
        assert planned == built, (rank, set(planned) ^ set(built))
