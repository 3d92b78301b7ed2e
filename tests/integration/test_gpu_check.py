"""The GPU check's CPU path: bench/gpu_check.py --device cpu runs the same check functions as on
the GPU machine, on the smallest jobs that take every path, so the script cannot rot between
the rare runs on a GPU. About 70-80 s on 2 cores."""

import json
import subprocess
import sys

import pytest

from tests.helpers.run import REPO

pytestmark = pytest.mark.distributed

CHECKS = ["determinism", "one_rank", "two_ranks_gloo", "memory", "throughput"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "gpu.json"
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads(out.read_text())
    assert json.loads(result.stdout) == written  # the JSON at the end is the file's
    return written


def test_every_check_runs_and_passes_on_the_cpu(report):
    rows = {row["check"]: row for row in report["checks"]}
    assert list(rows) == CHECKS
    for name, row in rows.items():
        assert row["ok"] is True, f"{name}: {row.get('summary') or row.get('skipped')}"
    assert report["ok"] is True and report["device"] == "cpu"


def test_what_each_check_saw(report):
    rows = {row["check"]: row for row in report["checks"]}
    [tiny_gpt] = rows["determinism"]["examples"]
    assert tiny_gpt["same_sha256"] and tiny_gpt["loss_falls"] and tiny_gpt["engine"] == "in-process"
    [offload] = rows["one_rank"]["variants"]  # a 1-rank group under the local engine, killed and resumed
    assert offload["workers"] == {"0": {"device": "cpu", "backend": "gloo"}}
    assert offload["restarts"] == 1 and offload["resumed_from_step"] and offload["same_sha256"]
    assert [run["engine"] for run in offload["runs"]] == ["local", "local"]
    [ddp] = rows["two_ranks_gloo"]["variants"]
    assert ddp["workers"] == {str(rank): {"device": "cpu", "backend": "gloo"} for rank in (0, 1)}
    assert ddp["restarts"] == 1 and ddp["same_sha256"]
    assert rows["two_ranks_gloo"]["collectives"] and rows["two_ranks_gloo"]["gloo_lacks"] == []
    [single] = rows["memory"]["variants"]
    assert single["state_bytes_exact"]
    assert rows["throughput"]["ratio"] > 0


def test_the_results_render_as_the_docs_table(report):
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check

    table = gpu_check.table(report)
    assert table.startswith(gpu_check.GPU_SECTION[0]) and table.endswith(gpu_check.GPU_SECTION[1])
    for name in CHECKS:
        assert f"| {name} | " in table
    # docs/benchmarks.md has the section this replaces
    assert gpu_check.gpu_section((REPO / "docs" / "benchmarks.md").read_text())
