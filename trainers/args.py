"""The one way a trainer dataclass is built from its config section (a plain dict)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, Type, TypeVar

T = TypeVar("T", bound="SectionArgs")


class SectionArgs:
    """Mixin for dataclasses: ``from_dict`` keeps the keys the dataclass declares and ignores
    the rest (the control plane's sections carry keys that only it reads)."""

    @classmethod
    def from_dict(cls: Type[T], d: Dict[str, Any]) -> T:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})
