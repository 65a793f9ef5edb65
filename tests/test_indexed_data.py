"""Corpora in Megatron's indexed format (``trainers/indexed.py``, ``data=megatron``): the files are
Megatron's byte for byte (parsed here from the layout its ``_IndexWriter`` writes, not by our
reader), a blend follows its weights, the order resumes and is the same across layouts, a trial
trains on two blended prefixes and resumes to the uninterrupted losses, and broken files are one
error line naming the key and the file."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from orchestrator import data as data_cli
from orchestrator import trial
from tests.conftest import cli_in_process, search_runs
from trainers import indexed
from trainers.config import DataConfig
from trainers.data import BlendedWindows, build_dataset, build_loader

DOCS = [[1, 2, 3], [], [7] * 5, list(range(200, 210))]


def test_the_files_are_megatron_s_layout(tmp_path):
    prefix = tmp_path / "c_text_document"
    assert indexed.write(prefix, DOCS, np.uint16) == 4
    raw = (tmp_path / "c_text_document.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    # 8: uint16; documents + 1 indices. The empty document is a document of no sequence, as
    # Megatron's IndexedDatasetBuilder.add_document records one given no lengths
    assert (version, code, n_seq, n_doc) == (1, 8, 3, 5)
    off = 9 + 8 + 1 + 8 + 8
    assert list(np.frombuffer(raw, np.int32, 3, off)) == [3, 5, 10]
    assert list(np.frombuffer(raw, np.int64, 3, off + 12)) == [0, 6, 16]  # byte offsets
    assert list(np.frombuffer(raw, np.int64, 5, off + 36)) == [0, 1, 1, 2, 3]
    assert len(raw) == off + 36 + 40
    bin_ = np.fromfile(tmp_path / "c_text_document.bin", dtype="<u2")
    assert list(bin_) == [t for d in DOCS for t in d]
    ix = indexed.IndexedTokens(prefix)
    assert ix.n_documents == 4 and ix.n_tokens == 18 and ix.dtype == np.uint16
    assert [list(ix.document(d)) for d in range(4)] == DOCS and ix.max_token() == 209


def test_broken_files_name_the_file(tmp_path):
    prefix = tmp_path / "c"
    indexed.write(prefix, DOCS, np.int32)
    assert indexed.IndexedTokens(prefix).dtype == np.int32
    with open(tmp_path / "c.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(indexed.IndexedError, match=r"c\.bin: 20 bytes, its index says 18 tokens of int32"):
        indexed.IndexedTokens(prefix)
    (tmp_path / "c.idx").write_bytes(b"not an index at all, but long enough to read a header")
    with pytest.raises(indexed.IndexedError, match=r"c\.idx: not a Megatron index"):
        indexed.IndexedTokens(prefix)
    with pytest.raises(indexed.IndexedError, match=r"nope\.idx: no such file"):
        indexed.IndexedTokens(tmp_path / "nope")


class _Part:
    def __init__(self, name, n):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (self.name, i)


def test_a_blend_follows_its_weights_and_reads_each_part_in_order():
    blend = BlendedWindows([_Part("a", 300), _Part("b", 100)], [3.0, 1.0])
    got = [blend[i] for i in range(len(blend))]
    assert len(got) == 400
    for n in (4, 40, 400):  # at every prefix, within one window of the 3:1 share
        assert abs(sum(1 for name, _ in got[:n] if name == "a") - 0.75 * n) <= 1
    assert [i for name, i in got if name == "b"] == list(range(100))
    # a part asked for more windows than it holds starts over
    tilted = BlendedWindows([_Part("a", 10), _Part("b", 390)], [1.0, 1.0])
    a_reads = [i for name, i in (tilted[k] for k in range(400)) if name == "a"]
    assert a_reads[:12] == list(range(10)) + [0, 1]


def _corpus(tmp_path):
    """Two prefixes written by the command (byte-level): text and code-like documents."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "tensor", "pipeline", "shard", "rank"]
    prose = tmp_path / "prose.jsonl"
    prose.write_text("\n".join('{"text": "%s"}' % " ".join(rng.choice(words, 60)) for _ in range(40)) + "\n")
    code = tmp_path / "code.txt"
    code.write_text("\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    a, b = tmp_path / "prose_text_document", tmp_path / "code_text_document"
    assert data_cli.main(["--input", str(prose), "--output-prefix", str(a)]) == 0
    assert data_cli.main(["--input", str(code), "--output-prefix", str(b)]) == 0
    return a, b


def test_the_order_resumes_and_is_the_same_across_data_parallel_ranks(tmp_path):
    a, b = _corpus(tmp_path)
    cfg = DataConfig(name="megatron", prefixes=[str(a), str(b)], weights=[0.7, 0.3], num_workers=0)
    assert len(build_dataset(cfg, 32, 256, 1)) > 100

    def batches(dp_rank, dp, start):
        loader = build_loader(cfg, seq_len=32, vocab_size=256, seed=1, global_batch=8, micro_batch=8 // dp,
                              dp_rank=dp_rank, dp_size=dp, steps=6, start_step=start)  # fmt: skip
        return [x for x, _ in loader]

    whole = batches(0, 1, 0)
    assert all((x < 256).all() for x in whole)
    resumed = batches(0, 1, 3)
    assert all(np.array_equal(u, v) for u, v in zip(whole[3:], resumed)) and len(resumed) == 3
    halves = [np.concatenate([x, y]) for x, y in zip(batches(0, 2, 0), batches(1, 2, 0))]
    assert all(np.array_equal(u, v) for u, v in zip(whole, halves))


@pytest.mark.distributed
def test_a_trial_trains_on_two_blended_prefixes_and_resumes_to_the_same_losses(compose_cfg, tmp_path):
    a, b = _corpus(tmp_path)
    overrides = [
        "+chip=cpu",
        "trainer=smoke",
        "trainer.steps=8",
        "trainer.seq_len=32",
        "trainer.checkpoint_every=4",
        f"trainer.checkpoint_dir={tmp_path / 'ckpt'}",
        "data=megatron",
        f"data.prefixes=[{a},{b}]",
        "data.weights=[0.7,0.3]",
        "data.num_workers=0",
        "parallel=dp2",
        "tracking.enabled=false",
    ]
    first = trial.run(compose_cfg(overrides), [], progress=False)
    assert first["status"] == "finished", first.get("reason")
    losses = first["summary"]["losses"]
    assert losses[-1] < losses[0]
    shutil.rmtree(tmp_path / "ckpt" / "step_00000008")
    again = trial.run(compose_cfg(overrides), [], progress=False)
    assert again["status"] == "finished" and again["summary"]["resumed_from_step"] == 4
    assert again["summary"]["losses"] == pytest.approx(losses[4:], rel=1e-6)


def test_bad_corpora_are_one_line_each_exit_2_and_nothing_runs(tmp_path, monkeypatch, capfd):
    a, _ = _corpus(tmp_path)
    shutil.copy(str(a) + ".idx", tmp_path / "cut.idx")
    (tmp_path / "cut.bin").write_bytes(b"\x00" * 10)
    args = [
        "+chip=cpu",
        "data=megatron",
        f"data.prefixes=[{tmp_path / 'missing'},{tmp_path / 'cut'}]",
        "data.weights=[1.0]",
        "model.vocab_size=300",
    ]
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 2, (out[-1500:], err[-1500:])
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert any(x.startswith("error: data.weights=[1.0]: one positive weight per prefix (2)") for x in lines), lines
    assert any(f"data.prefixes[0]={tmp_path / 'missing'}:" in x and "missing.idx: no such file" in x for x in lines)
    assert any("data.prefixes[1]=" in x and "cut.bin: 10 bytes" in x for x in lines), lines
    small = ["+chip=cpu", "data=megatron", f"data.prefixes=[{a}]", "model.vocab_size=100"]
    code, out, err = cli_in_process(small, tmp_path, monkeypatch, capfd)
    # the corpus's record of its tokenizer (written by orchestrator.data) answers first
    assert code == 2 and "tokenized by bytes (vocabulary 256), larger than model.vocab_size=100" in err, err[-1500:]
    Path(f"{a}.tokenizer.json").unlink()  # a corpus prepared elsewhere: its largest id is read
    code, out, err = cli_in_process(small, tmp_path, monkeypatch, capfd)
    assert code == 2 and "is not below model.vocab_size=100" in err, err[-1500:]
    db = tmp_path / "mlruns.db"
    assert not db.exists() or search_runs(f"sqlite:///{db}") == []  # nothing launched, nothing recorded
