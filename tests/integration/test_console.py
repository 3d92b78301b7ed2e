"""What a person sees on a terminal: a progress bar from rank 0, then a summary."""

import json
import os
import re
import subprocess
import sys

from tests.helpers.run import REPO
from tests.helpers.tasks import toy_job


def run_in_terminal(start, args, timeout=120):
    """Run the CLI (``start``: the processes fixture) with stdout and stderr on a
    pseudo-terminal; return what it printed."""
    controller, terminal = os.openpty()
    proc = start(
        [sys.executable, "-m", "scaletrain", *args],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # the terminal closed: every writer has exited
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=timeout)
    os.close(controller)
    text = b"".join(chunks).decode("utf-8", "replace")
    return proc.returncode, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_progress_bar_and_summary_on_a_terminal(tmp_path, processes):
    job_file = tmp_path / "toy.yaml"
    job_file.write_text(json.dumps(toy_job(tmp_path, scale={"workers": 2}, train={"max_steps": 30, "log_every": 5})))
    code, screen = run_in_terminal(processes, ["run", str(job_file)])
    assert code == 0, screen
    assert re.search(r"toy .*30/30 loss \d+\.\d{4} [\d,]+ samples/s", screen), screen
    assert "toy finished" in screen
    assert re.search(r"steps\s+│ 30", screen)
    assert '"level"' not in screen, "JSON log lines belong to files when a person is watching"
