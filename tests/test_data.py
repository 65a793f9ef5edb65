"""Data: the stdlib corpus, memmap windows, and a deterministic, resumable, sharded order."""

from __future__ import annotations

import numpy as np
import torch

from trainers.data import DataConfig, StepSampler, TokenWindows, build_loader, stdlib_corpus, stdlib_sources


def test_stdlib_corpus_is_real_bytes_and_cached(tmp_path):
    path = stdlib_corpus(str(tmp_path), max_mb=1)
    tokens = np.fromfile(path, dtype=np.uint16)
    assert len(tokens) == 1024 * 1024 and tokens.max() < 256
    first = stdlib_sources()[0].read_bytes()[:100]
    assert bytes(tokens[:100].astype(np.uint8)) == first
    mtime = path.stat().st_mtime_ns
    assert stdlib_corpus(str(tmp_path), max_mb=1) == path and path.stat().st_mtime_ns == mtime


def test_memmap_windows(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    ds = TokenWindows(path, seq_len=10, split="train", val_fraction=0.1)
    assert len(ds) == (900 - 1) // 10
    x, y = ds[3]
    assert x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    val = TokenWindows(path, seq_len=10, split="val", val_fraction=0.1)
    assert val[0][0][0].item() == 900


def _take(sampler):
    return list(iter(sampler))


def test_data_parallel_shards_cover_the_single_process_batch():
    single = _take(StepSampler(100, 8, 0, 1, seed=3, steps=5))
    r0 = _take(StepSampler(100, 8, 0, 2, seed=3, steps=5))
    r1 = _take(StepSampler(100, 8, 1, 2, seed=3, steps=5))
    for s in range(5):
        assert single[8 * s : 8 * s + 8] == r0[4 * s : 4 * s + 4] + r1[4 * s : 4 * s + 4]


def test_order_is_deterministic_resumable_and_crosses_epochs():
    full = _take(StepSampler(10, 4, 0, 1, seed=1, steps=6))  # 24 samples over a 10-window set
    assert full == _take(StepSampler(10, 4, 0, 1, seed=1, steps=6))
    assert full[12:] == _take(StepSampler(10, 4, 0, 1, seed=1, steps=6, start_step=3))
    assert sorted(full[:10]) == list(range(10)) and full[:10] != full[10:20]
    assert full != _take(StepSampler(10, 4, 0, 1, seed=2, steps=6))


def test_loader_with_workers_yields_micro_batches(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    args = DataConfig(name="memmap", path=str(path), num_workers=2, prefetch_factor=2, val_fraction=0.0)
    loader = build_loader(
        args, seq_len=16, vocab_size=65536, seed=0, global_batch=8, micro_batch=2, dp_rank=1, dp_size=2, steps=3
    )
    batches = list(loader)
    assert len(batches) == 3 * 2 and batches[0][0].shape == (2, 16) and batches[0][0].dtype == torch.int64
    x, y = batches[0]
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_the_data_section_s_cache_folder_and_size_cap_make_the_corpus(tmp_path, compose_cfg):
    """data.cache_dir is where the stdlib corpus is built; data.max_corpus_mb caps it (bytes, one
    uint16 token each)."""
    from orchestrator import trial
    from trainers.data import build_dataset

    cfg = trial.prepare(compose_cfg(["+chip=cpu", f"data.cache_dir={tmp_path}", "data.max_corpus_mb=1"]))
    spec = trial.build_spec(cfg)
    ds = build_dataset(spec.data, 64, 256, seed=0)
    (corpus,) = tmp_path.glob("stdlib-bytes-*.u16")
    assert corpus.stat().st_size == 2 * 1024 * 1024
    assert len(ds) == (int(1024 * 1024 * (1 - spec.data.val_fraction)) - 1) // 64
