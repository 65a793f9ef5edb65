"""The rules of what a trial reads from disk: the corpus (a token file, Megatron's indexed
prefixes with their tokenizer record) and a Hugging Face weights folder (headers only), each
problem one line naming its key. Part of ``orchestrator.validate``'s rules."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

import numpy as np
from omegaconf import DictConfig


def weights_rules(m: DictConfig, t: DictConfig, err: Callable[[str], None]) -> None:
    """A Hugging Face weights folder holds every tensor of the model, in its shapes (headers only);
    the layout it loads into and exports from is a Llama one."""
    if not (m.get("hf_weights") or t.get("export_hf")):
        return
    if (m.norm, m.mlp, m.pos_emb) != ("rmsnorm", "swiglu", "rope"):
        key = "model.hf_weights" if m.get("hf_weights") else "trainer.export_hf"
        err(
            f"{key}: the Hugging Face layout is Llama's (model.norm=rmsnorm, model.mlp=swiglu, "
            f"model.pos_emb=rope); this model has {m.norm}, {m.mlp}, {m.pos_emb}"
        )
        return
    if m.get("hf_weights"):
        from trainers.hf_layout import check

        problem = check(str(m.hf_weights), m)
        if problem:
            err(f"model.hf_weights={m.hf_weights}: {problem}")


def data_rules(cfg: DictConfig, err: Callable[[str], None]) -> None:
    """The corpus: a token file that holds a window, or indexed prefixes (:func:`_megatron_rules`)."""
    m, t = cfg.model, cfg.trainer
    d = cfg.data
    if d.name == "memmap":
        if not d.path:
            err("data.path: data=memmap needs the path of a uint16 token file")
        elif not Path(d.path).expanduser().is_file():
            err(f"data.path={d.path}: no such file")
        elif Path(d.path).expanduser().stat().st_size < 2 * (t.seq_len + 1):
            err(f"data.path={d.path}: holds fewer than trainer.seq_len+1={t.seq_len + 1} uint16 tokens")
    if d.name == "megatron":
        _megatron_rules(d, m, t, err)
    if d.name == "stdlib" and m.vocab_size < 256:
        err(f"model.vocab_size={m.vocab_size}: data=stdlib is byte-level and needs at least 256")


@functools.lru_cache(maxsize=64)
def _max_token(prefix: str, size: int, mtime_ns: int) -> int:
    """The largest token id of a corpus (``size`` and ``mtime_ns`` of its ``.bin`` key the cache)."""
    from trainers.indexed import IndexedTokens

    return IndexedTokens(prefix).max_token()


def _megatron_rules(d: DictConfig, m: DictConfig, t: DictConfig, err: Callable[[str], None]) -> None:
    """Indexed corpora that open, hold a window, stay below the vocabulary, with one weight each."""
    from orchestrator.data import tokenizer_record
    from trainers.indexed import IndexedError, IndexedTokens

    if not d.prefixes:
        err("data.prefixes: data=megatron needs the prefix of at least one PREFIX.bin/PREFIX.idx pair")
        return
    if d.weights and (len(d.weights) != len(d.prefixes) or min(d.weights) <= 0):
        err(f"data.weights={list(d.weights)}: one positive weight per prefix ({len(d.prefixes)}), or none")
    for i, prefix in enumerate(d.prefixes):
        try:
            ix = IndexedTokens(Path(str(prefix)).expanduser())
        except IndexedError as e:
            err(f"data.prefixes[{i}]={prefix}: {e}")
            continue
        record = tokenizer_record(str(Path(str(prefix)).expanduser()))
        if record and int(record["vocab_size"]) > m.vocab_size:
            err(
                f"data.prefixes[{i}]={prefix}: tokenized by {record['tokenizer']} (vocabulary "
                f"{record['vocab_size']}), larger than model.vocab_size={m.vocab_size}"
            )
            continue
        if ix.n_tokens < t.seq_len + 1:
            err(
                f"data.prefixes[{i}]={prefix}: holds {ix.n_tokens} tokens, fewer than trainer.seq_len+1={t.seq_len + 1}"
            )
        elif ix.dtype.kind not in "iu" or np.iinfo(ix.dtype).max >= m.vocab_size:
            # one pass over the file, only where its dtype can exceed the vocabulary, and once per
            # file version: a trial validates its config several times
            st = os.stat(ix.bin_path)
            top = _max_token(ix.prefix, st.st_size, st.st_mtime_ns)
            if top >= m.vocab_size:
                err(f"data.prefixes[{i}]={prefix}: token id {top} is not below model.vocab_size={m.vocab_size}")
