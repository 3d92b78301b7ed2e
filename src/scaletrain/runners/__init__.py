"""Runners by kind of job. Adding a kind means a module and a line here: the worker runtime and
the engines (in-process, local, Ray) do not change, and never import a runner's internals.

The kind is the job file's section that names the code to run: ``task:`` (a scaletrain Task,
trained by the engine's loop; ``tensorflow`` for a Task with ``framework: tensorflow``, a Keras
model trained with tf.distribute) or ``loop:`` (the user's own loop, given a LoopContext)."""

from __future__ import annotations

import importlib

from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError
from scaletrain.runners.base import Runner

__all__ = ["Runner", "RUNNERS", "runner_kind", "get_runner"]

# kind -> "module:class", imported only when a job of that kind runs (a TensorFlow runner must
# not import TensorFlow into a PyTorch job).
RUNNERS: dict[str, str] = {
    "task": "scaletrain.runners.task:TaskRunner",
    "loop": "scaletrain.runners.loop:LoopRunner",
    "tensorflow": "scaletrain.runners.tensorflow:TensorFlowRunner",
}


def runner_kind(job: JobConfig) -> str:
    """The kind the job asks for (the one runner section it sets; JobConfig.kind)."""
    if job.kind not in RUNNERS:
        raise ConfigError(f"a job of kind {job.kind!r} has no worker runner (a script job runs through "
                          "`scaletrain launch`)")
    return job.kind


def get_runner(kind: str) -> Runner:
    if kind not in RUNNERS:
        raise ConfigError(f"no runner for jobs of kind {kind!r}; known: {', '.join(sorted(RUNNERS))}")
    module, _, name = RUNNERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)()
