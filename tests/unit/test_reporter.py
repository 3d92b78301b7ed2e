"""Where the loop's numbers go: metrics.jsonl, the JSON log, and what each rank's reporter holds."""

import json
import logging

import pytest

from scaletrain.config import parse_job
from scaletrain.observe.telemetry import read_step_mark
from scaletrain.rundir import RunSpec
from scaletrain.tracking.logs import LogContext
from scaletrain.tracking.reporter import LogReporter, MetricsFile, NullReporter, Reporters, StepReport
from scaletrain.tracking.worker_sinks import worker_reporter
from tests.helpers.tasks import toy_job


def reports(first, last):
    return [StepReport(step, {"loss": 1.0 / step}, wall_time=1000.0 + step) for step in range(first, last + 1)]


def rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def train_steps(path):
    return [row["step"] for row in rows(path) if row["split"] == "train"]


def test_train_rows_at_every_nth_step_plus_the_first_and_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFile(path, every=5)
    sink.on_start(total_steps=12, start_step=0)
    sink.on_train_metrics(reports(1, 7))  # in batches, as the loop reports them
    sink.on_train_metrics(reports(8, 12))
    sink.on_end()
    assert train_steps(path) == [1, 5, 10, 12]
    assert rows(path)[1] == {"split": "train", "step": 5, "loss": 0.2}


def test_eval_rows_are_always_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFile(path, every=5)
    sink.on_start(total_steps=12, start_step=0)
    sink.on_train_metrics(reports(1, 3))
    sink.on_eval_metrics(3, {"accuracy": 0.5})
    sink.on_eval_metrics(7, {"accuracy": 0.75})
    sink.on_end()
    assert rows(path) == [
        {"split": "train", "step": 1, "loss": 1.0},
        {"split": "eval", "step": 3, "accuracy": 0.5},
        {"split": "eval", "step": 7, "accuracy": 0.75},
    ]


def test_no_total_steps_means_no_last_step_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFile(path, every=4)
    sink.on_start(total_steps=None, start_step=0)
    sink.on_train_metrics(reports(1, 10))
    sink.on_end()
    assert train_steps(path) == [1, 4, 8]


def test_nothing_is_written_before_start_or_after_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFile(path)
    sink.on_train_metrics(reports(1, 2))
    assert not path.exists()
    sink.on_start(total_steps=4, start_step=0)
    sink.on_end()
    sink.on_train_metrics(reports(1, 2))
    sink.on_eval_metrics(2, {"accuracy": 1.0})
    assert path.read_text(encoding="utf-8") == ""


def test_a_restart_does_not_write_the_steps_it_redoes_twice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsFile(path, every=2)
    first.on_start(total_steps=10, start_step=0)
    first.on_train_metrics(reports(1, 7))
    first.on_eval_metrics(6, {"accuracy": 0.5})
    # died at step 7; the restart resumes from its checkpoint at step 4 and redoes 5..7
    again = MetricsFile(path, every=2)
    again.on_start(total_steps=10, start_step=4)
    again.on_train_metrics(reports(5, 10))
    again.on_eval_metrics(6, {"accuracy": 0.5})
    again.on_eval_metrics(10, {"accuracy": 0.9})
    again.on_end()
    assert train_steps(path) == [1, 2, 4, 6, 8, 10]
    assert [row["step"] for row in rows(path) if row["split"] == "eval"] == [6, 10]


TORN = '{"split": "train", "step": 1, "loss": 1.0}\n{"split": "train", "step": 2, "loss": 0.5}\n{"split": "tr'


def test_a_torn_last_line_is_tolerated(tmp_path):
    """A worker killed mid-write leaves half a row: the restart reads past it, goes on appending
    and writes none of the steps the file holds whole again."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(TORN, encoding="utf-8")
    sink = MetricsFile(path)
    sink.on_start(total_steps=4, start_step=0)
    sink.on_train_metrics(reports(1, 4))
    sink.on_end()
    text = path.read_text(encoding="utf-8")
    assert text.startswith(TORN)
    assert text.count('"step": 1,') == text.count('"step": 2,') == 1
    assert json.loads(text.splitlines()[-1]) == {"split": "train", "step": 4, "loss": 0.25}


def test_the_first_row_after_a_torn_line_is_readable(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(TORN, encoding="utf-8")
    sink = MetricsFile(path)
    sink.on_start(total_steps=4, start_step=0)
    sink.on_train_metrics(reports(3, 4))
    sink.on_end()
    readable = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            readable.append(json.loads(line)["step"])
        except ValueError:
            continue
    assert readable == [1, 2, 3, 4]


def test_log_reporter_emits_train_metrics_at_the_same_cadence(caplog):
    logger = logging.getLogger("test_reporter.metrics")
    sink = LogReporter(logger, every=3)
    sink.on_start(total_steps=7, start_step=0)
    with caplog.at_level(logging.INFO, logger=logger.name):
        sink.on_train_metrics(reports(1, 7))
        sink.on_eval_metrics(7, {"accuracy": 0.5})
    records = [(r.getMessage(), r.step, r.metrics) for r in caplog.records]
    assert records == [
        ("train metrics", 1, {"loss": 1.0}),
        ("train metrics", 3, {"loss": 1 / 3}),
        ("train metrics", 6, {"loss": 1 / 6}),
        ("train metrics", 7, {"loss": 1 / 7}),
        ("eval metrics", 7, {"accuracy": 0.5}),
    ]


class Recorder:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getattr__(self, method):
        return lambda *args: self.calls.append((self.name, method, args))


def test_reporters_fan_every_call_out_to_every_sink_in_order():
    calls = []
    fan = Reporters(Recorder(calls, "a"), Recorder(calls, "b"))
    batch = reports(1, 1)
    fan.on_start(5, 0)
    fan.on_step(1)
    fan.on_train_metrics(batch)
    fan.on_eval_metrics(1, {"accuracy": 1.0})
    fan.on_end()
    expected = [("on_start", (5, 0)), ("on_step", (1,)), ("on_train_metrics", (batch,)),
                ("on_eval_metrics", (1, {"accuracy": 1.0})), ("on_end", ())]
    assert calls == [(name, method, args) for method, args in expected for name in ("a", "b")]


def worker_setup(tmp_path):
    job = toy_job(tmp_path, train={"max_steps": 4, "log_every": 2})
    spec = RunSpec.in_dir(job, tmp_path / "runs")
    return spec, parse_job(job), LogContext(spec.run_id, spec.trace_id, rank=1)


def test_a_non_main_rank_writes_only_its_step_mark_and_keeps_its_log_step_current(tmp_path):
    spec, job, context = worker_setup(tmp_path)
    reporter = worker_reporter(spec, job, context, is_main=False)
    reporter.on_start(4, 0)
    for step in range(1, 5):
        reporter.on_step(step)
        reporter.on_train_metrics(reports(step, step))
        assert context.step == step
    reporter.on_eval_metrics(4, {"accuracy": 1.0})
    reporter.on_end()
    assert [p.name for p in (tmp_path / "runs").rglob("*") if p.is_file()] == ["worker-1.step"]
    assert read_step_mark(spec.worker_step(1)) == 4  # what a root cause reads after a hang


def test_the_main_rank_writes_metrics_jsonl_at_the_console_cadence(tmp_path):
    spec, job, context = worker_setup(tmp_path)
    spec.out_dir.mkdir(parents=True)
    reporter = worker_reporter(spec, job, context, is_main=True)
    reporter.on_start(4, 0)
    for step in range(1, 5):
        reporter.on_step(step)
    reporter.on_train_metrics(reports(1, 4))
    reporter.on_end()
    assert context.step == 4
    assert train_steps(spec.out_dir / "metrics.jsonl") == [1, 2, 4]


def test_a_window_of_columns_reaches_every_sink_as_the_same_reports_would(tmp_path):
    """The loop hands its steps over as columns (ReportWindow): metrics.jsonl, the journal, the
    JSON log and the live figures come out as from a list of the same StepReports, and a step's
    dict is built only for a sink that keeps that step."""
    from scaletrain.observe.telemetry import Telemetry, TelemetrySink
    from scaletrain.tracking.journal_sink import JournalReporter
    from scaletrain.tracking.reporter import ReportWindow

    names = ["loss", "lr", "step_time_s", "samples_per_s", "data_wait_s"]
    steps = list(range(1, 13))
    window_rows = [[1.0 / s, 0.1, 0.01 * s, 100.0 + s, 0.001] for s in steps]
    window_columns = [list(column) for column in zip(*window_rows)]
    walls = [1000.0 + s for s in steps]
    built = []

    class Counted(ReportWindow):
        def __getitem__(self, index):
            built.append(index)
            return super().__getitem__(index)

    def outputs(batch, folder):
        folder.mkdir()
        records = []
        logger = logging.getLogger(f"test.window.{folder.name}")
        logger.addHandler(handler := logging.Handler())
        handler.emit = records.append
        logger.setLevel(logging.INFO)
        telemetry = Telemetry(folder / "telemetry.json", every_s=0)
        sinks = Reporters(MetricsFile(folder / "metrics.jsonl", every=5), JournalReporter(folder / "journal", every=2),
                          LogReporter(logger, every=5), TelemetrySink(telemetry, 1, True))
        sinks.on_start(total_steps=12, start_step=0)
        sinks.on_train_metrics(batch)
        sinks.on_end()
        journal = sorted((folder / "journal").iterdir())
        figures = json.loads((folder / "telemetry.json").read_text())["figures"]
        return ((folder / "metrics.jsonl").read_text(), [p.read_text() for p in journal],
                [(r.step, r.metrics) for r in records],
                {name: value for name, value in figures.items() if "timestamp" not in name})

    as_list = [StepReport(s, dict(zip(names, row)), w) for s, row, w in zip(steps, window_rows, walls)]
    from_window = outputs(Counted(steps, names, window_columns, walls), tmp_path / "window")
    assert from_window == outputs(as_list, tmp_path / "list")
    assert "train/samples_per_s" in "".join(from_window[1]) and from_window[3]["steps_total"] == 12
    assert train_steps(tmp_path / "window" / "metrics.jsonl") == [1, 5, 10, 12]
    assert sorted(set(built)) == [0, 4, 9, 11]  # only the steps metrics.jsonl and the log keep


def test_a_step_keeps_its_metrics_without_a_graph_and_the_report_makes_any_kind_a_scalar():
    """A reported step keeps its task's metrics as they are, save one with a graph (detached
    at once: kept, it would hold the graph's tensors until the report); at the report a float,
    a 1-element tensor and a scalar tensor all become the same mean."""
    import torch

    from scaletrain.engine.metrics import MetricsWindow, StepOutput

    weight = torch.ones(3, requires_grad=True)
    plain = torch.tensor(0.5)
    metrics = {"plain": plain, "graph": (weight * 2).sum()}  # one micro-step's, as the task gave them
    step = StepOutput(torch.tensor(9.0), metrics, None, 0.1, 0.0, True)
    MetricsWindow(0.0, 0).add(step, 1)
    kept = step.metrics
    assert kept["plain"] is plain and not kept["graph"].requires_grad and kept["graph"].item() == 6.0

    class Sink(NullReporter):
        def on_train_metrics(self, reports):
            self.rows = [(r.step, r.metrics["m"], r.metrics["loss"]) for r in reports]

    window, sink = MetricsWindow(0.0, 0), Sink()
    for step, metric in enumerate([torch.tensor(0.25), 0.5, torch.tensor([0.75])], start=1):
        window.add(StepOutput(torch.tensor(float(step)), {"m": metric}, None, 0.1, 0.0, True), step)
    window.report(sink, global_batch=8)
    assert sink.rows == [(1, 0.25, 1.0), (2, 0.5, 2.0), (3, 0.75, 3.0)]


def test_a_window_reports_each_step_in_columns_with_the_time_since_the_last_reported_step():
    """The window's columns: the loss and metrics (mean over ranks), lr, the gradient norm,
    and per step the time, samples/s, tokens/s and data wait since the previous reported step
    (an unreported step in between counts towards the next one); a non-finite loss anywhere in
    the window stops the run naming its step, unless the run skips such steps."""
    import math
    import time

    import torch

    from scaletrain.engine.metrics import MetricsWindow, StepOutput, TrainingDiverged

    class Sink(NullReporter):
        def on_train_metrics(self, reports):
            self.window = reports

    def output(loss, acc, norm, report=True, wait=0.5):
        return StepOutput(torch.tensor(loss), {"acc": torch.tensor(acc)}, torch.tensor(norm), 0.01 * loss, wait, report)

    started = time.perf_counter()
    window, sink = MetricsWindow(started, 0), Sink()
    window.add(output(1.0, 0.25, 3.0), 1)
    window.add(output(2.0, 0.5, 4.0), 2)
    window.add(output(9.0, 0.0, 0.0, report=False, wait=1.0), 3)  # not reported: counts towards step 4
    window.add(output(4.0, 1.0, 5.0, wait=1.5), 4)
    ended = [started] + [entry[2] for entry in window.pending]
    window.report(sink, global_batch=8, tokens_per_sample=4)
    got = sink.window
    assert got.steps == [1, 2, 4]
    assert got.names == ["loss", "acc", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s", "data_wait_s"]
    assert got.columns[:4] == [[1.0, 2.0, 4.0], [0.25, 0.5, 1.0], [0.01, 0.02, 0.04], [3.0, 4.0, 5.0]]
    between = [1, 1, 2]
    times = [(ended[i + 1] - ended[i]) / between[i] for i in range(3)]
    assert got.column("step_time_s") == times
    assert got.column("samples_per_s") == [8 / t for t in times]
    assert got.column("tokens_per_s") == [32 / t for t in times]
    assert got.column("data_wait_s") == [0.5, 0.5, 1.25]
    assert got[2].metrics["grad_norm"] == 5.0 and window.pending == []

    for skip in (False, True):
        window = MetricsWindow(time.perf_counter(), 0, stop_on_nonfinite=not skip)
        for step, loss in enumerate([1.0, math.inf, 2.0], start=1):
            window.add(output(loss, 0.0, 1.0), step)
        if skip:
            window.report(sink, global_batch=8)
            assert sink.window.column("loss") == [1.0, math.inf, 2.0]
        else:
            with pytest.raises(TrainingDiverged, match="the loss became inf at step 2;"):
                window.report(sink, global_batch=8)
