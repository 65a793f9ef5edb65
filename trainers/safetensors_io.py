"""Tensors in the ``safetensors`` format, read and written with torch alone (no extra dependency);
the header and index handling is :mod:`trainers.safetensors_format`.

Reading maps the file into memory and gives each tensor as a view of its bytes: nothing is read
until used, so a rank that needs one shard of one tensor touches only those pages, and no rank
holds the whole model.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from trainers.safetensors_format import entries

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


class Checkpoint:
    """The tensors of a folder (one ``model.safetensors`` or an index and its shards), by name,
    each a lazy view of its mapped file."""

    def __init__(self, folder: str):
        self.folder = Path(folder).expanduser()
        self.entries = entries(self.folder)
        self._maps: Dict[Path, mmap.mmap] = {}

    def names(self) -> List[str]:
        return sorted(self.entries)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def tensor(self, name: str) -> torch.Tensor:
        """A read-only view of the tensor's bytes in the mapped file (copy it to keep or change it)."""
        path, e, start = self.entries[name]
        if path not in self._maps:
            with open(path, "rb") as f:
                self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        begin, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        if end == begin:
            return torch.empty(e["shape"], dtype=dtype)
        buf = memoryview(self._maps[path])[start + begin : start + end]
        with warnings.catch_warnings():  # the buffer is read-only; callers copy what they keep
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=dtype).view(e["shape"])


def write(path: Path, tensors: Iterable[Tuple[str, torch.Tensor]], metadata: Optional[Dict[str, str]] = None) -> int:
    """Write ``(name, tensor)`` pairs (CPU, any layout) as one safetensors file; returns its size."""
    items = [(name, t.detach().cpu().contiguous()) for name, t in tensors]
    header: Dict[str, dict] = {}
    offset = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer pads it
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return 8 + len(raw) + offset
