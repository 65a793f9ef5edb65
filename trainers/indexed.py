"""Megatron's indexed token format (``PREFIX.bin`` + ``PREFIX.idx``), the one Megatron-LM,
MindSpeed-LLM and NeMo preprocess corpora into, read and written here so a team's prepared corpus
serves this tool and its production trainer alike.

The layout, as Megatron-Core's ``megatron/core/datasets/indexed_dataset.py`` writes it
(``_IndexWriter``; read, not copied):

- ``.bin``: every sequence's tokens, back to back, in the index's dtype, little-endian;
- ``.idx``: the 9-byte header ``MMIDIDX\\x00\\x00``, the version (``<Q``, 1), the dtype code
  (``<B``: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the
  sequence count and the document count (``<Q`` each), then the sequence lengths (int32), the
  sequence byte offsets into ``.bin`` (int64), and the document indices (int64: document ``d`` is
  sequences ``[doc[d], doc[d + 1])``, starting at 0, so there is one more entry than documents).
  A multimodal index adds a mode per sequence (int8) after them; token corpora have none.

A language model trains on the documents' tokens end to end, as Megatron's GPT dataset does, so
:class:`IndexedTokens` exposes the ``.bin`` as one flat token stream (its dtype from the index)
and the document boundaries beside it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedError(ValueError):
    """A prefix whose files are missing, truncated or do not match; the message names the file."""


class IndexedTokens:
    """One prefix's documents: its ``.idx`` read whole (small), its ``.bin`` memory-mapped on
    first use (each DataLoader worker maps its own)."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self.idx_path, self.bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedError(f"{path}: no such file")
        raw = Path(self.idx_path).read_bytes()
        head = len(HEADER) + 8 + 1 + 8 + 8
        if len(raw) < head or raw[: len(HEADER)] != HEADER:
            raise IndexedError(f"{self.idx_path}: not a Megatron index (no MMIDIDX header)")
        version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, len(HEADER))
        if version != VERSION:
            raise IndexedError(f"{self.idx_path}: index version {version}, this reader knows {VERSION}")
        if code not in DTYPES:
            raise IndexedError(f"{self.idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        need = head + n_seq * 4 + n_seq * 8 + n_doc * 8
        if len(raw) < need:
            raise IndexedError(f"{self.idx_path}: truncated ({len(raw)} bytes, its counts need {need})")
        self.lengths = np.frombuffer(raw, np.int32, n_seq, head)
        self.pointers = np.frombuffer(raw, np.int64, n_seq, head + n_seq * 4)
        self.documents = np.frombuffer(raw, np.int64, n_doc, head + n_seq * 12)
        self.n_tokens = int(self.lengths.sum(dtype=np.int64))
        size = os.path.getsize(self.bin_path)
        if size != self.n_tokens * self.dtype.itemsize:
            raise IndexedError(
                f"{self.bin_path}: {size} bytes, its index says {self.n_tokens} tokens of {self.dtype.name} "
                f"({self.n_tokens * self.dtype.itemsize} bytes): truncated or not this index's data"
            )
        if n_seq and (
            self.pointers[0] != 0 or np.any(np.diff(self.pointers) != self.lengths[:-1] * self.dtype.itemsize)
        ):
            raise IndexedError(f"{self.idx_path}: sequence offsets are not back to back in {self.bin_path}")
        self._tokens: Optional[np.memmap] = None

    @property
    def n_documents(self) -> int:
        return max(0, len(self.documents) - 1)

    def tokens(self) -> np.ndarray:
        """The whole stream (a read-only memory map)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        return self._tokens

    def document(self, d: int) -> np.ndarray:
        a, b = int(self.documents[d]), int(self.documents[d + 1])
        if a == b:
            return self.tokens()[:0]
        start = int(self.pointers[a]) // self.dtype.itemsize
        return self.tokens()[start : start + int(self.lengths[a:b].sum())]

    def max_token(self) -> int:
        return int(self.tokens().max()) if self.n_tokens else -1


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def write(prefix: str | Path, documents: Iterable[Sequence[int]], dtype: np.dtype | type = np.uint16) -> int:
    """Write ``documents`` (each one sequence of token ids) as ``PREFIX.bin`` / ``PREFIX.idx``;
    returns the number of documents. An empty document is a document of no sequence, as
    Megatron's ``IndexedDatasetBuilder.add_document`` records one given no lengths. Written under
    temporary names and renamed, index last."""
    dtype = np.dtype(dtype)
    if dtype not in CODES:
        raise ValueError(f"dtype {dtype} has no Megatron code")
    prefix = str(prefix)
    lengths: List[int] = []
    bounds: List[int] = [0]  # document d is sequences [bounds[d], bounds[d + 1])
    tmp_bin, tmp_idx = f"{prefix}.bin.tmp{os.getpid()}", f"{prefix}.idx.tmp{os.getpid()}"
    with open(tmp_bin, "wb") as f:
        for doc in documents:
            arr = np.asarray(doc, dtype=dtype)
            if len(arr):  # one sequence per document
                f.write(arr.tobytes())
                lengths.append(len(arr))
            bounds.append(len(lengths))
    n = len(lengths)
    lens = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        pointers[1:] = np.cumsum(lens[:-1].astype(np.int64)) * dtype.itemsize
    documents_idx = np.asarray(bounds, dtype=np.int64)
    with open(tmp_idx, "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<QBQQ", VERSION, CODES[dtype], n, len(bounds)))
        f.write(lens.tobytes())
        f.write(pointers.tobytes())
        f.write(documents_idx.tobytes())
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")
    return len(bounds) - 1
