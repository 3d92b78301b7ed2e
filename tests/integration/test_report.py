"""`scaletrain report`: the page of a run that restarted once (2 real workers, a SIGKILL) renders
in a real headless Chromium with its plots, says the restart, the resume and the checkpoints, and
is attached to the MLflow run; a tune search's page puts its trials side by side."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from scaletrain.recovery.faults import FAULT_ENV
from scaletrain.run_report.build import write_report
from tests.helpers.run import REPO, scaletrain_cli
from tests.helpers.servers import require_tool
from tests.helpers.tasks import toy_job

pytestmark = pytest.mark.distributed

TAB_BLUE = (0x1F / 255, 0x77 / 255, 0xB4 / 255)  # matplotlib's first colour: the bars and lines


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    browser = require_tool("chromium", "chromium")
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
         *args, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120)


def blue_pixels(png: Path) -> int:
    from matplotlib.image import imread

    pixels = imread(str(png))[..., :3]
    close = (abs(pixels - TAB_BLUE) < 0.04).all(axis=-1)
    return int(close.sum())


def test_the_report_of_a_restarted_run_renders_in_a_browser_and_is_attached(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = toy_job(tmp_path, train={"max_steps": 30, "log_every": 1, "eval_every": 10},
                  checkpoint={"every_steps": 10}, scale={"workers": 2},
                  recovery={"max_restarts": 1, "grace_period_s": 20},
                  tracking={"enabled": True, "uri": uri, "experiment": "report", "log_model": False})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    ran = scaletrain_cli("run", "job.yaml", "--json", cwd=tmp_path, env={FAULT_ENV: "sigkill:rank=1:step=15", "PYTHONPATH": str(REPO)})
    assert ran.returncode == 0, ran.stderr[-3000:]
    outcome = json.loads(ran.stdout)
    assert outcome["restarts"] == 1 and outcome["resumed_from_step"] == 10
    # Goodput: the steps redone after the restart are counted as such, the parts add up.
    spent = outcome["goodput"]
    assert 0 < spent["ratio"] < 1 and spent["redone_s"] > 0
    assert 0 < spent["startup_s"] < outcome["time_to_first_step_s"]  # the first attempt's, not the restart's
    parts = sum(spent[k] for k in ("productive_s", "startup_s", "checkpoint_stall_s", "redone_s", "other_s"))
    assert parts == pytest.approx(outcome["wall_time_s"], abs=0.01)
    # The job's figures as it ended, on the MLflow run beside train/ and eval/.
    ended = MlflowClient(uri).get_run(outcome["mlflow_run_id"]).data.metrics
    assert ended["system/restarts_total"] == 1 and ended["system/goodput"] == spent["ratio"]
    assert (ended["system/work_total/attempt"], ended["system/errors_total/attempt"]) == (2, 1)
    # (a killed attempt's last second of figures may be lost: they are figures, not records)
    assert ended["system/checkpoint_save_seconds/count"] >= 2 and ended["system/evals_total"] >= 2

    # In this process (what `scaletrain report RUN --out report --json` prints; the command itself is
    # run for a search below): its code is then counted by the suite's coverage.
    monkeypatch.chdir(tmp_path)
    written = write_report(uri, outcome["run_id"], Path("report"))
    page = tmp_path / "report" / "report.html"
    assert written["report"] == "report/report.html" and page.is_file()
    assert [Path(p).name for p in written["images"]] == ["curves.png", "ranks.png", "speed.png", "timeline.png"]
    # Attached to the run, page and plots.
    attached = sorted(a.path for a in MlflowClient(uri).list_artifacts(outcome["mlflow_run_id"], "report"))
    assert attached == ["report/curves.png", "report/ranks.png", "report/report.html", "report/speed.png",
                        "report/timeline.png"]

    # What a browser makes of it: the DOM after load, and a screenshot.
    dom = chromium(page, tmp_path / "profile", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count('src="data:image/png;base64,') == 4
    for section in ("Loss and evaluation", "Progress, restarts and checkpoints over time", "Speed", "Per rank",
                    "Alerts", "Events", "Run card", "Parameters"):
        assert f"<h2>{section}</h2>" in html, section
    events = html.split("<h2>Events</h2>")[1].split("</table>")[0]
    assert events.count("<td>checkpoint</td>") == 3  # step 10; killed at 15, resumed from 10; 20, 30
    assert "<td>restart</td>" in events and "restarting the workers after worker rank 1 failed" in events
    assert "resumed from the checkpoint of step 10" in events
    per_rank = html.split("<h2>Per rank</h2>")[1].split("</table>")[0]
    assert per_rank.count("<tr>") == 3  # the header and ranks 0, 1
    screenshot = tmp_path / "report.png"
    shot = chromium(page, tmp_path / "profile", "--window-size=1200,4200", "--hide-scrollbars",
                    f"--screenshot={screenshot}")
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    # The plots were drawn on the page (a broken image leaves its alt text, no coloured pixels).
    assert blue_pixels(screenshot) > 5000


def test_a_search_report_puts_its_trials_side_by_side(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("search")
    parent = client.create_run(experiment, run_name="tune lr", tags={"scaletrain.tune": "search"})
    parent_id = parent.info.run_id
    for key, value in {"metric": "eval/loss", "mode": "min", "space": json.dumps({"optim.lr": {"loguniform": [1e-4, 1e-1]}})}.items():
        client.log_param(parent_id, key, value)
    for number, (lr, final) in enumerate([(0.1, 0.9), (0.01, 0.3), (0.001, 0.6)]):
        trial = client.create_run(experiment, run_name=f"trial-{number}", tags={
            "mlflow.parentRunId": parent_id, "scaletrain.tune.trial": f"trial_0000{number}",
            **({"scaletrain.tune.best": "true"} if number == 1 else {})})
        client.log_param(trial.info.run_id, "optim.lr", lr)
        for step in (10, 20, 30):
            client.log_metric(trial.info.run_id, "eval/loss", final + (30 - step) / 10, step=step)
        client.set_terminated(trial.info.run_id, "FINISHED" if number != 2 else "FAILED")
    client.set_terminated(parent_id)

    made = scaletrain_cli("report", parent_id, "--uri", uri, "--out", "search", "--no-attach", cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.strip() == "report: search/report.html (1 plots)"
    html = (tmp_path / "search" / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 1 and (tmp_path / "search" / "trials.png").is_file()
    table = html.split("<h2>Trials side by side</h2>")[1].split("</table>")[0]
    assert table.count('<tr class="best">') == 1 and "trial_00001" in table.split('<tr class="best">')[1]
    assert "<td>FAILED</td>" in table and table.count("<tr") == 4
    assert "<td>best trial</td><td>trial_00001</td>" in html
    assert client.list_artifacts(parent_id) == []  # --no-attach


def test_report_of_a_run_that_is_not_there_says_so_in_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("empty")
    made = scaletrain_cli("report", "nosuchrun", "--uri", uri, cwd=tmp_path)
    assert made.returncode == 2
    assert made.stderr.strip().splitlines() == [
        f"error: no run 'nosuchrun' at {uri}; list them with: scaletrain runs"]
