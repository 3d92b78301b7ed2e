"""What every Ray Train worker runs: the engine-agnostic worker entry point, with the attempt
number, the launcher's stop and the console from the mailbox, and, on another machine than the
driver's, the run's files written locally and relayed."""

from __future__ import annotations

import os
import threading
from typing import Any

from scaletrain.launch.ray.console import RemoteConsole
from scaletrain.launch.ray.relay import FORCE_LOCAL_ENV, RunDirRelay, local_dir_for
from scaletrain.rundir import RESTART_COUNT_ENV, RunSpec

__all__ = ["train_loop", "ray_gpu_ids"]


def _assigned_gpu():
    """The GPU Ray Train gave this worker (it set CUDA_VISIBLE_DEVICES and the device), or None."""
    if not ray_gpu_ids():
        return None
    import ray.train.torch

    return ray.train.torch.get_device()


def ray_gpu_ids() -> list:
    import ray

    try:
        return list(ray.get_gpu_ids())
    except Exception:
        return []


def train_loop(config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker: the engine-agnostic worker entry point."""
    import ray

    from scaletrain.distributed.env import DistEnv
    from scaletrain.launch.worker import run_worker
    from scaletrain.recovery.signals import StopRequest

    spec = RunSpec(**config["spec"])
    mailbox = config["mailbox"]
    env = DistEnv.from_env()
    os.environ[RESTART_COUNT_ENV] = str(ray.get(mailbox.register.remote(env.rank)))
    stop = StopRequest()
    done = threading.Event()

    def poll_stop() -> None:  # the launcher's SIGTERM, relayed; rank 0's agreement tells the rest
        while not done.wait(0.5):
            try:
                requested = ray.get(mailbox.stop_requested.remote(), timeout=5)
            except Exception:  # noqa: S112  the mailbox is busy or gone: ask again, the end says so
                continue
            if requested:
                stop.signal_name = stop.signal_name or requested
                return

    if env.rank == 0:
        threading.Thread(target=poll_stop, name="scaletrain-stop-poll", daemon=True).start()
    node = ray.get_runtime_context().get_node_id()
    relay = None
    if node != config["driver_node"] or os.environ.get(FORCE_LOCAL_ENV) == "1":
        # Another machine than the driver's: write here, relay to the driver's run directory.
        spec.local_dir = local_dir_for(spec.run_id, node)
        relay = RunDirRelay(mailbox, spec.local_dir, env.rank).watch_stacks()
        if env.rank == 0:
            relay.start()
    try:
        result = run_worker(
            spec, env, stop=stop, node=node, console=RemoteConsole(mailbox, relay),
            device=_assigned_gpu(),
        )
    except BaseException:
        if relay is not None:
            relay.failed()
        raise
    finally:
        done.set()
    if relay is not None:  # rank 0: its files; every rank: its log
        relay.finish()
    if env.rank == 0:
        ray.get(mailbox.put_result.remote({**result, "restarts": int(os.environ[RESTART_COUNT_ENV])}))
