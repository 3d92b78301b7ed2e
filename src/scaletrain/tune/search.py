"""`scaletrain tune`: a hyperparameter search on Ray Tune where every trial is a full job.

Each trial runs ``scaletrain run`` (or, when Tune retries it, ``scaletrain resume`` from its
own verified checkpoint) as a child process, with the trial's values as ``--set`` overrides,
and reports the search metric to Tune each time the job writes it to ``metrics.jsonl``. ASHA
stops a trial by ending its Tune actor; the child then gets SIGTERM and stops at a checkpoint,
like any preempted job. MLflow: one parent run for the search, the trials' runs nested under
it (``mlflow.parentRunId``), the best one tagged. Everything lives in one search directory:

    <run_dir>/tune/<job name>/<search id>/
        job.yaml         the job searched, redacted (secret values read ***)
        search.json      what was asked (job, space, options; --set values redacted)
        ray/             Ray Tune's experiment state
        trials/<trial>/  the trial's scaletrain run directory (runs/...), its job (unredacted:
                         the trial runs it; mode 0600, like spec.json), console.log, stdout.log
        best_job.yaml    the best trial's job, redacted (secrets come from the environment)
        results.json     one row per trial

The search's own files are written atomically and readable by their owner only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.rundir.atomic import write_text_atomic
from scaletrain.config import job_to_yaml
from scaletrain.config.loading import parse_job
from scaletrain.config.schema import JobConfig
from scaletrain.errors import ConfigError, ScaletrainError
from scaletrain.tracking.redact import Redactor
from scaletrain.tune.space import Dimension, load_space
from scaletrain.rundir import SUMMARY_FILE

__all__ = ["SearchOptions", "run_search", "TRACKING_TAGS_ENV"]

TRACKING_TAGS_ENV = "SCALETRAIN_TRACKING_TAGS"  # JSON tags for a trial's MLflow run
log = logging.getLogger("scaletrain_launcher.tune")


@dataclass
class SearchOptions:
    trials: int = 8
    max_concurrent: int = 1
    metric: str = "eval/loss"
    mode: str = "min"
    search: str = "random"  # random | optuna
    scheduler: str = "asha"  # asha | none
    max_failures: int = 2  # Tune retries of a failed trial (each resumes from its checkpoint)
    address: str | None = None
    overrides: list[str] = field(default_factory=list)

    def check(self, space: list[Dimension]) -> None:
        problems = []
        if self.trials < 1:
            problems.append(f"--trials must be at least 1, got {self.trials}")
        if self.max_concurrent < 1:
            problems.append(f"--max-concurrent must be at least 1, got {self.max_concurrent}")
        if self.mode not in ("min", "max"):
            problems.append(f"--mode must be min or max, got {self.mode!r}")
        if self.search not in ("random", "optuna"):
            problems.append(f"--search must be random or optuna, got {self.search!r}")
        if self.scheduler not in ("asha", "none"):
            problems.append(f"--scheduler must be asha or none, got {self.scheduler!r}")
        if "/" not in self.metric or self.metric.split("/", 1)[0] not in ("train", "eval"):
            problems.append(f"--metric names a train/ or eval/ metric, e.g. eval/loss; got {self.metric!r}")
        if self.search == "optuna" and any(d.kind == "grid" for d in space):
            problems.append("grid rules need --search random (Optuna samples; it does not enumerate)")
        if problems:
            raise ConfigError(problems)


def search_root(job: JobConfig) -> Path:
    """Absolute: Ray Tune takes a relative storage path for a URI without a scheme."""
    return (Path(job.run_dir).expanduser() / "tune" / job.name).resolve()


def run_search(job_file: str, space_file: str, options: SearchOptions, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) a search; returns its summary (trials, best, best job file)."""
    from scaletrain.api import resolve_job

    job, search_path = resolve_job(job_file, options.overrides)
    space = load_space(space_file, job, search_path)
    options.check(space)
    _check_metric_is_produced(job, options.metric)
    root = search_root(job)
    redactor = Redactor.for_config(job.model_dump(mode="json"))
    directory = _latest_unfinished(root) if resume else None
    if resume and directory is None:
        raise ConfigError(f"no search of job '{job.name}' to resume under {root}; run without --resume")
    if directory is None:
        directory = root / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        directory.mkdir(parents=True)
        write_text_atomic(directory / "job.yaml", _redacted_yaml(job, redactor))
        write_text_atomic(directory / "search.json", redactor.json({
            "job_file": str(Path(job_file).resolve()), "space": [asdict(d) for d in space],
            "options": asdict(options), "search_path": search_path, "finished": False,
        }, indent=2))
    from scaletrain.launch.ray.cluster import import_ray, ray_session

    ray = import_ray(local_instance=(options.address or os.environ.get("RAY_ADDRESS")) is None)
    parent = _ParentRun(job, directory, options, space)
    # Tune prints its own progress tables; ours is the table at the end (and --json stays one object).
    with ray_session(ray, options.address, directory / "logs", redactor=redactor), \
            open(directory / "logs" / "tune-console.log", "a", encoding="utf-8") as tune_console, \
            contextlib.redirect_stdout(tune_console), contextlib.redirect_stderr(tune_console):
        grid = _tune(ray, job, space, options, directory, parent.run_id, resume, search_path)
    _wait_for_stopped_trials(directory, job.recovery.grace_period_s + 30)
    if _interrupted(directory, _expected_trials(space, options)):
        # Ctrl-C: Tune stopped the trials (their jobs at checkpoints) and saved its state.
        parent.interrupted()
        raise SearchInterrupted(
            f"the search was interrupted; its state is in {directory}; continue with: "
            f"scaletrain tune {job_file} --space {space_file} --resume"
        )
    rows = _rows(grid, options, directory)
    best = _best(rows, options)
    summary = {"search_dir": str(directory), "metric": options.metric, "mode": options.mode,
               "trials": rows, "best": best, "mlflow_parent_run_id": parent.run_id}
    if best is not None:
        best_job = parse_job(job.model_dump(mode="json"), _overrides(best["config"]))
        write_text_atomic(directory / "best_job.yaml", _redacted_yaml(best_job, redactor))
        summary["best_job"] = str(directory / "best_job.yaml")
    summary = redactor.value("", summary)
    write_text_atomic(directory / "results.json", json.dumps(summary, indent=2))
    state = json.loads((directory / "search.json").read_text(encoding="utf-8"))
    write_text_atomic(directory / "search.json", json.dumps({**state, "finished": True}, indent=2))
    parent.finish(best, rows, options.metric)
    return summary


def _redacted_yaml(job: JobConfig, redactor: Redactor) -> str:
    """The job as YAML with its secret values masked (what the run directory's job.yaml is)."""
    return job_to_yaml(JobConfig.model_validate(redactor.value("", job.model_dump(mode="json"))))


class SearchInterrupted(ScaletrainError):
    exit_code = 130


def _expected_trials(space: list[Dimension], options: SearchOptions) -> int:
    count = options.trials
    for dimension in space:
        if dimension.kind == "grid":
            count *= len(dimension.values)
    return count


def _interrupted(directory: Path, expected: int) -> bool:
    """Did the search end before every trial did (Ctrl-C)? Read from Tune's saved state."""
    from ray.tune import ExperimentAnalysis

    try:
        trials = ExperimentAnalysis(str(directory / "ray" / "search")).trials
    except Exception:
        return False
    ended = [t for t in trials if str(t.status) in ("TERMINATED", "ERROR")]
    return len(ended) < expected


def _check_metric_is_produced(job: JobConfig, metric: str) -> None:
    if metric.startswith("eval/") and not job.train.eval_every:
        raise ConfigError(
            f"--metric {metric} needs evaluations during training for the scheduler to compare "
            "trials: set train.eval_every (e.g. --set train.eval_every=50)"
        )


def _latest_unfinished(root: Path) -> Path | None:
    if not root.exists():
        return None
    for directory in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        try:
            if not json.loads((directory / "search.json").read_text(encoding="utf-8"))["finished"]:
                return directory
        except (OSError, ValueError, KeyError):
            continue
    return None


def _tune(ray: Any, job: JobConfig, space: list[Dimension], options: SearchOptions, directory: Path,
          parent_run_id: str | None, resume: bool, search_path: list[str]) -> Any:
    from ray import tune

    storage = str(directory / "ray")
    trainable = tune.with_resources(tune.with_parameters(
        _trial_class(), job=job.model_dump(mode="json"), directory=str(directory),
        metric=options.metric, parent_run_id=parent_run_id, search_path=search_path,
        grace_s=job.recovery.grace_period_s,
    ), _trial_resources(ray, job))
    if resume and tune.Tuner.can_restore(os.path.join(storage, "search")):
        tuner = tune.Tuner.restore(os.path.join(storage, "search"), trainable, resume_errored=True)
        return tuner.fit()
    scheduler = None
    if options.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        evals = _reports_per_trial(job, options.metric)
        scheduler = ASHAScheduler(max_t=max(1, evals), grace_period=1, reduction_factor=2)
    search_alg = None
    if options.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError:
            from scaletrain.errors import MissingExtraError

            raise MissingExtraError("--search optuna needs Optuna: pip install 'scaletrain[ray]'") from None
        search_alg = OptunaSearch(seed=job.seed)
    tuner = tune.Tuner(
        trainable,
        param_space={d.key: d.to_ray() for d in space},
        tune_config=tune.TuneConfig(
            metric=options.metric, mode=options.mode, num_samples=options.trials,
            max_concurrent_trials=options.max_concurrent, scheduler=scheduler, search_alg=search_alg,
        ),
        run_config=tune.RunConfig(
            name="search", storage_path=storage,
            failure_config=tune.FailureConfig(max_failures=options.max_failures),
            verbose=0,
        ),
    )
    return tuner.fit()


def _trial_resources(ray: Any, job: JobConfig) -> dict[str, float]:
    """What one trial reserves: a CPU for its actor, and on a cluster with GPUs one GPU per
    worker of its job (the job runs as local workers on the actor's node, on those GPUs only)."""
    resources = {"cpu": 1.0}
    if job.scale.engine == "local" and ray.cluster_resources().get("GPU", 0) >= 1:
        resources["gpu"] = float(job.scale.workers)
    return resources


def _reports_per_trial(job: JobConfig, metric: str) -> int:
    """How many times a full trial reports the metric (ASHA's max_t)."""
    steps = job.train.max_steps
    if steps is None:  # epochs: count from the task's data at run time; a generous bound
        return 1000
    every = job.train.eval_every if metric.startswith("eval/") else job.train.log_every
    return steps // every + (1 if steps % every else 0)


def _overrides(config: dict[str, Any]) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in config.items()]


def _trial_class():
    """The Tune trainable (a class: Tune calls its cleanup before it ends the actor, which
    lets a stopped trial's job checkpoint before the actor and its children are gone)."""
    from ray import tune

    class ScaletrainTrial(tune.Trainable):
        def setup(self, config: dict[str, Any], job: dict, directory: str, metric: str,
                  parent_run_id: str | None, search_path: list[str], grace_s: float) -> None:
            self.metric, self.grace_s = metric, grace_s
            self.split, self.key = metric.split("/", 1)
            self.redactor = Redactor.for_config(job)
            self.proc, self.trial_dir, self.runs = _start_trial_job(
                self.trial_id, config, job, Path(directory), parent_run_id, search_path
            )
            self.final_step = parse_job(job, _overrides(config)).train.max_steps
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

        def load_checkpoint(self, checkpoint_dir: str) -> None:
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


def _start_trial_job(trial_id: str, config: dict[str, Any], job: dict, directory: Path,
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
        write_text_atomic(job_file, json.dumps({**job, "run_dir": str(runs)}))
        command = ["run", str(job_file), "--json"]
        for item in _overrides(config):
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
        proc = subprocess.Popen(
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


def _wait_for_stopped_trials(directory: Path, timeout_s: float) -> None:
    """Trials the scheduler stopped are still writing their checkpoint and summary (their job
    got SIGTERM, as in a preemption): wait for them, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for run_dir in sorted(p.parent for p in directory.glob("trials/*/runs/*/*/spec.json")):
        while not (run_dir / SUMMARY_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.2)


def _rows(grid: Any, options: SearchOptions, directory: Path) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        trial_id = metrics.get("trial_id") or Path(str(result.path)).name
        trial_dir = directory / "trials" / trial_id
        summary = {}
        found = sorted(trial_dir.glob("runs/*/*/summary.json"))
        if found:
            summary = json.loads(found[-1].read_text(encoding="utf-8"))
        status = "failed" if result.error else (
            "finished" if summary.get("status") == "finished" else "pruned"
        )
        rows.append({
            "trial": trial_id,
            "config": result.config,
            "metric": metrics.get(options.metric),
            "reports": metrics.get("training_iteration"),
            "status": status,
            "run_dir": summary.get("run_dir"),
            "mlflow_run_id": summary.get("mlflow_run_id"),
            "error": str(result.error).strip().splitlines()[-1][:300] if result.error else None,
        })
    return rows


def _best(rows: list[dict[str, Any]], options: SearchOptions) -> dict[str, Any] | None:
    """The best trial among those that finished (a pruned trial's metric is from fewer steps)."""
    done = [r for r in rows if r["status"] == "finished" and r["metric"] is not None]
    if not done:
        return None
    pick = min if options.mode == "min" else max
    return pick(done, key=lambda r: r["metric"])


class _ParentRun:
    """The search's MLflow run; the trials' runs nest under it."""

    def __init__(self, job: JobConfig, directory: Path, options: SearchOptions, space: list[Dimension]):
        self.run_id: str | None = None
        self.client = None
        if not job.tracking.enabled:
            return
        try:
            from mlflow import MlflowClient

            from scaletrain.tracking.mlflow_run import experiment_for, resolve_tracking_uri
            from scaletrain.tracking.sender import configure_mlflow_client

            configure_mlflow_client()
            uri = resolve_tracking_uri(job)
            self.client = MlflowClient(tracking_uri=uri)
            experiment_id = experiment_for(self.client, uri, job.tracking.experiment or job.name)
            state = directory / "mlflow_parent_run.txt"
            if state.exists():  # --resume: the same parent run
                self.run_id = state.read_text(encoding="utf-8").strip()
                self.client.update_run(self.run_id, status="RUNNING")
                return
            run = self.client.create_run(experiment_id, run_name=f"tune {directory.name}", tags={
                "scaletrain.tune": "search", "scaletrain.tune.search": directory.name,
            })
            self.run_id = run.info.run_id
            write_text_atomic(state, self.run_id)
            self.client.log_batch(self.run_id, params=[
                _param(k, v) for k, v in {
                    "metric": options.metric, "mode": options.mode, "trials": options.trials,
                    "max_concurrent": options.max_concurrent, "search": options.search,
                    "scheduler": options.scheduler,
                    "space": json.dumps({d.key: {d.kind: list(d.values)} for d in space}),
                }.items()
            ])
        except Exception as exc:
            log.warning("no MLflow parent run for this search (%s: %s); the trials are tracked alone",
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            self.run_id = None

    def interrupted(self) -> None:
        if self.client is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, "KILLED")
            except Exception:
                pass

    def finish(self, best: dict[str, Any] | None, rows: list[dict[str, Any]], metric: str) -> None:
        if self.client is None or self.run_id is None:
            return
        try:
            if best is not None:
                self.client.set_tag(self.run_id, "scaletrain.tune.best_trial", best["trial"])
                if best.get("mlflow_run_id"):
                    self.client.set_tag(self.run_id, "scaletrain.tune.best_run_id", best["mlflow_run_id"])
                    self.client.set_tag(best["mlflow_run_id"], "scaletrain.tune.best", "true")
                self.client.log_metric(self.run_id, f"best/{metric}", best["metric"])
            for status in ("finished", "pruned", "failed"):
                self.client.log_metric(self.run_id, f"trials_{status}", sum(r["status"] == status for r in rows))
            self.client.set_terminated(self.run_id, "FINISHED")
        except Exception as exc:
            log.warning("could not finish the MLflow parent run: %s", exc)


def _param(key: str, value: Any):
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])

