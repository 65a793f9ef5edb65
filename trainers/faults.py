"""Chaos drills (``trainer.fault.*``): a rank killed at a step, or hung there (it stays alive
but takes part in no further collective, so its peers' collectives time out), a NaN or an fp16
overflow injected into one block's output at a step, a straggling rank 0 (late to every step)."""

from __future__ import annotations

import os
import signal
import time
from typing import List, Optional

import torch

from trainers.config import FaultConfig


def rank_drill(step: int, rank: int, fault: FaultConfig, marker_dir: Optional[str]) -> None:
    """The chosen rank dies hard at the chosen step, or (``inject=hang``) stops there for good:
    alive, its sockets open, in no further collective, until the launcher ends it after a peer's
    collective has timed out (``comm.timeout_s``). Once per trial (a marker in the checkpoint
    folder, or the elastic restart count, tells a restarted group it already fired)."""
    if fault.at_step != step or fault.kill_rank != rank:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if marker_dir:
        marker = os.path.join(marker_dir, f"fault_fired_rank{rank}_step{step}")
        if os.path.exists(marker):
            return
        os.makedirs(marker_dir, exist_ok=True)
        open(marker, "w").close()
    if fault.inject == "hang":
        while True:  # a SIGTERM or SIGKILL from the launcher ends it
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def straggle(rank: int, fault: FaultConfig) -> None:
    """Rank 0 is ``fault.straggle_s`` late to the step, as a slow host or device would be; its
    peers wait for it at the step's first collective, so every rank's step time carries it."""
    if rank == 0 and fault.straggle_s > 0:
        time.sleep(fault.straggle_s)


def _inject_hook(trainer_step: List[int], at_step: int, inject: str):
    def hook(module, inputs, output):
        if trainer_step[0] != at_step:
            return output
        if inject == "overflow":
            return (output * 1e5).to(torch.float16).to(output.dtype)
        return output + float("nan")

    return hook


def install_injection(parts: List[torch.nn.Module], fault: FaultConfig, trainer_step: List[int]) -> None:
    """A NaN in block ``fault.nan_layer``'s output at step ``fault.nan_at_step`` (on the rank
    holding that block); or (``inject=overflow``) that output scaled by 1e5 through fp16, which
    overflows to inf as an fp16 activation would. ``trainer_step[0]`` is the current step."""
    if fault.nan_at_step < 0:
        return
    key = str(fault.nan_layer)
    for m in parts:
        if key in m.layers:
            m.layers[key].register_forward_hook(_inject_hook(trainer_step, fault.nan_at_step, fault.inject))
