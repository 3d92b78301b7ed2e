"""The shipped alert rules and dashboard against real tools: promtool's own rule tests, and a real
Prometheus on loopback scraping a running job whose dataset raises on 10% of its samples
(data.on_error: skip) until the error-rate alert fires."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import yaml

from tests.helpers.run import REPO
from tests.helpers.servers import PrometheusServer, free_port, require_tool
from tests.helpers.tasks import toy_job

RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "scaletrain-dashboard.json"


def test_the_alert_rules_pass_promtools_checks_and_their_tests():
    promtool = require_tool("promtool", "prometheus")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", str(RULES.with_name("alerts_test.yml"))],
                            capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def _errors_seen(url: str) -> bool:
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return False
    return any(line.startswith('scaletrain_errors_total{kind="sample"}') and float(line.split()[-1]) > 0
               for line in text.splitlines())


def _firing(prometheus: PrometheusServer, name: str) -> list[dict]:
    return [a for a in prometheus.api("alerts")["data"]["alerts"] if a["labels"]["alertname"] == name
            and a["state"] == "firing"]


def test_prometheus_scrapes_a_running_job_and_its_error_rate_alert_fires(tmp_path):
    port = free_port()
    job = toy_job(tmp_path, task={"args": {"bad_every": 10, "step_sleep": 0.05}}, data={"on_error": "skip"},
                  train={"max_steps": 400, "log_every": 5}, scale={"workers": 2})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    prometheus = PrometheusServer(tmp_path, [f"127.0.0.1:{port}"], [RULES]).start()
    run = subprocess.Popen([sys.executable, "-m", "scaletrain", "run", str(job_file), "--metrics-port", str(port),
                            "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        endpoint = f"http://127.0.0.1:{port}/metrics"
        first_error = fired = None
        deadline = time.monotonic() + 120
        while fired is None and run.poll() is None and time.monotonic() < deadline:
            if first_error is None and _errors_seen(endpoint):
                first_error = time.monotonic()
            if first_error is not None and (alerts := _firing(prometheus, "ScaletrainErrorRateHigh")):
                fired = time.monotonic()
            time.sleep(0.2)
        assert fired is not None, f"no alert while the job ran: {prometheus.api('alerts')}"
        print(f"error-rate alert firing {fired - first_error:.1f} s after the first error was served")
        assert [a["labels"]["kind"] for a in alerts] == ["sample"]  # not the steps: none skipped
        assert 0.05 < float(alerts[0]["value"]) < 0.2  # 1 sample in 10 raises
        assert alerts[0]["annotations"]["summary"] == "sample error rate above 5%"
        # Every dashboard query is valid PromQL against the live data; the main ones have data.
        panels = json.loads(DASHBOARD.read_text())["panels"]
        empty = []
        for panel in panels:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m").replace('"$job"', '".+"')
                answer = prometheus.api("query", query=expr)
                assert answer["status"] == "success", (panel["title"], answer)
                if not answer["data"]["result"]:
                    empty.append(panel["title"])
        assert not {"Throughput (samples/s)", "Error rate by kind (alert above 5%)",
                    "Step time per rank (median, p90)", "Last step per rank"} & set(empty), empty
    finally:
        out, err = run.communicate(timeout=120)
        prometheus.stop()
    summary = json.loads(out.strip().splitlines()[-1])
    assert run.returncode == 0 and summary["status"] == "finished", err[-3000:]
    assert summary["metrics_url"] == f"http://127.0.0.1:{port}/metrics"
