"""Small tasks for tests: generated data, no downloads, and a few hooks for fault injection."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import scaletrain


class ToyTask(scaletrain.Task):
    """4-class classification of random points by a fixed random linear rule."""

    def __init__(
        self,
        samples: int = 512,
        dim: int = 16,
        hidden: int = 32,
        dropout: float = 0.0,
        eval_samples: int = 128,
        fail_rank: int | None = None,
        fail_at_step: int | None = None,
        pid_dir: str | None = None,
        nan_at_step: int | None = None,
        fail_kind: str = "raise",
        step_sleep: float = 0.0,
        secret_note: str | None = None,
        api_token: str | None = None,
        fail_once_marker: str | None = None,
        wait_for: str | None = None,
        nan_steps: list[int] | None = None,
        bad_every: int | None = None,
        bad_log: str | None = None,
    ):
        generator = torch.Generator().manual_seed(42)
        x = torch.randn(samples + eval_samples, dim, generator=generator)
        w = torch.randn(dim, 4, generator=generator)
        y = (x @ w).argmax(dim=-1)
        self.train = TensorDataset(x[:samples], y[:samples])
        self.eval = TensorDataset(x[samples:], y[samples:]) if eval_samples else None
        self.dim, self.hidden, self.dropout = dim, hidden, dropout
        self.fail_rank, self.fail_at_step = fail_rank, fail_at_step
        self.calls = 0
        self.nan_at_step = nan_at_step
        self.fail_kind = fail_kind
        self.step_sleep = step_sleep
        self.fail_once_marker = fail_once_marker  # fail only while this file does not exist
        self.wait_for = wait_for  # a glob: the first step waits until a file matches it
        self.nan_steps = set(nan_steps or ())  # training steps (1-based) whose loss is NaN
        if bad_every:  # every bad_every-th sample raises (its index logged to bad_log)
            self.train = RaisingDataset(self.train, bad_every, bad_log)
        if pid_dir:
            Path(pid_dir, f"{os.getpid()}.pid").write_text(str(os.getpid()))

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.dim, self.hidden), nn.Tanh(), nn.Dropout(self.dropout),
            nn.Linear(self.hidden, 4),
        )

    def train_dataset(self) -> Dataset:
        return self.train

    def eval_dataset(self) -> Dataset | None:
        return self.eval

    def loss(self, model, batch):
        if model.training:
            self.calls += 1
            if self.wait_for and self.calls == 1:
                _wait_for(self.wait_for)
            if self.step_sleep:
                time.sleep(self.step_sleep)
            rank = int(os.environ.get("RANK", "0"))
            if self.fail_at_step is not None and rank == self.fail_rank and self.calls > self.fail_at_step:
                if self.fail_once_marker:
                    if Path(self.fail_once_marker).exists():
                        return self._loss(model, batch)
                    Path(self.fail_once_marker).write_text("failed once")
                if self.fail_kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure on rank {rank}")
        return self._loss(model, batch)

    def _loss(self, model, batch):
        x, y = batch
        logits = model(x)
        accuracy = (logits.argmax(-1) == y).float().mean()
        loss = nn.functional.cross_entropy(logits, y)
        if self.nan_at_step is not None and self.calls > self.nan_at_step:
            loss = loss * float("nan")
        if model.training and self.calls in self.nan_steps:
            loss = loss * float("nan")
        return loss, {"accuracy": accuracy}


class RaisingDataset(Dataset):
    """A dataset with corrupt samples: every ``every``-th index raises."""

    def __init__(self, inner: Dataset, every: int, log: str | None):
        self.inner, self.every, self.log = inner, every, log

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        if index % self.every == 0:
            if self.log:
                with open(self.log, "a", encoding="utf-8") as file:
                    file.write(f"{index}\n")
            raise ValueError(f"corrupt record {index}")
        return self.inner[index]


def _wait_for(pattern: str, timeout_s: float = 120) -> None:
    import glob

    deadline = time.monotonic() + timeout_s
    while not glob.glob(pattern):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing matched {pattern} within {timeout_s:g} s")
        time.sleep(0.1)


class HiddenStateTask(ToyTask):
    """Scales its loss by a counter that no checkpoint holds: it cannot resume exactly."""

    def loss(self, model, batch):
        loss, metrics = super().loss(model, batch)
        return loss * (1.0 + 0.05 * (self.calls % 7)), metrics


class NoMethodsTask:
    """Lacks loss(): build_task must say so."""

    def build_model(self):
        return nn.Linear(1, 1)

    def train_dataset(self):
        return TensorDataset(torch.zeros(4, 1))


def toy_job(tmp_path, **sections) -> dict:
    """A job mapping for ToyTask; keyword arguments replace whole sections or keys."""
    job = {
        "name": "toy",
        "task": {"target": "tests.helpers.tasks:ToyTask", "args": {}},
        "data": {"batch_size": 16},
        "optim": {"name": "adamw", "lr": 0.01, "schedule": "constant"},
        "train": {"max_steps": 20, "log_every": 1},
        "scale": {"workers": 1},
        "seed": 7,
        "run_dir": str(tmp_path / "runs"),
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        else:
            job[key] = value
    return job


class ToyStream:
    """ToyTask's training samples as a stream (an IterableDataset: no len(), no [i]), in an order
    that changes with each pass (``set_epoch``), as a shuffling stream's does. ``stateful``: it has
    state_dict()/load_state_dict() (its pass and position in it); ``loaded_log``: a file each
    load_state_dict() appends its state to."""

    def __init__(self, samples, stateful: bool, loaded_log: str | None = None):
        self.samples, self.stateful, self.loaded_log = samples, stateful, loaded_log
        self.epoch, self.index = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.index = epoch, 0

    def __iter__(self):
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(1000 + self.epoch))
        while self.index < len(order):
            sample = self.samples[int(order[self.index])]
            self.index += 1
            yield sample

    def __getattr__(self, name):
        if name in ("state_dict", "load_state_dict") and self.__dict__.get("stateful"):
            return getattr(self, f"_{name}")
        raise AttributeError(name)

    def _state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def _load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        if self.loaded_log:
            with open(self.loaded_log, "a", encoding="utf-8") as file:
                file.write(json.dumps(state) + "\n")


class StreamingToyTask(ToyTask):
    """ToyTask trained from a stream (ToyStream); ``eval_stream``: its eval set a stream too."""

    def __init__(self, stateful: bool = False, loaded_log: str | None = None, eval_stream: bool = False, **args):
        super().__init__(**args)
        self.stream = ToyStream(self.train, stateful, loaded_log)
        self.eval_stream = eval_stream

    def train_dataset(self):
        from torch.utils.data import IterableDataset

        stream = self.stream

        class Stream(IterableDataset):  # a torch IterableDataset that hands on the stream's methods
            def __iter__(self):
                return iter(stream)

            def __getattr__(self, name):
                return getattr(stream, name)

        return Stream()

    def eval_dataset(self):
        return ToyStream(self.eval, False) if self.eval_stream else self.eval


class RecordingCorpusLM:
    """examples/shards/'s CorpusLM that appends each training micro-batch's sample ids to
    ``record``/rank-<rank>.jsonl (a new attempt starts the file again): the samples each rank read;
    ``step_sleep``: seconds each training step sleeps (a run that lasts long enough to stop)."""

    def __new__(cls, record: str, step_sleep: float = 0.0, **args):
        import sys
        from pathlib import Path

        example = str(Path(__file__).resolve().parents[2] / "examples" / "shards")
        if example not in sys.path:
            sys.path.insert(0, example)
        from corpus_lm import CorpusLM

        class Recording(CorpusLM):
            def __init__(self):
                super().__init__(**args)
                rank = int(os.environ.get("RANK", "0"))
                Path(record).mkdir(parents=True, exist_ok=True)
                self._ids = open(Path(record) / f"rank-{rank}.jsonl", "w")  # noqa: SIM115  # open for the run

            def loss(self, model, batch):
                if model.training:
                    self._ids.write(json.dumps(batch[2].tolist()) + "\n")
                    self._ids.flush()
                    if step_sleep:
                        time.sleep(step_sleep)
                return super().loss(model, batch)

        return Recording()
