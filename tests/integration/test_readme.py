"""The README is a promise: every command it shows runs as written, from the root of a fresh
checkout (a copy of the tracked files), with its relative paths, and ends without a traceback.

Commands are read out of README.md's bash blocks, so a command added there fails
test_every_readme_command_is_run_here until a test below runs it. Placeholders (RUN,
RUN_DIR, JOB, the example run id, the example addresses) are filled with real values from
earlier commands; long commands are shortened by appending options (``--set``...), never by
moving their paths.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers.run import REPO
from tests.helpers.servers import RayHead, free_port

README = REPO / "README.md"
EXAMPLE_RUN_DIR = "runs/digits/20261202-141500-3fa9c1"

# Run by the tests below (each looks its commands up here, by their README text).
NOT_RUN = {
    "make test": "the suite itself",
}
# The README's examples of what bad input prints; the others are asserted where they are made.
ERRORS_NOT_MADE_HERE = {
    "error: pre-flight: tracking: http://mlflow.internal:5000: user 'ana'": (
        "needs a tracking server with authentication: tests/integration/test_preflight.py"),
}


def readme_blocks(kind: str) -> list[list[str]]:
    """The lines of every fenced block of ``kind`` ("bash"; "" for plain ones)."""
    blocks, current = [], None  # current: a block of this kind's lines, False in another kind
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if current is None:
                current = [] if line.strip() == f"```{kind}" else False
            else:
                if current is not False:
                    blocks.append(current)
                current = None
        elif isinstance(current, list):
            current.append(line)
    return blocks


def readme_commands() -> list[str]:
    """Every command of the bash blocks: comments dropped, continued lines joined."""
    commands, pending = [], ""
    for block in readme_blocks("bash"):
        for line in block:
            line = pending + line.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def readme_errors() -> list[str]:
    return [line for block in readme_blocks("") for line in block if line.startswith("error: ")]


def readme(command: str) -> str:
    """``command`` as the README shows it (failing if it no longer does)."""
    assert command in readme_commands(), f"the README no longer shows {command!r}"
    return command


def fill(command: str, **values: str) -> str:
    """The README's placeholders, by name: RUN, RUN_DIR, JOB, ... (whole words only)."""
    for name, value in sorted(values.items(), key=lambda item: -len(item[0])):
        command = re.sub(rf"(?<![\w/.-]){re.escape(name)}(?![\w/-])", value, command)
    return command


class Checkout:
    """A fresh checkout: the tracked files, and the .venv `make` set up (the one running this)."""

    def __init__(self, root: Path):
        self.root = root
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        for name in filter(None, files.decode().split("\0")):
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target)
        venv = Path(sys.prefix)
        (root / ".venv").symlink_to(venv)
        stamp = venv / ".installed"  # `make` must see its set-up as done: never reinstall into it
        if stamp.exists():
            older = stamp.stat().st_mtime - 60
            os.utime(root / "pyproject.toml", (older, older))

    def env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items()  # a user's shell: nothing the test runner set
               if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH", "SCALETRAIN_FAULT", "COLUMNS")
               and not k.startswith("RAY_")}
        env["PATH"] = f"{self.root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **(extra or {})}

    def run(self, command: str, *shorten: str, code: int = 0, env: dict | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess:
        """``command`` in bash at the checkout's root, ``shorten`` appended; it must end with
        ``code`` and without a traceback."""
        line = " ".join([command, *shorten])
        result = subprocess.run(["bash", "-c", line], cwd=self.root, env=self.env(env),
                                capture_output=True, text=True, timeout=timeout)
        assert result.returncode == code, (line, result.returncode, result.stdout[-2000:], result.stderr[-3000:])
        assert "Traceback" not in result.stderr + result.stdout, (line, result.stderr[-3000:])
        return result

    def start(self, command: str, *shorten: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(["bash", "-c", "exec " + " ".join([command, *shorten])], cwd=self.root,
                                env=self.env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return Checkout(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="module")
def made_run(checkout):
    """`make run` as written: the run the later commands' RUN and RUN_DIR stand for."""
    result = checkout.run(readme("make run"), timeout=280)
    (run_dir,) = (checkout.root / "runs" / "digits").iterdir()
    assert (checkout.root / "mlflow.db").is_file(), "make run tracks into ./mlflow.db"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_size"] == 2, result.stderr[-2000:]
    # The example learns: 0.950, 0.958, 0.967, 0.958 eval accuracy at seeds 0-3 (chance: 0.1).
    assert summary["strategy"] == "ddp" and summary["eval"]["accuracy"] >= 0.94
    return summary


def test_every_readme_command_is_run_here():
    source = re.sub(r'"\s*\n\s*"', "", Path(__file__).read_text(encoding="utf-8"))  # literals joined
    shown = readme_commands()
    assert shown[:2] == ["make run", "make test"], "the README starts with the two commands"
    missing = [c for c in shown if c not in NOT_RUN and f'"{c}' not in source]
    assert missing == [], f"README commands no test runs: {missing}"
    errors = readme_errors()
    assert errors, "the README's bad-input examples were not found"
    for line in errors:
        assert line in source or any(line.startswith(k) for k in ERRORS_NOT_MADE_HERE), line


def test_make_run_then_the_commands_on_its_run(checkout, made_run):
    run_id, run_dir = made_run["run_id"], f"runs/digits/{made_run['run_id']}"
    listed = checkout.run(readme("scaletrain runs"), env={"COLUMNS": "80"})
    assert any(line.startswith(f"{run_id} ") and "finished" in line for line in listed.stdout.splitlines()), listed.stdout
    shown = json.loads(checkout.run(fill(readme("scaletrain show RUN"), RUN=run_id)).stdout)
    assert shown["name"] == run_id and shown["status"] == "FINISHED"
    reported = checkout.run(fill(readme("scaletrain report RUN"), RUN=run_id))
    assert reported.stdout.strip() == (f"report: reports/{run_id}/report.html (4 plots; attached to MLflow run "
                                       f"{made_run['mlflow_run_id']} as report/report.html)"), reported.stdout
    assert (checkout.root / "reports" / run_id / "report.html").is_file()

    # A finished run: one line, nothing changed (no MLflow attempt: its end time stays).
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{checkout.root / 'mlflow.db'}")
    before = client.get_run(made_run["mlflow_run_id"]).info
    resumed = checkout.run(fill(readme("scaletrain resume runs/digits/20261202-141500-3fa9c1"), **{EXAMPLE_RUN_DIR: run_dir}))
    assert resumed.stdout.strip() == (f"run {run_id} finished at step {made_run['steps']}: nothing to resume "
                                      "(to train it longer, pass --set train.epochs=N)"), resumed.stdout
    after = client.get_run(made_run["mlflow_run_id"])
    assert (after.info.end_time, after.info.status) == (before.end_time, before.status)
    assert after.data.tags["scaletrain.attempts"] == "1"

    listed = json.loads(checkout.run(fill(readme("scaletrain checkpoints ls RUN_DIR"), RUN_DIR=run_dir),
                                     "--json").stdout)
    assert {row["status"] for row in listed} == {"committed"} and listed[-1]["step"] == made_run["steps"], listed
    checkout.run(fill(readme("scaletrain checkpoints verify RUN_DIR"), RUN_DIR=run_dir))

    again = checkout.run(fill(readme("scaletrain reproduce RUN"), RUN=run_id), timeout=280)
    assert "final weights match bit for bit" in again.stdout + again.stderr, again.stderr[-2000:]


def test_the_run_and_inspect_commands(checkout):
    short = ("--set", "train.epochs=1")
    checkout.run(readme("scaletrain run examples/digits.yaml"), *short)
    checkout.run(readme("scaletrain run examples/digits.yaml --set optim.lr=1e-3 --set scale.workers=1"), *short)
    gpt = checkout.run(readme("scaletrain run examples/tiny_gpt.yaml --json"), "--set", "train.max_steps=10")
    assert json.loads(gpt.stdout)["steps"] == 10
    fsdp = checkout.run(readme("scaletrain run examples/tiny_gpt.yaml --set scale.strategy=fsdp"),
                        "--set", "train.max_steps=10", "--json")
    assert json.loads(fsdp.stdout)["strategy"] == "fsdp"
    checkout.run(readme("scaletrain validate examples/digits.yaml"))
    checkout.run(readme("scaletrain check examples/digits.yaml"))
    checkout.run(readme("scaletrain schema > job.schema.json"))
    assert "task" in json.loads((checkout.root / "job.schema.json").read_text())["properties"]
    planned = checkout.run(readme("scaletrain plan examples/tiny_gpt.yaml"))
    assert "recommendation: " in planned.stdout, planned.stdout[-2000:]
    checkout.run(readme("scaletrain plan --layers 32 --hidden 4096 --heads 32 --seq 4096 --gpu H100 --devices-per-node 8"))


def test_a_loop_and_a_script(checkout):
    loop = checkout.run(readme("scaletrain run examples/digits_loop.yaml"), "--set", "loop.args.steps=40",
                        "--set", "train.max_steps=40", "--json")
    summary = json.loads(loop.stdout)
    assert summary["steps"] == 40 and summary["strategy"] == "ddp" and summary["eval"]["accuracy"] > 0.5
    # Shorter: a later --epochs wins in the script's argparse.
    script = checkout.run(readme("scaletrain launch --workers 2 --max-restarts 2 examples/digits_torchrun.py -- "
                                 "--epochs 5"), "--epochs", "1")
    assert "epoch 0 step 29 loss" in script.stdout and "digits_torchrun finished" in script.stdout


def test_a_keras_job(checkout):
    keras = checkout.run(readme("scaletrain run examples/digits_keras.yaml"), "--set", "train.epochs=3", "--json")
    summary = json.loads(keras.stdout)
    assert (summary["strategy"], summary["world_size"]) == ("mirrored", 2) and summary["eval"]["accuracy"] > 0.9
    planned = checkout.run(readme("scaletrain plan examples/digits_keras.yaml"))
    assert "mirrored" in planned.stdout and "recommendation: " in planned.stdout, planned.stdout[-2000:]


def test_the_bad_input_examples_print_what_the_readme_shows(checkout):
    job = checkout.root / "examples" / "digits.yaml"
    original = job.read_text()
    try:
        for edited, line in [
            (original.replace("lr: 3.0e-3", "lrr: 3.0e-3"),
             "error: examples/digits.yaml: optim.lrr: unknown key; did you mean 'lr'?"),
            (original.replace("lr: 3.0e-3", "lr: fast"),
             'error: examples/digits.yaml: optim.lr: must be a positive number, got "fast"'),
        ]:
            assert edited != original
            job.write_text(edited)
            result = checkout.run(readme("scaletrain run examples/digits.yaml"), code=2)
            assert result.stderr.strip().splitlines() == [line]
    finally:
        job.write_text(original)


def test_the_ui(checkout, made_run):
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 5000)) == 0:
            pytest.fail("port 5000 is taken on this machine: `scaletrain ui` (README) needs it free")
    proc = checkout.start(readme("scaletrain ui"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                with urllib.request.urlopen("http://127.0.0.1:5000/health", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the UI did not answer on 127.0.0.1:5000"
                time.sleep(0.5)
    finally:
        stop(proc)
    assert "Traceback" not in proc.stderr.read()


def needs_ray() -> None:
    # Not imported here: Ray reads its settings once, at import; scaletrain runs in its own process.
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')")


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head` on this machine, its token in its user's ~/.ray: what
    `--address 10.0.0.5:6379` stands for."""
    needs_ray()
    head = RayHead()
    try:
        yield head.start()
    finally:
        head.stop()


def test_the_ray_engine(checkout):
    needs_ray()
    short = ("--set", "train.epochs=1", "--json")
    local = checkout.run(readme("scaletrain run examples/digits.yaml --engine ray"), *short, timeout=280)
    assert json.loads(local.stdout)["engine"] == "ray"


def test_a_running_ray_cluster(checkout, ray_head):
    command = fill(readme("scaletrain run examples/digits.yaml --engine ray --address 10.0.0.5:6379"),
                   **{"10.0.0.5:6379": f"127.0.0.1:{ray_head.port}"})
    joined = checkout.run(command, "--set", "train.epochs=1", "--json", timeout=280,
                          env={"HOME": str(ray_head.home), "RAY_USAGE_STATS_ENABLED": "0"})
    assert json.loads(joined.stdout)["engine"] == "ray"


@pytest.mark.parametrize("command", [
    "scaletrain tune examples/digits.yaml --space examples/spaces/digits.yaml --trials 8",
    "scaletrain tune examples/digits.yaml --space examples/spaces/digits.yaml --trials 8 --max-concurrent 2 "
    "--metric eval/accuracy --mode max --search optuna --scheduler asha",
])
def test_the_searches(checkout, command):
    needs_ray()
    # Shorter: 2 trials of 10 steps on one worker each (a later --trials wins).
    result = checkout.run(readme(command), "--trials", "2", "--set", "train.epochs=null", "--set",
                          "train.max_steps=10", "--set", "scale.workers=1", "--json", timeout=280)
    summary = json.loads(result.stdout)
    assert [row["status"] for row in summary["trials"]] == ["finished", "finished"], summary["trials"]
    assert Path(summary["search_dir"]).is_relative_to(checkout.root / "runs" / "tune" / "digits")


def test_the_metrics_endpoint_and_the_alert_rules(checkout):
    run = checkout.start(readme("scaletrain run examples/digits.yaml --metrics-port 9464"))
    served, deadline = "", time.monotonic() + 120
    try:
        # Until both ranks' figures are served (each rank rewrites its file at most once a second).
        while (run.poll() is None and time.monotonic() < deadline
               and 'scaletrain_steps_total{rank="1"}' not in served):
            try:
                served = urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
        out, err = run.communicate(timeout=240)
    finally:
        stop(run)
    assert run.returncode == 0, err[-3000:]
    assert 'scaletrain_steps_total{rank="1"}' in served and "scaletrain_run_info{" in served, served[:2000]
    if shutil.which("promtool") or os.environ.get("CI") == "true":  # make test installs it
        tested = checkout.run(readme("promtool test rules deploy/prometheus/alerts_test.yml"))
        assert "SUCCESS" in tested.stdout


def test_verify_resume(checkout):
    result = checkout.run(readme("scaletrain verify-resume examples/digits.yaml"), timeout=280)
    assert "PASS" in result.stdout, result.stdout + result.stderr[-2000:]


def test_two_machines_on_object_storage(checkout, s3_server, tmp_path):
    """The two launchers of "Several machines" on this machine (10.0.0.5 is 127.0.0.1), each in
    its own checkout as on two machines (no shared disk), checkpoints in the moto S3 server;
    then `checkpoints ls` on the bucket."""
    other = Checkout(tmp_path / "machine-2")
    for machine in (checkout, other):
        digits = yaml.safe_load((machine.root / "examples" / "digits.yaml").read_text())
        digits["task"]["target"] = "examples.digits:DigitsTask"  # job.yaml is at the root
        (machine.root / "job.yaml").write_text(yaml.safe_dump(digits))
    endpoint = f"127.0.0.1:{free_port()}"
    short = ("--set", "train.epochs=1", "--json")
    nodes = [
        checkout.start(fill(readme("scaletrain run job.yaml --nodes 2 --rdzv-endpoint 10.0.0.5:29400 "
                                   "--set checkpoint.dir=s3://ckpt/runs"), **{"10.0.0.5:29400": endpoint}), *short),
        other.start(fill(readme("scaletrain run job.yaml --nodes 2 --rdzv-endpoint 10.0.0.5:29400 "
                                "--set checkpoint.dir=s3://ckpt/runs --node-rank 1"),
                         **{"10.0.0.5:29400": endpoint}), *short),
    ]
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:  # both read at once: neither pipe fills
            outputs = list(pool.map(lambda proc: proc.communicate(timeout=240), nodes))
    finally:
        for proc in nodes:
            stop(proc)
    for rank, (proc, (_out, err)) in enumerate(zip(nodes, outputs)):
        assert proc.returncode == 0 and "Traceback" not in err, (f"node {rank}", err[-3000:])
    driver = json.loads(outputs[0][0])
    assert driver["world_size"] == 2 and driver["status"] == "finished"
    listed = checkout.run(fill(readme("scaletrain checkpoints ls s3://bucket/prefix/JOB/RUN"),
                               **{"s3://bucket/prefix/JOB/RUN": f"s3://ckpt/runs/digits/{driver['run_id']}"}), "--json")
    rows = json.loads(listed.stdout)
    assert rows and {row["status"] for row in rows} == {"committed"}, rows


def test_data_in_shards_on_disk_on_s3_and_as_a_stream(checkout, s3_server):
    short = ("--set", "train.max_steps=40", "--json")
    local = json.loads(checkout.run(readme("scaletrain run examples/shards/job.yaml"), *short).stdout)
    assert local["status"] == "finished" and local["steps"] == 40 and local["world_size"] == 2
    assert (checkout.root / "examples" / "shards" / "data" / "train" / "index.json").is_file()
    bucket = {"s3://my-bucket/corpus": "s3://ckpt/corpus"}
    wrote = checkout.run(fill(readme("python examples/shards/corpus.py s3://my-bucket/corpus"), **bucket))
    assert wrote.stdout.strip() == "wrote 16384 + 1024 sequences of 33 tokens to s3://ckpt/corpus"
    again = checkout.run(fill(readme("python examples/shards/corpus.py s3://my-bucket/corpus"), **bucket), code=1)
    assert again.stderr.strip() == "error: s3://ckpt/corpus already holds a corpus; delete it to write it again"
    remote = json.loads(checkout.run(fill(readme(
        "scaletrain run examples/shards/job.yaml --set task.args.location=s3://my-bucket/corpus"), **bucket),
        *short).stdout)
    # The same corpus, seed and order: the same weights from the bucket as from the disk.
    assert remote["weights_sha256"] == local["weights_sha256"]
    checked = checkout.run(readme("scaletrain verify-resume examples/shards/job.yaml --set task.args.stream=true"),
                           timeout=280)
    assert "PASS" in checked.stdout, checked.stdout + checked.stderr[-2000:]
    # The Hugging Face stream resumed from its state_dict(), not by skipping.
    assert "has no state_dict()" not in checked.stderr and "from its saved state" in checked.stderr
