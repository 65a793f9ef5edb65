"""Token data: a real offline corpus, user memmap files, corpora in Megatron's indexed format
(one prefix, or several blended by weight: ``trainers/indexed.py``), or synthetic tokens.

Every data-parallel rank reads its own slice of each global batch through a DataLoader with
worker processes and prefetch. The order is a pure function of (seed, step), so a run resumes
from any step by starting the sampler there, and ``dp=2`` sees exactly the sequences that
``dp=1`` sees in the same step.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainers.config import DataConfig, default_cache_dir


def stdlib_sources() -> list[Path]:
    """The standard library's own ``.py`` files, in a stable order (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(cache_dir: Optional[str] = None, max_mb: int = 16) -> Path:
    """Byte-level tokens of the stdlib sources as a uint16 file, built once and cached.

    The file name carries a hash of the Python version and the size cap, so two interpreters
    never share a cache entry; the file is written under a temporary name and renamed, so a
    reader never sees half of it.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha256(
        f"{sysconfig.get_python_version()}|{sysconfig.get_paths()['stdlib']}|{max_mb}".encode()
    ).hexdigest()[:12]
    out = cache / f"stdlib-bytes-{key}.u16"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    limit = max_mb * 1024 * 1024
    chunks, size = [], 0
    for path in stdlib_sources():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n\n")
        size += len(data) + 2
        if size >= limit:
            break
    raw = np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8).astype(np.uint16)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    raw.tofile(tmp)
    os.replace(tmp, out)
    return out


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a flat token file (uint16, or the
    dtype of a Megatron index), across document boundaries as Megatron's GPT dataset reads them."""

    def __init__(
        self, path: str | Path, seq_len: int, split: str = "train", val_fraction: float = 0.0, dtype=np.uint16
    ):
        self.path, self.seq_len, self.dtype = str(path), seq_len, np.dtype(dtype)
        n_tokens = os.path.getsize(self.path) // self.dtype.itemsize
        n_val = int(n_tokens * val_fraction)
        self.lo, self.hi = (0, n_tokens - n_val) if split == "train" else (n_tokens - n_val, n_tokens)
        self.n = max(0, (self.hi - self.lo - 1) // seq_len)
        self._tokens: Optional[np.memmap] = None  # opened lazily, once per DataLoader worker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = self.lo + i * self.seq_len
        w = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class BlendedWindows(Dataset):
    """Several datasets interleaved by weight: position ``i`` of the blend is the next unread
    window of the dataset whose share is most behind at ``i`` (each dataset's ``j``-th window is
    due at ``(j + 0.5) / weight``; all merged by due time, ties by dataset order), as Megatron's
    blended dataset spreads its parts. A part asked for more windows than it has starts over. The
    order is a function of the lengths and weights only; the sampler shuffles it by seed."""

    def __init__(self, parts: List[Dataset], weights: List[float]):
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        self.parts, self.n = parts, sum(len(p) for p in parts)
        due = [(np.arange(int(np.ceil(wk * self.n)) + 1) + 0.5) / wk for wk in w]
        which = np.concatenate([np.full(len(d), k, dtype=np.int64) for k, d in enumerate(due)])
        order = np.lexsort((which, np.concatenate(due)))[: self.n]
        self.which = which[order]
        rank = np.concatenate([np.arange(len(d), dtype=np.int64) for d in due])[order]
        sizes = np.asarray([max(1, len(p)) for p in parts], dtype=np.int64)
        self.index = rank % sizes[self.which]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parts[int(self.which[i])][int(self.index[i])]


class SyntheticTokens(Dataset):
    """Uniform random tokens, reproducible per index: for throughput runs."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, n: int = 1 << 20):
        self.vocab_size, self.seq_len, self.seed, self.n = vocab_size, seq_len, seed, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        w = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        return w[:-1], w[1:]


class StepSampler(Sampler[int]):
    """Yields this rank's sample indices for steps ``start_step .. steps - 1``.

    Step ``s`` uses positions ``s * G .. (s + 1) * G - 1`` of an endless stream made of seeded
    permutations of the dataset, one per epoch; data-parallel rank ``r`` of ``dp`` takes the
    ``r``-th contiguous ``G / dp`` of them.
    """

    def __init__(
        self, n: int, global_batch: int, dp_rank: int, dp_size: int, seed: int, steps: int, start_step: int = 0
    ):
        if n <= 0:
            raise ValueError("the dataset has no full window; lower trainer.seq_len or use a larger corpus")
        self.n, self.G, self.rank, self.dp, self.seed = n, global_batch, dp_rank, dp_size, seed
        self.steps, self.start_step = steps, start_step
        self._epoch, self._perm = -1, None

    def _index(self, pos: int) -> int:
        epoch, k = divmod(pos, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return int(self._perm[k])

    def __iter__(self) -> Iterator[int]:
        per_rank = self.G // self.dp
        for step in range(self.start_step, self.steps):
            base = step * self.G + self.rank * per_rank
            for j in range(per_rank):
                yield self._index(base + j)

    def __len__(self) -> int:
        return (self.steps - self.start_step) * (self.G // self.dp)


def build_dataset(args: DataConfig, seq_len: int, vocab_size: int, seed: int, split: str = "train") -> Dataset:
    if args.name == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, seed + (0 if split == "train" else 1))
    if args.name == "megatron":
        from trainers.indexed import IndexedTokens

        parts: List[Dataset] = []
        for prefix in args.prefixes:
            ix = IndexedTokens(prefix)
            parts.append(TokenWindows(ix.bin_path, seq_len, split, args.val_fraction, ix.dtype))
        if len(parts) == 1:
            return parts[0]
        return BlendedWindows(parts, list(args.weights) or [1.0] * len(parts))
    path = args.path if args.name == "memmap" else stdlib_corpus(args.cache_dir, args.max_corpus_mb)
    return TokenWindows(path, seq_len, split, args.val_fraction)


def prepare(args: DataConfig) -> None:
    """Build what the dataset reads (the cached corpus) once, before the ranks open it."""
    if args.name == "stdlib":
        stdlib_corpus(args.cache_dir, args.max_corpus_mb)


def build_loader(
    args: DataConfig,
    *,
    seq_len: int,
    vocab_size: int,
    seed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    steps: int,
    start_step: int = 0,
    pin_device: str = "",
) -> DataLoader:
    """The training batches of one data-parallel rank. ``pin_device`` (``cuda``, ``npu``): the
    accelerator the batches go to, whose pinned host memory the loader fills so the copy is
    asynchronous; "" on CPU. torch_npu documents ``DataLoader(pin_memory=True)`` on NPU and its
    tests pass ``pin_memory_device="npu"`` (Ascend/pytorch ``test/test_dataloader.py``). From
    torch 2.7, the floor, the loader pins for the current accelerator by itself (and 2.13 warns
    that ``pin_memory_device`` is deprecated), so it is not passed."""
    ds = build_dataset(args, seq_len, vocab_size, seed)
    sampler = StepSampler(len(ds), global_batch, dp_rank, dp_size, seed, steps, start_step)
    workers = max(0, args.num_workers)
    return DataLoader(
        ds,
        batch_size=micro_batch,
        sampler=sampler,
        drop_last=False,
        num_workers=workers,
        prefetch_factor=args.prefetch_factor if workers else None,
        pin_memory=bool(pin_device),
        persistent_workers=False,
        # the rank's own children, forked from it: a rank started by a forkserver would otherwise
        # have the server start its loader workers, which then outlive the rank if it dies
        multiprocessing_context="fork" if workers else None,
    )


def build_val_loader(
    args: DataConfig,
    *,
    seq_len: int,
    vocab_size: int,
    seed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
    batches: int,
) -> DataLoader:
    """The held-out split (the tail ``data.val_fraction`` of the corpus; other seeds for synthetic
    tokens): the same ``batches`` global batches at every evaluation, each data-parallel rank
    taking its slice as in training. Read in the calling process (an evaluation is a few
    batches), with its own generator, so evaluating draws nothing from the training RNG."""
    ds = build_dataset(args, seq_len, vocab_size, seed, split="val")
    sampler = StepSampler(len(ds), global_batch, dp_rank, dp_size, seed, batches)
    return DataLoader(
        ds,
        batch_size=micro_batch,
        sampler=sampler,
        drop_last=False,
        num_workers=0,
        generator=torch.Generator().manual_seed(seed),
    )
