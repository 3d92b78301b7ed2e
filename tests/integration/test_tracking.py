"""MLflow tracking, read back through MlflowClient: one run per job, what it holds, secrets."""

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import scaletrain
from scaletrain.errors import WorkerFailedError
from tests.helpers.run import REPO, read_metrics
from tests.helpers.tasks import toy_job

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402


def tracked_job(tmp_path, uri, **sections):
    job = toy_job(tmp_path, **sections)
    # The model export (torch.export, ~2 s) only where a test looks at the model.
    job["tracking"] = {"enabled": True, "uri": uri, "experiment": "tests", "log_model": False,
                       **sections.get("tracking", {})}
    return job


def the_run(uri, summary):
    client = MlflowClient(uri)
    return client, client.get_run(summary["mlflow_run_id"])


@pytest.mark.parametrize("workers", [1, 2])
def test_one_run_per_job_with_params_metrics_tags_artifacts_and_model(tmp_path, workers, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = scaletrain.run(
        tracked_job(tmp_path, uri, train={"max_steps": 12, "log_every": 5, "eval_every": 6},
                    scale={"workers": workers}, tracking={"log_model": workers == 2})
    )
    client, run = the_run(uri, summary)
    experiment = client.get_experiment_by_name("tests")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run.info.run_id]
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.01"
    assert run.data.params["scale.workers"] == str(workers)
    assert run.data.params["task.target"] == "tests.helpers.tasks:ToyTask"
    tags = run.data.tags
    assert tags["scaletrain.run_id"] == summary["run_id"]
    assert tags["scaletrain.world_size"] == str(workers)
    assert tags["scaletrain.strategy"] == ("ddp" if workers == 2 else "single")
    assert tags["mlflow.source.git.commit"] and tags["scaletrain.git.dirty"] in ("true", "false")
    # Reported at steps 1, 5, 10 and the last (12); eval at 6 and 12: exactly those points.
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 5, 10, 12]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [6, 12]
    local = {row["step"]: row["loss"] for row in read_metrics(summary["run_dir"])}
    for point in client.get_metric_history(run.info.run_id, "train/loss"):
        assert point.value == pytest.approx(local[point.step])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"job.yaml", "summary.json", "logs", "weights"} <= artifacts
    logs = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "logs")}
    assert {f"worker-{r}.jsonl" for r in range(workers)} <= logs
    # MLflow 3's UI opens a model-training experiment in its training view, not GenAI's.
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    logged = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    if workers == 1:  # tracking.log_model: false
        assert "model" not in artifacts and len(logged) == 0
        return
    # The model is an MLflow 3 logged model of the run (the run page lists it; the UI registers
    # it), not a copy among the run's artifacts.
    (model_entity,) = logged
    assert (model_entity.name, model_entity.source_run_id, str(model_entity.status)) == (
        "model", run.info.run_id, "READY")
    assert [o.model_id for o in run.outputs.model_outputs] == [model_entity.model_id]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what runs:/ URIs resolve against
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    import torch
    from safetensors.torch import load_file

    trained = load_file(Path(summary["run_dir"], "model.safetensors"))
    for source in (f"runs:/{run.info.run_id}/model", f"models:/{model_entity.model_id}"):
        model = mlflow.pytorch.load_model(source)
        assert tuple(model(torch.from_numpy(x)).shape) == (5, 4)  # any batch size, not the example's 2
        # The final weights, bit for bit, and pyfunc serves what the module computes.
        assert {k: v for k, v in model.state_dict().items()}.keys() == trained.keys()
        assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
        served = mlflow.pyfunc.load_model(source)
        assert np.array_equal(np.asarray(served.predict(x)), model(torch.from_numpy(x)).detach().numpy())
    info = mlflow.models.get_model_info(f"models:/{model_entity.model_id}")
    assert info.signature.inputs.to_dict() == [{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": (-1, 16)}}]
    assert info.signature.outputs.to_dict() == [{"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": (-1, 4)}}]
    assert info.saved_input_example_info["type"] == "ndarray"
    assert info.flavors["pytorch"]["pytorch_version"] == torch.__version__


def test_an_sqlite_stores_artifacts_live_beside_it_not_in_the_working_directory(tmp_path, monkeypatch):
    """MLflow's default puts them in ./mlruns of whichever folder the first run started in."""
    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.syspath_prepend(str(REPO))  # the task's module, from any working directory
    monkeypatch.chdir(elsewhere)
    summary = scaletrain.run(tracked_job(tmp_path, uri, train={"max_steps": 2}))
    client, run = the_run(uri, summary)
    assert run.info.artifact_uri == (store / "mlruns" / "tests" / run.info.run_id / "artifacts").as_uri()
    assert (store / "mlruns" / "tests" / run.info.run_id / "artifacts" / "summary.json").is_file()
    assert list(elsewhere.iterdir()) == []


def test_tracking_off_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'unused.db'}")
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 3}))
    assert summary["mlflow_run_id"] is None
    assert not (tmp_path / "unused.db").exists()


def test_failed_job_marks_the_run_failed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tracked_job(tmp_path, uri, task={"args": {"fail_rank": 0, "fail_at_step": 2}})
    with pytest.raises(WorkerFailedError):
        scaletrain.run(job)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED"


def test_secrets_never_reach_params_tags_artifacts_or_logs(tmp_path, monkeypatch):
    env_secret = "envsecret-9f8e7d6c"
    config_secret = "cfgsecret-1a2b3c4d"
    url_password = "urlpass-5e6f7a8b"
    monkeypatch.setenv("MY_SERVICE_TOKEN", env_secret)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tracked_job(
        tmp_path, uri, scale={"workers": 2},
        task={"args": {
            "api_token": config_secret,
            "secret_note": f"fetch from https://alice:{url_password}@data.example/x using {env_secret}",
        }},
    )
    summary = scaletrain.run(job)
    client, run = the_run(uri, summary)
    planted = (env_secret, config_secret, url_password)
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags)]
    assert run.data.params["task.args.api_token"] == "***"
    download = tmp_path / "artifacts"
    client.download_artifacts(run.info.run_id, "", str(download))
    files = [p for p in download.rglob("*") if p.is_file()]
    assert files
    texts += [p.read_bytes().decode("utf-8", "replace") for p in files]
    run_dir = Path(summary["run_dir"])
    texts += [p.read_text() for p in (run_dir / "logs").rglob("*.json*")]
    texts.append((run_dir / "job.yaml").read_text())
    for text in texts:
        for secret in planted:
            assert secret not in text


def test_server_outage_loses_no_metric_and_duplicates_none(tmp_path, mlflow_server):
    """Kill the tracking server mid-run, bring it back on the same port: every logged step's
    metric arrives exactly once, and training never stopped."""
    job = tracked_job(
        tmp_path, mlflow_server.uri, scale={"workers": 2},
        task={"args": {"step_sleep": 0.05}},
        train={"max_steps": 160, "log_every": 1},
        tracking={"flush_timeout_s": 120},
    )
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(summary=scaletrain.run(job)))
    runner.start()
    metrics_file = None
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until training is under way
        files = list((tmp_path / "runs").rglob("metrics.jsonl"))
        if files and len(files[0].read_text().splitlines()) >= 25:
            metrics_file = files[0]
            break
        time.sleep(0.2)
    assert metrics_file is not None, "training did not start"
    mlflow_server.stop()
    down_at = len(metrics_file.read_text().splitlines())
    deadline = time.time() + 120
    while len(metrics_file.read_text().splitlines()) < down_at + 15:  # steps trained while it is down
        assert time.time() < deadline, "training stopped while the tracking server was down"
        time.sleep(0.1)
    mlflow_server.start()
    runner.join(timeout=240)
    summary = outcome["summary"]
    assert summary["status"] == "finished" and summary["steps"] == 160
    logged_during_outage = len(read_metrics(summary["run_dir"])) - down_at
    assert logged_during_outage > 10, "the outage should overlap training"
    client, run = the_run(mlflow_server.uri, summary)
    local_steps = [row["step"] for row in read_metrics(summary["run_dir"])]
    assert local_steps == list(range(1, 161))
    for key in ("train/loss", "train/lr", "train/accuracy"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == local_steps, f"{key}: lost or duplicated points"
    # The launcher ships the journal; its log says what happened, once.
    launcher_log = [json.loads(line) for line in
                    Path(summary["run_dir"], "logs", "launcher.jsonl").read_text().splitlines()]
    warnings = [entry for entry in launcher_log if entry.get("level") == "warning"]
    # MLflow keeps an exact repeat once, so the store cannot show a re-sent point: count sends.
    from scaletrain.tracking.journal import MetricJournal

    journaled = len(MetricJournal(Path(summary["run_dir"], "tracking")).read_from(0)[0])
    delivered = [entry["points_delivered"] for entry in launcher_log if "points_delivered" in entry]
    assert delivered == [journaled], (delivered, journaled)
    unreachable = [w for w in warnings if "cannot reach the tracking server" in w["message"]]
    assert len(unreachable) == 1, "one warning per outage, not one per step"
    assert run.info.status == "FINISHED"


def test_a_server_down_at_start_gets_the_whole_run_once_it_is_up(tmp_path, mlflow_server):
    """Training starts with the tracker down (one warning); the run is opened when it comes up
    and holds params and every point, each once."""
    mlflow_server.stop()
    job = tracked_job(
        tmp_path, mlflow_server.uri, task={"args": {"step_sleep": 0.05}},
        train={"max_steps": 200, "log_every": 1}, tracking={"flush_timeout_s": 120},
    )
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(summary=scaletrain.run(job)))
    runner.start()
    deadline = time.time() + 120
    while time.time() < deadline:  # training goes on without the tracker
        files = list((tmp_path / "runs").rglob("metrics.jsonl"))
        if files and len(files[0].read_text().splitlines()) >= 20:
            break
        time.sleep(0.2)
    else:
        pytest.fail("training did not start while the tracker was down")
    mlflow_server.start()
    runner.join(timeout=240)
    summary = outcome["summary"]
    assert summary["status"] == "finished" and summary["mlflow_run_id"]
    client, run = the_run(mlflow_server.uri, summary)
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.01"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 201))
    warnings = [
        json.loads(line)["message"]
        for line in Path(summary["run_dir"], "logs", "launcher.jsonl").read_text().splitlines()
        if '"warning"' in line
    ]
    assert len([w for w in warnings if w.startswith("cannot reach the tracking server")]) == 1
    assert any(w.startswith("tracking server reachable: opened MLflow run") for w in warnings)


def test_runs_show_and_reproduce_commands(tmp_path):
    from tests.helpers.run import scaletrain_cli

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job_file = tmp_path / "toy.yaml"
    job_file.write_text(json.dumps(tracked_job(tmp_path, uri, task={"args": {"dropout": 0.1}},
                                               train={"max_steps": 15, "log_every": 5})))
    first = scaletrain_cli("run", str(job_file), "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    summary = json.loads(first.stdout)

    listed = scaletrain_cli("runs", "--uri", uri, "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["run"] == summary["mlflow_run_id"] and row["name"] == summary["run_id"]
    assert row["status"] == "FINISHED" and row["steps"] == 15
    assert row["final_loss"] == pytest.approx(summary["train"]["loss"])
    assert row["git_sha"] and row["duration_s"] > 0

    shown = scaletrain_cli("show", summary["run_id"], "--uri", uri)  # by scaletrain's run id
    assert shown.returncode == 0, shown.stderr
    details = json.loads(shown.stdout)
    assert details["params"]["train.max_steps"] == "15"
    assert details["metrics"]["train/loss"] == pytest.approx(summary["train"]["loss"])
    assert "run_card.json" in details["artifacts"]
    card = details["run_card"]
    assert card["torch"] and card["git_commit"] and card["data_fingerprint"].startswith("sha256:")
    assert card["packages"] > 10

    again = scaletrain_cli("reproduce", summary["mlflow_run_id"], "--uri", uri, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    outcome = json.loads(again.stdout)
    assert outcome["weights_match"] is True
    assert outcome["weights_sha256"] == summary["weights_sha256"]
    assert outcome["differences"] == []
    assert "environment: same code, packages and hardware" in again.stderr
    client = MlflowClient(uri)
    assert client.get_run(outcome["new_run"]).data.tags["scaletrain.reproduces"] == summary["mlflow_run_id"]

    # A run that fails after 7 steps is listed with 7, not 0.
    failed = scaletrain_cli("run", str(job_file), env={"SCALETRAIN_FAULT": "raise:rank=0:step=7"})
    assert failed.returncode == 1, failed.stderr[-2000:]
    rows = json.loads(scaletrain_cli("runs", "--uri", uri, "--json").stdout)
    assert [(r["status"], r["steps"]) for r in rows] == [("FAILED", 7), ("FINISHED", 15), ("FINISHED", 15)]

    # At 80 columns every id a command takes is printed whole, one run per line.
    table = scaletrain_cli("runs", "--uri", uri, env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert max(map(len, lines)) <= 80, table.stdout
    for row in rows:
        (line,) = [line for line in lines if line.startswith(row["run_id"] + " ")]
        assert row["status"].lower() in line and str(row["steps"]) in line, table.stdout

    # Any prefix only one run's id has (as git and docker take them); a shared one is refused.
    by_prefix = scaletrain_cli("show", summary["mlflow_run_id"][:8], "--uri", uri)
    assert json.loads(by_prefix.stdout)["name"] == summary["run_id"], by_prefix.stderr
    by_prefix = scaletrain_cli("show", summary["run_id"][:-2], "--uri", uri)
    assert json.loads(by_prefix.stdout)["run"] == summary["mlflow_run_id"], by_prefix.stderr
    shared = os.path.commonprefix([r["run_id"] for r in rows])  # at least the year
    ambiguous = scaletrain_cli("show", shared, "--uri", uri)
    names = ", ".join(sorted(r["run_id"] for r in rows))
    assert (ambiguous.returncode, ambiguous.stderr.strip()) == (
        2, f"error: '{shared}' is the start of 3 runs' ids ({names}); type more of it")

    missing = scaletrain_cli("show", "no-such-run", "--uri", uri)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: no run 'no-such-run' at {uri}; list them with: scaletrain runs"
    no_experiment = scaletrain_cli("runs", "--uri", uri, "--experiment", "nope")
    assert no_experiment.returncode == 2
    assert no_experiment.stderr.strip() == (
        "error: no experiment named 'nope' at this tracking store; experiments: Default, tests"
    )


def test_run_card_records_environment_and_data(tmp_path):
    summary = scaletrain.run(toy_job(tmp_path, train={"max_steps": 2}))
    card = json.loads(Path(summary["run_dir"], "run_card.json").read_text())
    assert card["seed"] == 7 and card["deterministic"] is False
    assert any(p.startswith("torch==") for p in card["packages"])
    assert card["torch"]["version"] and card["hardware"]["cpu_count"] >= 1
    assert card["git"]["commit"] and "diff_sha256" in card["git"] and "diff" not in card["git"]
    other = scaletrain.run(toy_job(tmp_path, train={"max_steps": 2}, task={"args": {"samples": 256}}))
    other_card = json.loads(Path(other["run_dir"], "run_card.json").read_text())
    assert other_card["data_fingerprint"] != card["data_fingerprint"]


def test_cli_json_against_a_server_prints_only_the_summary(tmp_path, mlflow_server):
    from tests.helpers.run import scaletrain_cli

    job_file = tmp_path / "toy.yaml"
    job_file.write_text(json.dumps(tracked_job(tmp_path, mlflow_server.uri, train={"max_steps": 5})))
    result = scaletrain_cli("run", str(job_file), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)  # nothing else on stdout, e.g. MLflow's run URL
    _, run = the_run(mlflow_server.uri, summary)
    assert run.info.status == "FINISHED"
    assert len(MlflowClient(mlflow_server.uri).get_metric_history(run.info.run_id, "train/loss")) == 5


def test_system_metrics_are_sampled_while_training(tmp_path):
    # The sampler starts once the tracking process has opened the run (importing MLflow takes
    # seconds): the first step waits for that, then training lasts 6 s (12 samples' time).
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    opened = str(tmp_path / "runs" / "toy" / "*" / "tracking" / "mlflow_run.json")
    summary = scaletrain.run(tracked_job(
        tmp_path, uri, task={"args": {"step_sleep": 0.05, "wait_for": opened}},
        train={"max_steps": 120, "log_every": 20}, tracking={"system_metrics_every_s": 0.5},
    ))
    client, run = the_run(uri, summary)
    cpu = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    memory = client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")
    assert len(cpu) >= 2 and len(memory) >= 2
    assert all(0 <= m.value <= 100 for m in cpu)


def test_a_warm_tracking_process_not_used_ends_by_itself_and_one_used_opens_the_run(tmp_path):
    """The tracking process starts as soon as the job is read (WarmTracker); a job refused
    before its attempt (a pre-flight failure) closes it unused: it ends, nothing opened."""
    from scaletrain.config.schema import JobConfig
    from scaletrain.tracking.tracker_handle import WarmTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    warm = WarmTracker(JobConfig.model_validate(tracked_job(tmp_path, uri)))
    process = warm.process
    started = time.monotonic()
    warm.discard()
    assert process.returncode == 0 and time.monotonic() - started < 30
    assert warm.take() is None
    assert not (tmp_path / "mlflow.db").exists()  # it never opened the store
    # Used: a tracked run's tracking process is the warm one (it opens the run).
    summary = scaletrain.run(tracked_job(tmp_path, uri, train={"max_steps": 2}))
    _client, run = the_run(uri, summary)
    assert run.info.status == "FINISHED"
