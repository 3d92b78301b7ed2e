"""The Ray engine on a real two-node Ray cluster on this machine (a head and a second node,
separate raylet processes with one CPU each, so a 2-worker job puts one worker on each).

The same job must give the same final weights as the local engine, and a worker killed
mid-run must be recovered from the newest verified checkpoint with the same weights.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scaletrain
from scaletrain.errors import WorkerFailedError
from scaletrain.recovery.faults import FAULT_ENV
from tests.helpers.loops import loop_job
from tests.helpers.run import REPO, read_metrics, scaletrain_cli
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

# Not imported here: Ray reads RAY_AUTH_MODE once, at import, and the cluster fixture sets it.
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)


def ray_job(root, **sections):
    base = {
        "task": {"args": {"dropout": 0.1}},
        "train": {"max_steps": 30, "log_every": 1, "eval_every": 15},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "scale": {"workers": 2},
        "recovery": {"max_restarts": 1},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return toy_job(root, **base)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """Two Ray nodes (head + worker node), one CPU each, token authentication on (the token
    is in this process's environment, as a user joining such a cluster would have it)."""
    import secrets

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "token")
    patch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
    patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        patch.undo()
        # Ray's test cluster leaves its address for a later bare ray.init() to join: not ours.
        Path("/tmp/ray/ray_current_cluster").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """The same job under the local engine (torch elastic), uninterrupted."""
    return scaletrain.run(ray_job(tmp_path_factory.mktemp("local")))


def worker_nodes(summary):
    nodes = {}
    for rank in (0, 1):
        log = Path(summary["run_dir"]) / "logs" / f"worker-{rank}.jsonl"
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry["message"] == "worker started":
                nodes[rank] = entry["node"]
    return nodes


def test_two_nodes_give_the_local_engines_weights(tmp_path, ray_cluster, local_reference):
    job = ray_job(tmp_path, scale={"engine": "ray", "address": ray_cluster.address})
    summary = scaletrain.run(job)
    assert summary["engine"] == "ray" and summary["status"] == "finished"
    assert summary["steps"] == 30 and summary["restarts"] == 0
    assert summary["weights_sha256"] == local_reference["weights_sha256"]
    assert summary["eval"] == local_reference["eval"]
    nodes = worker_nodes(summary)
    assert len(set(nodes.values())) == 2, nodes  # one worker on each node
    assert [row["step"] for row in read_metrics(summary["run_dir"])] == list(range(1, 31))


def test_a_users_loop_on_two_ray_nodes_gives_the_local_engines_weights(tmp_path, ray_cluster):
    local = scaletrain.run(loop_job(tmp_path / "local", train={"max_steps": 30}, loop={"args": {"steps": 30}}))
    on_ray = scaletrain.run(loop_job(tmp_path / "ray", train={"max_steps": 30}, loop={"args": {"steps": 30}},
                                     scale={"engine": "ray", "address": ray_cluster.address}))
    assert on_ray["engine"] == "ray" and on_ray["steps"] == 30 and on_ray["strategy"] == "ddp"
    assert on_ray["weights_sha256"] == local["weights_sha256"] != ""
    assert len(set(worker_nodes(on_ray).values())) == 2
    assert [row["step"] for row in read_metrics(on_ray["run_dir"])] == list(range(1, 31))


def test_a_tensorflow_job_on_two_ray_nodes_gives_the_local_engines_weights(tmp_path, ray_cluster):
    """TF_CONFIG set on our Ray workers (swapped over their gloo group), not Ray's TensorflowTrainer:
    the same worker, runner, checkpoints and recovery as the local engine."""
    from tests.helpers.keras_jobs import keras_job

    local = scaletrain.run(keras_job(tmp_path / "local", train={"max_steps": 20, "eval_every": 10}))
    on_ray = scaletrain.run(keras_job(tmp_path / "ray", train={"max_steps": 20, "eval_every": 10},
                                      scale={"engine": "ray", "address": ray_cluster.address}))
    assert on_ray["engine"] == "ray" and on_ray["steps"] == 20 and on_ray["strategy"] == "mirrored"
    assert on_ray["weights_sha256"] == local["weights_sha256"] != ""
    assert on_ray["eval"] == local["eval"]
    assert len(set(worker_nodes(on_ray).values())) == 2
    assert [row["step"] for row in read_metrics(on_ray["run_dir"])] == [1, 10, 20]


def test_a_killed_worker_is_recovered_from_the_newest_checkpoint(tmp_path, monkeypatch, ray_cluster, local_reference):
    job = ray_job(tmp_path, scale={"engine": "ray", "address": ray_cluster.address})
    monkeypatch.setenv(FAULT_ENV, "sigkill:rank=1:step=25")
    summary = scaletrain.run(job)
    assert summary["restarts"] == 1 and summary["resumed_from_step"] == 20
    assert summary["weights_sha256"] == local_reference["weights_sha256"]
    assert [row["step"] for row in read_metrics(summary["run_dir"])] == list(range(1, 31))
    # Counted while it ran (the endpoint, the alerts), not only in the summary.
    logs = Path(summary["run_dir"]) / "logs"
    assert json.loads((logs / "telemetry" / "launcher-0.json").read_text())["figures"]["restarts_total"] == 1
    assert (logs / "launcher.jsonl").read_text().count("restarting the workers (start 2) after a worker failure") == 1


def test_a_hang_under_ray_is_dumped_ended_and_restarted(tmp_path, monkeypatch, ray_cluster, local_reference):
    """The hang watchdog runs in Ray's workers as in torch elastic's: rank 1 stops making
    progress at step 25, its stacks are dumped after hang_timeout_s, the attempt ends and the
    workers restart from step 20's checkpoint, to the local engine's weights."""
    job = ray_job(tmp_path, scale={"engine": "ray", "address": ray_cluster.address}, recovery={"hang_timeout_s": 8})
    monkeypatch.setenv(FAULT_ENV, "hang:rank=1:step=25")
    started = time.monotonic()
    summary = scaletrain.run(job)
    assert (summary["restarts"], summary["resumed_from_step"]) == (1, 20)
    assert summary["weights_sha256"] == local_reference["weights_sha256"]
    assert time.monotonic() - started < 8 + 120, "the hang was ended by the watchdog, not by a timeout"
    stacks = list(Path(summary["run_dir"]).rglob("worker-1.stacks.txt"))
    assert stacks, sorted(p.name for p in Path(summary["run_dir"]).rglob("*"))
    text = stacks[0].read_text()
    assert "Timeout (0:00:08)!" in text and "_fire" in text  # the hung frame is in the dump
    peer = list(Path(summary["run_dir"]).rglob("worker-0.stacks.txt"))  # dumped too, in the grace
    assert peer and "Timeout (0:00:08)!" in peer[0].read_text()


def test_a_failing_rank_is_named(tmp_path, monkeypatch, ray_cluster):
    job = ray_job(tmp_path, scale={"engine": "ray", "address": ray_cluster.address}, recovery={"max_restarts": 0})
    monkeypatch.setenv(FAULT_ENV, "raise:rank=1:step=5")
    with pytest.raises(WorkerFailedError) as info:
        scaletrain.run(job)
    assert str(info.value).startswith("worker rank 1 failed: RuntimeError: injected fault at step 5 on rank 1")


def test_sigterm_to_the_launcher_stops_the_ray_workers_at_a_checkpoint_then_resume(
    tmp_path, ray_cluster, local_reference, processes
):
    """Preemption on a cluster: the launcher relays the stop to the workers, which agree on a
    step and checkpoint (exit 75); `scaletrain resume` continues on the cluster, same weights."""
    import yaml

    # Rank 0's metrics reach the driver's run directory up to half a second late, and the stop
    # takes another second or so to reach the workers (more on a loaded machine): 0.25 s steps,
    # and the signal at step 4, leave the run 6 s to stop before it would end on its own.
    job = ray_job(tmp_path, task={"args": {"dropout": 0.1, "step_sleep": 0.25}},
                  scale={"engine": "ray", "address": ray_cluster.address})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    launcher = processes(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline, reported = time.time() + 180, False
    while time.time() < deadline and not reported:  # step 4 reported: preempt
        found = list((tmp_path / "runs" / "toy").glob("*/metrics.jsonl"))
        reported = bool(found) and len(found[0].read_text().splitlines()) >= 4
        time.sleep(0.2)
    assert reported
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 75, err[-3000:]
    preempted = json.loads(out)
    assert preempted["status"] == "preempted" and 4 <= preempted["steps"] < 30
    run_dir = preempted["run_dir"]
    assert f"continue with: scaletrain resume {run_dir}" in err

    done = scaletrain_cli("resume", run_dir, "--json", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["engine"] == "ray" and summary["resumed_from_step"] == preempted["steps"]
    assert summary["weights_sha256"] == local_reference["weights_sha256"]
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, 31))


def test_a_local_ray_instance_is_started_and_stopped(tmp_path):
    """No address: a Ray instance for this run only, on loopback, with token authentication
    and no dashboard (a fresh interpreter: Ray reads these settings when it is imported)."""
    job_file = tmp_path / "job.yaml"
    job = ray_job(tmp_path, scale={"engine": "ray", "workers": 1}, train={"max_steps": 5, "eval_every": 5})
    job_file.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # not the cluster's
    out = subprocess.run([sys.executable, "-m", "scaletrain", "run", str(job_file), "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["engine"] == "ray" and summary["steps"] == 5
    started = [
        json.loads(line) for line in (Path(summary["run_dir"]) / "logs" / "launcher.jsonl").read_text().splitlines()
        if '"started a local Ray instance"' in line
    ]
    assert len(started) == 1
    assert started[0]["ray_node_ip"] == "127.0.0.1" and started[0]["ray_address"].startswith("127.0.0.1:")
    assert started[0]["ray_auth_mode"] == "token" and started[0]["ray_dashboard"] is None


def test_without_ray_the_engine_names_the_extra(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(ray_job(tmp_path, scale={"workers": 1})))
    hide_ray = (
        "import sys; sys.modules['ray'] = None; "
        "from scaletrain.cli.main import entrypoint; sys.argv = ['scaletrain', 'run', "
        f"{str(job)!r}, '--engine', 'ray']; entrypoint()"
    )
    out = subprocess.run([sys.executable, "-c", hide_ray], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: the ray engine needs Ray Train, which is not installed: pip install 'scaletrain[ray]'"
    ]
