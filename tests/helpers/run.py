"""Helpers to run scaletrain as a user would and read what a run leaves behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def read_metrics(run_dir: str | Path, split: str = "train") -> list[dict]:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["split"] == split]


def scaletrain_cli(*args: str, cwd: Path = REPO, timeout: float = 240, env: dict | None = None):
    """Run the CLI in a subprocess; returns the CompletedProcess (stdout, stderr, returncode)."""
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def preempt_then_resume_on_one_worker(job: dict, monkeypatch, at_step: int = 12) -> tuple[int, dict]:
    """Run ``job`` (2 workers x batch 16) until rank 0 gets SIGTERM at ``at_step``, then resume it
    on 1 worker x batch 32 (the same global batch); the step it stopped at, and the summary."""
    import pytest

    import scaletrain
    from scaletrain.errors import RunPreempted
    from scaletrain.recovery.faults import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, f"sigterm:rank=0:step={at_step}")
    with pytest.raises(RunPreempted) as stopped:
        scaletrain.run(job)
    monkeypatch.delenv(FAULT_ENV)
    resumed = scaletrain.resume(stopped.value.run_dir, ["scale.workers=1", "data.batch_size=32"])
    assert resumed["world_size"] == 1 and resumed["resumed_from_step"] == stopped.value.step
    return stopped.value.step, resumed


def assert_same_losses_after(reference: dict, resumed: dict, step: int, last: int) -> None:
    """Every train loss after ``step`` equals the reference run's at that step: the same batches
    (only the order of floating-point sums differs)."""
    import pytest

    expected = {row["step"]: row["loss"] for row in read_metrics(reference["run_dir"])}
    after = [row for row in read_metrics(resumed["run_dir"]) if row["step"] > step]
    assert [row["step"] for row in after] == list(range(step + 1, last + 1))
    for row in after:
        assert row["loss"] == pytest.approx(expected[row["step"]], rel=1e-4)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has stopped running all the same.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def state_bytes_by_rank(run_dir: str | Path) -> dict[int, dict[str, int]]:
    """What each rank measured it holds after its second step (its ``model state bytes`` log line)."""
    found = {}
    for log in sorted(Path(run_dir, "logs").glob("worker-*.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            if entry["message"] == "model state bytes":
                found[entry["rank"]] = entry["state_bytes"]
    return found


def assert_weights_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-4) -> None:
    """The final weights of two runs' summaries agree within float32 rounding, tensor by tensor;
    a failure names the tensor and its largest difference. ``atol``: Adam divides each update
    by the gradient's running RMS, so a parameter whose true gradient is about 0 (attention's
    key bias) moves by the rounding noise itself: measured 1.2e-5 on tiny_gpt (lr 3e-3) after
    20 steps; bf16 compute is 1.3e-2 off."""
    import torch
    from safetensors.torch import load_file

    left, right = load_file(a["weights"]), load_file(b["weights"])
    assert sorted(left) == sorted(right), (sorted(left), sorted(right))
    for name in sorted(left):
        delta = (left[name] - right[name]).abs().max().item()
        assert torch.allclose(left[name], right[name], rtol=rtol, atol=atol), f"{name}: max abs difference {delta:.3g}"


def stop_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End ``proc`` and every process of its group (a launcher's workers, a server's children):
    SIGTERM, then SIGKILL after ``grace_s``; its pipes closed."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
