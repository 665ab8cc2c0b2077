"""Build a token channel (``tokens.bin`` + ``tokens.json``) from text files.

    python -m dtrain.runtime.train.tokenize --input corpus/*.txt --output data/train
    python -m dtrain.runtime.train.tokenize --input corpus.txt --output data/train --tokenizer bpe --vocab_size 512

The default tokenizer is byte-level: ids 0-255 are the UTF-8 bytes, then special tokens, so it
needs no download and no training. ``--tokenizer bpe`` trains a byte-level BPE on the inputs with
the ``tokenizers`` library (seconds for a few MB) and saves its ``tokenizer.json`` in the channel.
Each file is one document, followed by ``<|endoftext|>``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from dtrain.runtime.train.data import TokenDataset

# Byte-level vocabulary: 256 bytes, then these (the masked LM recipe needs <mask> and <pad>).
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<mask>", "<bos>")
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
TOKENIZER_FILE = "tokenizer.json"


def byte_special_tokens() -> dict[str, int]:
    return {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}


def encode_bytes(texts: Sequence[str]) -> TokenDataset:
    """Byte-level ids of ``texts``, each followed by ``<|endoftext|>``."""
    specials = byte_special_tokens()
    eos = np.array([specials["<|endoftext|>"]], dtype=np.uint16)
    parts = []
    for text in texts:
        parts += [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16), eos]
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    meta = {"vocab_size": BYTE_VOCAB_SIZE,
            "tokenizer": {"type": "byte", "special_tokens": specials}}
    return TokenDataset(tokens, meta)


def train_bpe(texts: Sequence[str], *, vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``; specials come first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_bpe(texts: Sequence[str], tokenizer) -> TokenDataset:
    specials = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids += encoding.ids + [specials["<|endoftext|>"]]
    meta = {"vocab_size": tokenizer.get_vocab_size(),
            "tokenizer": {"type": "bpe", "file": TOKENIZER_FILE, "special_tokens": specials}}
    return TokenDataset(np.asarray(ids, dtype=np.int64), meta)


def read_texts(paths: Sequence[str | Path]) -> list[str]:
    texts = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"input {path} is not a file; pass text files to --input")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


def build_channel(
    inputs: Sequence[str | Path], output: str | Path, *, tokenizer: str = "byte",
    vocab_size: int = 512,
) -> TokenDataset:
    """Tokenize ``inputs`` and write the channel to ``output``; returns the dataset."""
    texts = read_texts(inputs)
    if tokenizer == "byte":
        dataset = encode_bytes(texts)
    elif tokenizer == "bpe":
        if vocab_size <= BYTE_VOCAB_SIZE:
            raise ValueError(f"--vocab_size {vocab_size} leaves no room for merges; use more "
                             f"than {BYTE_VOCAB_SIZE}")
        bpe = train_bpe(texts, vocab_size=vocab_size)
        dataset = encode_bpe(texts, bpe)
        Path(output).mkdir(parents=True, exist_ok=True)
        bpe.save(str(Path(output) / TOKENIZER_FILE))
    else:
        raise ValueError(f"--tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    dataset.save(output)
    return dataset


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.runtime.train.tokenize",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text files, one document each")
    parser.add_argument("--output", required=True, help="channel folder to write")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    parser.add_argument("--vocab_size", type=int, default=512, help="BPE vocabulary size")
    args = parser.parse_args(argv)
    try:
        dataset = build_channel(args.input, args.output, tokenizer=args.tokenizer,
                                vocab_size=args.vocab_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(dataset)} tokens (vocab {dataset.vocab_size}) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
