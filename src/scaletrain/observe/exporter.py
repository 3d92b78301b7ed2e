"""The launcher's Prometheus endpoint for the whole job (this node's ranks, its tracking process
and itself): on each scrape a collector reads every telemetry file of the run and adds the
shares up as catalog.py says. Served by prometheus-client on 127.0.0.1 unless the job says
otherwise; nothing here runs on a worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletrain.observe.catalog import FIGURES, PREFIX, Figure
from scaletrain.observe.telemetry import Telemetry, install

__all__ = ["JobCollector", "MetricsEndpoint", "Observation", "read_shares", "observed", "job_totals"]

log = logging.getLogger(__name__)


def read_shares(directory: Path) -> list[dict[str, Any]]:
    """Every telemetry file in the run's telemetry folder (one being replaced is read next time)."""
    shares = []
    for path in sorted(directory.glob("*.json")):
        try:
            share = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(share, dict) and isinstance(share.get("figures"), dict):
            shares.append(share)
    return shares


# Per-rank positions and clock times: live figures, not totals a finished run is compared by.
_NOT_TOTALS = {"last_step", "last_step_timestamp_seconds", "last_checkpoint_timestamp_seconds", "data_ready_batches",
               "trials"}


def job_totals(directory: Path) -> dict[str, float]:
    """The job's figures added up over its processes as MLflow metric names (``system/...``;
    a label's value and a histogram's sum and count as a last part): what a run ends with."""
    shares = read_shares(directory)
    totals: dict[str, float] = {}
    for figure in FIGURES.values():
        if figure.name in _NOT_TOTALS:
            continue
        name = f"system/{figure.name}"
        if figure.type == "histogram":
            for hist in _histograms(figure, shares).values():
                totals[f"{name}/sum"] = totals.get(f"{name}/sum", 0.0) + hist["sum"]
                totals[f"{name}/count"] = totals.get(f"{name}/count", 0.0) + sum(hist["counts"])
            continue
        for labels, value in _values(figure, shares).items():
            label = labels[-1] if figure.label is not None else None
            key = f"{name}/{label}" if label else name
            totals[key] = totals.get(key, 0.0) + value  # per-rank figures: summed over the ranks
    return dict(sorted(totals.items()))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


class JobCollector:
    """A prometheus-client collector over the run's telemetry files, plus the run's identity."""

    def __init__(self, directory: Path, info: dict[str, str]):
        self.directory = Path(directory)
        self.info = info

    def describe(self) -> list[Any]:
        return []  # figures come and go with the files: no fixed description

    def collect(self) -> Any:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        yield InfoMetricFamily(f"{PREFIX}run", "The run this endpoint serves.", value=self.info)
        shares = read_shares(self.directory)
        for figure in FIGURES.values():
            name = PREFIX + figure.name
            if figure.type == "histogram":
                family: Any = HistogramMetricFamily(name, figure.help, labels=_labels(figure))
                for labels, hist in _histograms(figure, shares).items():
                    cumulative, total = [], 0
                    for bound, count in zip([*figure.buckets, math.inf], hist["counts"]):
                        total += count
                        cumulative.append((_bound(bound), total))
                    family.add_metric(list(labels), cumulative, hist["sum"])
            else:
                kind = CounterMetricFamily if figure.type == "counter" else GaugeMetricFamily
                # prometheus-client appends _total to a counter's name itself.
                family = kind(name.removesuffix("_total") if figure.type == "counter" else name, figure.help,
                              labels=_labels(figure))
                for labels, value in _values(figure, shares).items():
                    family.add_metric(list(labels), value)
            yield family


def _labels(figure: Figure) -> list[str]:
    return ["rank"] * (figure.aggregate == "per_rank") + ([figure.label] if figure.label is not None else [])


def _values(figure: Figure, shares: list[dict[str, Any]]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for share in shares:
        raw = share["figures"].get(figure.name)
        items = raw.items() if figure.label is not None and isinstance(raw, dict) else [(None, raw)]
        for label, value in items:
            number = _number(value)
            if number is None:
                continue
            key = _key(figure, share, label)
            if key is None:
                continue
            if key in out and figure.aggregate == "max":
                out[key] = max(out[key], number)
            else:
                out[key] = out.get(key, 0.0) + number
    return out


def _histograms(figure: Figure, shares: list[dict[str, Any]]) -> dict[tuple[str, ...], dict[str, Any]]:
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    width = len(figure.buckets) + 1
    for share in shares:
        hist = share["figures"].get(figure.name)
        if not isinstance(hist, dict) or len(hist.get("counts", ())) != width:
            continue
        key = _key(figure, share, None)
        if key is None:
            continue
        into = out.setdefault(key, {"counts": [0] * width, "sum": 0.0})
        into["counts"] = [a + int(b) for a, b in zip(into["counts"], hist["counts"])]
        into["sum"] += float(hist.get("sum", 0.0))
    return out


def _key(figure: Figure, share: dict[str, Any], label: str | None) -> tuple[str, ...] | None:
    key: tuple[str, ...] = ()
    if figure.aggregate == "per_rank":
        rank = share.get("labels", {}).get("rank")
        if rank is None:
            return None
        key += (str(rank),)
    if figure.label is not None:
        if label is None:
            return None
        key += (str(label),)
    return key


def _bound(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


class MetricsEndpoint:
    """prometheus-client's WSGI app over a JobCollector, served for as long as the launcher runs.

    Served from our own thread rather than ``start_http_server``'s: its loop polls for a stop
    every 0.5 s, and closing waited out that poll at the end of every job (0.25-0.5 s of the
    command's time). Ours polls every ``_POLL_S``."""

    _POLL_S = 0.05

    def __init__(self, directory: Path, info: dict[str, str], host: str, port: int):
        import socket
        import threading
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import CollectorRegistry, make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):  # a class of its own: the address family is per class
            address_family = family

        class QuietHandler(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  the base's name
                pass  # a scrape is not news

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(directory, info))
        self.host = host
        self._server = make_server(str(address[0]), port, make_wsgi_app(self.registry), Server,
                                   handler_class=QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": self._POLL_S},
                                        name="scaletrain-metrics", daemon=True)
        self._thread.start()
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()  # returns at the loop's next poll
        self._server.server_close()
        self._thread.join(timeout=5)


class Observation:
    """What a launch observes: the endpoint and the built-in alerts (observe/alerts.py)."""

    def __init__(self, endpoint: MetricsEndpoint, alerts: Any):
        self.endpoint, self.alerts = endpoint, alerts
        self._finished = False

    def finish(self) -> list[dict[str, Any]]:
        """Stop evaluating (after a last look at what the workers counted); the alerts that fired."""
        if not self._finished:
            self._finished = True
            self.alerts.close()
        return list(self.alerts.fired)


@contextlib.contextmanager
def observed(config: Any, spec: Any, engine: str, logger: logging.Logger = log) -> Iterator[Observation | None]:
    """For one launch: the launcher's own telemetry (attempts, restarts) installed, the endpoint
    served over the run's figures, the built-in alerts evaluated; None when
    ``observability.enabled`` is off. A port that cannot be bound is the pre-flight's kind of
    refusal: one line, nothing started."""
    from scaletrain.errors import ConfigError
    from scaletrain.observe.alerts import AlertLoop

    settings = config.observability
    if not settings.enabled:
        yield None
        return
    directory = spec.telemetry_dir
    telemetry = Telemetry(directory / f"launcher-{spec.node_rank}.json", {"source": "launcher"})
    info = {"run_id": spec.run_id, "trace_id": spec.trace_id, "job": config.name, "engine": engine,
            "node_rank": str(spec.node_rank)}
    try:
        endpoint = MetricsEndpoint(directory, info, settings.host, settings.port)
    except OSError as exc:
        raise ConfigError([
            f"observability: cannot serve metrics on {settings.host}:{settings.port} ({exc.strerror or exc}); "
            "choose another port (--metrics-port N, or 0 for a free one) or set observability.enabled: false"
        ]) from None
    logger.info("metrics for Prometheus on %s", endpoint.url, extra={"metrics_url": endpoint.url, "console": False})
    telemetry.add("restarts_total", 0)  # there from the start: a first restart is an increase
    telemetry.flush(force=True)
    previous = install(telemetry)
    observation = Observation(endpoint, AlertLoop(settings.alerts, directory, info,
                                                  logging.getLogger(f"{logger.name.rsplit('.', 1)[0]}.alerts")).start())
    try:
        yield observation
    finally:
        observation.finish()
        telemetry.flush(force=True)
        install(previous)
        endpoint.close()
