"""``python -m orchestrator.data``: text or JSONL files into Megatron's indexed format
(``PREFIX.bin`` + ``PREFIX.idx``, ``trainers/indexed.py``), the format Megatron-LM, MindSpeed-LLM
and NeMo train from, so one prepared corpus serves this tool and a team's production trainer.

    python -m orchestrator.data --input docs.jsonl more.txt --output-prefix /data/corpus_text_document
    python -m orchestrator.data --inspect /data/corpus_text_document

Each JSONL line is a document (its ``--json-key`` field, default ``text``); any other file is one
document. Tokenizer: ``bytes`` (UTF-8 bytes, ids 0-255: the vocabulary of the bundled ``stdlib``
corpus and the tiny presets), or a Hugging Face ``tokenizer.json`` (the file, or the model folder
holding it; read by the ``tokenizers`` package, the optional extra ``hf``), with
``--append-eod`` adding the end-of-document id after each document as Megatron's
``preprocess_data.py`` does (the id of ``tokenizer_config.json``'s ``eos_token``, or
``--eod-token``). As Megatron with ``--tokenizer-type HuggingFaceTokenizer``, each document gets the
tokenizer's own special tokens (a leading BOS for Llama 2 and 3; ``--no-special-tokens`` leaves
them out) and an empty document no tokens at all, so one prepared corpus means the same in both.
The ids are stored as uint16 below a vocabulary of 65,500 and int32 above it, as
Megatron chooses. ``PREFIX.tokenizer.json`` beside the pair records the tokenizer and its
vocabulary size (Megatron ignores it); the validator refuses a corpus whose tokenizer's
vocabulary exceeds ``model.vocab_size``. A SentencePiece-only model (``tokenizer.model`` without a
``tokenizer.json``) is not read. Bad input is one ``error:`` line and exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from orchestrator import cli


def documents(paths: List[Path], json_key: str) -> Iterator[str]:
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield str(json.loads(line)[json_key])
                    except (ValueError, KeyError, TypeError) as e:
                        raise ValueError(f"--input {path}:{n}: not a JSON object with a {json_key!r} field ({e})")
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the file, or a folder holding it)."""

    def __init__(self, where: str, eod_token: Optional[str] = None):
        path = Path(where).expanduser()
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            sp = (
                " (a SentencePiece tokenizer.model alone is not read)" if (folder / "tokenizer.model").is_file() else ""
            )
            raise ValueError(f"--tokenizer {where}: no tokenizer.json{sp}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("--tokenizer: reading tokenizer.json needs the tokenizers package (pip install '.[hf]')")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust library's own error types
            raise ValueError(f"--tokenizer {file}: not a tokenizer.json ({e})") from None
        self.path, self.vocab_size = str(file), self.tok.get_vocab_size(with_added_tokens=True)
        self.dtype = np.uint16 if self.vocab_size < 65500 else np.int32
        self.eod: Optional[int] = None
        name = eod_token or _eos_token(folder)
        if name is not None:
            self.eod = self.tok.token_to_id(name)
            if self.eod is None:
                raise ValueError(f"--eod-token {name}: not in {file}'s vocabulary")

    def encode(self, text: str, append_eod: bool, special_tokens: bool = True) -> np.ndarray:
        """As Megatron-LM's ``preprocess_data.py`` with ``--tokenizer-type HuggingFaceTokenizer``
        encodes a document: the tokenizer's own special tokens (its post-processor: a leading
        BOS for Llama 2 and 3; ``transformers``' ``tokenizer(text).input_ids``, which Megatron
        calls, runs the same ``tokenizer.json``), then the end-of-document id when the document
        has any id at all (an empty text without a BOS stays empty: Megatron writes no tokens for
        it)."""
        ids = self.tok.encode(text, add_special_tokens=special_tokens).ids
        if append_eod and ids:
            if self.eod is None:
                raise ValueError("--append-eod: the tokenizer names no eos_token; give --eod-token")
            ids.append(self.eod)
        return np.asarray(ids, dtype=self.dtype)


def _eos_token(folder: Path) -> Optional[str]:
    """``eos_token`` of the folder's ``tokenizer_config.json`` (a string or ``{"content": ...}``)."""
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def tokenizer_record(prefix: str) -> Optional[dict]:
    """What ``PREFIX.tokenizer.json`` says (written beside a corpus by this command), or None."""
    try:
        return json.loads(Path(f"{prefix}.tokenizer.json").expanduser().read_text())
    except (OSError, ValueError):
        return None


def _inspect(prefix: str) -> Dict[str, Any]:
    """What the indexed corpus at ``prefix`` holds, and the tokenizer it was written with."""
    from trainers import indexed

    ix = indexed.IndexedTokens(prefix)
    info = {
        "prefix": prefix,
        "dtype": ix.dtype.name,
        "documents": ix.n_documents,
        "sequences": len(ix.lengths),
        "tokens": ix.n_tokens,
        "max_token": ix.max_token(),
    }
    record = tokenizer_record(prefix)
    if record:
        info.update(tokenizer=record["tokenizer"], vocab_size=record["vocab_size"])
    return info


def _write_corpus(args: argparse.Namespace) -> Dict[str, Any]:
    """Tokenize ``args.input`` into the indexed corpus ``args.output_prefix`` (and its tokenizer
    record beside it); its figures. A ValueError names the argument that cannot be honoured."""
    from trainers import indexed

    if not args.input or not args.output_prefix:
        raise ValueError("--input and --output-prefix: give both (or --inspect PREFIX)")
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        raise ValueError(f"--input {missing[0]}: no such file")
    if args.tokenizer == "bytes":
        if args.append_eod:
            raise ValueError("--append-eod: the bytes tokenizer has no end-of-document id")
        dtype, vocab, name = np.uint16, 256, "bytes"
        docs = [encode_bytes(t) for t in documents(args.input, args.json_key)]
    else:
        tok = HFTokenizer(args.tokenizer, args.eod_token)
        dtype, vocab, name = tok.dtype, tok.vocab_size, tok.path
        docs = [tok.encode(t, args.append_eod, args.special_tokens) for t in documents(args.input, args.json_key)]
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    n = indexed.write(args.output_prefix, docs, dtype)
    Path(f"{args.output_prefix}.tokenizer.json").write_text(json.dumps({"tokenizer": name, "vocab_size": vocab}))
    return {
        "prefix": args.output_prefix,
        "dtype": np.dtype(dtype).name,
        "documents": n,
        "tokens": int(sum(len(d) for d in docs)),
        "tokenizer": name,
        "vocab_size": vocab,
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", type=Path, help="text or JSONL files")
    ap.add_argument("--output-prefix", help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer.json (or the folder holding it)")
    ap.add_argument("--append-eod", action="store_true", help="the end-of-document id after each document")
    ap.add_argument("--eod-token", help="that token (default: tokenizer_config.json's eos_token)")
    ap.add_argument(
        "--no-special-tokens",
        dest="special_tokens",
        action="store_false",
        help="leave out the tokenizer's own special tokens (its BOS); by default they are added, as Megatron-LM does",
    )
    ap.add_argument("--inspect", metavar="PREFIX", help="print what an indexed corpus holds")
    cli.add_json_arg(ap, "the corpus's figures")
    args = ap.parse_args(argv)
    try:
        info = _inspect(args.inspect) if args.inspect else _write_corpus(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        print(", ".join(f"{k} {v}" for k, v in info.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
