"""Rank 0's MLflow reporter: metrics go to the journal, then to MLflow from a background thread."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from scaletrain.tracking.journal import MetricJournal
from scaletrain.tracking.reporter import NullReporter
from scaletrain.tracking.sender import MetricSender, configure_mlflow_client

__all__ = ["MlflowReporter"]


class MlflowReporter(NullReporter):
    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        journal_dir: str | Path,
        every: int,
        flush_timeout_s: float,
        logger: logging.Logger,
    ):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.every = every
        self.flush_timeout_s = flush_timeout_s
        self.log = logger
        self.journal = MetricJournal(journal_dir)
        self.sender: MetricSender | None = None
        self.total_steps = 0

    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri)

    def on_start(self, total_steps: int, start_step: int) -> None:
        configure_mlflow_client()
        self.total_steps = total_steps
        self.sender = MetricSender(self._client, self.run_id, self.journal, self.log)
        # Whatever an earlier attempt journaled but could not deliver goes first.
        self.sender.submit(self.journal.pending())
        self.sender.start()

    def _send(self, prefix: str, step: int, metrics: dict[str, float]) -> None:
        if self.sender is None:
            return
        points = self.journal.append(
            {f"{prefix}/{k}": v for k, v in metrics.items()}, step, int(time.time() * 1000)
        )
        self.sender.submit(points)

    def on_train_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0 or step == self.total_steps or step == 1:
            self._send("train", step, metrics)

    def on_eval_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._send("eval", step, metrics)

    def on_end(self) -> None:
        if self.sender is None:
            return
        sender, self.sender = self.sender, None
        left = sender.close(self.flush_timeout_s)
        self.journal.close()
        if left:
            self.log.warning(
                "%d metric points could not be delivered to the tracking server; they are kept "
                "in %s and sent by the next attempt",
                left, self.journal.path,
            )
