"""``scaletrain reproduce RUN``: run a recorded job again and say whether it came out the same.

Differences in code, packages and hardware are reported before anything runs; then the job
file recorded with the run is trained again (tracked as a new run tagged with the original),
and the final weights are compared bit for bit.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

__all__ = ["reproduce"]


def reproduce(run_ref: str, uri: str, announce: Any = print) -> dict[str, Any]:
    from scaletrain.api import run
    from scaletrain.config import load_job
    from scaletrain.tracking.run_card import build_run_card, compare_run_cards
    from scaletrain.tracking.runs import RunNotFound, download_artifact, download_json, find_run

    original = find_run(uri, run_ref)
    run_id = original.info.run_id
    recorded_card = download_json(uri, run_id, "run_card.json")
    recorded_summary = download_json(uri, run_id, "summary.json") or {}
    search_path = json.loads(original.data.tags.get("scaletrain.python_path", "[]"))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            job_file = download_artifact(uri, run_id, "job.yaml", tmp)
        except Exception:
            raise RunNotFound(f"run {run_id} has no recorded job.yaml; it cannot be reproduced") from None
        config = load_job(job_file)
        before = []
        if recorded_card:
            current = build_run_card(
                config.model_dump(mode="json"), recorded_card.get("data_fingerprint"), config.scale.workers
            )
            before = compare_run_cards(recorded_card, current)
        else:
            before = ["the original run has no run card: nothing to compare the environment with"]
        if not config.deterministic and _cuda():
            # GPU kernels with atomics change the last bits from run to run.
            before.append("deterministic: false on CUDA: the weights can differ in their last bits "
                          "even when nothing else does (bit-exact runs need deterministic: true)")
        for line in before:
            announce(f"differs: {line}")
        if not before:
            announce("environment: same code, packages and hardware as the recorded run")
        summary = run(
            job_file,
            search_path=search_path,
            tracking_tags={"scaletrain.reproduces": run_id},
        )
    new_card = download_json(uri, summary["mlflow_run_id"], "run_card.json") if summary.get("mlflow_run_id") else None
    data_changed = bool(
        recorded_card and new_card and recorded_card.get("data_fingerprint") != new_card.get("data_fingerprint")
    )
    recorded_sha = recorded_summary.get("weights_sha256")
    same = recorded_sha is not None and recorded_sha == summary.get("weights_sha256")
    return {
        "original_run": run_id,
        "new_run": summary.get("mlflow_run_id"),
        "differences": before + (["data fingerprint differs"] if data_changed else []),
        "weights_match": same,
        "recorded_weights_sha256": recorded_sha,
        "weights_sha256": summary.get("weights_sha256"),
        "summary": summary,
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
