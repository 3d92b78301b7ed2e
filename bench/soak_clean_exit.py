"""Soak: run a 2-worker job many times in one process and fail on the first run that does
not finish (a worker stuck at exit, an agent waiting forever). Too slow for CI; run it after
touching process-group, DDP or launcher code.

    .venv/bin/python bench/soak_clean_exit.py --runs 60

Before the fix in launch/worker.py (free DDP before destroying the process group), about one
run in 20 hung with a worker blocked in teardown after training had finished.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import scaletrain  # noqa: E402
from tests.helpers.tasks import toy_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--per-run-timeout", type=float, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            # A stuck run dumps every thread's stack and exits non-zero.
            faulthandler.dump_traceback_later(args.per_run_timeout, exit=True)
            started = time.time()
            job = toy_job(
                Path(tmp), data={"batch_size": 8}, scale={"workers": 2},
                train={"max_steps": 20, "log_every": 10, "grad_accum": 2},
            )
            scaletrain.run(job)
            faulthandler.cancel_dump_traceback_later()
            print(f"run {i + 1}/{args.runs}: {time.time() - started:.1f} s", flush=True)
    print(f"{args.runs} runs, all finished cleanly")


if __name__ == "__main__":
    main()
