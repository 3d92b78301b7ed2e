"""The Ray engine with nothing shared but checkpoint storage: a Ray cluster of two nodes (Ray's
cluster_utils on this machine: a head with no CPUs, so the workers run on the other node), whose
workers write only into their node's own directory (SCALETRAIN_RAY_NODE_LOCAL, as on another
machine) and are refused any write under the driver's run directory (SCALETRAIN_DENY_WRITES).
The driver's run directory and MLflow run must still be complete; rank 0 is SIGKILLed once and
the job resumes from the local S3 server."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import scaletrain
from tests.helpers.run import REPO, read_metrics
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed
# Not imported here: Ray reads RAY_AUTH_MODE once, at import (test_ray_engine.py's cluster sets it).
if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (pip install 'scaletrain[ray]')", allow_module_level=True)

CLUSTER = """
import json, os, signal, sys
from ray.cluster_utils import Cluster
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
try:
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address}), flush=True)
    signal.pause()
finally:
    cluster.shutdown()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server):
    """A head and one worker node on 127.0.0.1 (the workers see the S3 server and the tests'
    tasks); its address."""
    home = tmp_path_factory.mktemp("ray-home")
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, "the Ray cluster did not start"
        yield {"address": json.loads(line)["address"], "home": str(home)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_rank_0_on_another_node_leaves_the_driver_a_complete_run(tmp_path, cluster):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(
        tmp_path, scale={"workers": 2, "engine": "ray", "cpus_per_worker": 1},
        train={"max_steps": 20, "log_every": 5}, recovery={"max_restarts": 1},
        checkpoint={"dir": "s3://ckpt/ray-nodes", "every_steps": 5},
        tracking={"enabled": True, "uri": uri, "log_model": False, "system_metrics_every_s": 0},
    )
    local = scaletrain.run({**job, "scale": {"workers": 2}, "tracking": {"enabled": False},
                            "checkpoint": {"at_end": False}, "run_dir": str(tmp_path / "local")})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    runs, nodes = tmp_path / "runs", tmp_path / "nodes"
    out = subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", str(job_file), "--address", cluster["address"], "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "HOME": cluster["home"], "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
             "SCALETRAIN_RAY_NODE_LOCAL": "1", "SCALETRAIN_DENY_WRITES": str(runs),
             "SCALETRAIN_NODE_DIR": str(nodes), "SCALETRAIN_FAULT": "sigkill:rank=0:step=12"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)  # stdout is the JSON alone (Ray's cluster messages go to stderr)
    assert summary["weights_sha256"] == local["weights_sha256"]
    assert (summary["restarts"], summary["resumed_from_step"]) == (1, 10)

    run_dir = Path(summary["run_dir"])
    # Rank 0 wrote on its node; every file reached the driver through the engine.
    [node_dir] = list((nodes / summary["run_id"]).iterdir())
    assert (node_dir / "model.safetensors").read_bytes() == (run_dir / "model.safetensors").read_bytes()
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 5, 10, 15, 20]  # the killed rank's step 10 too
    assert (run_dir / "run_card.json").exists()
    log = (run_dir / "logs" / "worker-0.jsonl").read_text()
    assert '"message": "resuming from checkpoint s3://ckpt/ray-nodes/' in log
    assert not list(run_dir.rglob("*.relay"))
    # Every rank's live figures reached the driver's endpoint folder; the restart was counted live.
    telemetry = run_dir / "logs" / "telemetry"
    for rank in (0, 1):
        figures = json.loads((telemetry / f"rank-{rank}.json").read_text())["figures"]
        assert figures["last_step"] == 20, (rank, figures)
    assert json.loads((telemetry / "launcher-0.json").read_text())["figures"]["restarts_total"] == 1
    assert "restarting the workers (start 2) after a worker failure" in (run_dir / "logs" / "launcher.jsonl").read_text()

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 5, 10, 15, 20]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"weights", "logs", "summary.json", "run_card.json"} <= artifacts
