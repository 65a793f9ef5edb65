"""The one step that turns a composed config into the config it stands for: the chip filled in
(detected when no ``+chip=NAME`` was given, ``orchestrator/chips.py``) and the model section from
a Hugging Face ``config.json`` (``model.hf_config``, ``orchestrator/hf_model.py``). A trial, the
planner's preflight, the auto search and the OVAT engine's effect check all start from it."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from orchestrator import chips, hf_model


def fill(cfg: DictConfig) -> Optional[str]:
    """Fill ``cfg`` in place; the error line (a Hugging Face folder that does not read), or None."""
    chips.resolve(cfg)
    return hf_model.apply(cfg)
