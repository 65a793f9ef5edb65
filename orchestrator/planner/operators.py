"""Operator coverage: every aten operator one forward + backward of the model calls, captured on
the meta device (``trainers.ops.capture_ops``, imported when first needed: composing,
validating and planning a config import no torch), planned against the chip's operator table:
native, mapped to a decomposition the trainer applies through a model option, or a custom
kernel to write. The seed article's two figures: coverage N_supported / N_total and replacement
rate (N_mapped + N_fused + N_custom) / N_total.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from fnmatch import fnmatch
from typing import Any, Dict, Iterable, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf

from orchestrator import cache, conf_dir


@functools.lru_cache(maxsize=32)
def _captured(model_json: str, seq_len: int, compute_dtype: str) -> Tuple[Tuple[str, int], ...]:
    # seconds of tracing on the meta device (and torch's import) per trial otherwise: kept on disk
    # under what decides the answer, the model, the shapes, torch and the trainer's own source
    key = {
        "model": json.loads(model_json),
        "seq_len": seq_len,
        "compute_dtype": compute_dtype,
        "torch": cache.version("torch"),
        "trainer": cache.trainer_source_digest(),
    }

    def capture() -> Dict[str, int]:
        from trainers.ops import capture_ops

        return capture_ops(json.loads(model_json), seq_len=seq_len, compute_dtype=compute_dtype).counts

    counts = cache.json_entry("ops", key, capture)
    return tuple(sorted((str(op), int(n)) for op, n in counts.items()))


def captured_ops(model: DictConfig | Dict[str, Any], seq_len: int, compute_dtype: str) -> Dict[str, int]:
    """aten op -> calls in one forward + backward of the model, run on the meta device."""
    body = OmegaConf.to_container(model, resolve=True) if isinstance(model, DictConfig) else dict(model)
    return dict(_captured(json.dumps(body, sort_keys=True), int(seq_len), str(compute_dtype)))


def op_table(name: str) -> Dict[str, List[str]]:
    """``conf/op_tables/NAME.json``'s operators (``aten::name`` -> registered overloads), written
    by ``python -m orchestrator.npu_ops``; FileNotFoundError names the file."""
    return dict(_op_table(str(name)))


@functools.lru_cache(maxsize=8)
def _op_table(name: str) -> Tuple[Tuple[str, List[str]], ...]:
    path = conf_dir() / "op_tables" / f"{name}.json"
    return tuple(sorted(json.loads(path.read_text())["ops"].items()))


@functools.lru_cache(maxsize=1)
def op_tables() -> List[str]:
    """The shipped tables' names."""
    return sorted(p.stem for p in (conf_dir() / "op_tables").glob("*.json"))


def composites(ops: Iterable[str]) -> List[str]:
    """The operators among ``ops`` that torch implements as composites of other operators (an
    overload with a CompositeExplicitAutograd or CompositeImplicitAutograd kernel: views,
    ``stack``, ``slice_backward``...): they run on any backend that has the operators they call,
    so a table of a backend's own kernels does not list them. Cached on disk by torch's version."""

    def find() -> List[str]:
        import torch

        out = []
        for op in ops:
            packet = getattr(torch.ops.aten, op.split("::", 1)[1], None) if op.startswith("aten::") else None
            names = [f"{op}.{o}" if o != "default" else op for o in (packet.overloads() if packet else [])]
            keys = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")
            if any(torch._C._dispatch_has_kernel_for_dispatch_key(n, k) for n in names for k in keys):
                out.append(op)
        return out

    ops = sorted(set(ops))
    return cache.json_entry("composites", {"ops": ops, "torch": cache.version("torch")}, find)


@dataclass
class OpPlan:
    op: str
    plan: str  # native | mapped | custom
    # the decomposition (model.KEY=VALUE), why a custom kernel is needed, or for a native operator
    # the chip's table does not list, "composite" (it runs on the operators it calls)
    via: str = ""
    calls: int = 0


@dataclass
class OpCoverage:
    """The seed article's two figures over the model's distinct operators: coverage
    N_supported / N_total and replacement rate (N_mapped + N_fused + N_custom) / N_total."""

    ops: List[OpPlan]
    model_overrides: Dict[str, Any]
    unresolved: List[str]  # operators with neither support nor a usable decomposition
    n_fused: int = 0  # operator fusion (graph compilers) is not planned here

    def count(self, plan: str) -> int:
        return sum(1 for o in self.ops if o.plan == plan)

    @property
    def n_total(self) -> int:
        return len(self.ops)

    @property
    def coverage(self) -> float:
        return self.count("native") / self.n_total if self.ops else 1.0

    @property
    def replacement_rate(self) -> float:
        return (self.count("mapped") + self.n_fused + self.count("custom")) / self.n_total if self.ops else 0.0

    def to_dict(self) -> Dict[str, Any]:
        return {
            "n_total": self.n_total,
            "n_supported": self.count("native"),
            "n_mapped": self.count("mapped"),
            "n_fused": self.n_fused,
            "n_custom": self.count("custom"),
            "coverage": self.coverage,
            "replacement_rate": self.replacement_rate,
            "model_overrides": dict(self.model_overrides),
            "unresolved": list(self.unresolved),
            "ops": [asdict(o) for o in self.ops],
        }


def _matches(op: str, patterns: Iterable[str]) -> Optional[str]:
    """The first pattern naming ``op``: a glob, or a prefix (``chip.decompositions`` keys become
    MLflow param names, which may not contain ``*``)."""
    return next((p for p in patterns if fnmatch(op, p) or op.startswith(p)), None)


def _model_override(value: str, model: DictConfig | Dict[str, Any]) -> Optional[Tuple[str, str]]:
    key, sep, val = str(value).partition("=")
    if not sep or not key.startswith("model.") or key[len("model.") :] not in model:
        return None
    return key[len("model.") :], val


def op_coverage(model: DictConfig, seq_len: int, compute_dtype: str, chip: DictConfig) -> OpCoverage:
    """Plan every operator of the model against the chip's table (``chip.op_table``: the operators
    its framework registers, a composite of torch's counting as native; ``chip.unsupported_ops``;
    ``chip.decompositions``: glob or prefix -> ``model.KEY=VALUE``): native, mapped to a decomposition
    the trainer applies through that model option, or a custom kernel to write. The mapped
    model is captured again, so a decomposition that itself needs a missing operator shows up
    as unresolved."""
    unsupported = list(chip.unsupported_ops)
    decomps = {str(k): str(v) for k, v in chip.decompositions.items()}
    counts = captured_ops(model, seq_len, compute_dtype)
    registered = op_table(chip.op_table) if chip.get("op_table") else None
    composite = set(composites(op for op in counts if op not in registered)) if registered is not None else set()

    def native(op: str) -> Optional[str]:
        """None where the chip lacks ``op``; else how it runs ("" its own kernel, or "composite")."""
        if _matches(op, unsupported):
            return None
        if registered is None or op in registered or not op.startswith("aten::"):
            return ""  # torch_npu's own npu:: operators are its kernels
        return "composite" if op in composite else None

    plans: List[OpPlan] = []
    overrides: Dict[str, Any] = {}
    for op, calls in sorted(counts.items()):
        how = native(op)
        if how is not None:
            plans.append(OpPlan(op, "native", how, calls))
            continue
        pattern = _matches(op, decomps)
        kv = _model_override(decomps[pattern], model) if pattern else None
        if kv is None:
            why = (
                f"chip.decompositions[{pattern!r}]={decomps[pattern]!r} is not a model.KEY=VALUE option"
                if pattern
                else "no decomposition in the chip table"
            )
            plans.append(OpPlan(op, "custom", why, calls))
        else:
            overrides[kv[0]] = yaml.safe_load(kv[1]) if kv[1] else kv[1]
            plans.append(OpPlan(op, "mapped", f"model.{kv[0]}={kv[1]}", calls))
    unresolved = [p.op for p in plans if p.plan == "custom"]
    if overrides:
        mapped_model = (
            {**OmegaConf.to_container(model, resolve=True), **overrides}
            if isinstance(model, DictConfig)
            else {**model, **overrides}
        )
        mapped_ops = captured_ops(mapped_model, seq_len, compute_dtype)
        if registered is not None:
            composite |= set(composites(op for op in mapped_ops if op not in registered))
        for op in mapped_ops:
            if op not in counts and native(op) is None:
                unresolved.append(op)
                plans.append(OpPlan(op, "custom", "needed by the decomposition and unsupported", 0))
    return OpCoverage(plans, overrides, sorted(set(unresolved)))
