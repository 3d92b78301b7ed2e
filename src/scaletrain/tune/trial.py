"""One trial of a search: a Tune Trainable whose work is a full `scaletrain run` (or `resume`,
when Tune retries it) in a child process, reporting the search metric as the job writes it to
metrics.jsonl; stopped by SIGTERM, so it ends at a checkpoint like any preempted job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scaletrain.config.loading import parse_job
from scaletrain.rundir import TRACKING_TAGS_ENV
from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.tracking.redact import Redactor

__all__ = ["trial_class", "start_trial_job", "overrides"]


def overrides(config: dict[str, Any]) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in config.items()]


def trial_class():
    """The Tune trainable (a class: Tune calls its cleanup before it ends the actor, which
    lets a stopped trial's job checkpoint before the actor and its children are gone)."""
    from ray import tune

    class ScaletrainTrial(tune.Trainable):
        def setup(self, config: dict[str, Any], job: dict, directory: str, metric: str,  # type: ignore[override]  # Tune passes with_parameters' keywords to setup
                  parent_run_id: str | None, search_path: list[str], grace_s: float) -> None:
            self.metric, self.grace_s = metric, grace_s
            self.split, self.key = metric.split("/", 1)
            self.redactor = Redactor.for_config(job)
            self.proc, self.trial_dir, self.runs = start_trial_job(
                self.trial_id, config, job, Path(directory), parent_run_id, search_path
            )
            self.final_step = parse_job(job, overrides(config)).train.max_steps
            self.reported = 0
            self.last: dict[str, Any] = {}

        def step(self) -> dict[str, Any]:
            """The job's next value of the metric, as it writes it. The last evaluation is
            reported once the job has finished (a scheduler ends a trial at its last report)."""
            while True:
                finished = self.proc.poll() is not None
                rows = _metric_rows(self.runs, self.split, self.key)
                if len(rows) > self.reported:
                    step, value = rows[self.reported]
                    if step != self.final_step or finished:
                        self.reported += 1
                        self.last = {self.metric: value, "step": step}
                        return {**self.last, "done": finished and self.reported == len(rows)}
                if finished:
                    self._raise_if_failed()
                    return {**self.last, "done": True}
                time.sleep(0.2)

        def _raise_if_failed(self) -> None:
            if self.proc.returncode not in (0, None):
                error = _trial_error(self.trial_dir, self.proc.returncode)
                console = self.trial_dir / "console.log"
                raise RuntimeError(self.redactor.text(f"trial job failed: {error} (console: {console})"))

        def save_checkpoint(self, checkpoint_dir: str) -> None:
            """The trial's state is its job's own verified checkpoints; Tune keeps a pointer."""
            runs = sorted(str(p.parent) for p in self.runs.glob("*/*/spec.json"))
            write_text_atomic(Path(checkpoint_dir, "scaletrain_run.json"),
                              json.dumps({"run_dir": runs[-1] if runs else None, "reported": self.reported}))

        def load_checkpoint(self, checkpoint_dir: str) -> None:  # type: ignore[override]  # a directory checkpoint: Tune passes its path
            """Nothing to load: setup() resumes the trial's job from its run directory."""

        def cleanup(self) -> None:
            """Stopped early (a scheduler's decision, the search ending): the job stops at a
            checkpoint, as on preemption, before this actor goes."""
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    return ScaletrainTrial


def start_trial_job(trial_id: str, config: dict[str, Any], job: dict, directory: Path,
                     parent_run_id: str | None, search_path: list[str]):
    """``scaletrain run`` of the trial's job, or ``scaletrain resume`` of it when Tune retries a
    failed trial (from its newest verified checkpoint). Its output goes to files, never to a
    pipe: a task that prints more than a pipe holds would block on it for good."""
    trial_dir = directory / "trials" / trial_id
    trial_dir.mkdir(parents=True, exist_ok=True)
    runs = trial_dir / "runs"
    existing = sorted(runs.glob("*/*/spec.json"))
    if existing:
        command = ["resume", str(existing[-1].parent), "--json"]
    else:
        job_file = trial_dir / "job.yaml"  # what the trial runs, secrets included: mode 0600
        write_text_atomic(job_file, json.dumps({
            **job, "run_dir": str(runs),
            # Trials run side by side: each serves its figures on a free port (the job's port,
            # if it names one, is the search's own endpoint).
            "observability": {**(job.get("observability") or {}), "port": 0},
        }))
        command = ["run", str(job_file), "--json"]
        for item in overrides(config):
            command += ["--set", item]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*search_path, os.environ.get("PYTHONPATH", "")]),
        TRACKING_TAGS_ENV: json.dumps({
            **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {}),
            "scaletrain.tune.trial": trial_id,
            "scaletrain.tune.search": directory.name,
        }),
    }
    gpus = _actor_gpus()
    if gpus is not None:  # the trial's job sees the GPUs Ray gave this trial, no others
        env["CUDA_VISIBLE_DEVICES"] = gpus
    # The child holds its own copies of these files; ours close when Popen has started it.
    with _private_append(trial_dir / "stdout.log") as stdout, \
            _private_append(trial_dir / "console.log") as console:
        proc = subprocess.Popen(  # noqa: S603  this interpreter running scaletrain, no shell
            [sys.executable, "-m", "scaletrain", *command], stdout=stdout, stderr=console,
            env=env, cwd=search_path[0] if search_path else None, preexec_fn=_stop_with_parent,
        )
    return proc, trial_dir, runs


def _private_append(path: Path):
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def _trial_error(trial_dir: Path, returncode: int) -> str:
    """Why a trial's job failed: the ``error`` of the outcome it printed last (``--json``)."""
    path = trial_dir / "stdout.log"
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - 65536))
            tail = handle.read().decode("utf-8", "replace")
    except OSError:
        tail = ""
    return _last_json(tail).get("error") or f"scaletrain exited with {returncode}"


def _actor_gpus() -> str | None:
    import ray

    if not ray.is_initialized():  # not in a Tune actor; get_gpu_ids() would start an instance
        return None
    try:
        ids = ray.get_gpu_ids()
    except Exception:
        return None
    return ",".join(str(i) for i in ids) if ids else None


def _stop_with_parent() -> None:
    """In the child: SIGTERM (a clean stop at a checkpoint) if the trial's process dies first."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _metric_rows(runs: Path, split: str, key: str) -> list[tuple[int, float]]:
    files = sorted(runs.glob("*/*/metrics.jsonl"))
    if not files:
        return []
    rows = []
    for line in files[-1].read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the line being written
        if row.get("split") == split and key in row:
            rows.append((int(row["step"]), float(row[key])))
    return rows


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return {}
