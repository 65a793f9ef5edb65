"""``python -m orchestrator.data``: text or JSONL files into Megatron's indexed format
(``PREFIX.bin`` + ``PREFIX.idx``, ``trainers/indexed.py``), the format Megatron-LM, MindSpeed-LLM
and NeMo train from, so one prepared corpus serves this tool and a team's production trainer.

    python -m orchestrator.data --input docs.jsonl more.txt --output-prefix /data/corpus_text_document
    python -m orchestrator.data --inspect /data/corpus_text_document

Each JSONL line is a document (its ``--json-key`` field, default ``text``); any other file is one
document. Tokenizer: ``bytes`` (UTF-8 bytes, ids 0-255: the vocabulary of the bundled ``stdlib``
corpus and the tiny presets). A Hugging Face ``tokenizer.json`` or a SentencePiece model is not
read yet (issue 29). Bad input is one ``error:`` line and exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, List, Optional

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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", type=Path, help="text or JSONL files")
    ap.add_argument("--output-prefix", help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--tokenizer", choices=("bytes",), default="bytes")
    ap.add_argument("--inspect", metavar="PREFIX", help="print what an indexed corpus holds")
    cli.add_json_arg(ap, "the corpus's figures")
    args = ap.parse_args(argv)
    from trainers import indexed

    try:
        if args.inspect:
            ix = indexed.IndexedTokens(args.inspect)
            info = {
                "prefix": args.inspect,
                "dtype": ix.dtype.name,
                "documents": ix.n_documents,
                "sequences": len(ix.lengths),
                "tokens": ix.n_tokens,
                "max_token": ix.max_token(),
            }
        else:
            if not args.input or not args.output_prefix:
                raise ValueError("--input and --output-prefix: give both (or --inspect PREFIX)")
            missing = [str(p) for p in args.input if not p.is_file()]
            if missing:
                raise ValueError(f"--input {missing[0]}: no such file")
            docs = [encode_bytes(t) for t in documents(args.input, args.json_key)]
            Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
            n = indexed.write(args.output_prefix, docs, np.uint16)
            info = {
                "prefix": args.output_prefix,
                "dtype": "uint16",
                "documents": n,
                "tokens": int(sum(len(d) for d in docs)),
                "tokenizer": args.tokenizer,
            }
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
