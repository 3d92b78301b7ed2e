"""`scaletrain tune` on a local Ray instance: 4 trials, ASHA, nested MLflow runs, best job."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.run import REPO, scaletrain_cli
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)


def test_a_search_with_asha_nests_its_trials_and_writes_the_best_job(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(
        tmp_path,
        train={"max_steps": 40, "eval_every": 10, "log_every": 10},
        checkpoint={"every_steps": 10},
        tracking={"enabled": True, "uri": uri, "experiment": "search", "log_model": False},
        # Slow steps (2 s a trial): ASHA's stop must reach a trial before its last step.
        task={"args": {"step_sleep": 0.05}},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    space = tmp_path / "space.yaml"
    # In this order, one at a time: the second trial (a learning rate that does not learn)
    # is behind the first at the first evaluation, so ASHA stops it there.
    space.write_text("optim.lr: {grid: [0.05, 1.0e-7, 0.02]}\n")
    out = scaletrain_cli(
        "tune", str(job_file), "--space", str(space), "--trials", "1", "--metric", "eval/loss",
        "--mode", "min", "--scheduler", "asha", "--json", timeout=270,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    rows = {row["config"]["optim.lr"]: row for row in summary["trials"]}
    assert sorted(rows) == [1.0e-7, 0.02, 0.05]
    assert rows[0.05]["status"] == "finished" and rows[0.05]["reports"] == 4
    assert rows[1.0e-7]["status"] == "pruned" and rows[1.0e-7]["reports"] < 4
    assert summary["best"]["config"]["optim.lr"] in (0.05, 0.02)
    best_job = yaml.safe_load(Path(summary["best_job"]).read_text())
    assert best_job["optim"]["lr"] == summary["best"]["config"]["optim.lr"]

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("search")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("scaletrain.tune") == "search"]
    assert len(parents) == 1
    parent = parents[0]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(trials) == 3
    best = [r for r in trials if r.data.tags.get("scaletrain.tune.best") == "true"]
    assert [r.info.run_id for r in best] == [summary["best"]["mlflow_run_id"]]
    assert parent.data.tags["scaletrain.tune.best_run_id"] == summary["best"]["mlflow_run_id"]
    assert parent.data.metrics["trials_pruned"] >= 1
    pruned_run = client.get_run(rows[1.0e-7]["mlflow_run_id"])
    assert pruned_run.info.status == "KILLED"  # stopped at a checkpoint, like a preemption

    # The search's own log and figures: each trial's start and end under the search's trace id,
    # the trials by status and each ended trial a unit of work (its error rate).
    search_dir = Path(summary["search_dir"])
    said = [json.loads(line) for line in (search_dir / "logs" / "tune.jsonl").read_text().splitlines()]
    assert {(r["trace_id"], r["request_id"]) for r in said} == {(summary["trace_id"], said[0]["request_id"])}
    assert said[0]["request_id"] and said[0]["message"].startswith("metrics for Prometheus on http://127.0.0.1:")
    trial_lines = sorted(r["message"].split(" ", 2)[2] for r in said if r["message"].startswith("trial "))
    assert trial_lines == ["ended"] * 3 + ["started"] * 3, trial_lines
    figures = json.loads((search_dir / "logs" / "telemetry" / "launcher-0.json").read_text())["figures"]
    assert figures["trials"] == {"pending": 0, "running": 0, "paused": 0, "finished": 3, "failed": 0}
    assert (figures["work_total"]["trial"], figures["errors_total"]["trial"]) == (3, 0)
    assert summary["metrics_url"].startswith("http://127.0.0.1:") and summary["alerts"] == []

    # Its report: the trials side by side, the best one marked.
    made = scaletrain_cli("report", summary["mlflow_parent_run_id"], "--uri", uri, "--out", str(tmp_path / "report"))
    assert made.returncode == 0, made.stderr[-2000:]
    page = (tmp_path / "report" / "report.html").read_text()
    table = page.split("<h2>Trials side by side</h2>")[1].split("</table>")[0]
    assert table.count("<tr") == 4 and table.count('<tr class="best">') == 1
    assert summary["best"]["mlflow_run_id"] in table.split('<tr class="best">')[1]


def test_a_failing_trial_is_retried_from_its_checkpoint_and_the_others_go_on(tmp_path):
    """Optuna TPE search; one trial's job fails once mid-run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(
        tmp_path,
        task={"args": {"fail_at_step": 15, "fail_rank": 0, "fail_once_marker": str(tmp_path / "failed")}},
        train={"max_steps": 30, "eval_every": 10, "log_every": 10},
        checkpoint={"every_steps": 10},
        tracking={"enabled": True, "uri": uri, "experiment": "retry", "log_model": False},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {loguniform: [0.01, 0.05]}\n")
    out = scaletrain_cli(  # Optuna's TPE proposes the trials
        "tune", str(job_file), "--space", str(space), "--trials", "2", "--search", "optuna",
        "--max-concurrent", "2", "--scheduler", "none", "--json", timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert [row["status"] for row in summary["trials"]] == ["finished", "finished"]
    lrs = [row["config"]["optim.lr"] for row in summary["trials"]]
    assert all(0.01 <= lr <= 0.05 for lr in lrs) and lrs[0] != lrs[1], lrs
    # Optuna's, not Ray's random search: TPE seeded with the job's seed proposes exactly these.
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=job["seed"]))
    space = {"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.05, log=True)}
    assert sorted(lrs) == sorted(study.ask(fixed_distributions=space).params["optim.lr"] for _ in lrs)
    runs = [json.loads(Path(row["run_dir"], "summary.json").read_text()) for row in summary["trials"]]
    retried = [run for run in runs if run["attempt"] == 2]
    assert len(retried) == 1 and retried[0]["resumed_from_step"] == 10 and retried[0]["steps"] == 30
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    nested = client.search_runs(
        [client.get_experiment_by_name("retry").experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{summary['mlflow_parent_run_id']}'",
    )
    assert len(nested) == 2  # the retried trial continued its own run
    said = (Path(summary["search_dir"]) / "logs" / "tune.jsonl").read_text()
    assert said.count("failed; Tune retries it from its checkpoint") == 1 and said.count(" ended\"") == 2


def test_an_interrupted_search_resumes_where_it_stopped(tmp_path, processes):
    job = toy_job(
        tmp_path,
        task={"args": {"step_sleep": 0.05}},
        train={"max_steps": 40, "eval_every": 20, "log_every": 10},
        checkpoint={"every_steps": 10},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {grid: [0.05, 0.02]}\n")
    args = [sys.executable, "-m", "scaletrain", "tune", str(job_file), "--space", str(space),
            "--trials", "1", "--scheduler", "none", "--json"]
    search = processes(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trials = tmp_path / "runs" / "tune" / "toy"
    deadline = time.time() + 120
    while time.time() < deadline:  # the first trial has finished, the second is training
        done = [p for p in trials.glob("*/trials/*/runs/*/*/summary.json")]
        started = list(trials.glob("*/trials/*/runs/*/*/metrics.jsonl"))
        if done and len(started) >= 2:
            break
        time.sleep(0.2)
    assert done and len(started) >= 2, f"after 120 s: {len(done)} trials done, {len(started)} started"
    # The search's endpoint while it runs: one trial running, one finished.
    (log,) = trials.glob("*/logs/tune.jsonl")
    first_lines = [json.loads(line) for line in log.read_text().splitlines()]
    url = first_lines[0]["message"].removeprefix("metrics for Prometheus on ")
    import urllib.request

    expected = ('scaletrain_trials{status="running"} 1.0', 'scaletrain_trials{status="finished"} 1.0')
    for _ in range(20):  # the figures are rewritten at most once a second
        with urllib.request.urlopen(url, timeout=5) as response:
            served = response.read().decode()
        if all(line in served for line in expected):
            break
        time.sleep(0.25)
    assert 'scaletrain_trials{status="running"} 1.0' in served
    assert 'scaletrain_trials{status="finished"} 1.0' in served
    search.send_signal(signal.SIGINT)
    out, err = search.communicate(timeout=60)
    assert search.returncode == 130, err[-3000:]
    assert "--resume" in err.strip().splitlines()[-1]
    first = json.loads(done[0].read_text())

    resumed = scaletrain_cli(*args[3:], "--resume", timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert [row["status"] for row in summary["trials"]] == ["finished"] * 2
    again = [row for row in summary["trials"] if row["run_dir"] == first["run_dir"]]
    assert len(again) == 1  # the finished trial was kept, not trained again
    assert json.loads(Path(first["run_dir"], "summary.json").read_text())["attempt"] == 1
    # One trace id for the search, across both invocations; a request id for each.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["trace_id"] for r in lines} == {summary["trace_id"]}
    assert len({r["request_id"] for r in lines}) == 2


def test_a_bad_space_is_one_line(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(toy_job(tmp_path, train={"max_steps": 20, "eval_every": 10})))
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {uniform: [0.5, 0.1]}\n")
    out = scaletrain_cli("tune", str(job_file), "--space", str(space))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {space}: optim.lr: uniform low end 0.5 is not below its high end 0.1; write [low, high]"
    ]
