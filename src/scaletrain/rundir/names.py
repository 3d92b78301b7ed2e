"""Every name in a run directory, and the environment variables a run is handed: spelled once,
here, for the launchers, workers, the tracking process and the tools that read a run."""

from __future__ import annotations

__all__ = [
    "SPEC_FILE", "SUMMARY_FILE", "JOB_FILE", "METRICS_FILE", "RUN_CARD_FILE", "WEIGHTS_FILE",
    "LOCK_FILE", "LOGS_DIR", "LAUNCHER_LOG", "NODE_RESULT_FILE", "CHECKPOINTS_DIR", "CHECKPOINT_CACHE_DIR",
    "TRACKING_DIR", "MLFLOW_RUN_FILE", "TELEMETRY_DIR", "PEER_HANG_REQUEST", "worker_log_name", "worker_error_name", "worker_stacks_name", "worker_step_name",
    "RESTART_COUNT_ENV", "FAULT_ENV", "DENY_WRITES_ENV", "CHECKPOINT_KEY_ENV", "NODE_RANK_ENV",
    "DRIVER_STORE_ENV", "NODE_DIR_ENV", "RAY_NODE_LOCAL_ENV", "TRACKING_TAGS_ENV", "EXTRA_TAGS_ENV",
    "LOOP_FILE_ENV", "LOOP_KEY_ENV", "SCRIPT_SPEC_ENV", "HEARTBEAT_ENV",
]

SPEC_FILE = "spec.json"  # what every worker starts from (unredacted, the owner's alone, never uploaded)
SUMMARY_FILE = "summary.json"  # the outcome of the newest attempt
JOB_FILE = "job.yaml"  # the resolved job, secrets masked: what is shown and uploaded
METRICS_FILE = "metrics.jsonl"  # rank 0's metrics, one line per reported step
RUN_CARD_FILE = "run_card.json"  # environment, data fingerprint, git state
WEIGHTS_FILE = "model.safetensors"  # the final weights
LOCK_FILE = ".lock"  # held by the launcher using the directory
LOGS_DIR = "logs"
LAUNCHER_LOG = "launcher.jsonl"  # in LOGS_DIR
NODE_RESULT_FILE = "node-result.json"  # in LOGS_DIR: this node's result, from its first worker
CHECKPOINTS_DIR = "checkpoints"  # the default checkpoint location
CHECKPOINT_CACHE_DIR = "checkpoint-cache"  # verified local copies of checkpoints from object storage
TRACKING_DIR = "tracking"  # the metric journal, its cursor, MLFLOW_RUN_FILE
MLFLOW_RUN_FILE = "mlflow_run.json"  # in TRACKING_DIR: the job's MLflow run and its store
# in LOGS_DIR: each process's share of the live figures (rank-N.json, tracker.json, launcher.json)
TELEMETRY_DIR = "telemetry"
# in LOGS_DIR: written by a script's worker when its script hung: this node's other ranks dump
# where they wait (launch/script_worker.py)
PEER_HANG_REQUEST = "peer-hang-request"

# The environment variables scaletrain reads. Set by users:
CHECKPOINT_KEY_ENV = "SCALETRAIN_CHECKPOINT_KEY"  # HMAC key for checkpoint manifests (a secret)
NODE_DIR_ENV = "SCALETRAIN_NODE_DIR"  # Ray: where workers on other machines write (default: temp dir)
# Set by a launcher for its workers:
# which start of the workers this is in a launch (0: the first), for fault injection's attempts,
# the console and the summary's restart count;
RESTART_COUNT_ENV = "SCALETRAIN_RESTART_COUNT"
NODE_RANK_ENV = "SCALETRAIN_NODE_RANK"  # the launcher's node rank
DRIVER_STORE_ENV = "SCALETRAIN_DRIVER_STORE"  # HOST:PORT of the driver's store (failures go there)
TRACKING_TAGS_ENV = "SCALETRAIN_TRACKING_TAGS"  # `tune`: JSON tags for a trial's MLflow run
EXTRA_TAGS_ENV = "_SCALETRAIN_TRACKING_EXTRA_TAGS"  # the tracking process's tags from its launcher
# scaletrain.run_loop(loop) with a loop defined in __main__ (a notebook, a script): the file its
# workers load it from, and the HMAC key (a secret, never on disk) that file must verify with
# `scaletrain launch`: a script's run (scaletrain.report() finds it from its spec file) and the
# file its report()/should_stop() calls touch, the progress the hang check looks for
SCRIPT_SPEC_ENV = "SCALETRAIN_SPEC"
HEARTBEAT_ENV = "SCALETRAIN_HEARTBEAT"
LOOP_FILE_ENV = "SCALETRAIN_LOOP_FILE"
LOOP_KEY_ENV = "SCALETRAIN_LOOP_KEY"
# Testing facilities:
FAULT_ENV = "SCALETRAIN_FAULT"  # recovery/faults.py: kill, hang or stop a chosen rank at a step
DENY_WRITES_ENV = "SCALETRAIN_DENY_WRITES"  # a folder this worker may not write (another machine's)
RAY_NODE_LOCAL_ENV = "SCALETRAIN_RAY_NODE_LOCAL"  # every Ray worker writes locally and relays


def worker_log_name(rank: int) -> str:
    return f"worker-{rank}.jsonl"


def worker_error_name(rank: int) -> str:
    return f"worker-{rank}.error.json"


def worker_stacks_name(rank: int) -> str:
    return f"worker-{rank}.stacks.txt"


def worker_step_name(rank: int) -> str:
    """The rank's last finished step (8 bytes, observe/telemetry.py StepMark)."""
    return f"worker-{rank}.step"
