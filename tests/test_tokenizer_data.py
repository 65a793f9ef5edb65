"""A Hugging Face ``tokenizer.json`` tokenizes text into an indexed corpus
(``python -m orchestrator.data --tokenizer``): the ids are the tokenizer's own, each document ends
with the end-of-document id from ``tokenizer_config.json``, the corpus records its vocabulary,
a model whose vocabulary is smaller is refused before launch (one line, exit 2), and a model of
the tokenizer's vocabulary trains on it. The tokenizer is trained here, offline, by the
``tokenizers`` package itself (a byte-level BPE, as GPT-2's and Llama 3's are)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator import data as data_cli
from orchestrator import trial
from tests.conftest import cli_in_process
from trainers.indexed import IndexedTokens

tokenizers = pytest.importorskip("tokenizers")  # the test extra installs it; the `hf` extra for users

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallelism splits the layers; tensor parallelism splits each matrix.",
] * 20
EOS = "<|end_of_text|>"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tok") / "tiny-bpe"
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS}}))
    return folder


@pytest.fixture(scope="module")
def corpus(tokenizer_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = root / "docs_text_document"
    code = data_cli.main(
        ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(tokenizer_folder), "--append-eod"]
    )
    assert code == 0
    return prefix


def test_the_corpus_holds_the_tokenizer_s_ids_and_the_eod(tokenizer_folder, corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    eod = tok.token_to_id(EOS)
    ix = IndexedTokens(str(corpus))
    assert ix.n_documents == len(TEXTS)
    tokens = np.memmap(ix.bin_path, dtype=ix.dtype, mode="r")
    want = np.concatenate([np.array(tok.encode(t, add_special_tokens=False).ids + [eod]) for t in TEXTS])
    assert np.array_equal(np.asarray(tokens), want)
    assert len(want) < sum(len(t.encode()) for t in TEXTS) / 2  # merged: far fewer ids than bytes
    record = data_cli.tokenizer_record(str(corpus))
    assert record == {"tokenizer": str(tokenizer_folder / "tokenizer.json"), "vocab_size": tok.get_vocab_size()}


def test_a_model_smaller_than_the_vocabulary_is_refused(tokenizer_folder, corpus, tmp_path, monkeypatch, capfd):
    vocab = data_cli.tokenizer_record(str(corpus))["vocab_size"]
    args = ["+chip=cpu", "trainer=smoke", "data=megatron", f"data.prefixes=[{corpus}]", f"model.vocab_size={vocab - 1}"]
    code, out, err = cli_in_process(args, tmp_path, monkeypatch, capfd)
    assert code == 2, (out[-1500:], err[-1500:])
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and f"data.prefixes[0]={corpus}" in lines[0], lines
    assert f"(vocabulary {vocab}), larger than model.vocab_size={vocab - 1}" in lines[0], lines


def test_a_model_of_the_tokenizer_s_vocabulary_trains_on_it(compose_cfg, corpus):
    vocab = data_cli.tokenizer_record(str(corpus))["vocab_size"]
    over = ["+chip=cpu", "trainer=smoke", "trainer.seq_len=32", "data=megatron", f"data.prefixes=[{corpus}]"]
    result = trial.run(compose_cfg([*over, f"model.vocab_size={vocab}", "tracking.enabled=false"]), [], progress=False)
    assert result["status"] == "finished", result.get("reason")
    losses = result["summary"]["losses"]
    assert losses[-1] < losses[0]


def test_a_sentencepiece_only_folder_and_a_missing_eos_are_one_line(tokenizer_folder, tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    sp = tmp_path / "sp"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(b"\x00")
    assert data_cli.main(["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--tokenizer", str(sp)]) == 2
    assert "no tokenizer.json (a SentencePiece tokenizer.model alone is not read)" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((tokenizer_folder / "tokenizer.json").read_text())
    args = ["--input", str(src), "--output-prefix", str(tmp_path / "y"), "--tokenizer", str(bare), "--append-eod"]
    assert data_cli.main(args) == 2
    assert "--append-eod: the tokenizer names no eos_token; give --eod-token" in capsys.readouterr().err
    assert not (tmp_path / "y.bin").exists() and not (tmp_path / "x.bin").exists()


BOS = "<|begin_of_text|>"


def _bos_folder(tokenizer_folder, root):
    """The tiny BPE with Llama 3's post-processor: a BOS before every text (TemplateProcessing,
    as Llama 3's tokenizer.json carries it), and the tokenizer_config.json transformers reads."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    tok.add_special_tokens([BOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    folder = root / "tiny-bpe-bos"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("bos", [True, False], ids=["bos-adding", "plain"])
def test_the_corpus_is_what_megatron_preprocessing_writes(tokenizer_folder, tmp_path, bos):
    """Megatron-LM's ``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
    --append-eod`` writes, for each JSONL document, ``tokenizer(text).input_ids`` (transformers'
    AutoTokenizer: the tokenizer's special tokens included, so Llama 3's leading BOS) and the EOD
    after it when that list is not empty, and nothing for a document with no ids (an empty
    document in the index: no sequence). The expected ids come from transformers' own tokenizer
    on the same folder; before, this command added no BOS (seen failing on that code: the first
    id was the text's, not the BOS) and wrote a lone EOD for an empty text."""
    import transformers  # a test dependency (pyproject's [test])

    if bos:
        folder = _bos_folder(tokenizer_folder, tmp_path)
    else:
        folder = tmp_path / "tiny-bpe"
        folder.mkdir()
        (folder / "tokenizer.json").write_text((tokenizer_folder / "tokenizer.json").read_text())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    texts = [TEXTS[0], "", TEXTS[1], TEXTS[2]]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tmp_path / "docs_text_document"
    args = ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(folder), "--append-eod"]
    assert data_cli.main(args) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = []
    for t in texts:
        ids = hf(t).input_ids
        want.append(ids + [hf.eos_token_id] if ids else [])
    ix = IndexedTokens(str(prefix))
    assert ix.n_documents == len(texts)
    assert [ix.document(d).tolist() for d in range(len(texts))] == want
    assert len(ix.lengths) == sum(1 for w in want if w)  # the empty document holds no sequence
    if bos:
        assert want[0][0] == hf.bos_token_id and want[1] == [hf.bos_token_id, hf.eos_token_id]
    else:
        assert want[1] == []
    args.append("--no-special-tokens")
    assert data_cli.main(args) == 0
    plain = IndexedTokens(str(prefix))
    assert plain.document(0).tolist() == hf(texts[0], add_special_tokens=False).input_ids + [hf.eos_token_id]
