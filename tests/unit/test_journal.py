import base64
import json
import struct

import pytest

from scaletrain.tracking.journal import MetricJournal


def pending(journal):
    """What a shipper sends: the points past the delivered cursor, oldest first."""
    cursor = journal.sent_cursor()
    return [p for p in journal.read_from(0)[0] if p.seq > cursor]


def test_points_survive_a_reopen_and_the_cursor_says_what_is_left(tmp_path):
    journal = MetricJournal(tmp_path)
    journal.append([(1, 1000, {"train/loss": 1.5, "train/lr": 0.1})])
    journal.append([(2, 2000, {"train/loss": 1.2, "train/lr": 0.1})])
    assert [(p.seq, p.step) for p in pending(journal)] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    journal.mark_sent(2)
    journal.close()
    with open(journal.path, "a") as handle:  # a crash mid-write leaves a torn last line
        handle.write('{"seq": 5, "step": 3, "ts"')
    reopened = MetricJournal(tmp_path)
    assert [(p.seq, p.key, p.value, p.step, p.timestamp_ms) for p in pending(reopened)] == [
        (3, "train/loss", 1.2, 2, 2000),
        (4, "train/lr", 0.1, 2, 2000),
    ]
    reopened.append([(3, 3000, {"x": 1.0}), (4, 4000, {"x": 2.0})])  # one write, two lines
    reopened.close()
    assert [p.seq for p in pending(MetricJournal(tmp_path))] == [3, 4, 5, 6]


class RecordingClient:
    """MLflow's client as the sender sees it (log_batch), recording every point it accepts;
    the first ``fail`` calls raise as an unreachable server does (nothing accepted)."""

    def __init__(self, fail: int = 0):
        self.fail, self.calls, self.accepted = fail, 0, []

    def log_batch(self, run_id, metrics, synchronous=True):
        self.calls += 1
        if self.calls <= self.fail:
            raise ConnectionError("server down")
        self.accepted += [(m.key, m.step, m.timestamp) for m in metrics]


def journal_with(tmp_path, steps: range) -> MetricJournal:
    journal = MetricJournal(tmp_path)
    for step in steps:
        journal.append([(step, 1000 * step, {"train/loss": 1.0 / step, "train/lr": 0.1})])
    return journal


def ship(tmp_path, client, timeout_s=30.0, poll_s=0.05, while_running=None):
    import logging

    from scaletrain.tracking.journal_tail import JournalShipper

    shipper = JournalShipper(client, "run", tmp_path, logging.getLogger("test"), poll_s=poll_s)
    shipper.sender._interval = 0.01  # gather briefly: the test is about what is sent, not when
    shipper.sender._max_backoff = 0.05
    shipper.start()
    if while_running is not None:
        while_running(shipper)
    return shipper.close(timeout_s), shipper.sender.delivered


def test_the_shipper_sends_every_point_once_through_failures_and_polls(tmp_path):
    import time

    journal = journal_with(tmp_path, range(1, 6))
    client = RecordingClient(fail=3)

    def more_while_polling(shipper):
        for step in range(6, 11):  # journaled while the shipper polls and the server fails
            journal.append([(step, 1000 * step, {"train/loss": 1.0 / step, "train/lr": 0.1})])
            time.sleep(0.03)

    left, delivered = ship(tmp_path, client, while_running=more_while_polling)
    sent = [(key, step) for key, step, _ in client.accepted]
    expected = [(key, step) for step in range(1, 11) for key in ("train/loss", "train/lr")]
    assert (left, delivered, sorted(sent)) == (0, 20, sorted(expected)), sent
    assert client.calls > 3 and journal.sent_cursor() == 20


def test_a_later_attempt_sends_only_what_the_earlier_could_not(tmp_path):
    journal_with(tmp_path, range(1, 4))
    down = RecordingClient(fail=10**6)
    left, delivered = ship(tmp_path, down, timeout_s=0.2)
    assert (left, delivered, down.accepted) == (6, 0, [])

    up = RecordingClient()
    assert ship(tmp_path, up) == (0, 6)
    journal = MetricJournal(tmp_path)
    journal.append([(4, 4000, {"train/loss": 0.25})])  # the next attempt trains on
    again = RecordingClient()
    assert ship(tmp_path, again) == (0, 1)
    assert [(key, step) for key, step, _ in up.accepted + again.accepted] == [
        ("train/loss", 1), ("train/lr", 1), ("train/loss", 2), ("train/lr", 2), ("train/loss", 3), ("train/lr", 3),
        ("train/loss", 4)]
    assert [ts for _, _, ts in up.accepted[:2]] == [1000, 1000]  # a point keeps its own time


def test_a_report_window_is_one_line_numbered_as_its_steps_would_be(tmp_path):
    """A window of steps naming the same metrics is one line; its points are numbered step by
    step, key by key, as per-step lines number them; old per-step lines still read."""
    windowed, per_step = MetricJournal(tmp_path / "w"), MetricJournal(tmp_path / "s")
    rows = [(step, 1000 * step, {"train/loss": 1.0 / step, "train/lr": 0.1, "train/x": float("nan")})
            for step in (21, 22, 23)]
    per_step.append(rows[:1])
    per_step.append(rows[1:])
    windowed.append(rows[:1])  # a line of the old kind first
    windowed.append_window([21 + 1, 23], [22.0, 23.0], ["train/loss", "train/lr", "train/x"],
                           [[1 / 22, 1 / 23], [0.1, 0.1], [float("nan"), float("nan")]])
    windowed.close()
    assert len(windowed.path.read_text().splitlines()) == 2

    def points(journal):
        return [(p.seq, p.key, p.value if p.value == p.value else "nan", p.step, p.timestamp_ms)
                for p in MetricJournal(journal.directory).read_from(0)[0]]

    assert points(windowed) == points(per_step)
    assert [p[0] for p in points(windowed)] == list(range(1, 10))
    assert MetricJournal(tmp_path / "w")._next_seq == 10  # a reopened journal numbers on
    assert MetricJournal(tmp_path / "w").last_steps() == {"train": 23}


def test_a_window_line_torn_or_with_a_short_row_is_skipped_whole(tmp_path):
    journal = MetricJournal(tmp_path)
    journal.append_window([1, 2], [1.0, 2.0], ["a", "b"], [[1.0, 3.0], [2.0, 4.0]])
    journal.close()
    with open(journal.path, "a") as handle:
        handle.write('{"seq": 5, "steps": [3, 4], "ts": [3000, 4000], "keys": ["a", "b"], "values": [[5.0], [6.0, 7.0]]}\n')
        handle.write('{"seq": 5, "steps": [3, 4], "ts": [3000')
    assert [p.seq for p in MetricJournal(tmp_path).read_from(0)[0]] == [1, 2, 3, 4]


def test_window_values_travel_packed_exactly_and_earlier_lines_still_read(tmp_path):
    """A window's steps, times and values are written as int64/float64 bits (no number text to
    format on the training thread): every value reads back bit for bit; window lines of the
    earlier kinds (values as JSON rows, or packed rows) read the same; a packed window one value
    short is skipped whole."""
    values = [[0.1 + 0.2, float("inf"), -0.0], [1e-310, 3.0, 2.0 ** 60 + 1.0]]  # rows: a step's
    packed = MetricJournal(tmp_path / "p")
    packed.append_window([5, 6], [5.0, 6.0], ["a", "b", "c"], [list(column) for column in zip(*values)])
    packed.close()
    line = json.loads(packed.path.read_text())
    assert set(line) == {"seq", "keys", "n", "columns"}
    got = MetricJournal(tmp_path / "p").read_from(0)[0]
    assert [struct.pack("<d", p.value) for p in got] == [struct.pack("<d", v) for row in values for v in row]
    assert [(p.seq, p.key, p.step, p.timestamp_ms) for p in got][:4] == \
        [(1, "a", 5, 5000), (2, "b", 5, 5000), (3, "c", 5, 5000), (4, "a", 6, 6000)]

    earlier = {"seq": 1, "steps": [5, 6], "ts": [5000, 6000], "keys": ["a", "b", "c"]}
    as_rows = base64.b64encode(struct.pack("<6d", *(v for row in values for v in row))).decode()
    for name, kind in (("json", {"values": values}), ("rows", {"f64": as_rows})):
        old = tmp_path / name
        old.mkdir()
        (old / "metrics.journal.jsonl").write_text(json.dumps(dict(earlier, **kind)) + "\n")
        assert [(p.seq, p.key, p.step, p.timestamp_ms, struct.pack("<d", p.value))
                for p in MetricJournal(old).read_from(0)[0]] == \
            [(p.seq, p.key, p.step, p.timestamp_ms, struct.pack("<d", p.value)) for p in got]

    short = dict(line, columns=base64.b64encode(base64.b64decode(line["columns"])[:-8]).decode())
    with open(packed.path, "a") as handle:
        handle.write(json.dumps(short) + "\n")
    assert len(MetricJournal(tmp_path / "p").read_from(0)[0]) == 6
    with pytest.raises(ValueError, match="a column without a value for every step"):
        packed.append_window([7, 8], [7.0, 8.0], ["a"], [[1.0]])
