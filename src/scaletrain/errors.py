"""Errors a user can hit. Each carries a one-line message that says what to do.

The CLI prints ``error: <message>`` and exits with ``exit_code``: 2 for bad input
(job file, flags, task path), 1 for a run that started and failed.
"""

from __future__ import annotations

__all__ = [
    "ScaletrainError",
    "SearchInterrupted",
    "ConfigError",
    "TaskError",
    "WorkerFailedError",
    "RunInterrupted",
    "RunPreempted",
    "StopTimedOut",
    "MissingExtraError",
]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; resumable


class ScaletrainError(Exception):
    """Base class: a problem with a message meant for the user, not a bug. ``code``: its stable,
    documented error code (docs/observability.md), in JSON logs, summaries and --json errors."""

    exit_code = 1
    code = "ST-ERROR"


class ConfigError(ScaletrainError):
    """The job file or an override is invalid. ``problems`` holds one line per problem."""

    exit_code = 2
    code = "ST-CONFIG"

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


class TaskError(ScaletrainError):
    """The task named by ``task.target`` cannot be imported or does not fit the Task protocol."""

    exit_code = 2
    code = "ST-TASK"


class WorkerFailedError(ScaletrainError):
    """A training worker raised or died. ``rank`` is the first rank that failed."""

    exit_code = 1
    code = "ST-WORKER"

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        log_path: str | None = None,
        bad_input: bool = False,
        steps: int | None = None,
    ):
        self.rank = rank
        self.log_path = log_path
        self.steps = steps  # the steps the job had trained when it failed, when a rank said
        if bad_input:  # the worker failed on the user's input (e.g. a task it cannot import)
            self.exit_code = 2
        super().__init__(message)


class MissingExtraError(ScaletrainError):
    """The job asks for an optional part (Ray, S3) whose extra is not installed."""

    exit_code = 2
    code = "ST-MISSING-EXTRA"


class RunInterrupted(ScaletrainError):
    """The launcher was stopped by a signal (Ctrl-C, SIGTERM); the workers were stopped too."""

    code = "ST-INTERRUPTED"

    def __init__(self, signal_name: str, signal_number: int):
        self.exit_code = 128 + signal_number
        super().__init__(f"interrupted by {signal_name}; the workers were stopped")


class SearchInterrupted(ScaletrainError):
    """`scaletrain tune` was stopped (Ctrl-C); Tune saved its state and --resume continues it."""

    exit_code = 130
    code = "ST-SEARCH-INTERRUPTED"


class RunPreempted(ScaletrainError):
    """SIGTERM/SIGUSR1 stopped the run at a step all ranks agreed on, after a checkpoint."""

    exit_code = PREEMPTED_EXIT_CODE
    code = "ST-PREEMPTED"

    step: int | None  # None: killed before the agreed step was known (StopTimedOut)

    def __init__(self, signal_name: str, step: int, checkpoint_step: int | None, run_dir: str):
        self.signal_name, self.step, self.checkpoint_step, self.run_dir = (
            signal_name, step, checkpoint_step, run_dir
        )
        saved = (
            f"checkpoint of step {checkpoint_step} saved"
            if checkpoint_step is not None
            else "no checkpoint (checkpoints are off)"
        )
        super().__init__(
            f"preempted by {signal_name} at step {step}; {saved}; continue with: "
            f"scaletrain resume {run_dir}"
        )


class StopTimedOut(RunPreempted):
    """After a stop signal, workers still running when recovery.grace_period_s ran out were
    killed: their stop checkpoint, if they were writing one, is incomplete and never used."""

    code = "ST-STOP-TIMED-OUT"

    def __init__(self, signal_name: str, grace_period_s: float, run_dir: str):
        ScaletrainError.__init__(
            self,
            f"preempted by {signal_name}; the workers were still running {grace_period_s:g} s later "
            "(recovery.grace_period_s), saving their stop checkpoint or stuck, and were killed: that "
            f"checkpoint is incomplete and will not be used; continue with: scaletrain resume {run_dir} "
            "(from the newest complete checkpoint), and give a stop more time with recovery.grace_period_s",
        )
        self.signal_name, self.step, self.checkpoint_step, self.run_dir = signal_name, None, None, run_dir
