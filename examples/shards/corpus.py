"""A small tokenized corpus, generated and written as Parquet shards: what a real corpus looks like
once tokenized (one row per training sequence: its id and its tokens), small enough for a laptop.

    python examples/shards/corpus.py examples/shards/data            # a local folder
    python examples/shards/corpus.py s3://my-bucket/corpus           # object storage (fsspec)

Sentences come from a tiny seeded grammar ("the quick fox sees a red bird ."), so a language model
has structure to learn; words are tokens. They are packed end to end into sequences of
``context + 1`` tokens and written in chunks, as a tokenizer pipeline over a large corpus would
(never the whole corpus in memory), under ``train/`` and ``eval/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from scaletrain.data import write_shards

ARTICLES = ["the", "a"]
ADJECTIVES = ["quick", "lazy", "red", "small", "old", "bright", "quiet", "brave"]
NOUNS = ["fox", "dog", "bird", "cat", "tree", "river", "house", "child"]
VERBS = ["sees", "likes", "follows", "finds", "hears", "leaves"]
WORDS = ["<pad>", ".", *ARTICLES, *ADJECTIVES, *NOUNS, *VERBS]
TOKEN = {word: i for i, word in enumerate(WORDS)}


def sentences(rng: np.random.Generator) -> Iterator[list[int]]:
    while True:
        words = []
        for part in ("subject", "verb", "object"):
            if part == "verb":
                words.append(VERBS[rng.integers(len(VERBS))])
                continue
            words.append(ARTICLES[rng.integers(2)])
            if rng.random() < 0.7:
                words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
            words.append(NOUNS[rng.integers(len(NOUNS))])
        yield [TOKEN[w] for w in [*words, "."]]


def sequences(count: int, context: int, seed: int, first_id: int, chunk: int = 4096) -> Iterator[dict]:
    """``count`` rows of ``context + 1`` tokens, in chunks of ``chunk`` rows."""
    stream = sentences(np.random.default_rng(seed))
    carry: list[int] = []
    for start in range(0, count, chunk):
        rows = min(chunk, count - start)
        tokens = np.empty((rows, context + 1), dtype=np.int16)
        for row in range(rows):
            while len(carry) < context + 1:
                carry.extend(next(stream))
            tokens[row], carry = carry[: context + 1], carry[context + 1 :]
        yield {"id": np.arange(first_id + start, first_id + start + rows, dtype=np.int64), "tokens": list(tokens)}


def write_corpus(dest: str, train_rows: int = 16384, eval_rows: int = 1024, context: int = 32,
                 rows_per_group: int = 256, seed: int = 0) -> bool:
    """The corpus at ``dest``/train and ``dest``/eval. A local one appears whole or not at all
    (written aside, then renamed), so workers that start together can each ask for it. False when
    it was there already."""
    local = "://" not in dest
    target = Path(dest)
    if local:
        if (target / "train").is_dir():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        aside = tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent)
        where = aside
    else:
        where = dest.rstrip("/")
        import fsspec

        fs, root = fsspec.core.url_to_fs(f"{where}/train")
        if fs.exists(f"{root}/index.json"):
            return False  # written before (write_shards never writes over a set)
    write_shards(sequences(train_rows, context, seed, 0), f"{where}/train", rows_per_group=rows_per_group)
    write_shards(sequences(eval_rows, context, seed + 1, train_rows), f"{where}/eval", rows_per_group=rows_per_group)
    if local:
        try:
            os.rename(aside, target)
        except OSError:  # another process wrote it first
            shutil.rmtree(aside, ignore_errors=True)
    return True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="a local folder or an fsspec URL (s3://bucket/prefix)")
    parser.add_argument("--train-rows", type=int, default=16384)
    parser.add_argument("--eval-rows", type=int, default=1024)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--rows-per-group", type=int, default=256)
    args = parser.parse_args()
    if not write_corpus(args.dest, args.train_rows, args.eval_rows, args.context, args.rows_per_group):
        raise SystemExit(f"error: {args.dest} already holds a corpus; delete it to write it again")
    print(f"wrote {args.train_rows} + {args.eval_rows} sequences of {args.context + 1} tokens to {args.dest}")
