"""A language model trained from Parquet shards (examples/shards/corpus.py writes them): the
training set is read a row group at a time from a local folder or object storage, never whole.

    scaletrain run examples/shards/job.yaml
    scaletrain run examples/shards/job.yaml --set task.args.location=s3://my-bucket/corpus
    scaletrain run examples/shards/job.yaml --set task.args.stream=true   # as a Hugging Face stream

``stream: true`` reads the same files as a Hugging Face ``datasets`` stream (pip install datasets):
scaletrain saves its state_dict() in each checkpoint and loads it on resume; ``in_memory: true``
loads them whole first (a list: what the data-loading bench compares with). The model is
examples/tiny_gpt.py's GPT. A local corpus that is not there yet is generated first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

import scaletrain
from scaletrain.data import ParquetShards

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the GPT of tiny_gpt.py
from corpus import WORDS, write_corpus  # noqa: E402
from tiny_gpt import GPT  # noqa: E402


def next_token_batch(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows -> (inputs, next-token targets, their ids), one array op each, not one per row: the
    ids let a test name the samples read."""
    tokens = torch.from_numpy(np.stack([np.asarray(s["tokens"]) for s in samples]).astype(np.int64))
    ids = torch.tensor([int(s["id"]) for s in samples])
    return tokens[:, :-1], tokens[:, 1:], ids


class CorpusLM(scaletrain.Task):
    def __init__(self, location: str = "examples/shards/data", layers: int = 2, dim: int = 64, heads: int = 4,
                 shuffle_window: int = 8, cache_mib: float = 64, stream: bool = False, in_memory: bool = False):
        if "://" not in location:
            write_corpus(location)  # a no-op when it is there
        self.location = location.rstrip("/")
        self.shards = dict(shuffle_window=shuffle_window, cache_mib=cache_mib)
        self.train = ParquetShards(f"{self.location}/train", **self.shards)
        self.stream, self.in_memory = stream, in_memory
        context = len(self.train[0]["tokens"]) - 1
        self.config = dict(vocab=len(WORDS), context=context, layers=layers, dim=dim, heads=heads, dropout=0.0)
        self.tokens_per_sample = context

    def build_model(self) -> torch.nn.Module:
        return GPT(**self.config)

    def train_dataset(self):
        if self.in_memory:  # the same rows loaded whole (bench/data_loading.py's baseline)
            return self.train.__getitems__(list(range(len(self.train))))
        if not self.stream:
            return self.train
        import datasets  # pip install datasets

        files = f"{self.location}/train/*.parquet"
        return datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)

    def collate(self, samples: list[dict]) -> tuple[torch.Tensor, ...]:
        """Rows (a dict per sample, from the shards or the stream) -> a batch of (inputs, targets, ids)."""
        return next_token_batch(samples)

    def eval_dataset(self) -> ParquetShards:
        return ParquetShards(f"{self.location}/eval", **self.shards)

    def loss(self, model, batch):
        inputs, targets, _ids = batch
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, {"token_accuracy": (logits.argmax(-1) == targets).float().mean()}
