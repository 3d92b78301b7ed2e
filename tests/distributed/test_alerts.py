"""The built-in alerts, evaluated by the launcher without Prometheus, on 2 real workers whose
dataset raises on 10% of its samples (data.on_error: skip): the error-rate alert fires, says so
in the log, posts to the webhook (a local HTTP server; its URL, a secret, is masked
everywhere), and with action: stop the run stops at an agreed step with a checkpoint; resume
goes on to the end, the alerts on the MLflow run's tags."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import yaml
from mlflow import MlflowClient

from tests.helpers.run import scaletrain_cli
from tests.helpers.tasks import toy_job

TOKEN = "hook-token-5a7c91e4"


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802  http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append({"path": self.path, "body": json.loads(body)})
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_alert_fires_posts_its_webhook_and_stops_the_run_with_a_checkpoint(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(tmp_path, task={"args": {"bad_every": 10, "step_sleep": 0.02}}, data={"on_error": "skip"},
                  train={"max_steps": 300, "log_every": 5}, scale={"workers": 2},
                  tracking={"enabled": True, "uri": uri, "log_model": False},
                  observability={"alerts": {"every_s": 0.5, "error_rate": {"action": "stop"}}})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    env = {"SCALETRAIN_ALERT_WEBHOOK_URL": f"http://127.0.0.1:{server.server_port}/hooks/{TOKEN}"}
    try:
        stopped = scaletrain_cli("run", str(job_file), "--json", env=env)
        # Stopped by its own alert, at a step every rank agreed on, with a checkpoint of it.
        assert stopped.returncode == 75, stopped.stderr[-3000:]
        outcome = json.loads(stopped.stdout)
        step = outcome["steps"]
        assert outcome["status"] == "preempted" and 0 < step < 300 and outcome["checkpoint_step"] == step
        errors = [line for line in stopped.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(
            "error: preempted by alert ScaletrainErrorRateHigh (sample errors are "), errors
        assert f"at step {step}; checkpoint of step {step} saved; continue with: scaletrain resume" in errors[0]
        run_dir = Path(outcome["run_dir"])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped_by"] == "ScaletrainErrorRateHigh"
        (fired,) = summary["alerts"]
        assert (fired["alert"], fired["labels"], fired["action"]) == ("ScaletrainErrorRateHigh", {"kind": "sample"}, "stop")
        assert 0.05 < fired["value"] < 0.2
        said = [json.loads(line) for line in (run_dir / "logs" / "launcher.jsonl").read_text().splitlines()]
        alert_lines = [r for r in said if r["message"].startswith("alert ScaletrainErrorRateHigh: sample errors are")]
        assert [r["level"] for r in alert_lines] == ["error"] and alert_lines[0]["labels"] == {"kind": "sample"}
        posted = [h["body"] for h in _Hook.received if h["body"]["status"] == "firing"]
        assert [(p["alert"], p["labels"], p["run_id"]) for p in posted] == [
            ("ScaletrainErrorRateHigh", {"kind": "sample"}, summary["run_id"])]
        # Resumed with the alert only warning, the run goes on to the end.
        resumed = scaletrain_cli("resume", str(run_dir), "--json", "--set",
                                 "observability.alerts.error_rate.action=warn", env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        final = json.loads(resumed.stdout)
        assert final["status"] == "finished" and final["steps"] == 300 and final["resumed_from_step"] == step
        assert [a["action"] for a in final["alerts"]] == ["warn"]
    finally:
        server.shutdown()
        server.server_close()
    tags = MlflowClient(uri).get_run(final["mlflow_run_id"]).data.tags
    assert tags["scaletrain.alerts"] == "ScaletrainErrorRateHigh"
    # The webhook's URL is a secret: in no file of the run and on no console.
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and p != job_file and TOKEN.encode() in p.read_bytes()]
    assert leaked == [] and TOKEN not in stopped.stdout + stopped.stderr + resumed.stdout + resumed.stderr
