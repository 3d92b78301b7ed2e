"""The CLI as a user meets it: bad input gets one clear line, exit code 2, no traceback."""

import json
import re

import pytest
import yaml

from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job


def write_job(tmp_path, job, name="job.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job))
    return path


def assert_one_error_line(result, expected):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [expected]


def test_missing_file(tmp_path):
    result = scaletrain_cli("run", str(tmp_path / "nope.yaml"))
    assert_one_error_line(result, f"error: job file '{tmp_path / 'nope.yaml'}' not found; check the path")


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: {target: a:b\ndata: 1\n")
    result = scaletrain_cli("run", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {path}: line 2, column 5: invalid YAML:")
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_key(tmp_path):
    job = toy_job(tmp_path)
    job["optim"]["learning_rate"] = 0.1
    path = write_job(tmp_path, job)
    result = scaletrain_cli("run", str(path))
    assert_one_error_line(result, f"error: {path}: optim.learning_rate: unknown key; valid keys here: "
                          "name, lr, weight_decay, betas, momentum, schedule, warmup_steps, min_lr_ratio")


def test_unknown_key_with_a_close_match(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path))
    result = scaletrain_cli("run", str(path), "--set", "optim.lrr=0.1")
    assert_one_error_line(result, f"error: {path}: optim.lrr: unknown key; did you mean 'lr'?")


def test_wrong_type(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, optim={"lr": "fast"}))
    result = scaletrain_cli("run", str(path))
    assert_one_error_line(result, f'error: {path}: optim.lr: must be a positive number, got "fast"')


def test_workers_below_one(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, scale={"workers": 0}))
    result = scaletrain_cli("run", str(path))
    assert_one_error_line(result, f"error: {path}: scale.workers: must be a positive integer, got 0")


def test_task_that_does_not_resolve(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, task={"target": "tests.helpers.tasks:ToyTsk"}))
    result = scaletrain_cli("run", str(path))
    assert_one_error_line(
        result,
        "error: task.target 'tests.helpers.tasks:ToyTsk': 'tests.helpers.tasks' has no attribute "
        "'ToyTsk'; did you mean 'ToyTask'?",
    )
    result = scaletrain_cli("validate", str(path), "--set", "task.target=missing_pkg.mod:Task")
    assert_one_error_line(
        result,
        "error: task.target 'missing_pkg.mod:Task': module 'missing_pkg' not found; run from the "
        "directory that contains it or install its package",
    )


def test_task_args_that_do_not_fit(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, task={"args": {"hiden": 3}}))
    result = scaletrain_cli("run", str(path))
    assert_one_error_line(
        result,
        "error: task.args: tests.helpers.tasks:ToyTask takes no argument 'hiden'; "
        "did you mean 'hidden'?",
    )


def test_task_that_is_not_callable_is_bad_input_in_process_and_in_workers(tmp_path):
    # Only an import can tell that REPO is a path, not a factory: the worker finds out.
    path = write_job(tmp_path, toy_job(tmp_path, task={"target": "tests.helpers.run:REPO"}))
    result = scaletrain_cli("run", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: task.target 'tests.helpers.run:REPO' is not a class or function; it cannot be called"
    )
    result = scaletrain_cli("run", str(path), "--set", "scale.workers=2")
    assert "Traceback" not in result.stderr
    assert result.returncode == 2
    assert re.match(
        r"error: worker rank [01] failed: TaskError: task.target 'tests.helpers.run:REPO' is not "
        r"a class or function",
        result.stderr.strip().splitlines()[-1],
    )


def test_bad_set_flag(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path))
    result = scaletrain_cli("run", str(path), "--set", "optim.lr")
    assert_one_error_line(
        result, "error: --set 'optim.lr': expected KEY=VALUE with a dotted key, e.g. --set optim.lr=3e-4"
    )


def test_nothing_is_created_for_bad_input(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, optim={"lr": -1}))
    scaletrain_cli("run", str(path))
    assert not (tmp_path / "runs").exists()


def test_validate_prints_the_resolved_job(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path))
    result = scaletrain_cli("validate", str(path), "--set", "optim.lr=3e-4", "--set", "scale.workers=2")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["optim"]["lr"] == pytest.approx(3e-4)
    assert resolved["scale"] == {
        "workers": 2, "engine": "local", "backend": "auto", "address": None, "connect_timeout_s": 60.0,
        "strategy": "auto", "nodes": 1, "rdzv_endpoint": None,
        "threads_per_worker": None, "cpus_per_worker": 1.0, "gpus_per_worker": None,
        "fsdp": {"reshard_after_forward": True, "param_dtype": None, "reduce_dtype": None,
                 "cpu_offload": False, "shard_size": None},
        "activation_checkpointing": False,
    }
    assert resolved["train"]["precision"] == "fp32"


def test_schema_is_json_schema():
    result = scaletrain_cli("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["title"] == "scaletrain job"
    assert "optim" in schema["properties"]


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from scaletrain.cli.main import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_bad_multi_node_input_is_one_line_each(tmp_path):
    path = write_job(tmp_path, toy_job(tmp_path, scale={"workers": 2}))
    cases = {
        ("--node-rank", "1"): "error: --node-rank 1: this job runs on one node (set scale.nodes)",
        ("--nodes", "2"): "scale: 2 nodes need scale.rdzv_endpoint (HOST:PORT of node 0, e.g. "
                          "--rdzv-endpoint 10.0.0.5:29400)",
        ("--nodes", "3", "--rdzv-endpoint", "127.0.0.1:29400"):
            "scale: scale.workers (2) must split evenly over 3 nodes; use a multiple of 3",
        ("--nodes", "1:x"): "scale.nodes: must be a count or MIN:MAX, got '1:x'",
        ("--nodes", "2", "--rdzv-endpoint", "nohost"):
            "scale.rdzv_endpoint: must be HOST:PORT, e.g. 10.0.0.5:29400, got 'nohost'",
        ("--nodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--node-rank", "5"):
            "error: --node-rank 5: this job runs on 2 nodes, ranks 0 to 1",
        ("--set", "scale.backend=nccl"): "error: scale.backend is nccl but this machine has no CUDA device; "
                                         "use auto or gloo",
    }
    for args, message in cases.items():
        result = scaletrain_cli("run", str(path), *args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
    assert not (tmp_path / "runs").exists()


def test_a_node_whose_driver_never_answers_says_so_in_one_line(tmp_path):
    from tests.helpers.servers import free_port

    job = toy_job(tmp_path, scale={"workers": 2, "nodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"},
                  recovery={"node_wait_s": 2})
    result = scaletrain_cli("run", str(write_job(tmp_path, job)), "--node-rank", "1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: nothing answered at {job['scale']['rdzv_endpoint']} (the driver, node 0) within 2 s; "
        "start node 0 first with the same job, and check scale.rdzv_endpoint (recovery.node_wait_s "
        "sets the wait)"]


def test_a_stream_trained_for_epochs_or_evaluated_is_one_line_naming_what_to_set(tmp_path):
    task = {"target": "tests.helpers.tasks:StreamingToyTask", "args": {}}
    job = toy_job(tmp_path, task=task, train={"epochs": 1, "max_steps": None})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = scaletrain_cli("run", str(tmp_path / "job.yaml"))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode != 0 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "train_dataset() returned a stream (Stream), whose length is not known: set train.max_steps" in errors[0]

    job = toy_job(tmp_path, task={**task, "args": {"eval_stream": True}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = scaletrain_cli("run", str(tmp_path / "job.yaml"))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode != 0 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "eval_dataset() returned a ToyStream, which has no len() and [i]" in errors[0]
    assert "map-style" in errors[0]


def test_sigterm_while_the_launcher_starts_ends_the_run_as_interrupted(tmp_path):
    """A SIGTERM before any worker runs (here: the pre-flight waiting on a tracking server that
    took the connection and says nothing) ends the run with its outcome and exit code 143, as
    one while it trains does, not a process gone without a word; nothing is left running."""
    import signal
    import socket
    import subprocess
    import sys

    from tests.helpers.run import REPO, stop_group

    silent = socket.create_server(("127.0.0.1", 0))
    silent.settimeout(120)
    job = write_job(tmp_path, toy_job(tmp_path, tracking={"enabled": True,
                                                          "uri": f"http://127.0.0.1:{silent.getsockname()[1]}"}))
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain", "run", str(job), "--json"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        connection, _ = silent.accept()  # the launcher is in its pre-flight, before any worker
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
        silent.close()
    connection.close()
    assert proc.returncode == 143, err[-2000:]
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["status"] == "failed" and outcome["code"] == "ST-INTERRUPTED"
    assert outcome["error"] == "interrupted by SIGTERM; the workers were stopped"
    assert "Traceback" not in err
