"""The ``safetensors`` file format's headers and indexes, without torch: what the validator reads
to check a weights folder before launch (``trainers/safetensors_io.py`` reads and writes tensors).

A file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors' bytes: the
header maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
into the bytes after the header, row-major, little-endian), plus an optional ``__metadata__`` of
strings (the format's specification: huggingface/safetensors, README "Format"). A model too big
for one file is several files and ``model.safetensors.index.json``, whose ``weight_map`` names the
file of each tensor (what ``transformers``' ``save_pretrained`` writes).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Tuple

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class SafetensorsError(ValueError):
    """A missing, truncated or malformed file, named."""


def read_header(path: Path) -> Tuple[Dict[str, dict], int]:
    """The header's tensor entries and where the data starts; raises SafetensorsError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, e in header.items():
        if e.get("dtype") not in SIZES:
            raise SafetensorsError(f"{path}: tensor {name}: dtype {e.get('dtype')!r} is not supported")
        begin, end = e["data_offsets"]
        count = 1
        for s in e["shape"]:
            count *= s
        if end > data or end - begin != count * SIZES[e["dtype"]]:
            raise SafetensorsError(f"{path}: tensor {name} runs past the file's {data} data bytes (truncated?)")
    return header, 8 + n


def entries(folder: Path) -> Dict[str, Tuple[Path, dict, int]]:
    """Every tensor of a folder (one ``model.safetensors``, or an index and its shards): name ->
    (file, header entry, where the file's data starts); raises SafetensorsError."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise SafetensorsError(f"{index}: no weight_map ({e})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise SafetensorsError(f"{folder}: neither {INDEX} nor {SINGLE}")
    out: Dict[str, Tuple[Path, dict, int]] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise SafetensorsError(f"{path}: no such file (listed in {INDEX})")
        header, start = read_header(path)
        for key, e in header.items():
            out[key] = (path, e, start)
    return out


def write_index(folder: Path, weight_map: Dict[str, str], total_size: int) -> None:
    (folder / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
