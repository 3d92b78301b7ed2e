"""The Ray relay's two ends without a cluster: a worker's files reach the driver's run directory
as they are, only the run's own files are written, and another rank sends its log alone."""

import json

import pytest

from scaletrain.launch.ray.relay import RunDirRelay, read_asked, write_relayed


class Mailbox:
    """The mailbox actor's file methods, in this process."""

    def __init__(self, driver_dir):
        self.driver_dir, self.files, self.asked, self.provided = driver_dir, [], [], None

    def call(self, method, *args):
        if method == "write":
            self.files.append(args)
        elif method == "backlog":
            return 0
        elif method == "ask_files":  # the driver answers at once
            self.provided = read_asked(self.driver_dir, args[0])
        elif method == "provided_files":
            return self.provided

    def deliver(self):
        refused = write_relayed(self.driver_dir, self.files)
        self.files = []
        return refused


class LocalRelay(RunDirRelay):
    def _call(self, method, *args):
        return self.mailbox.call(method, *args)


def rows(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rank_0_continues_the_drivers_files_and_sends_its_final_ones(tmp_path):
    driver, node = tmp_path / "driver", tmp_path / "node"
    (driver).mkdir()
    (driver / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 5)))
    mailbox = Mailbox(driver)
    relay = LocalRelay(mailbox, node, rank=0)
    relay._seed()  # an earlier attempt's rows, written while rank 0 ran elsewhere
    assert rows(node / "metrics.jsonl") == [1, 5]
    with open(node / "metrics.jsonl", "a") as handle:  # this attempt's rows
        handle.write(json.dumps({"step": 10}) + "\n")
    relay.flush()
    assert mailbox.deliver() == []
    assert rows(driver / "metrics.jsonl") == [1, 5, 10]
    (node / "model.safetensors").write_bytes(b"w" * 100)
    (node / "mlflow_model" / "data").mkdir(parents=True)
    (node / "mlflow_model" / "data" / "model.pt2").write_bytes(b"m" * 10)
    with open(node / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 15}) + "\n")
    relay.finish()
    mailbox.deliver()
    assert rows(driver / "metrics.jsonl") == [1, 5, 10, 15]
    assert (driver / "model.safetensors").read_bytes() == b"w" * 100
    assert (driver / "mlflow_model" / "data" / "model.pt2").read_bytes() == b"m" * 10
    assert not list(driver.rglob("*.relay"))


def test_another_rank_sends_its_log_and_never_a_stale_metrics_file(tmp_path):
    driver, node = tmp_path / "driver", tmp_path / "node"
    driver.mkdir()
    (driver / "metrics.jsonl").write_text(json.dumps({"step": 30}) + "\n")
    (node / "logs").mkdir(parents=True)
    (node / "metrics.jsonl").write_text(json.dumps({"step": 23}) + "\n")  # rank 0 ran here once
    (node / "logs" / "worker-1.jsonl").write_text('{"message": "worker finished"}\n')
    mailbox = Mailbox(driver)
    LocalRelay(mailbox, node, rank=1).finish()
    mailbox.deliver()
    assert rows(driver / "metrics.jsonl") == [30]
    assert (driver / "logs" / "worker-1.jsonl").read_text() == '{"message": "worker finished"}\n'


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "logs/../../x", "spec.json", "checkpoints/x",
                                  "logs/worker-0.jsonl/../../../x"])
def test_the_driver_writes_only_the_runs_own_files(tmp_path, path):
    assert write_relayed(tmp_path / "run", [(path, 0, b"x", True, True)]) == [path]
    assert not (tmp_path / "escape").exists() and not list((tmp_path).rglob("x"))
