"""Job mappings for the TensorFlow runner's tests (no TensorFlow import here: the test process
needs none; the workers import tests/helpers/keras_tasks.py)."""

from __future__ import annotations


def keras_job(tmp_path, **sections) -> dict:
    """A job mapping for ToyKeras on 2 workers; keyword arguments merge into its sections."""
    job = {
        "name": "keras",
        "task": {"target": "tests.helpers.keras_tasks:ToyKeras", "framework": "tensorflow", "args": {}},
        "data": {"batch_size": 16},
        "optim": {"lr": 0.01, "warmup_steps": 5},
        "train": {"max_steps": 40, "log_every": 10, "eval_every": 20, "clip_grad_norm": 1.0},
        "scale": {"workers": 2},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "recovery": {"max_restarts": 1, "grace_period_s": 20},
        "seed": 7,
        "deterministic": True,
        "run_dir": str(tmp_path / "runs"),
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        job[key] = {**job[key], **value} if isinstance(value, dict) and isinstance(job.get(key), dict) else value
    return job
