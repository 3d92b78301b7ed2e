"""``scaletrain reproduce RUN``: run a recorded job again and say whether it came out the same.

Differences in code, packages and hardware are reported before anything runs; then the job
recorded with the run is trained again (tracked as a new run tagged with the original, in the
store given), and the final weights are compared bit for bit.

It runs the recorded code: the task named by the job. The job is the run's own ``spec.json``
(the real one, secrets included) when its run directory is on this machine and this user's;
else the tracking server's ``job.yaml``, which is redacted: a job with masked values is refused
until each is supplied (``--set KEY=VALUE``), rather than training something else. Folders the
run imported its task from are used only when they exist, are this user's and no one else can
write them, and each is named.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from scaletrain.rundir import JOB_FILE, RUN_CARD_FILE, SPEC_FILE, SUMMARY_FILE

__all__ = ["reproduce"]


def reproduce(run_ref: str, uri: str, announce: Any = print,
              overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``overrides``: values for the masked keys of a redacted job, and nothing else."""
    from scaletrain.api import run
    from scaletrain.config import parse_job
    from scaletrain.tracking.run_card import build_run_card, compare_run_cards
    from scaletrain.tracking.runs import download_json, find_run

    original = find_run(uri, run_ref)
    run_id = original.info.run_id
    recorded_card = download_json(uri, run_id, RUN_CARD_FILE)
    recorded_summary = download_json(uri, run_id, SUMMARY_FILE) or {}
    job, python_path, source = _recorded_job(uri, original, recorded_summary, overrides)
    announce(f"job: {source}")
    # The new run goes to the store given, whatever store the recorded job names.
    config = parse_job(job, [*overrides, f"tracking.uri={json.dumps(uri)}", "tracking.enabled=true"])
    search_path = _import_folders(python_path, announce)
    if recorded_card:
        from scaletrain.tracking.git_state import git_state

        current = build_run_card(
            config.model_dump(mode="json"), recorded_card.get("data_fingerprint"), config.scale.workers,  # type: ignore[arg-type]  # an older card without a fingerprint compares as missing
            git_state(),
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
    summary = run(config, search_path=search_path, tracking_tags={"scaletrain.reproduces": run_id})
    new_card = download_json(uri, summary["mlflow_run_id"], RUN_CARD_FILE) if summary.get("mlflow_run_id") else None
    data_changed = bool(
        recorded_card and new_card and recorded_card.get("data_fingerprint") != new_card.get("data_fingerprint")
    )
    recorded_sha = recorded_summary.get("weights_sha256")
    return {
        "original_run": run_id,
        "new_run": summary.get("mlflow_run_id"),
        "differences": before + (["data fingerprint differs"] if data_changed else []),
        # None: the original recorded no weights, so there is nothing to compare with.
        "weights_match": None if recorded_sha is None else recorded_sha == summary.get("weights_sha256"),
        "recorded_weights_sha256": recorded_sha,
        "weights_sha256": summary.get("weights_sha256"),
        "summary": summary,
    }


def _recorded_job(uri: str, original: Any, summary: dict[str, Any],
                  overrides: list[str] | tuple[str, ...]) -> tuple[dict[str, Any], list[str], str]:
    """The job to run, the folders its task was imported from, and where the job came from."""
    from scaletrain.errors import ConfigError

    spec = _local_spec(original, summary)
    if spec is not None:
        if overrides:
            raise ConfigError("--set: this run's own spec.json has every value; reproduce runs it "
                              "as recorded")
        where = f"{Path(spec.run_dir) / 'spec.json'} (the run's own, on this machine)"
        return spec.job, spec.python_path, where
    job = _server_job(uri, original.info.run_id)
    masked = _masked_keys(job)
    given = [item.split("=", 1)[0].strip() for item in overrides]
    if extra := [key for key in given if key not in masked]:
        raise ConfigError(
            f"--set {', '.join(extra)}: reproduce runs the recorded job; --set only supplies its "
            f"masked values ({', '.join(masked) or 'it has none'})"
        )
    if missing := [key for key in masked if key not in given]:
        raise ConfigError(
            f"run {original.info.run_id}'s job on the tracking server is redacted: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} masked (***); supply "
            f"{'it' if len(missing) == 1 else 'each'} with --set KEY=VALUE, or reproduce on the "
            "machine that has the run directory (its spec.json holds the real job)"
        )
    try:
        paths = json.loads(original.data.tags.get("scaletrain.python_path", "[]"))
    except ValueError:
        paths = []
    return job, paths if isinstance(paths, list) else [], "the tracking server's job.yaml (redacted)"


def _local_spec(original: Any, summary: dict[str, Any]) -> Any:
    """The run's spec.json when its run directory is here: a regular file of this user's, of
    the same run. None otherwise."""
    from scaletrain.rundir import RunSpec

    run_id = original.data.tags.get("scaletrain.run_id")
    params = original.data.params
    candidates = [summary.get("run_dir")]
    if run_id and params.get("run_dir") and params.get("name"):
        candidates.append(str(Path(params["run_dir"]) / params["name"] / run_id))
    for folder in filter(None, candidates):
        path = Path(str(folder)) / SPEC_FILE
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                continue
            spec = RunSpec.read(path)
        except (OSError, ValueError, TypeError):
            continue
        if spec.run_id == run_id:
            return spec
    return None


def _server_job(uri: str, run_id: str) -> dict[str, Any]:
    import yaml

    from scaletrain.tracking.runs import RunNotFound, download_artifact

    with tempfile.TemporaryDirectory() as tmp:
        path = download_artifact(uri, run_id, JOB_FILE, tmp)
        if path is None:
            raise RunNotFound(f"run {run_id} has no recorded job.yaml; it cannot be reproduced")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise RunNotFound(f"run {run_id}'s job.yaml is not a job; it cannot be reproduced")
    return data


def _masked_keys(job: dict[str, Any]) -> list[str]:
    """Keys whose recorded value was redacted (holds ***). The tracking URI is not one: the
    new run goes to the store given."""
    from scaletrain.tracking.redact import MASK, flatten

    return [key for key, value in flatten(job).items()
            if key != "tracking.uri" and MASK in json.dumps(value)]


def _import_folders(paths: list[Any], announce: Any) -> list[str]:
    """The recorded folders the task may be imported from: each one that exists, is a folder of
    this user's and no one else can write. Every folder is named, used or not: they go ahead
    of everything on the import path of the code that runs."""
    kept = []
    for path in paths:
        why = _unsafe(path)
        if why:
            announce(f"not importing the task from {path!s}: {why}")
        else:
            announce(f"importing the task from {path} (recorded with the run)")
            kept.append(path)
    return kept


def _unsafe(path: Any) -> str | None:
    if not isinstance(path, str) or not os.path.isabs(path):
        return "not an absolute path"
    try:
        info = os.stat(path)
    except OSError:
        return "it does not exist here"
    if not stat.S_ISDIR(info.st_mode):
        return "not a folder"
    if info.st_uid != os.getuid():
        return "it belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "others can write to it"
    return None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()

