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
