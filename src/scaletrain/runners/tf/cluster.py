"""TensorFlow in a worker: imported with its logs quiet, told its threads, its device and its
determinism before anything runs, then joined to the other workers.

The cluster is tf.distribute's MultiWorkerMirroredStrategy (a full replica per worker, gradients
all-reduced). Its TF_CONFIG needs every worker's address up front: each worker picks a free
port on the address its peers reach it at, and the workers swap them over the job's gloo group
(the one the launcher's rendezvous already built), so the local engine, several machines and
Ray's workers all get TF_CONFIG the same way."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
from typing import Any

from scaletrain.distributed import collectives
from scaletrain.distributed.env import DistEnv
from scaletrain.errors import ScaletrainError
from scaletrain.tracking.logs import LOGGER_NAME

__all__ = ["import_tensorflow", "configure", "make_strategy", "tf_config", "INSTALL_HINT"]

log = logging.getLogger(f"{LOGGER_NAME}.worker")

INSTALL_HINT = "pip install 'scaletrain[tensorflow]'"
# scale.backend -> tf.distribute's collective implementation
_COLLECTIVES = {"auto": "AUTO", "gloo": "RING", "nccl": "NCCL"}


def import_tensorflow() -> Any:
    """TensorFlow, with its C++ info lines off the worker's log; one line when it is missing."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise ScaletrainError(f"a TensorFlow job needs TensorFlow ({exc}); {INSTALL_HINT}") from None
    return tf


def configure(tf: Any, env: DistEnv, threads: int | None, deterministic: bool, precision: str) -> str:
    """Threads, this worker's device and determinism, before TensorFlow starts its runtime.
    Returns the device TF computes on ("GPU:0" is this worker's GPU; "CPU")."""
    gpus = tf.config.list_physical_devices("GPU")
    mine = gpus[env.local_rank % len(gpus)] if gpus else None
    try:
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
        if mine is not None:  # one GPU per worker on its machine, grown as needed (torch stays on the CPU)
            tf.config.set_visible_devices([mine], "GPU")
            tf.config.experimental.set_memory_growth(mine, True)
    except RuntimeError:
        # TF already runs in this process (the in-process engine, a second job from a notebook):
        # its threads and devices are set for good; training goes on with them.
        log.info("TensorFlow was already initialized in this process: its threads and devices are kept")
    device = f"GPU:0 ({mine.name})" if mine is not None else "CPU"
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    import keras

    keras.config.disable_interactive_logging()  # no progress bars on the launcher's stdout
    if precision == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return device


def tf_config(env: DistEnv) -> dict[str, Any]:
    """TF_CONFIG for this worker: every worker's address, swapped over the job's gloo group."""
    host = _reachable_address()
    addresses = collectives.all_gather_object(f"{host}:{_free_port(host)}")
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": env.rank}}


def make_strategy(tf: Any, env: DistEnv, backend: str) -> Any:
    """One worker: TF's default strategy. Several: MultiWorkerMirroredStrategy over TF_CONFIG."""
    if env.world_size == 1:
        return tf.distribute.get_strategy()
    config = tf_config(env)
    os.environ["TF_CONFIG"] = json.dumps(config)
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, _COLLECTIVES[backend])
    stop_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation)
    )
    # TF's coordination service takes SIGTERM for its own preemption notifier (in C++, out of
    # Python's sight): the worker's stop handlers go back, so a SIGTERM stops at an agreed step.
    # (Under Ray the loop runs off the main thread, and the engine relays the stop instead.)
    if threading.current_thread() is threading.main_thread():
        for sig, handler in stop_handlers.items():
            if callable(handler):
                signal.signal(sig, handler)
    if env.is_main:
        log.info("tf.distribute cluster", extra={"workers": config["cluster"]["worker"],
                                                 "collectives": _COLLECTIVES[backend]})
    return strategy


def _reachable_address() -> str:
    """Loopback when the job is on this machine; else the address that routes to the
    rendezvous host (MASTER_ADDR), which is the one the other machines reach."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1") or master.startswith("127."):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
