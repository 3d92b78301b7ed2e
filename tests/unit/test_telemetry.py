"""Each process's share of the live figures, and the launcher's collector that adds them up, read
back through prometheus-client's own parser (what Prometheus reads)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scaletrain.observe.catalog import FIGURES, STEP_BUCKETS
from scaletrain.observe.exporter import MetricsEndpoint
from scaletrain.observe.telemetry import Telemetry, TelemetrySink
from scaletrain.tracking.reporter import StepReport


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}} from a live endpoint."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_a_rank_share_counts_windows_of_steps_and_goes_on_after_a_restart(tmp_path):
    path = tmp_path / "rank-1.json"
    telemetry = Telemetry(path, {"rank": "1"}, every_s=0)
    sink = TelemetrySink(telemetry, world_size=2, is_main=False)
    sink.on_start(100, 0)
    # Two windows: steps 1 (alone) and 2-10 (9 steps at 20 ms), 64 samples a step over 2 ranks.
    sink.on_train_metrics([StepReport(1, {"step_time_s": 0.5, "samples_per_s": 128.0, "data_wait_s": 0.1}, 0.0),
                           StepReport(10, {"step_time_s": 0.02, "samples_per_s": 3200.0, "data_wait_s": 0.001}, 0.0)])
    sink.on_step(10)
    figures = json.loads(path.read_text())["figures"]
    assert figures["steps_total"] == 10 and figures["samples_total"] == pytest.approx(320.0)
    assert "work_total" not in figures  # the job's steps are counted once, by rank 0
    hist = figures["step_seconds"]
    assert sum(hist["counts"]) == 10 and hist["counts"][STEP_BUCKETS.index(0.025)] == 9
    assert hist["sum"] == pytest.approx(0.5 + 9 * 0.02)
    assert figures["data_wait_seconds_total"] == pytest.approx(0.1 + 0.009)
    assert figures["last_step"] == 10
    # A restarted worker's telemetry goes on from the file: a counter never goes back.
    again = Telemetry(path, {"rank": "1"}, every_s=0)
    TelemetrySink(again, 2, False).on_train_metrics([StepReport(11, {"step_time_s": 0.02}, 0.0)])
    assert json.loads(path.read_text())["figures"]["steps_total"] == 11


def test_the_endpoint_adds_the_shares_up_as_the_catalog_says(tmp_path):
    for rank in (0, 1):
        t = Telemetry(tmp_path / f"rank-{rank}.json", {"rank": str(rank)}, every_s=0)
        t.add("steps_total", 5 + rank)
        t.observe("step_seconds", 0.02, 5)
        t.work("sample", 100, errors=10 * (rank + 1))
        t.set("last_checkpoint_step", 20 + rank)
        t.flush()
    launcher = Telemetry(tmp_path / "launcher-0.json", {"source": "launcher"}, every_s=0)
    launcher.work("attempt", 2, errors=1)
    launcher.add("restarts_total")
    launcher.flush()
    (tmp_path / "torn.json").write_text('{"figures": ')  # a file being written: skipped
    endpoint = MetricsEndpoint(tmp_path, {"run_id": "r1", "job": "toy"}, "127.0.0.1", 0)
    try:
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        got = scrape(endpoint.url)
    finally:
        endpoint.close()
    assert got["scaletrain_run_info"] == {(("job", "toy"), ("run_id", "r1")): 1.0}
    assert got["scaletrain_steps_total"] == {(("rank", "0"),): 5.0, (("rank", "1"),): 6.0}
    assert got["scaletrain_step_seconds_bucket"][(("le", "0.025"), ("rank", "1"))] == 5.0
    assert got["scaletrain_step_seconds_bucket"][(("le", "0.01"), ("rank", "1"))] == 0.0
    # Job-level: errors and work summed over the ranks; the newest checkpoint the max.
    assert got["scaletrain_errors_total"] == {(("kind", "attempt"),): 1.0, (("kind", "sample"),): 30.0}
    assert got["scaletrain_work_total"][(("kind", "sample"),)] == 200.0
    assert got["scaletrain_last_checkpoint_step"] == {(): 21.0}
    assert got["scaletrain_restarts_total"] == {(): 1.0}


def test_every_figure_is_documented():
    text = open("docs/observability.md", encoding="utf-8").read()
    missing = [f"scaletrain_{name}" for name in FIGURES if f"scaletrain_{name}" not in text]
    assert missing == []


def test_the_endpoint_serves_ipv6_and_closing_frees_its_port(tmp_path):
    """Served from our own thread (prometheus-client's loop made every job's end wait out a
    0.5 s poll): it still answers on IPv6 loopback, and once closed nothing listens there."""
    import socket

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    endpoint = MetricsEndpoint(tmp_path, {"run_id": "r1", "job": "toy"}, "::1", 0)
    try:
        assert endpoint.url == f"http://[::1]:{endpoint.port}/metrics"
        assert scrape(endpoint.url)["scaletrain_run_info"] == {(("job", "toy"), ("run_id", "r1")): 1.0}
    finally:
        endpoint.close()
    assert not endpoint._thread.is_alive()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("::1", endpoint.port), timeout=5):
        pass


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path):
    from scaletrain.config.schema import JobConfig
    from scaletrain.errors import ConfigError
    from scaletrain.observe.exporter import observed
    from scaletrain.rundir import RunSpec

    busy = MetricsEndpoint(tmp_path, {}, "127.0.0.1", 0)
    try:
        job = {"name": "toy", "task": {"target": "m:f"}, "data": {"batch_size": 4}, "optim": {"lr": 0.1},
               "train": {"max_steps": 1}, "observability": {"port": busy.port}}
        config = JobConfig.model_validate(job)
        spec = RunSpec.in_dir(config.model_dump(mode="json"), tmp_path / "runs")
        with pytest.raises(ConfigError) as raised:
            with observed(config, spec, "local"):
                pass
    finally:
        busy.close()
    assert str(raised.value).startswith(f"observability: cannot serve metrics on 127.0.0.1:{busy.port} (")
    assert "--metrics-port" in str(raised.value) and "\n" not in str(raised.value)


def test_every_error_has_its_own_documented_code():
    import importlib
    import pkgutil

    import scaletrain
    from scaletrain.errors import ScaletrainError

    for module in pkgutil.walk_packages(scaletrain.__path__, "scaletrain."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    classes = [ScaletrainError, *subclasses(ScaletrainError)]
    codes = {cls.__name__: cls.code for cls in classes}
    assert len(set(codes.values())) == len(codes), codes  # each its own
    text = open("docs/observability.md", encoding="utf-8").read()
    assert [code for code in codes.values() if f"| `{code}` |" not in text] == []
